"""Group-relative advantages: one scalar per trajectory, relative to its group (same prompt).

rewards [N], group_ids [N] (any labels: int codes or the `group_id` strings). numpy arrays or
torch tensors in, the same kind out (float32). Vectorised with np.unique + np.bincount.

    grpo           A_i = (r_i - mean_g) / (std_g + eps)     (std optional, see below)
    dr_grpo        A_i =  r_i - mean_g                      (Dr.GRPO: no std division)
    leave_one_out  A_i =  r_i - mean_{j in g, j != i} r_j   (RLOO) = n/(n-1) (r_i - mean_g)

GRPO's std (`std=`, config key `advantage.std`):
    "sample"      sqrt(sum (r - mean)^2 / (G - 1)), ddof 1 — the default. veRL (`torch.std` in
                  `compute_grpo_outcome_advantage`) and TRL's GRPOTrainer (`.std(dim=1)`) both
                  divide by the sample std, so trajflow's advantages equal theirs.
    "population"  sqrt(sum (r - mean)^2 / G), ddof 0 (the GRPO paper's formula read literally).
At G = 4 the two differ by sqrt(G / (G - 1)) = 1.155 (population advantages are larger). A group
of one has std 0 either way and gets advantage 0. Groups of one get leave-one-out advantage 0
(there is no other sample to compare with). Every estimator gives exactly 0 to a group whose
rewards are all equal.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .config import GROUP_STDS, GroupStd

ArrayLike = Any  # np.ndarray | torch.Tensor | sequence


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _like(out: np.ndarray, ref: ArrayLike) -> ArrayLike:
    if isinstance(ref, torch.Tensor):
        return torch.from_numpy(out).to(ref.device)
    return out


def _group_stats(rewards: ArrayLike, group_ids: ArrayLike):
    """(rewards float64 [N], group code per row [N], group size [G], group sum [G])."""
    r = _to_numpy(rewards).astype(np.float64).reshape(-1)
    g = _to_numpy(group_ids).reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"rewards has {r.shape[0]} rows, group_ids has {g.shape[0]}")
    _, codes = np.unique(g, return_inverse=True)
    codes = codes.reshape(-1)
    size = np.bincount(codes).astype(np.float64)
    total = np.bincount(codes, weights=r)
    return r, codes, size, total


def _constant_rows(r: np.ndarray, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """bool [N]: the row's group has identical rewards (min == max, exact)."""
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, codes, r)
    np.maximum.at(hi, codes, r)
    return (lo == hi)[codes]


def grpo(rewards: ArrayLike, group_ids: ArrayLike, *, normalize_std: bool = True,
         std: GroupStd = "sample", eps: float = 1e-6) -> ArrayLike:
    """(r - group mean) / (group std + eps); without std when normalize_std=False.

    std: "sample" (ddof 1, veRL's and TRL's convention; the default) or "population" (ddof 0).
    Groups with identical rewards get exactly 0 (not rounding noise / tiny std, and no 0/0).
    """
    if std not in GROUP_STDS:
        raise ValueError(f"grpo: std must be one of {GROUP_STDS}, got {std!r}")
    r, codes, size, total = _group_stats(rewards, group_ids)
    mean = total / size
    centered = r - mean[codes]
    if normalize_std:
        ddof = 1 if std == "sample" else 0
        sq = np.bincount(codes, weights=centered**2)  # two-pass: no E[r^2] - E[r]^2 cancellation
        std = np.sqrt(sq / np.maximum(size - ddof, 1.0))[codes]
        centered = centered / np.where(std + eps > 0, std + eps, 1.0)
    centered = np.where(_constant_rows(r, codes, size.size), 0.0, centered)
    return _like(centered.astype(np.float32), rewards)


def dr_grpo(rewards: ArrayLike, group_ids: ArrayLike) -> ArrayLike:
    """Dr.GRPO: r - group mean (no std division: no per-prompt difficulty reweighting)."""
    return grpo(rewards, group_ids, normalize_std=False)


def leave_one_out(rewards: ArrayLike, group_ids: ArrayLike) -> ArrayLike:
    """RLOO: r_i - mean of the other rewards in its group (0 for a group of one)."""
    r, codes, size, total = _group_stats(rewards, group_ids)
    n = size[codes]
    others_mean = (total[codes] - r) / np.maximum(n - 1.0, 1.0)
    adv = np.where((n > 1) & ~_constant_rows(r, codes, size.size), r - others_mean, 0.0)
    return _like(adv.astype(np.float32), rewards)


def zero_variance_groups(rewards: ArrayLike, group_ids: ArrayLike) -> ArrayLike:
    """bool [N]: the row's group has identical rewards (no learning signal)."""
    r, codes, size, _ = _group_stats(rewards, group_ids)
    return _like(_constant_rows(r, codes, size.size), rewards)


ESTIMATORS: dict[str, Callable[..., ArrayLike]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "leave_one_out": leave_one_out,
}


def group_advantages(estimator: str, rewards: ArrayLike, group_ids: ArrayLike, **kwargs) -> ArrayLike:
    """Dispatch by name: "grpo" | "dr_grpo" | "leave_one_out" (kwargs go to the estimator)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {list(ESTIMATORS)}")
    return ESTIMATORS[estimator](rewards, group_ids, **kwargs)
