"""Advantages: one scalar per trajectory, relative to its group (same prompt) or to the batch.
The functions of the estimators algorithms/estimators.py registers (`compute_advantages` dispatches
through that registry).

rewards [N], group_ids [N] (any labels: int codes or the `group_id` strings). numpy arrays or
torch tensors in, the same kind out (float32). Vectorised with np.unique + np.bincount.

    grpo           A_i = (r_i - mean_g) / (std_g + eps)     (std optional, see below)
    dr_grpo        A_i =  r_i - mean_g                      (Dr.GRPO: no std division)
    leave_one_out  A_i =  r_i - mean_{j in g, j != i} r_j   (RLOO) = n/(n-1) (r_i - mean_g)
    reinforce_plus_plus           A_i = (r_i - mu_B) / sqrt(var_B + 1e-8)   (REINFORCE++, arXiv 2501.03262)
    reinforce_plus_plus_baseline  the same on r_i - mean_g  (the group mean is the baseline; a
                                  group of one keeps its reward, as veRL)
  with mu_B, var_B the batch's mean and (ddof 1) variance, each trajectory weighted by its loss
  tokens when `token_counts` is given: veRL whitens the outcome return repeated over every
  response token (`masked_whiten`, gamma 1), so a long response weighs more. Without weights
  every trajectory counts once. These two are not group-relative: a group with equal rewards
  gets -mu_B / sigma_B, not 0. veRL `algorithm.adv_estimator` reinforce_plus_plus(_baseline).

Reward shaping before the estimator (`overlong_penalty`): DAPO's soft overlong punishment (Yu et
al. 2025, arXiv 2503.14476, eq. 13) for a response of L tokens, budget L_max, buffer L_cache:
    R_len = 0 for L <= L_max - L_cache,  -p (L - (L_max - L_cache)) / L_cache up to L_max,  -p beyond
(veRL's `reward_model.overlong_buffer.{len, penalty_factor}`, p = 1 in the paper).

GRPO's std (`std=`, config key `advantage.std`):
    "sample"      sqrt(sum (r - mean)^2 / (G - 1)), ddof 1 — the default. veRL (`torch.std` in
                  `compute_grpo_outcome_advantage`) and TRL's GRPOTrainer (`.std(dim=1)`) both
                  divide by the sample std, so trajflow's advantages equal theirs.
    "population"  sqrt(sum (r - mean)^2 / G), ddof 0 (the GRPO paper's formula read literally).
At G = 4 the two differ by sqrt(G / (G - 1)) = 1.155 (population advantages are larger). A group
of one has std 0 either way and gets advantage 0. Groups of one get leave-one-out advantage 0
(there is no other sample to compare with). Every group-relative estimator (grpo, dr_grpo,
leave_one_out) gives exactly 0 to a group whose rewards are all equal.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from trajflow.settings import check_number

from .config import GROUP_STDS, AdvantageConfig, GroupStd

ArrayLike = Any  # np.ndarray | torch.Tensor | sequence


def _is_tensor(x: ArrayLike) -> bool:
    """A torch tensor (torch is not imported for it: the advantage stage runs without torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if _is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _like(out: np.ndarray, ref: ArrayLike) -> ArrayLike:
    if _is_tensor(ref):
        return sys.modules["torch"].from_numpy(out).to(ref.device)
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
    check_number("grpo", eps=eps)
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


def _whitened(x: np.ndarray, weights: np.ndarray | None, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / sqrt(var + eps), weighted mean and ddof-1 variance over total weight W (0 when
    W <= 1: nothing to compare with)."""
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != x.shape:
        raise ValueError(f"token_counts has {w.shape[0]} rows, rewards have {x.shape[0]}")
    total = w.sum()
    if total <= 1.0:
        return np.zeros_like(x)
    mean = (w * x).sum() / total
    var = (w * (x - mean) ** 2).sum() / (total - 1.0)
    return (x - mean) / np.sqrt(var + eps)


def reinforce_plus_plus(rewards: ArrayLike, group_ids: ArrayLike, *,
                        token_counts: ArrayLike | None = None) -> ArrayLike:
    """REINFORCE++: rewards whitened over the batch (module docstring); `group_ids` only for the
    shared signature. `token_counts` [N]: loss tokens per trajectory (veRL's token weighting)."""
    r, _, _, _ = _group_stats(rewards, group_ids)
    weights = None if token_counts is None else _to_numpy(token_counts)
    return _like(_whitened(r, weights).astype(np.float32), rewards)


def reinforce_plus_plus_baseline(rewards: ArrayLike, group_ids: ArrayLike, *,
                                 token_counts: ArrayLike | None = None) -> ArrayLike:
    """REINFORCE++-baseline: r - group mean (a group of one: 0 subtracted), whitened over the batch."""
    r, codes, size, total = _group_stats(rewards, group_ids)
    baseline = np.where(size > 1, total / size, 0.0)[codes]
    weights = None if token_counts is None else _to_numpy(token_counts)
    return _like(_whitened(r - baseline, weights).astype(np.float32), rewards)


def overlong_penalty(lengths: ArrayLike, max_tokens: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment R_len [N] (float64, <= 0) for response lengths [N]."""
    check_number("overlong_penalty", max_tokens=max_tokens, buffer=buffer, penalty=penalty)
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong_penalty: need 0 < buffer <= max_tokens, got {buffer} and {max_tokens}")
    excess = _to_numpy(lengths).astype(np.float64).reshape(-1) - (max_tokens - buffer)
    return -penalty * np.clip(excess / buffer, 0.0, 1.0)


def shaped_rewards(config: AdvantageConfig, rewards: ArrayLike, lengths: ArrayLike | None = None) -> ArrayLike:
    """The rewards after the overlong shaping `config` asks for (needs `lengths`, response tokens
    per row); unchanged without it."""
    if config.overlong_buffer is None:
        return rewards
    if lengths is None or config.overlong_max_tokens is None:
        raise ValueError("advantage.overlong_buffer needs the response lengths and overlong_max_tokens")
    shaped = _to_numpy(rewards).astype(np.float64).reshape(-1) + overlong_penalty(
        lengths, config.overlong_max_tokens, config.overlong_buffer, config.overlong_penalty)
    return _like(shaped, rewards)


def compute_token_advantages(config: AdvantageConfig, rewards: ArrayLike, loss_mask: ArrayLike, *,
                             lengths: ArrayLike | None = None) -> np.ndarray:
    """Per-token advantages [N, T] float32 (`config.gamma` < 1: REINFORCE++ with the discount,
    algorithms/discounted.py) from rewards [N] and the padded loss mask [N, T]."""
    from .estimators import ESTIMATORS

    estimator = ESTIMATORS.resolve(config.estimator)()
    return estimator.token_advantages(config, _to_numpy(shaped_rewards(config, rewards, lengths)), loss_mask)


def compute_advantages(config: AdvantageConfig, rewards: ArrayLike, group_ids: ArrayLike, *,
                       lengths: ArrayLike | None = None, token_counts: ArrayLike | None = None) -> ArrayLike:
    """The advantages `config` asks for: the overlong shaping on the rewards (needs `lengths`,
    response tokens per row), then the estimator it names (algorithms/estimators.py; grpo reads
    `std`, REINFORCE++ `token_counts`). One per row; with `config.gamma` < 1 use
    compute_token_advantages. An estimator on a critic's values (GAE) is refused: the pipeline's
    GAE path computes it (operators/advantage.py `gae_columns`)."""
    from .estimators import ESTIMATORS

    cls = ESTIMATORS.resolve(config.estimator)
    if cls.needs_values:
        raise ValueError(f"advantage estimator {cls.name}: its advantages are per token from a critic's values "
                         "(operators/advantage.py gae_columns), not from the rewards alone")
    return cls().advantages(config, shaped_rewards(config, rewards, lengths), group_ids, token_counts=token_counts)
