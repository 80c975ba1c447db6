r"""Rejection criteria on the training-inference ratio r_d, chained: veRL's `rollout_rs`.

`CorrectionConfig.rejection` is a list of RejectionRule (algorithms/config.py); a loss token stays
in the r_d mask only if every rule keeps it (and `mask_level` keeps it): the AND veRL takes over a
comma-separated `rollout_rs` ("token_k1,seq_mean_k3"). With x = log r_d = old - inference per
loss token, clamped to ±LOG_RATIO_CLAMP (veRL's ±20):

    k1 = -x = log(mu / pi_old)        k2 = x^2 / 2        k3 = exp(x) - 1 - x  (>= 0)

    token_k{1,2,3}     the token's own value
    seq_sum_k{1,2,3}   the sum over the sequence's loss tokens, for each of them
    seq_mean_k{1,2,3}  the mean over them
    seq_max_k{2,3}     the largest of them (0 for a sequence without loss tokens)

A k1 statistic is kept inside [log lower, log upper] (bounds given as ratios of mu / pi_old, the
lower one 1 / upper unless given); a k2 or k3 statistic while <= upper. As veRL's rejection edits
`response_mask`, a rejected token leaves the mean under `denominator: kept`; `all` counts it.
Diagnostics: `rejection_metrics` gives each rule's rejected fraction of loss tokens and of
sequences, as veRL's `rollout_rs_<option>_masked_fraction` / `_seq_masked_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .config import RejectionRule
from .masked import LOG_RATIO_CLAMP, masked_mean, masked_sum


def token_statistic(log_rd: Tensor, kind: str) -> Tensor:
    """k1, k2 or k3 per token [B, T] from log r_d (clamped first, as every log-ratio here)."""
    x = log_rd.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.expm1(x) - x  # exp(x) - 1 - x without cancellation near 0
    raise ValueError(f"token_statistic: kind must be k1, k2 or k3, got {kind!r}")


def rule_statistic(log_rd: Tensor, loss_mask: Tensor, rule: RejectionRule) -> Tensor:
    """The rule's statistic per token [B, T] (a sequence statistic repeated over the row)."""
    level, kind = rule.statistic.rsplit("_", 1)
    values = token_statistic(log_rd, kind)
    if level == "token":
        return values
    if level == "seq_sum":
        seq = masked_sum(values, loss_mask, dim=-1)
    elif level == "seq_mean":
        seq = masked_mean(values, loss_mask, dim=-1)
    else:  # seq_max: k2 and k3 are >= 0, so the max over no token is 0
        seq = torch.where(loss_mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).amax(dim=-1)
    return seq[:, None].expand_as(loss_mask)


def rule_keeps(log_rd: Tensor, loss_mask: Tensor, rule: RejectionRule) -> Tensor:
    """bool [B, T]: the tokens `rule` keeps (module docstring); not restricted to loss_mask."""
    stat = rule_statistic(log_rd, loss_mask, rule)
    if rule.statistic.endswith("k1"):
        upper = math.log(rule.upper)
        lower = math.log(rule.lower) if rule.lower is not None else -upper
        return (stat >= lower) & (stat <= upper)
    return stat <= rule.upper


def rejection_mask(log_rd: Tensor, keep: Tensor, rules: Sequence[RejectionRule],
                   loss_mask: Tensor | None = None) -> Tensor:
    """bool [B, T]: the tokens of `keep` that every rule keeps. `loss_mask`: the tokens a
    sequence statistic is taken over (default `keep`; the objective passes the loss tokens, so
    an earlier mask does not change a sequence's statistic)."""
    loss_mask = keep if loss_mask is None else loss_mask
    out = keep.clone()
    for rule in rules:
        out &= rule_keeps(log_rd, loss_mask, rule)
    return out


def rejection_metrics(log_rd: Tensor, loss_mask: Tensor, rules: Sequence[RejectionRule]) -> dict[str, float]:
    """{"rejection/<statistic>/token_frac", "rejection/<statistic>/seq_frac"}: the fraction of
    loss tokens and of sequences (with a loss token) each rule alone rejects."""
    out: dict[str, float] = {}
    rows = loss_mask.any(dim=-1)
    for rule in rules:
        dropped = loss_mask & ~rule_keeps(log_rd, loss_mask, rule)
        out[f"rejection/{rule.statistic}/token_frac"] = float(dropped.sum()) / max(int(loss_mask.sum()), 1)
        out[f"rejection/{rule.statistic}/seq_frac"] = float(dropped.any(dim=-1).sum()) / max(int(rows.sum()), 1)
    return out
