"""Per-batch correction diagnostics, as a flat dict[str, float] for the metrics row.

All fractions are over loss tokens (loss_mask true) unless the key says seq.

    mask/token_kept_frac   loss tokens kept by the r_d mask
    mask/seq_kept_frac     sequences (with >= 1 loss token) that keep >= 1 token
    mask/kept_frac_pos_adv, mask/kept_frac_neg_adv   token_kept_frac among A > 0 / A < 0 tokens
                           (when advantages are given). Unequal values mean the mask selects by
                           advantage sign: with a drifting proxy as "old", the sequences the policy
                           has learnt to like (A > 0) drift most and are masked, leaving a
                           negative-only gradient.
    clip/low_frac          A < 0 and r_s < 1 - eps_low
    clip/high_frac         A > 0 and r_s > 1 + eps_high
    clip/dual_frac         A < 0 and r_s > dual_clip_c
    clip/frac              any of the three (their meaning under losses other than ppo:
                           algorithms/losses.py; cispo: weights truncated, tokens still trained)
    mask/off_policy_frac   kept tokens dropped by the off-policy sequence mask
    cov/selected_frac      tokens Clip-Cov detached / KL-Cov penalised
    active_frac            kept, inside every policy-side mask and carrying the policy term's
                           gradient (ppo: unclipped): the EWMA reset signal
    kl/mean                mean per-token KL to the reference model (algorithms/kl.py), when the
                           loss was given reference log-probs (`reference=True`)
    mismatch/k1            mean(log mu - log pi_old)            } estimators of KL(mu || pi_old) on
    mismatch/k3            mean(rho - 1 - log rho), rho = pi_old/mu }  samples from mu; k3 >= 0
    mismatch/max_abs_log_rd  max |log pi_old - log mu| (0 when old log-probs are exact and numerics match)
    staleness/max_abs_log_ratio  max |log pi_theta - log pi_old| per token (0 on-policy when pi_old is
                           computed in the same numerics as pi_theta)
    split/var_log_rd       variance over loss tokens of log r_d = log pi_old - log mu: with exact old
    split/var_log_rs       logits, the engine-mismatch and the staleness parts of the total log-ratio
    split/var_log_total    log pi_theta - log mu (the split of arXiv 2605.14220; under a proxy pi_old
                           the two parts mix)
    grad/cos_vs_exact      gradient_agreement(): a strategy's parameter gradient against the exact
    grad/rel_err_vs_exact  one on the same batch (replay --diagnose --gradients)
    is/ess                 (sum w)^2 / (N sum w^2), w = r_d per loss token; 1 = all equal
    staleness/mean, /max   trainer_version - versions over loss tokens
    staleness/lag_{k}      token count at lag k, for k = 0..max (a histogram)
    loss_tokens            number of loss tokens in the batch
    ewma/age, ewma/reset_count   passed through when given

For an offline "diagnose" pass without an update, call decoupled_loss with
current_logprobs = old_logprobs under torch.no_grad() (r_s = 1: nothing clipped).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number

from .kl import kl_metrics
from .masked import broadcast_to_tokens
from .objective import LossOutput


def _frac(selected: Tensor, among: Tensor) -> float:
    n = int(among.sum())
    return float((selected & among).sum()) / n if n else 0.0


def mismatch_kl(log_rd: Tensor, mask: Tensor) -> tuple[float, float]:
    """(k1, k3) for KL(mu || pi_old) from log r_d = log pi_old - log mu on samples of mu."""
    x = log_rd[mask].to(torch.float64)
    if x.numel() == 0:
        return 0.0, 0.0
    k1 = (-x).mean()
    k3 = (torch.expm1(x) - x).mean()  # rho - 1 - log rho, expm1 for accuracy near rho = 1
    return float(k1), float(k3)


def _variance(x: Tensor, mask: Tensor) -> float:
    """Population variance of x over the mask (float64); 0 for fewer than two tokens."""
    v = x[mask].detach().to(torch.float64)
    return float(v.var(unbiased=False)) if v.numel() > 1 else 0.0


def gradient_agreement(grad: Tensor, exact: Tensor) -> dict[str, float]:
    """How a strategy's flattened parameter gradient `grad` departs from the exact one on the same
    batch: cosine similarity (1: the same direction; NaN when either gradient is zero) and the
    relative norm error |grad - exact| / |exact| (0: the same gradient; NaN when exact is zero)."""
    g, e = grad.detach().to(torch.float64).flatten(), exact.detach().to(torch.float64).flatten()
    gn, en = float(g.norm()), float(e.norm())
    cos = float(g @ e) / (gn * en) if gn > 0 and en > 0 else float("nan")
    rel = float((g - e).norm()) / en if en > 0 else float("nan")
    return {"grad/cos_vs_exact": cos, "grad/rel_err_vs_exact": rel, "grad/norm": gn}


def effective_sample_size(weights: Tensor, mask: Tensor) -> float:
    """Normalised ESS (sum w)^2 / (N sum w^2) in (0, 1]; 0 for an empty selection."""
    w = weights[mask].to(torch.float64)
    if w.numel() == 0:
        return 0.0
    denom = w.numel() * (w * w).sum()
    return float(w.sum() ** 2 / denom) if denom > 0 else 0.0


def staleness_stats(versions: Tensor, trainer_version: int, mask: Tensor) -> dict[str, float]:
    """Lag = trainer_version - version per loss token: mean, max, histogram (counts per lag)."""
    check_number("staleness_stats", trainer_version=trainer_version)
    lag = (trainer_version - versions[mask].to(torch.int64))
    if lag.numel() == 0:
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    out = {"staleness/mean": float(lag.double().mean()), "staleness/max": float(lag.max())}
    negative = int((lag < 0).sum())  # tokens from a version the trainer has not reached: a bug upstream
    if negative:
        out["staleness/negative_count"] = float(negative)
    counts = torch.bincount(lag.clamp(min=0))
    out.update({f"staleness/lag_{k}": float(c) for k, c in enumerate(counts.tolist())})
    return out


def correction_diagnostics(
    out: LossOutput,
    *,
    versions: Tensor | None = None,
    trainer_version: int | None = None,
    ewma_age: float | None = None,
    ewma_reset_count: int | None = None,
    advantages: Tensor | None = None,
    reference: bool = False,
) -> dict[str, float]:
    """Diagnostics of one batch from the loss bookkeeping (see the module docstring for keys).
    `reference`: the loss had reference log-probs (report kl/mean from LossOutput.kl)."""
    check_number("correction_diagnostics", trainer_version=trainer_version, ewma_age=ewma_age,
                 ewma_reset_count=ewma_reset_count)
    m = out.loss_mask
    seqs = m.any(dim=-1)
    clipped = out.clipped_low | out.clipped_high | out.dual_clipped
    k1, k3 = mismatch_kl(out.log_rd, m)
    d = {
        "mask/token_kept_frac": _frac(out.discrepancy_mask, m),
        "mask/seq_kept_frac": _frac(out.discrepancy_mask.any(dim=-1), seqs),
        "clip/low_frac": _frac(out.clipped_low, m),
        "clip/high_frac": _frac(out.clipped_high, m),
        "clip/dual_frac": _frac(out.dual_clipped, m),
        "clip/frac": _frac(clipped, m),
        "mask/off_policy_frac": _frac(out.off_policy_masked, m),
        "cov/selected_frac": _frac(out.cov_selected, m),
        "active_frac": _frac(out.active, m),
        "mismatch/k1": k1,
        "mismatch/k3": k3,
        "mismatch/max_abs_log_rd": float(out.log_rd[m].abs().max()) if bool(m.any()) else 0.0,
        "staleness/max_abs_log_ratio": float(out.log_rs_token[m].abs().max()) if bool(m.any()) else 0.0,
        "is/ess": effective_sample_size(out.log_rd.exp(), m),
        "loss_tokens": float(m.sum()),
        "split/var_log_rd": _variance(out.log_rd, m),
        "split/var_log_rs": _variance(out.log_rs_token, m),
        "split/var_log_total": _variance(out.log_rd + out.log_rs_token, m),
    }
    if reference:
        d.update(kl_metrics(out.kl, m))
    if advantages is not None:
        sign = broadcast_to_tokens(advantages, m)  # per row [B] or per token [B, T]
        d["mask/kept_frac_pos_adv"] = _frac(out.discrepancy_mask, m & (sign > 0))
        d["mask/kept_frac_neg_adv"] = _frac(out.discrepancy_mask, m & (sign < 0))
    if versions is not None:
        if trainer_version is None:
            raise ValueError("staleness diagnostics need trainer_version along with versions")
        d.update(staleness_stats(versions, trainer_version, m))
    if ewma_age is not None:
        d["ewma/age"] = float(ewma_age)
    if ewma_reset_count is not None:
        d["ewma/reset_count"] = float(ewma_reset_count)
    return d
