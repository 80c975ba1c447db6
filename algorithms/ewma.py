"""Revised PPO-EWMA: a bias-corrected EWMA of the trainer's weights as the proximal policy.

    theta_prox(t) = sum_{k=k0..t} beta^(t-k) theta(k) / sum_{k=k0..t} beta^(t-k)

k0 is the last reset (or construction). Maintained in O(1) per step by the running normaliser
n_t = beta n_{t-1} + 1 and theta_prox <- theta_prox + (theta - theta_prox) / n_t.

The window is counted in the unit the EWMA is updated in: one update per optimizer step. A
staleness window of W versions with m optimizer steps per version (minibatches_per_step) is
W·m updates, so beta = W·m / (W·m + 2) puts the mean age beta / (1 - beta) at W·m / 2 updates =
W / 2 versions, the middle of the version window. (beta = W / (W + 2) with m > 1 would put the
reference at W / (2m) versions.) Auto-reset: theta_prox <- theta when the active-token fraction
(kept by the r_d mask and unclipped) falls below reset_threshold tau (default 0.9).

Step order in the trainer: score the batch with theta_prox, take the optimizer step, then
`ewma.step(new_state_dict, active_fraction)` (reset if below reset_threshold, else update).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trajflow.settings import check_number

StateDict = dict[str, Tensor]


def ewma_beta(window: int, minibatches_per_step: int = 1) -> float:
    """beta = n / (n + 2) for a window of n = window · minibatches_per_step EWMA updates: mean age
    n / 2 updates = window / 2 versions. window = 0 gives beta = 0 (prox = current)."""
    check_number("ewma_beta", window=window, minibatches_per_step=minibatches_per_step)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if minibatches_per_step < 1:
        raise ValueError(f"minibatches_per_step must be >= 1, got {minibatches_per_step}")
    updates = window * minibatches_per_step
    return updates / (updates + 2)


def ewma_mean_age(beta: float) -> float:
    """Mean age in steps of the stationary EWMA weights: sum k beta^k / sum beta^k = beta / (1 - beta)."""
    check_number("ewma_mean_age", beta=beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    return beta / (1.0 - beta)


class EwmaProximal:
    """A float32 EWMA copy of a state dict. Non-float entries (int buffers) track the latest value."""

    def __init__(self, state_dict: StateDict, beta: float, *, reset_threshold: float,
                 device: str | torch.device | None = None) -> None:
        check_number("EwmaProximal", beta=beta, reset_threshold=reset_threshold)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EwmaProximal.beta must be in [0, 1), got {beta}")
        if not 0.0 <= reset_threshold <= 1.0:
            raise ValueError(f"EwmaProximal.reset_threshold must be in [0, 1], got {reset_threshold}")
        self.beta = float(beta)
        self.reset_threshold = float(reset_threshold)
        self.device = device
        self.reset_count = 0
        self._copy_from(state_dict)

    # -- the EWMA ---------------------------------------------------------------------------
    def _own(self, t: Tensor) -> Tensor:
        t = t.detach()
        dtype = torch.float32 if t.is_floating_point() else t.dtype
        return t.to(device=self.device or t.device, dtype=dtype, copy=True)

    def _copy_from(self, state_dict: StateDict) -> None:
        self.weights: StateDict = {k: self._own(v) for k, v in state_dict.items()}
        self.norm = 1.0        # sum_k beta^(t-k)
        self._age_sum = 0.0    # sum_k (t-k) beta^(t-k)
        self.steps_since_reset = 0

    @torch.no_grad()
    def update(self, state_dict: StateDict) -> None:
        """Fold in theta(t), the weights after an optimizer step."""
        if state_dict.keys() != self.weights.keys():
            missing = sorted(set(self.weights) ^ set(state_dict))
            raise KeyError(f"state dict keys differ from the EWMA's: {missing[:5]}")
        prev = self.norm
        self.norm = self.beta * prev + 1.0
        self._age_sum = self.beta * (self._age_sum + prev)
        step = 1.0 / self.norm
        for k, w in self.weights.items():
            new = state_dict[k].detach()
            if w.is_floating_point():
                w.lerp_(new.to(device=w.device, dtype=w.dtype), step)
            else:
                w.copy_(new)
        self.steps_since_reset += 1

    def reset(self, state_dict: StateDict) -> None:
        """theta_prox <- theta: forget the history."""
        self._copy_from(state_dict)
        self.reset_count += 1

    def maybe_reset(self, active_fraction: float, state_dict: StateDict) -> bool:
        """Reset iff active_fraction < reset_threshold (tau). Returns whether it fired."""
        if active_fraction < self.reset_threshold:
            self.reset(state_dict)
            return True
        return False

    def step(self, state_dict: StateDict, active_fraction: float) -> bool:
        """After an optimizer step: reset if active_fraction < reset_threshold, else update. Returns reset?"""
        if self.maybe_reset(active_fraction, state_dict):
            return True
        self.update(state_dict)
        return False

    @property
    def age(self) -> float:
        """Mean age in updates (optimizer steps) of the current weighted average (0 right after a reset)."""
        return self._age_sum / self.norm

    def prox_state_dict(self) -> StateDict:
        """The proximal weights (float32, the live buffers: read, do not modify; a model's
        load_state_dict copies and casts them)."""
        return self.weights

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "weights": {k: v.clone() for k, v in self.weights.items()},
            "beta": self.beta,
            "reset_threshold": self.reset_threshold,
            "norm": self.norm,
            "age_sum": self._age_sum,
            "steps_since_reset": self.steps_since_reset,
            "reset_count": self.reset_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.weights = {k: self._own(v) for k, v in state["weights"].items()}
        self.beta = float(state["beta"])
        self.reset_threshold = float(state["reset_threshold"])
        self.norm = float(state["norm"])
        self._age_sum = float(state["age_sum"])
        self.steps_since_reset = int(state["steps_since_reset"])
        self.reset_count = int(state["reset_count"])
        if not (0.0 <= self.beta < 1.0 and math.isfinite(self.norm) and self.norm >= 1.0):
            raise ValueError(f"corrupt EwmaProximal state: beta={self.beta}, norm={self.norm}")
