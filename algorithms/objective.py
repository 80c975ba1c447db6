r"""The decoupled off-policy objective: a discrepancy mask on r_d, a policy term on r_s.

Per loss token t of sequence i (log-probs of the sampled token; `old` is whatever the chosen
strategy supplies as pi_old, see old_logprobs.py):

    r_d = exp(old - inference)          training-inference discrepancy  (pi_old^train / mu)
    r_s = exp(current - old)            policy staleness                (pi_theta / pi_old^train)

    L = - agg_t [ M_d · M_p · w_d · J(r_s, A) ]  +  beta · agg_t KL_t  -  c_H · agg_t H_t

  M_d  r_d keep-mask (`mask_level`), bounds [lo, c]: lo = 1/c unless mask_low_* is set (asymmetric;
       c null = lower-only):
         token             lo_tok <= r_d <= c_tok per token (IcePop with lo 0.5, c 5)
         sequence          lo_seq <= exp(mean_t log r_d) <= c_seq            (all of seq i)
         sequence-product  lo_seq <= exp(sum_t log r_d)  <= c_seq            (all of seq i)
         sequence-any      seq i goes when any of its tokens breaks the token bounds (veRL's veto
                           with a lower-only bound, its seq_max_k* with a band)
         none              1
       and every rule of `rejection` (veRL's chained rollout_rs: k1/k2/k3 per token, or their sum,
       mean or max over the sequence; algorithms/rejection.py)
       and, given `distribution_keep`, only tokens the distribution-level mask keeps (the mismatch
       of mu and pi_old over the captured top-k support: algorithms/distributions.py)
  w_d  1, or the truncated IS weight (`tis_cap` C, detached: a weight, not a path):
         tis_level token     min(r_d, C) per token
         tis_level sequence  min(prod_t r_d, C) on all tokens of seq i (product of token ratios)
  M_p  policy-side masks, which keep a token in the denominator with zero contribution and no
       gradient: the strategy's trust mask (M2PO), the off-policy sequence mask (`off_policy_mask`
       delta: a token with A < 0 in a sequence with mean_t log(mu / pi_theta) > delta; DeepSeek-V3.2,
       TRL), and Clip-Cov's covariance selection
  J    the loss's policy term on r_s (algorithms/losses.py: ppo, cispo, sapo, dppo_tv, dppo_kl,
       clip_cov, kl_cov). r_s is per token, or at clip_level "sequence" (GSPO-token) the value
       exp(mean_t log r_s) shared by the sequence's tokens with a per-token gradient:
       s_i · exp(log pi_t - sg(log pi_t)); clip_level "none" removes the loss's bound on r_s
  KL   optional, given the reference (`reference=ReferenceKL(logprobs, kl)`): per-token estimator
       of KL(pi_theta || pi_ref) (algorithms/kl.py), `kl.beta` x its aggregate added
       (KLConfig.in_ = "loss")
  H    optional, given per-token entropies: `entropy_coef` x their aggregate subtracted
  agg  over the counted tokens with the aggregation's weights (one set of weights for all terms):
         counted     `denominator` kept: tokens kept by M_d;  all: every loss token (an M_d-dropped
                     token adds 0 and is counted, as veRL/TRL/SkyRL/AReaL average IcePop/TIS masks)
         token-mean  / number of counted tokens
         seq-mean-token-mean   per sequence / its counted tokens, then / sequences with one
         token-sum-norm        / (loss_norm_tokens x rows)  (Dr.GRPO)
         prompt-mean           per prompt / its counted tokens, then / prompts with one (SkyRL)

The paper's runs bound both factors at sequence level with [1/c, c]:
`CorrectionConfig.paper(c_ti=1.003, c_stale=1.004)` gives M_d on the geometric mean with
c_seq = c_ti, and the sequence-level clip with eps_low = 1 - 1/c_stale, eps_high = c_stale - 1.

Normalisation: the loss is computed in sum form (`LossOutput.loss_sum`, token weights before the
division) together with the aggregation's count (`LossOutput.count`, loss_denominator), and
divided once (`LossSum`: loss = loss_sum / max(count, 1)). Every count is a sum over rows, so the
shards of a batch (data-parallel workers, micro-batches) add their (loss_sum, count) pairs and
divide at the end — the train step does exactly that, gradients included — or are each given
the global count (`whole=WholeUpdate(denominator=...)`): either way they give the whole batch's
loss and gradient. Two statistics are not per row: prompt-mean's per-prompt counts
(`WholeUpdate.group_counts`, prompt_token_counts) and Clip-Cov / KL-Cov's selection
(`WholeUpdate.cov_selected`, losses.covariance_selection); compute them on the whole update (e.g.
decoupled_loss on it without gradient) and hand each shard its rows.

Gradient flows only through `current_logprobs` (and `entropy`, when given). Masked tokens
(loss_mask false, dropped by M_d, outside a policy-side mask) contribute exactly zero gradient to
the policy term. Log-ratios are clamped to ±LOG_RATIO_CLAMP before exp, so extreme log-probs
(-1e4 vs 0) give finite values and gradients; a clamped token gets no gradient through its ratio
(it would be clipped or masked at any sane threshold anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from trajflow.deprecations import notice
from trajflow.settings import check_number

from .config import AGGREGATIONS, CLIP_LEVELS, LOSSES, MASK_LEVELS, CorrectionConfig
from .kl import ReferenceKL, kl_estimate
from .losses import (
    PolicyTerm,
    cispo_term,
    covariance_selection,
    dppo_term,
    dppo_trust_region,
    kl_cov_term,
    ppo_term,
    sapo_term,
)
from .masked import LOG_RATIO_CLAMP, broadcast_to_tokens, log_ratio, masked_mean, masked_sum
from .rejection import rejection_mask

__all__ = ["AGGREGATIONS", "CLIP_LEVELS", "LOG_RATIO_CLAMP", "LOSSES", "MASK_LEVELS", "CorrectionConfig",
           "LossOutput", "LossSum", "ReferenceKL", "WholeUpdate", "aggregation_weights", "decoupled_loss",
           "discrepancy_mask", "discrepancy_weights", "loss_denominator", "off_policy_sequence_mask",
           "prompt_token_counts"]


@dataclass(frozen=True)
class WholeUpdate:
    """Statistics of the whole update when the rows given to decoupled_loss are a shard of it (a
    data-parallel worker's, a micro-batch), each at these rows: so the shards' losses add up to the
    whole update's (module docstring, Normalisation). A field left None is counted on these rows.

    denominator   the aggregation's count over the whole update (loss_denominator summed over the
                  shards). The train step instead adds the shards' `loss_sum` and `count` and
                  divides once (LossSum).
    groups        [B] integers: the prompt of each row (prompt-mean)
    group_counts  [B]: each row's prompt count over the whole update (prompt_token_counts;
                  default: on these rows, from `groups`)
    cov_selected  [B, T] bool: Clip-Cov / KL-Cov's selection over the whole update (default:
                  covariance_selection on these rows)
    """

    denominator: float | Tensor | None = None
    groups: Tensor | None = None
    group_counts: Tensor | None = None
    cov_selected: Tensor | None = None

    def __post_init__(self) -> None:
        check_number("WholeUpdate", denominator=self.denominator)


@dataclass(frozen=True)
class LossSum:
    """A loss in sum form and the aggregation's count it is divided by (loss_denominator). The
    parts of one update (micro-batches, data-parallel workers) add up; the one division of the
    aggregation comes last: `mean` = total / `divisor`, and the train step divides the summed
    gradients by the same `divisor`. Floats or scalar tensors (the loss's total keeps its graph)."""

    total: float | Tensor = 0.0
    count: float | Tensor = 0.0

    def __add__(self, other: "LossSum") -> "LossSum":
        return LossSum(self.total + other.total, self.count + other.count)

    @property
    def divisor(self) -> float | Tensor:
        """The count, at least 1: a batch with nothing counted has loss 0, not NaN."""
        if isinstance(self.count, Tensor):
            return self.count.clamp(min=1.0)
        return max(float(self.count), 1.0)

    @property
    def mean(self) -> float | Tensor:
        return self.total / self.divisor


@dataclass
class LossOutput:
    """The loss and the per-token bookkeeping diagnostics need. All [B, T] tensors are detached.
    What `clipped_*`, `dual_clipped` and `active` mean under each loss: algorithms/losses.py.

    loss              scalar, loss_sum / max(count, 1); gradient flows to current_logprobs (and
                      entropy) only
    loss_sum          scalar, the loss in sum form (before the division; with gradient)
    count             scalar, what the aggregation divides by: loss_denominator on this batch,
                      or the WholeUpdate.denominator given
    loss_mask         [B, T] bool, as given
    discrepancy_mask  [B, T] bool, loss tokens kept by the r_d mask (M_d & loss_mask)
    counted           [B, T] bool, the tokens the aggregation counts: discrepancy_mask
                      (denominator "kept") or loss_mask ("all"); loss_denominator(counted, ...)
    clipped_low       [B, T] bool, ppo: loss tokens with A < 0 and r_s < 1 - eps_low (no gradient)
    clipped_high      [B, T] bool, ppo: loss tokens with A > 0 and r_s > 1 + eps_high (no gradient)
    dual_clipped      [B, T] bool, ppo: loss tokens with A < 0 and r_s > dual_clip_c (no gradient)
    trust_masked      [B, T] bool, loss tokens kept by the r_d mask but outside the strategy's
                      trust mask (no gradient, zero contribution, still in the denominator)
    off_policy_masked [B, T] bool, kept tokens the off-policy sequence mask drops (the same)
    cov_selected      [B, T] bool, clip_cov: tokens detached (the same); kl_cov: tokens penalised
    active            [B, T] bool, kept, inside every policy-side mask and carrying the policy
                      term's gradient (ppo: not clipped)
    log_rd            [B, T] clamped log r_d (0 off loss tokens)
    log_rs            [B, T] clamped log r_s as the policy term saw it (the sequence value if
                      clip_level="sequence"; 0 off loss tokens)
    log_rs_token      [B, T] clamped per-token log r_s = current - old (0 off loss tokens)
    is_weights        [B, T] w_d (1 without TIS)
    token_weights     [B, T] aggregation weight of each token before the division (0 off counted
                      tokens), so that loss_sum = -sum(token_weights · w_d · J) (+ the KL and
                      entropy terms): additive over the shards of a batch
    kl                [B, T] per-token KL estimate to the reference (0 without reference
                      log-probs, and off loss tokens)
    """

    loss: Tensor
    loss_sum: Tensor
    count: Tensor
    loss_mask: Tensor
    discrepancy_mask: Tensor
    counted: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor
    trust_masked: Tensor
    off_policy_masked: Tensor
    cov_selected: Tensor
    active: Tensor
    log_rd: Tensor
    log_rs: Tensor
    log_rs_token: Tensor
    is_weights: Tensor
    token_weights: Tensor
    kl: Tensor

    def detached(self) -> LossOutput:
        """This output with its two scalars detached too: what a step keeps of a micro-batch
        after its backward (the [B, T] fields are detached already)."""
        return replace(self, loss=self.loss.detach(), loss_sum=self.loss_sum.detach())


def _log_bounds(c: float | None, low: float | None) -> tuple[float, float]:
    """[lo, c] as log bounds: lo = 1/c unless `low` is given; c None = no upper bound."""
    hi = math.inf if c is None else math.log(c)
    return (math.log(low) if low is not None else -hi), hi


def discrepancy_mask(log_rd: Tensor, loss_mask: Tensor, config: CorrectionConfig) -> Tensor:
    """M_d & loss_mask, [B, T] bool (module docstring). lo <= r_d <= c is tested on log r_d;
    `config.rejection`'s rules must keep the token too (algorithms/rejection.py)."""
    keep = _level_mask(log_rd, loss_mask, config)
    return rejection_mask(log_rd, keep, config.rejection, loss_mask) if config.rejection else keep


def _level_mask(log_rd: Tensor, loss_mask: Tensor, config: CorrectionConfig) -> Tensor:
    if config.mask_level == "none":
        return loss_mask.clone()
    if config.mask_level in ("token", "sequence-any"):
        lo, hi = _log_bounds(config.mask_c_token, config.mask_low_token)
        keep = (log_rd >= lo) & (log_rd <= hi)
        if config.mask_level == "sequence-any":
            keep = (keep | ~loss_mask).all(dim=-1, keepdim=True).expand_as(loss_mask)
    else:  # the sequence's value: geometric mean or product of r_d over its loss tokens
        lo, hi = _log_bounds(config.mask_c_seq, config.mask_low_seq)
        reduce = masked_mean if config.mask_level == "sequence" else masked_sum
        seq = reduce(log_rd, loss_mask, dim=-1)
        keep = ((seq >= lo) & (seq <= hi))[:, None].expand_as(loss_mask)
    return keep & loss_mask


def discrepancy_weights(log_rd: Tensor, loss_mask: Tensor, config: CorrectionConfig) -> Tensor:
    """w_d [B, T], detached: 1, min(r_d, C) per token or min(prod_t r_d, C) per sequence."""
    if config.tis_cap is None:
        return torch.ones_like(log_rd)
    if config.tis_level == "token":
        return log_rd.exp().clamp(max=config.tis_cap)
    seq = masked_sum(log_rd, loss_mask, dim=-1).clamp(-LOG_RATIO_CLAMP, math.log(config.tis_cap))
    return seq.exp()[:, None].expand_as(log_rd).clone()


def off_policy_sequence_mask(log_rd: Tensor, log_rs: Tensor, advantages: Tensor, loss_mask: Tensor,
                             delta: float) -> Tensor:
    """bool [B, T]: loss tokens the off-policy sequence mask drops: A < 0 and
    mean_t log(mu / pi_theta) = -mean_t (log r_d + log r_s) > delta over the sequence's loss tokens.

    DeepSeek-V3.2 (arXiv 2512.02556, eq. 9); TRL `off_policy_mask_threshold`, which measures
    against the sampling (inference) log-probs as here: the whole drift from mu, numerics and
    staleness. `log_rs` per token."""
    check_number("off_policy_sequence_mask", delta=delta)
    drift = -masked_mean(log_rd + log_rs.detach(), loss_mask, dim=-1)
    return loss_mask & (advantages < 0) & (drift > delta)[:, None]


def prompt_token_counts(counted: Tensor, groups: Tensor) -> Tensor:
    """float [B]: the number of counted tokens of each row's prompt (rows with equal `groups`
    codes, [B] integers). On the whole update, this is prompt-mean's `group_counts`."""
    per_row = counted.sum(dim=-1).double()
    prompts, codes = torch.unique(groups, return_inverse=True)
    totals = torch.zeros(len(prompts), dtype=torch.float64, device=per_row.device).index_add_(0, codes, per_row)
    return totals[codes]


def loss_denominator(counted: Tensor, config: CorrectionConfig, group_counts: Tensor | None = None) -> Tensor:
    """What the aggregation divides by, counted on this batch (a float scalar, not clamped).

    `counted`: LossOutput.counted. token-mean: counted tokens; seq-mean-token-mean: sequences with
    a counted token; token-sum-norm: loss_norm_tokens x rows; prompt-mean: sum over rows of
    (row's counted tokens / its prompt's, `group_counts`), i.e. the prompts with a counted token.
    Every one is a sum over rows, so the count of a batch split into shards (workers,
    micro-batches) is the sum of the shards' counts: pass that global count as `denominator` and
    the shards' losses add up to the loss of the whole batch.
    """
    counted_f = counted.float()
    if config.aggregation == "token-mean":
        return counted_f.sum()
    if config.aggregation == "seq-mean-token-mean":
        return (counted_f.sum(dim=-1) > 0).float().sum()
    if config.aggregation == "prompt-mean":
        if group_counts is None:
            raise ValueError("loss_denominator: aggregation prompt-mean needs group_counts (prompt_token_counts)")
        per_row = counted.sum(dim=-1).double()
        return (per_row / group_counts.double().clamp(min=1.0)).sum().float()
    batch, width = counted.shape
    norm_tokens = config.loss_norm_tokens if config.loss_norm_tokens is not None else width
    return torch.tensor(float(norm_tokens * batch))


def aggregation_weights(counted: Tensor, config: CorrectionConfig, group_counts: Tensor | None = None) -> Tensor:
    """Constant per-token weights [B, T] (zero off `counted`) that turn per-token losses into the
    loss in sum form; divided by the aggregation's count (loss_denominator) they give its mean.

    `group_counts`: prompt-mean's per-row prompt counts (prompt_token_counts, over the whole batch
    when this is a shard)."""
    counted_f = counted.float()
    if config.aggregation == "seq-mean-token-mean":
        return counted_f / counted_f.sum(dim=-1, keepdim=True).clamp(min=1.0)
    if config.aggregation == "prompt-mean":
        return counted_f / group_counts.to(counted_f.dtype).clamp(min=1.0)[:, None]
    return counted_f


def _policy_term(config: CorrectionConfig, log_rs: Tensor, cur: Tensor, old: Tensor, adv: Tensor, m: Tensor,
                 policy: Tensor, cov_selected: Tensor | None) -> tuple[PolicyTerm, Tensor]:
    """(J and its flags, the covariance selection) for config.loss; `policy`: the tokens that
    carry a policy term before the covariance selection."""
    none = torch.zeros_like(m)
    if config.loss in ("ppo", "clip_cov"):
        term = ppo_term(log_rs, adv, m, config)
        if config.loss == "clip_cov":
            if cov_selected is None:
                cov_selected = covariance_selection(cur, adv, policy, config, eligible=~term.no_grad)
            return term, cov_selected & policy
        return term, none
    if config.loss == "cispo":
        return cispo_term(log_rs, adv, m, config), none
    if config.loss == "sapo":
        return sapo_term(log_rs, adv, m, config), none
    if config.loss in ("dppo_tv", "dppo_kl"):
        return dppo_term(log_rs, adv, m, config, dppo_trust_region(cur, old, adv, config)), none
    if cov_selected is None:  # kl_cov
        cov_selected = covariance_selection(cur, adv, policy, config)
    cov_selected = cov_selected & policy
    return kl_cov_term(log_rs, adv, m, config, cov_selected), cov_selected


def _check_mask(name: str, t: Tensor | None, like: Tensor) -> None:
    if t is None:
        return
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be bool, got {t.dtype}")
    if t.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, loss_mask has {tuple(like.shape)}")


# decoupled_loss's arguments before ReferenceKL and WholeUpdate grouped them: each still works for
# one release, with a notice (trajflow/deprecations.py); old name -> (argument, field) of the new form
_RENAMED: dict[str, tuple[str, str]] = {
    "reference_logprobs": ("reference", "logprobs"), "kl": ("reference", "config"),
    "denominator": ("whole", "denominator"), "groups": ("whole", "groups"),
    "group_counts": ("whole", "group_counts"), "cov_selected": ("whole", "cov_selected"),
}
_GROUPS = {"reference": ReferenceKL, "whole": WholeUpdate}
# the old form's arguments after `config` by position -> what replaces them
_BY_POSITION = {"trust_mask": "trust_mask=...", "denominator": "whole=WholeUpdate(denominator=...)"}


def _regrouped(legacy: tuple[Any, ...], renamed: dict[str, Any], trust_mask: Tensor | None,
               reference: ReferenceKL | None,
               whole: WholeUpdate | None) -> tuple[Tensor | None, ReferenceKL | None, WholeUpdate | None]:
    """decoupled_loss's old form in the new one: `trust_mask` and `denominator` by position after
    `config`, the keywords of _RENAMED; one notice each. A TypeError, as for any call that does not
    bind: an unknown keyword, an argument given twice, an old name next to the group replacing it."""
    if len(legacy) > len(_BY_POSITION):
        raise TypeError(f"decoupled_loss() takes from 5 to 8 positional arguments but {6 + len(legacy)} were given")
    unknown = [name for name in renamed if name not in _RENAMED]
    if unknown:
        raise TypeError(f"decoupled_loss() got an unexpected keyword argument {unknown[0]!r}")
    by_position = dict(zip(_BY_POSITION, legacy))
    twice = [name for name in by_position if name in renamed or (name == "trust_mask" and trust_mask is not None)]
    if twice:
        raise TypeError(f"decoupled_loss() got multiple values for argument {twice[0]!r}")
    moved = {**by_position, **renamed}
    trust_mask = moved.pop("trust_mask", trust_mask)
    given = {"reference": reference, "whole": whole}
    mixed = [old for old in moved if given[_RENAMED[old][0]] is not None]
    if mixed:
        group = _RENAMED[mixed[0]][0]
        raise TypeError(f"decoupled_loss(): {mixed[0]} is part of {group}= ({_GROUPS[group].__name__}): "
                        "give one or the other")
    for name in by_position:
        notice(f"decoupled_loss(): {name} by position", _BY_POSITION[name], stacklevel=4)
    fields: dict[str, dict[str, Any]] = {"reference": {}, "whole": {}}
    for old, value in moved.items():
        group, field = _RENAMED[old]
        if old in renamed:
            notice(f"decoupled_loss({old}=...)", f"{group}={_GROUPS[group].__name__}({field}=...)", stacklevel=4)
        fields[group][field] = value
    if fields["reference"].get("logprobs") is not None:  # `kl` without reference log-probs adds nothing, as before
        reference = ReferenceKL(**fields["reference"])
    if fields["whole"]:
        whole = WholeUpdate(**fields["whole"])
    return trust_mask, reference, whole


def decoupled_loss(
    current_logprobs: Tensor,
    old_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config: CorrectionConfig = CorrectionConfig(),
    *legacy: Any,
    trust_mask: Tensor | None = None,
    entropy: Tensor | None = None,
    reference: ReferenceKL | None = None,
    whole: WholeUpdate | None = None,
    distribution_keep: Tensor | None = None,
    **renamed: Any,
) -> LossOutput:
    """The decoupled objective of the module docstring, one pure function (AReaL's ppo_actor_loss_fn).

    current_logprobs [B, T] (with grad), old_logprobs / inference_logprobs [B, T] (treated as
    constants), advantages [B] or [B, T], loss_mask [B, T] bool. trust_mask [B, T] bool or None
    (None: every token may carry gradient). entropy [B, T]: per-token entropy of pi_theta (with
    grad), required when config.entropy_coef > 0. reference: pi_ref's log-probs [B, T] and the
    KLConfig (ReferenceKL); adds beta x the aggregate of its estimator (its in_ must be "loss").
    whole: the whole update's statistics when these rows are a shard of it (WholeUpdate; None:
    these rows are the update). distribution_keep [B, T] bool: tokens the distribution-level mask
    keeps, part of M_d.

    `legacy` and `renamed`: the old form, for one release with a notice each (TrajflowDeprecation):
    trust_mask and denominator by position after `config`; the keywords reference_logprobs and kl
    (now `reference`), denominator, groups, group_counts and cov_selected (now `whole`).

    Every loss token must have finite log-probs: a token the sampling filter excludes under
    training numerics (-inf) is taken out of `loss_mask` by the caller and counted there.
    """
    if legacy or renamed:
        trust_mask, reference, whole = _regrouped(legacy, renamed, trust_mask, reference, whole)
    whole = WholeUpdate() if whole is None else whole
    group_counts = whole.group_counts
    if loss_mask.dtype != torch.bool:
        raise TypeError(f"loss_mask must be bool, got {loss_mask.dtype}")
    named = [("current_logprobs", current_logprobs), ("old_logprobs", old_logprobs),
             ("inference_logprobs", inference_logprobs),
             ("reference.logprobs", None if reference is None else reference.logprobs), ("entropy", entropy)]
    for name, t in named:
        if t is not None and t.shape != loss_mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, loss_mask has {tuple(loss_mask.shape)}")
    _check_mask("trust_mask", trust_mask, loss_mask)
    _check_mask("cov_selected", whole.cov_selected, loss_mask)
    _check_mask("distribution_keep", distribution_keep, loss_mask)
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("CorrectionConfig.entropy_coef > 0 needs the per-token `entropy`")
    if reference is not None and reference.config.in_ != "loss":
        raise ValueError("a reference given to the loss, but KLConfig.in_ is 'reward' "
                         "(the KL is in the reward: kl_penalized_rewards)")
    if config.aggregation == "prompt-mean" and whole.groups is None and group_counts is None:
        raise ValueError("CorrectionConfig.aggregation prompt-mean needs `groups` (the prompt of each row: "
                         "whole=WholeUpdate(groups=...))")
    m = loss_mask
    zero = torch.zeros((), dtype=current_logprobs.dtype, device=current_logprobs.device)

    # Select padding away first: padding may hold NaN/-inf, and where() keeps it out of both
    # the forward value and the backward pass.
    cur = torch.where(m, current_logprobs, zero)
    old = torch.where(m, old_logprobs.detach().to(cur.dtype), zero)
    inf = torch.where(m, inference_logprobs.detach().to(cur.dtype), zero)
    adv = torch.where(m, broadcast_to_tokens(advantages.detach().to(cur.dtype), m), zero)

    # Discrepancy factor r_d: a mask and a detached weight.
    log_rd = log_ratio(old, inf)
    keep = discrepancy_mask(log_rd, m, config)
    if distribution_keep is not None:
        keep = keep & distribution_keep
    w_d = discrepancy_weights(log_rd, m, config)

    # Staleness factor r_s. At sequence level the value is the geometric mean over the loss
    # tokens (r_s compares training numerics with training numerics, so a token dropped by the
    # r_d mask still measures drift) and each token keeps its own gradient path: x - sg(x) is
    # exactly 0 in value, 1 in gradient (GSPO-token).
    log_rs_tok = log_ratio(cur, old)
    if config.clip_level in ("token", "none"):
        log_rs = log_rs_tok
    else:
        seq = masked_mean(log_rs_tok.detach(), m, dim=-1)
        log_rs = seq[:, None] + (log_rs_tok - log_rs_tok.detach())

    # Policy-side masks narrow what carries the policy term, not the denominator (M2PO's
    # objective divides by all loss tokens; TRL keeps off-policy-masked tokens in its count).
    trusted = keep if trust_mask is None else keep & trust_mask
    if config.off_policy_mask is not None:
        dropped = off_policy_sequence_mask(log_rd, log_rs_tok, adv, m, config.off_policy_mask)
    else:
        dropped = torch.zeros_like(m)
    policy = trusted & ~dropped
    term, selected = _policy_term(config, log_rs, cur, old, adv, m, policy, whole.cov_selected)
    if config.loss == "clip_cov":
        policy = policy & ~selected

    counted = keep if config.denominator == "kept" else m.clone()
    if config.aggregation == "prompt-mean" and group_counts is None:
        group_counts = prompt_token_counts(counted, whole.groups)
    # The loss in sum form and its count, divided once (LossSum): shards add both, then divide.
    weights = aggregation_weights(counted, config, group_counts)
    count = loss_denominator(counted, config, group_counts) if whole.denominator is None else whole.denominator
    per_token = torch.where(policy, -w_d * term.value, zero)
    loss_sum = (per_token * weights).sum()
    if reference is not None:
        ref = torch.where(m, reference.logprobs.detach().to(cur.dtype), zero)
        kl_tokens = torch.where(m, kl_estimate(cur, ref, reference.config.estimator), zero)
        loss_sum = loss_sum + reference.config.beta * (kl_tokens * weights).sum()
    else:
        kl_tokens = torch.zeros_like(cur)
    if config.entropy_coef > 0:
        loss_sum = loss_sum - config.entropy_coef * (torch.where(m, entropy, zero) * weights).sum()
    total = LossSum(loss_sum, torch.as_tensor(count, dtype=loss_sum.dtype, device=loss_sum.device))

    return LossOutput(
        loss=total.mean,
        loss_sum=loss_sum,
        count=total.count,
        loss_mask=m,
        discrepancy_mask=keep,
        counted=counted,
        clipped_low=term.clipped_low,
        clipped_high=term.clipped_high,
        dual_clipped=term.dual_clipped,
        trust_masked=keep & ~trusted,
        off_policy_masked=trusted & dropped,
        cov_selected=selected,
        active=policy & ~term.no_grad,
        log_rd=log_rd,
        log_rs=torch.where(m, log_rs.detach(), zero),
        log_rs_token=torch.where(m, log_rs_tok.detach(), zero),
        is_weights=w_d,
        token_weights=weights,
        kl=kl_tokens.detach(),
    )
