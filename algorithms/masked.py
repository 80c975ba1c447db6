"""Masked reductions over right-padded [B, T] tensors, and the clamped log-ratio every ratio in
the objective starts from.

Every reduction selects with `torch.where` instead of multiplying by the mask, so a NaN/inf
sitting on a padded position can never leak into the value or the gradient (0 * inf = NaN).
An empty selection reduces to 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number

LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 4.9e8: finite in float32, squares still finite


def log_ratio(numer: Tensor, denom: Tensor) -> Tensor:
    """numer - denom clamped to ±LOG_RATIO_CLAMP: extreme log-probs give finite ratios and
    gradients (a clamped token gets no gradient through its ratio)."""
    return (numer - denom).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is true (over everything, or along `dim`)."""
    check_number("masked_sum", dim=dim)
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of true entries (int64)."""
    check_number("masked_count", dim=dim)
    return mask.sum() if dim is None else mask.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is true; 0 where the selection is empty."""
    check_number("masked_mean", dim=dim)
    total = masked_sum(x, mask, dim)
    count = masked_count(mask, dim).clamp(min=1).to(total.dtype)
    return total / count


def broadcast_to_tokens(x: Tensor, like: Tensor) -> Tensor:
    """Per-sequence values [B] -> [B, T] (per-token [B, T] values pass through)."""
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(f"per-sequence tensor has {x.shape[0]} rows, tokens have {like.shape[0]}")
        return x[:, None].expand_as(like)
    if x.shape != like.shape:
        raise ValueError(f"per-token tensor has shape {tuple(x.shape)}, expected {tuple(like.shape)}")
    return x
