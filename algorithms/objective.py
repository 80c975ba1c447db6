r"""The decoupled off-policy objective: a discrepancy mask on r_d, a PPO clip on r_s.

Per loss token t of sequence i (log-probs of the sampled token; `old` is whatever the chosen
strategy supplies as pi_old, see proximal.py):

    r_d = exp(old - inference)          training-inference discrepancy  (pi_old^train / mu)
    r_s = exp(current - old)            policy staleness                (pi_theta / pi_old^train)

    L = - agg_t [ M_d · w_d · min( r_s A,  clip(r_s, 1 - eps_low, 1 + eps_high) A ) ]

  M_d  keep-mask, symmetric:  token     1/c_tok <= r_d <= c_tok
                              sequence  1/c_seq <= exp(mean_t log r_d) <= c_seq   (all of seq i)
                              none      1
  w_d  min(r_d, C) if tis_cap = C is set, else 1 (truncated IS, detached: a weight, not a path)
  r_s  token level as above, or sequence level (GSPO-token): value exp(mean_t log r_s) shared by
       all tokens of the sequence, gradient per token:  s_i · exp(log pi_t - sg(log pi_t));
       clip level "none": no clip at all (a strategy that bounds the update otherwise, e.g. M2PO)
  dual clip (optional, A < 0):  max(·, c_dual · A), i.e. the per-token loss is at most c_dual |A|
  agg  token-mean | seq-mean-token-mean | token-sum-norm over tokens with loss_mask & M_d
  M_t  optional trust mask from the strategy (M2PO): a kept token outside it contributes 0 and
       no gradient but stays in the aggregation's denominator, like a clipped token

The paper's runs bound both factors at sequence level with [1/c, c]:
`CorrectionConfig.paper(c_ti=1.003, c_stale=1.004)` gives M_d on the geometric mean with
c_seq = c_ti, and the sequence-level clip with eps_low = 1 - 1/c_stale, eps_high = c_stale - 1.

Gradient flows only through `current_logprobs`. Masked tokens (loss_mask false, or dropped by
M_d) contribute exactly zero gradient. Log-ratios are clamped to ±LOG_RATIO_CLAMP before exp, so
extreme log-probs (-1e4 vs 0) give finite values and gradients; a clamped token gets no gradient
through its ratio (it would be clipped or masked at any sane threshold anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import AGGREGATIONS, CLIP_LEVELS, MASK_LEVELS, CorrectionConfig
from .masked import broadcast_to_tokens, masked_mean

__all__ = ["AGGREGATIONS", "CLIP_LEVELS", "LOG_RATIO_CLAMP", "MASK_LEVELS", "CorrectionConfig", "LossOutput",
           "aggregation_weights", "decoupled_loss", "discrepancy_mask", "loss_denominator"]

LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 4.9e8: finite in float32, squares still finite


@dataclass
class LossOutput:
    """The loss and the per-token bookkeeping diagnostics need. All [B, T] tensors are detached.

    loss              scalar; gradient flows to current_logprobs only
    loss_mask         [B, T] bool, as given
    discrepancy_mask  [B, T] bool, loss tokens kept by the r_d mask (M_d & loss_mask)
    clipped_low       [B, T] bool, loss tokens with A < 0 and r_s < 1 - eps_low (no gradient)
    clipped_high      [B, T] bool, loss tokens with A > 0 and r_s > 1 + eps_high (no gradient)
    dual_clipped      [B, T] bool, loss tokens with A < 0 and r_s > dual_clip_c (no gradient)
    trust_masked      [B, T] bool, loss tokens kept by the r_d mask but outside the strategy's
                      trust mask (no gradient, zero contribution, still in the denominator)
    active            [B, T] bool, kept by the mask, inside the trust mask and not clipped: the
                      tokens that carry gradient
    log_rd            [B, T] clamped log r_d (0 off loss tokens)
    log_rs            [B, T] clamped log r_s as the clip saw it (the sequence value if
                      clip_level="sequence"; 0 off loss tokens)
    log_rs_token      [B, T] clamped per-token log r_s = current - old (0 off loss tokens)
    is_weights        [B, T] w_d (1 without TIS)
    token_weights     [B, T] aggregation weight of each token (0 off kept tokens), so that
                      loss = -sum(token_weights · w_d · min(...))
    """

    loss: Tensor
    loss_mask: Tensor
    discrepancy_mask: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor
    trust_masked: Tensor
    active: Tensor
    log_rd: Tensor
    log_rs: Tensor
    log_rs_token: Tensor
    is_weights: Tensor
    token_weights: Tensor


def _log_ratio(numer: Tensor, denom: Tensor) -> Tensor:
    return (numer - denom).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def discrepancy_mask(log_rd: Tensor, loss_mask: Tensor, config: CorrectionConfig) -> Tensor:
    """M_d & loss_mask, [B, T] bool. 1/c <= r_d <= c is tested as |log r_d| <= log c."""
    if config.mask_level == "none":
        return loss_mask.clone()
    if config.mask_level == "token":
        keep = log_rd.abs() <= math.log(config.mask_c_token)
    else:  # sequence: geometric mean of r_d over the sequence's loss tokens
        seq_log_rd = masked_mean(log_rd, loss_mask, dim=-1)
        keep = (seq_log_rd.abs() <= math.log(config.mask_c_seq))[:, None].expand_as(loss_mask)
    return keep & loss_mask


def loss_denominator(keep: Tensor, config: CorrectionConfig) -> Tensor:
    """What the aggregation divides by, counted on this batch (a float scalar, not clamped).

    token-mean: kept tokens; seq-mean-token-mean: sequences with a kept token; token-sum-norm:
    loss_norm_tokens x rows. Every one is a sum over rows, so the count of a batch split into
    shards (workers, micro-batches) is the sum of the shards' counts: pass that global count as
    `denominator` and the shards' losses add up to the loss of the whole batch.
    """
    keep_f = keep.float()
    if config.aggregation == "token-mean":
        return keep_f.sum()
    if config.aggregation == "seq-mean-token-mean":
        return (keep_f.sum(dim=-1) > 0).float().sum()
    batch, width = keep.shape
    norm_tokens = config.loss_norm_tokens if config.loss_norm_tokens is not None else width
    return torch.tensor(float(norm_tokens * batch))


def aggregation_weights(keep: Tensor, config: CorrectionConfig, denominator: float | Tensor | None = None) -> Tensor:
    """Constant per-token weights [B, T] (zero off `keep`) that turn per-token losses into one scalar.

    `denominator`: the aggregation's count over the whole batch when `keep` is one shard of it
    (see loss_denominator); None: this batch's own count."""
    keep_f = keep.float()
    if denominator is None:
        denominator = loss_denominator(keep, config)
    denominator = torch.as_tensor(denominator, dtype=keep_f.dtype).clamp(min=1.0)
    if config.aggregation == "seq-mean-token-mean":
        return keep_f / keep_f.sum(dim=-1, keepdim=True).clamp(min=1.0) / denominator
    return keep_f / denominator


def decoupled_loss(
    current_logprobs: Tensor,
    old_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig = CorrectionConfig(),
    trust_mask: Tensor | None = None,
    denominator: float | Tensor | None = None,
) -> LossOutput:
    """The decoupled objective of the module docstring.

    current_logprobs [B, T] (with grad), old_logprobs / inference_logprobs [B, T] (treated as
    constants), advantages [B] or [B, T], loss_mask [B, T] bool, trust_mask [B, T] bool or None
    (None: every token may carry gradient). `denominator`: the aggregation's count over the
    whole batch when these rows are a shard of it (loss_denominator summed over the shards);
    None: this batch's own count. Data-parallel workers and micro-batches pass the global one.

    Every loss token must have finite log-probs: a token the sampling filter excludes under
    training numerics (-inf) is taken out of `loss_mask` by the caller and counted there.
    """
    if loss_mask.dtype != torch.bool:
        raise TypeError(f"loss_mask must be bool, got {loss_mask.dtype}")
    named = [("current_logprobs", current_logprobs), ("old_logprobs", old_logprobs),
             ("inference_logprobs", inference_logprobs)]
    if trust_mask is not None:
        if trust_mask.dtype != torch.bool:
            raise TypeError(f"trust_mask must be bool, got {trust_mask.dtype}")
        named.append(("trust_mask", trust_mask))
    for name, t in named:
        if t.shape != loss_mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, loss_mask has {tuple(loss_mask.shape)}")
    m = loss_mask
    zero = torch.zeros((), dtype=current_logprobs.dtype, device=current_logprobs.device)

    # Select padding away first: padding may hold NaN/-inf, and where() keeps it out of both
    # the forward value and the backward pass.
    cur = torch.where(m, current_logprobs, zero)
    old = torch.where(m, old_logprobs.detach().to(cur.dtype), zero)
    inf = torch.where(m, inference_logprobs.detach().to(cur.dtype), zero)
    adv = torch.where(m, broadcast_to_tokens(advantages.detach().to(cur.dtype), m), zero)

    # Discrepancy factor r_d: a mask (and optionally a detached truncated IS weight).
    log_rd = _log_ratio(old, inf)
    keep = discrepancy_mask(log_rd, m, config)
    if config.tis_cap is not None:
        w_d = log_rd.exp().clamp(max=config.tis_cap)
    else:
        w_d = torch.ones_like(log_rd)

    # Staleness factor r_s. At sequence level the value is the geometric mean over the loss
    # tokens (r_s compares training numerics with training numerics, so a token dropped by the
    # r_d mask still measures drift) and each token keeps its own gradient path: x - sg(x) is
    # exactly 0 in value, 1 in gradient (GSPO-token).
    log_rs_tok = _log_ratio(cur, old)
    if config.clip_level in ("token", "none"):
        log_rs = log_rs_tok
    else:
        seq = masked_mean(log_rs_tok.detach(), m, dim=-1)
        log_rs = seq[:, None] + (log_rs_tok - log_rs_tok.detach())
    r_s = log_rs.exp()

    # min(r A, clip(r) A) picks the clipped constant exactly when A > 0, r > 1 + eps_high or
    # A < 0, r < 1 - eps_low. Selecting those cases explicitly gives the same value and makes the
    # gradient-carrying set exactly `active` (no split gradient at a floating-point tie).
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    r_val = r_s.detach()
    clipping = config.clip_level != "none"
    clipped_high = m & (adv > 0) & (r_val > hi) & clipping
    clipped_low = m & (adv < 0) & (r_val < lo) & clipping
    pg = torch.where(clipped_low | clipped_high, r_val.clamp(lo, hi) * adv, r_s * adv)
    if config.dual_clip_c is not None:  # A < 0 and r > c: r A < c A, so max(., c A) = c A
        dual_clipped = m & (adv < 0) & (r_val > config.dual_clip_c)
        pg = torch.where(dual_clipped, config.dual_clip_c * adv, pg)
    else:
        dual_clipped = torch.zeros_like(m)

    # The trust mask narrows what carries gradient, not the denominator (M2PO's objective divides
    # by all loss tokens).
    weights = aggregation_weights(keep, config, denominator)
    trusted = keep if trust_mask is None else keep & trust_mask
    per_token = torch.where(trusted, -w_d * pg, zero)
    loss = (per_token * weights).sum()

    active = trusted & ~(clipped_low | clipped_high | dual_clipped)
    return LossOutput(
        loss=loss,
        loss_mask=m,
        discrepancy_mask=keep,
        clipped_low=clipped_low,
        clipped_high=clipped_high,
        dual_clipped=dual_clipped,
        trust_masked=keep & ~trusted,
        active=active,
        log_rd=log_rd,
        log_rs=torch.where(m, log_rs.detach(), zero),
        log_rs_token=torch.where(m, log_rs_tok.detach(), zero),
        is_weights=w_d,
        token_weights=weights,
    )
