"""The train-time old log-probs (pi_old, decoupled PPO's proximal policy) that are pure functions
of the batch's tensors.

The objective (objective.py) takes `old_logprobs` as given; each strategy (one file each in
operators/strategies/) decides what goes there and calls these. Exact strategies and EWMA produce
them with a forward pass instead (an operator, or the trainer scoring with its EWMA weights).

Version convention (A-3PO): v_behav is the version that sampled the token (the `versions`
column), v_theta is the version this update produces (the trainer holds weights v_theta - 1 and
publishes v_theta after the step), and v_prox defaults to v_theta - 1: the weights the trainer
holds before the update, i.e. what `recompute` scores with. If the trainer is at version k
(on-policy tokens carry version k), pass theta_version = k + 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number


def behavior_logprobs(inference_logprobs: Tensor) -> Tensor:
    """`behavior`: old := mu, the inference engine's own log-probs."""
    return inference_logprobs.detach()


def recompute_logprobs(current_before_update: Tensor) -> Tensor:
    """`recompute`: old := the trainer's current weights scored *before* the optimizer step.

    With one optimizer step per batch this is current_logprobs.detach() of that step's forward
    pass; with several minibatches or epochs, score once before the first update and reuse it.
    In async training those weights are newer than the token's version (pi_async, not pi_old).
    """
    return current_before_update.detach()


def loglinear_alpha(versions: Tensor, theta_version: int, prox_version: int | None = None) -> Tensor:
    """Per-token alpha = (v_prox - v_behav) / (v_theta - v_behav), clamped to [0, 1].

    v_prox defaults to v_theta - 1, giving alpha = s / (s + 1) with s = v_prox - v_behav the
    staleness: on-policy tokens (s = 0) get alpha = 0 (prox = mu), older ones approach 1.
    Edge case v_theta == v_behav (the token came from the very weights being optimised): alpha := 1,
    prox := current, the trainer-numerics reference that `recompute` would give.
    """
    check_number("loglinear_alpha", theta_version=theta_version, prox_version=prox_version)
    v_b = versions.to(torch.float64)
    v_t = float(theta_version)
    v_p = float(theta_version - 1 if prox_version is None else prox_version)
    span = v_t - v_b
    alpha = torch.where(span != 0, (v_p - v_b) / torch.where(span != 0, span, 1.0), 1.0)
    return alpha.clamp(0.0, 1.0).to(torch.float32)


def loglinear_logprobs(current_logprobs: Tensor, inference_logprobs: Tensor, alpha: Tensor | float) -> Tensor:
    """`loglinear` (A-3PO): log pi_prox = log mu + alpha (log pi_theta - log mu), detached."""
    check_number("loglinear_logprobs", alpha=alpha)
    cur, inf = current_logprobs.detach(), inference_logprobs.detach()
    return inf + alpha * (cur - inf)


def linear_logprobs(current_logprobs: Tensor, inference_logprobs: Tensor, alpha: Tensor | float) -> Tensor:
    """Arithmetic interpolation (linear_prox): pi_prox = (1 - alpha) mu + alpha pi_theta, as a log, detached."""
    check_number("linear_logprobs", alpha=alpha)
    cur, inf = current_logprobs.detach(), inference_logprobs.detach()
    alpha = torch.as_tensor(alpha, dtype=cur.dtype, device=cur.device)
    return torch.logaddexp(torch.log1p(-alpha) + inf, torch.log(alpha) + cur)
