r"""Distributions on a captured support: the mismatch between two of them, and the mask on it.

Per response token the sampler records its K most likely ids S (the top-k of the processed
distribution mu it sampled from, `top_k_logprobs`) and their log-probs; another side (pi_old at
the token's own version, a teacher, the current policy) is scored on the same ids. Each side is
normalised over the full vocabulary, so its mass on S is at most 1, and neither side's mass
outside S is known id by id. Both are therefore coarsened to S plus one tail bucket, whose mass
is 1 - (the side's mass on S):

    TV(p, q)    = 1/2 [ sum_{i in S} |p_i - q_i| + |p_tail - q_tail| ]               in [0, 1]
    KL(p || q)  = sum_{i in S} p_i log(p_i / q_i) + p_tail log(p_tail / q_tail)      >= 0

By the data-processing inequality (coarsening never increases a divergence) both are lower
bounds of the full-vocabulary TV and KL, and exact when S holds every id either side gives mass
to (K >= the support of a top-k sampler, or K = the vocabulary). `support_mass` reports how much
of mu the K ids hold. Numerics: 0 log 0 = 0; a log-ratio is clamped to ±LOG_RATIO_CLAMP (an id
one side cannot produce gives a large finite KL, never inf or NaN); a tail mass at or below
TAIL_FLOOR counts as 0 in the numerator's side and is floored there in the denominator's (float32
rounding of a full-support sum leaves ~1e-7 that is not mass).

The mask (`correction.dist_mask`, the r_d mask's distribution-level counterpart): a loss token
whose mismatch between mu and pi_old exceeds the threshold leaves the kept set M_d, at token level
or with its sequence (mean over the sequence's loss tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number

from .masked import LOG_RATIO_CLAMP, masked_mean

TAIL_FLOOR = 1e-6  # the paper's floor for tail masses (arXiv 2609.20807, appendix A.3)


def tail_mass(logprobs: Tensor) -> Tensor:
    """[...]: 1 - sum over the support of exp(logprobs [..., K]), >= 0 (differentiable)."""
    lse = torch.logsumexp(logprobs, dim=-1).clamp(max=0.0)
    return -torch.expm1(lse)


def support_tv(p_logprobs: Tensor, q_logprobs: Tensor) -> Tensor:
    """Total variation [...] between p and q on the support [..., K] plus the tail bucket."""
    head = (p_logprobs.exp() - q_logprobs.exp()).abs().sum(dim=-1)
    return 0.5 * (head + (tail_mass(p_logprobs) - tail_mass(q_logprobs)).abs())


def _plogratio(p_log: Tensor, q_log: Tensor) -> Tensor:
    """p (log p - log q) elementwise, 0 where p = 0, the log-ratio clamped; no NaN in value or
    gradient (the -inf entries are selected away before any arithmetic on them)."""
    present = p_log > float("-inf")
    ratio = torch.where(present, p_log, 0.0) - torch.where(present, q_log, 0.0)
    ratio = ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(present, torch.where(present, p_log, 0.0).exp() * ratio, 0.0)


def support_kl(p_logprobs: Tensor, q_logprobs: Tensor) -> Tensor:
    """KL(p || q) [...] on the support [..., K] plus the tail bucket (module docstring).
    Differentiable in both (the forward KL of distillation differentiates q)."""
    head = _plogratio(p_logprobs, q_logprobs).sum(dim=-1)
    p_tail, q_tail = tail_mass(p_logprobs), tail_mass(q_logprobs)
    has = p_tail > TAIL_FLOOR
    p_log = torch.log(torch.where(has, p_tail, 1.0))
    q_log = torch.log(q_tail.clamp(min=TAIL_FLOOR))
    tail = torch.where(has, p_tail * (p_log - q_log).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    return head + tail


def support_mass(logprobs: Tensor) -> Tensor:
    """[...]: the mass a distribution puts on the support [..., K]."""
    return torch.logsumexp(logprobs, dim=-1).exp()


def mismatch(p_logprobs: Tensor, q_logprobs: Tensor, metric: str) -> Tensor:
    """Per-token mismatch [...] by name: "tv" (support_tv) or "kl" (support_kl, KL(p || q))."""
    if metric == "tv":
        return support_tv(p_logprobs, q_logprobs)
    if metric == "kl":
        return support_kl(p_logprobs, q_logprobs)
    raise ValueError(f"mismatch: metric must be tv or kl, got {metric!r}")


def distribution_keep(distance: Tensor, loss_mask: Tensor, threshold: float, level: str) -> Tensor:
    """bool [B, T]: the loss tokens the distribution-level mask keeps, distance <= threshold per
    token ("token") or the mean over the sequence's loss tokens ("sequence")."""
    check_number("distribution_keep", threshold=threshold)
    if level == "token":
        keep = distance <= threshold
    elif level == "sequence":
        keep = (masked_mean(distance, loss_mask, dim=-1) <= threshold)[:, None].expand_as(loss_mask)
    else:
        raise ValueError(f"distribution_keep: level must be token or sequence, got {level!r}")
    return keep & loss_mask


def distribution_diagnostics(sampler: Tensor, old: Tensor | None, loss_mask: Tensor) -> dict[str, float]:
    """The mismatch between mu (`sampler` [B, T, K]) and pi_old (`old` on the same ids; None: the
    strategy supplies no distribution) over the loss tokens:

        mismatch/tv, mismatch/tv_max   total variation on the support plus the tail (mean, max)
        mismatch/kl_support            KL(mu || pi_old) on the support plus the tail (mean)
        mismatch/support_mass          mu's mass on the K ids (mean): how much the bounds see
    """
    m = loss_mask
    out = {"mismatch/support_mass": float(masked_mean(support_mass(sampler.double()), m))}
    if old is not None:
        tv = support_tv(sampler.double(), old.double())
        out["mismatch/tv"] = float(masked_mean(tv, m))
        out["mismatch/tv_max"] = float(tv[m].max()) if bool(m.any()) else 0.0
        out["mismatch/kl_support"] = float(masked_mean(support_kl(sampler.double(), old.double()), m))
    return out
