r"""REINFORCE++ with a per-token discount gamma: one advantage per token (veRL's
`compute_reinforce_plus_plus_outcome_advantage` with `algorithm.gamma`).

Token-level rewards r_t (an outcome reward sits on the trajectory's last loss token) are turned
into returns by a reverse scan over the loss tokens only:

    G_t = r_t + gamma * G_{t'}     t a loss token, t' the next loss token after it
    G_t = 0                        t not a loss token (tool output, padding): the scan passes it
                                   without discounting, so an outcome reaches the earlier turns

so with an outcome reward R the loss token t gets gamma^k R, k = the loss tokens after it. The
returns are whitened over every loss token of the batch (mean, ddof-1 variance, 1e-8; veRL's
`masked_whiten`), and that is each token's advantage (0 off the loss tokens). gamma = 1 gives R
on every loss token: the per-trajectory, token-weighted REINFORCE++ of advantages.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trajflow.settings import check_number


def discounted_returns(token_rewards: Any, loss_mask: Any, gamma: float) -> np.ndarray:
    """G [B, T] float64 from token rewards [B, T] and a loss mask [B, T] (module docstring)."""
    check_number("discounted_returns", gamma=gamma)
    rewards = np.asarray(token_rewards, dtype=np.float64)
    mask = np.asarray(loss_mask, dtype=bool)
    if rewards.shape != mask.shape or rewards.ndim != 2:
        raise ValueError(f"discounted_returns: token_rewards {rewards.shape} and loss_mask {mask.shape} must be "
                         "the same [B, T]")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discounted_returns: gamma must be in [0, 1], got {gamma}")
    returns = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        here = mask[:, t]
        running = np.where(here, rewards[:, t] + gamma * running, running)
        returns[:, t] = np.where(here, running, 0.0)
    return returns


def outcome_token_rewards(rewards: Any, loss_mask: Any) -> np.ndarray:
    """[N] outcome rewards placed on each row's last loss token: [N, T] float64 (0 elsewhere; a
    row without a loss token gets nothing)."""
    mask = np.asarray(loss_mask, dtype=bool)
    out = np.zeros(mask.shape, dtype=np.float64)
    rows = np.flatnonzero(mask.any(axis=1))
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    out[rows, last[rows]] = np.asarray(rewards, dtype=np.float64).reshape(-1)[rows]
    return out


def masked_whiten(values: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """(values - mean) / sqrt(var + eps) over the masked entries (ddof 1), 0 elsewhere; 0
    everywhere with fewer than two masked entries."""
    check_number("masked_whiten", eps=eps)
    mask = np.asarray(mask, dtype=bool)
    n = int(mask.sum())
    if n < 2:
        return np.zeros(mask.shape)
    mean = values[mask].mean()
    var = ((values[mask] - mean) ** 2).sum() / (n - 1)
    return np.where(mask, (values - mean) / np.sqrt(var + eps), 0.0)


def reinforce_plus_plus_discounted(rewards: Any, loss_mask: Any, gamma: float) -> np.ndarray:
    """Per-token REINFORCE++ advantages [N, T] float32 from outcome rewards [N] and a loss
    mask [N, T] (module docstring)."""
    check_number("reinforce_plus_plus_discounted", gamma=gamma)
    mask = np.asarray(loss_mask, dtype=bool)
    returns = discounted_returns(outcome_token_rewards(rewards, mask), mask, gamma)
    return masked_whiten(returns, mask).astype(np.float32)
