"""Generalized advantage estimation and the value loss: the math of PPO with a critic.

Per response token t of a row (the token-level MDP of LLM RL: the state is the prompt and the
tokens before t, the action is token t), with the critic's value V_t of that state:

    delta_t = r_t + gamma V_next(t) - V_t
    A_t     = delta_t + gamma lam A_next(t)          (0 past the row's last loss token)
    R_t     = A_t + V_t                              the return the critic regresses on

Only loss tokens (`mask`) are steps of the MDP: a token the policy did not produce (tool or
environment output in the middle of a response) is skipped, its value and TD error both, so
next(t) is the next *loss* token, as veRL's `compute_gae_advantage_return`; at a skipped token the
scan carries the advantage of the next loss token unchanged (it is not trained). lam = 1 gives
A_t = (discounted return) - V_t; gamma = lam = 1 with a terminal reward gives R_t = the reward.

The rewards r_t (`token_rewards`): the row's reward on its last loss token, minus
beta x KL_t on every loss token when the KL to a reference is in the reward (`kl.in: reward`).

The value loss (PPO's clipped value objective, veRL's `compute_value_loss` with
`cliprange_value`), per loss token, around an anchor V_anchor (the values GAE used, or those of
another version: `critic.clip_anchor`):

    V_clip = V_anchor + clip(V - V_anchor, -c, c)
    l_t    = 0.5 max((V - R)^2, (V_clip - R)^2)

in sum form with its count (algorithms/objective.py `LossSum`), so data-parallel shards add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trajflow.settings import check_number


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, T] of rewards, values [B, T] and the loss-token mask [B, T]
    (module docstring). Computed in float64, returned in the values' dtype; positions after a
    row's last loss token get advantage 0."""
    check_number("gae", gamma=gamma, lam=lam)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must be in [0, 1], got {gamma} and {lam}")
    if rewards.shape != values.shape or values.shape != mask.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape [B, T]")
    r, v, m = rewards.double(), values.double(), mask.bool()
    advantages = torch.zeros_like(v)
    last = torch.zeros(v.shape[0], dtype=torch.float64, device=v.device)
    next_value = torch.zeros_like(last)
    for t in reversed(range(v.shape[1])):
        step = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last
        next_value = torch.where(m[:, t], v[:, t], next_value)
        last = torch.where(m[:, t], step, last)
        advantages[:, t] = last
    return advantages.to(values.dtype), (advantages + v).to(values.dtype)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, beta: float = 0.0) -> Tensor:
    """r_t [B, T]: each row's reward [B] on its last loss token, minus beta x kl [B, T] on every
    loss token (the KL penalty in the reward). A row without loss tokens gets none."""
    check_number("token_rewards", beta=beta)
    m = mask.bool()
    out = torch.zeros(m.shape, dtype=torch.float64)
    positions = torch.arange(m.shape[1]).expand_as(m)
    last = torch.where(m, positions, -1).max(dim=1).values
    has = last >= 0
    out[has.nonzero().flatten(), last[has]] = rewards.double()[has]
    if kl is not None and beta:
        out = out - beta * torch.where(m, kl.double(), 0.0)
    return out


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and the unbiased variance over the mask's
    tokens (veRL's `masked_whiten`); every position is shifted, the masked ones included. Fewer
    than two tokens: x - mean (nothing to scale by)."""
    check_number("whiten", eps=eps)
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return x
    mean = x[m].double().mean()
    centered = x.double() - mean
    if n < 2:
        return centered.to(x.dtype)
    var = (centered[m] ** 2).sum() / (n - 1)
    return (centered * torch.rsqrt(var + eps)).to(x.dtype)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the loss tokens: 1 a perfect critic, 0 one that predicts the
    mean return, below 0 worse than that; NaN when the returns do not vary."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return float("nan")
    r, v = returns[m].double(), values[m].double()
    var = r.var()
    return float(1.0 - (r - v).var() / var) if var > 0 else float("nan")


@dataclass
class ValueLoss:
    """The value loss of a batch in sum form: `loss_sum` over `count` loss tokens (divide once, by
    the global count), and per token whether the clipped branch was the larger (`clipped`)."""

    loss_sum: Tensor
    count: Tensor
    clipped: Tensor  # [B, T] bool, False off the mask


def value_loss(values: Tensor, returns: Tensor, anchor: Tensor, mask: Tensor, clip: float | None) -> ValueLoss:
    """PPO's clipped value loss (module docstring) on values [B, T] (with gradient), returns and
    anchor [B, T] (without); `clip` None: the plain squared error."""
    if clip is not None:
        check_number("value_loss", clip=clip)
    m = mask.bool()
    returns, anchor = returns.detach().to(values.dtype), anchor.detach().to(values.dtype)
    plain = (values - returns) ** 2
    if clip is None:
        worst, clipped = plain, torch.zeros_like(m)
    else:
        bounded = anchor + (values - anchor).clamp(-clip, clip)
        other = (bounded - returns) ** 2
        worst, clipped = torch.maximum(plain, other), (other > plain) & m
    loss_sum = 0.5 * torch.where(m, worst, 0.0).sum()
    return ValueLoss(loss_sum, m.sum().to(values.dtype), clipped)
