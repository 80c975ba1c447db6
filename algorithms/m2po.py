r"""M2PO's second-moment trust mask (Zheng et al., arXiv 2510.01161).

With the behavior log-probs as "old", M2PO bounds the update by the second moment of the
log-ratio instead of a PPO clip:

    M2 = mean_t (log pi_theta(t) - log mu(t))^2          over the loss tokens of one update

If M2 > tau, the tokens with the largest squared log-ratio are masked, largest first, until the
mean over the remaining tokens is <= tau. Masked tokens carry no gradient; the objective still
divides by every loss token (see objective.py, `trust_mask`).

The mask is a *value cutoff*: a token is kept iff its squared log-ratio is below a bound b. The
bound is a function of the multiset of values only, so

- ties at the cutoff are all masked (the remaining mean is then <= tau all the more: dropping the
  largest remaining value never raises the mean), and the result does not depend on token order;
- with data-parallel training, M2 is a statistic of the whole update's batch: gather the squared
  log-ratios of the loss tokens from every worker, compute `m2_cutoff` once (identically on
  each), and let each worker apply `squared < b` to its own tokens. This equals the
  single-process mask exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trajflow.settings import check_number


def m2_cutoff(squared: Tensor, tau: float) -> float:
    """The bound b such that keeping the values < b leaves a mean <= tau, masking as few as possible.

    squared: 1-D tensor of (log r)^2 over every loss token of the update (gathered across workers).
    Returns inf when the mean is already <= tau (nothing masked). Sort descending (s_1 >= s_2 >= ...);
    the smallest k with mean(s_{k+1..n}) <= tau masks s_1..s_k, and b = s_k.
    """
    check_number("m2_cutoff", tau=tau)
    if not (math.isfinite(tau) and tau >= 0.0):
        raise ValueError(f"m2_cutoff: tau must be a finite number >= 0, got {tau!r}")
    values = squared.detach().reshape(-1).to(torch.float64)
    n = values.numel()
    if n == 0:
        return math.inf
    ordered = torch.sort(values, descending=True).values
    remaining = torch.arange(n, 0, -1, dtype=torch.float64, device=ordered.device)  # n - k for k = 0..n-1
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / remaining  # mean after masking the k largest
    within = torch.nonzero(suffix_mean <= tau)
    k = int(within[0]) if len(within) else n
    return math.inf if k == 0 else float(ordered[k - 1])


@dataclass(frozen=True)
class M2Mask:
    """The trust mask of one update and what it did."""

    keep: Tensor          # [B, T] bool: loss tokens that may carry gradient
    m2_before: float      # mean squared log-ratio over the loss tokens
    m2_after: float       # ... over the kept ones (0 if none is kept)
    loss_tokens: int
    masked_tokens: int


def m2po_mask(log_ratio: Tensor, loss_mask: Tensor, tau: float) -> M2Mask:
    """M2PO's mask for one update: log_ratio = log pi_theta - log mu, [B, T]; loss_mask [B, T] bool.

    Single-process form of `m2_cutoff` (gather first when the update is spread over workers).
    """
    check_number("m2po_mask", tau=tau)
    squared = torch.where(loss_mask, log_ratio.detach().to(torch.float64) ** 2, 0.0)
    selected = squared[loss_mask]
    bound = m2_cutoff(selected, tau)
    keep = loss_mask & (squared < bound)
    kept = squared[keep]
    return M2Mask(
        keep=keep,
        m2_before=float(selected.mean()) if selected.numel() else 0.0,
        m2_after=float(kept.mean()) if kept.numel() else 0.0,
        loss_tokens=int(selected.numel()),
        masked_tokens=int(selected.numel() - kept.numel()),
    )
