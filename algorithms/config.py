"""The settings of the math, declared once (trajflow/settings.py): the objective (`correction:`),
the advantage estimator (`advantage:`), the KL to a reference model (`kl:`), on-policy
distillation (`distill:`) and the optimizer (`optimizer:`).

These dataclasses hold THE defaults: a job config's YAML sections are built from them
(pipelines/config/sections.py), so `decoupled_loss(..., CorrectionConfig())` in a notebook is
exactly the objective a YAML job with no `correction:` key trains with. Torch-free, so validating
a job config imports no torch.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from trajflow.settings import SettingError, check_number, check_settings, fail, setting

Loss = Literal["ppo", "cispo", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"]
MaskLevel = Literal["token", "sequence", "sequence-product", "sequence-any", "none"]
TisLevel = Literal["token", "sequence"]
ClipLevel = Literal["token", "sequence", "none"]
Denominator = Literal["kept", "all"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "token-sum-norm", "prompt-mean"]
GroupStd = Literal["sample", "population"]
# "+": veRL's straight-through variants (the estimator's value, k2's gradient); k2 is its own
KLEstimator = Literal["k1", "k2", "k3", "low_var", "abs", "k1+", "k3+", "low_var+", "abs+"]
# veRL's rejection statistics on the log-ratio log r_d (algorithms/rejection.py)
RejectionStatistic = Literal["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                             "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]
DistMetric = Literal["tv", "kl"]
DistLevel = Literal["token", "sequence"]
StudentSide = Literal["current", "old"]
Schedule = Literal["constant", "linear", "cosine"]

LOSSES: tuple[str, ...] = typing.get_args(Loss)
MASK_LEVELS: tuple[str, ...] = typing.get_args(MaskLevel)
CLIP_LEVELS: tuple[str, ...] = typing.get_args(ClipLevel)
AGGREGATIONS: tuple[str, ...] = typing.get_args(Aggregation)
GROUP_STDS: tuple[str, ...] = typing.get_args(GroupStd)
KL_ESTIMATORS: tuple[str, ...] = typing.get_args(KLEstimator)
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
REJECTION_STATISTICS: tuple[str, ...] = typing.get_args(RejectionStatistic)

# Losses whose policy term has a PPO clip (dual clip applies), and those defined per token only.
_PPO_CLIPPED = ("ppo", "clip_cov")
_TOKEN_ONLY = ("dppo_tv", "dppo_kl", "kl_cov")


@dataclass(frozen=True)
class RejectionRule:
    """One rejection criterion on r_d, as veRL's `rollout_rs` option of the same name defines it
    (algorithms/rejection.py). k1 = log(mu / pi_old) = -log r_d; k2 = (log r_d)^2 / 2;
    k3 = r_d - 1 - log r_d; per token, or its sum, mean or max over the sequence's loss tokens."""

    statistic: RejectionStatistic = setting(
        doc="token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3} or seq_max_k{2,3} (veRL's names)")
    upper: float = setting(
        doc="k2 / k3: keep while the statistic <= upper; k1: keep while exp(k1) = mu / pi_old <= upper "
        "(veRL's threshold, a ratio)", gt=0.0)
    lower: float | None = setting(
        None, "k1 only: keep while exp(k1) >= lower (null: 1 / upper, as veRL)", gt=0.0)

    def __post_init__(self) -> None:
        check_settings(self)
        k1 = self.statistic.endswith("k1")
        if self.lower is not None and not k1:
            fail(self, "lower", f"{self.statistic} has an upper bound only (lower applies to the k1 statistics)")
        if k1 and self.lower is not None and self.lower > self.upper:
            fail(self, "lower", f"must be <= upper ({self.upper})")


@dataclass(frozen=True)
class CorrectionConfig:
    """The decoupled objective (algorithms/objective.py has the formula, algorithms/losses.py the
    policy term of each `loss`). Settings of one loss are ignored by the others."""

    loss: Loss = setting(
        "ppo", "the policy term on r_s = pi_theta / pi_old: ppo (clipped surrogate), cispo (MiniMax-M1), "
        "sapo (soft gate), dppo_tv / dppo_kl (DPPO trust region on probabilities), clip_cov / kl_cov "
        "(covariance-selected tokens detached / KL-penalised); algorithms/losses.py")
    mask_level: MaskLevel = setting(
        "sequence", "where the r_d mask acts: token; sequence (geometric mean of r_d over the sequence's "
        "loss tokens); sequence-product (product of its token ratios); sequence-any (the sequence goes "
        "when any token is outside the token bounds); none")
    mask_c_token: float | None = setting(
        2.0, "token bounds keep r_d <= c and r_d >= 1/c (or >= mask_low_token); null = no upper bound", ge=1.0)
    mask_low_token: float | None = setting(
        None, "lower token bound on r_d when it is not 1/mask_c_token (asymmetric, e.g. IcePop's 0.5 "
        "with c = 5; lower-only with mask_c_token: null); null = 1/mask_c_token", gt=0.0, le=1.0)
    mask_c_seq: float | None = setting(
        1.05, "sequence bounds keep the sequence value (geometric mean or product of r_d) <= c and >= 1/c "
        "(or >= mask_low_seq); null = no upper bound", ge=1.0)
    mask_low_seq: float | None = setting(
        None, "lower sequence bound when it is not 1/mask_c_seq; null = 1/mask_c_seq", gt=0.0, le=1.0)
    rejection: tuple[RejectionRule, ...] = setting(
        (), "more r_d criteria that a kept token must also pass, each {statistic, upper, lower} as veRL's "
        "rollout_rs options (chained like a comma-separated rollout_rs: every one must pass), e.g. "
        "[{statistic: token_k1, upper: 2.0}, {statistic: seq_mean_k3, upper: 0.01}]; part of the r_d mask "
        "(denominator applies)")
    tis_cap: float | None = setting(
        None, "truncated IS weight min(r_d, C) on kept tokens (TIS); null = off", gt=0.0)
    tis_level: TisLevel = setting(
        "token", "the TIS weight per token, or per sequence: min(prod_t r_d, C) on all its tokens")
    denominator: Denominator = setting(
        "kept", "what the aggregation counts: kept (tokens kept by the r_d mask) or all (every loss "
        "token; a masked token adds 0 but is counted, as veRL, TRL, SkyRL and AReaL do)")
    off_policy_mask: float | None = setting(
        None, "drop the A < 0 tokens of a sequence whose mean_t log(mu / pi_theta) exceeds this "
        "(DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold); null = off", ge=0.0)
    dist_mask: float | None = setting(
        None, "the r_d mask on distributions: drop a token whose mismatch between mu and pi_old over the "
        "captured top-k support (dist_mask_metric; the mass outside it is one bucket) exceeds this; needs "
        "top_k_logprobs > 0 (algorithms/distributions.py); null = off", ge=0.0)
    dist_mask_metric: DistMetric = setting(
        "tv", "the mismatch dist_mask bounds: tv (total variation, in [0, 1]) or kl (KL(mu || pi_old))")
    dist_mask_level: DistLevel = setting(
        "token", "where dist_mask acts: token, or sequence (the mean over the sequence's loss tokens; all of "
        "it goes)")
    clip_level: ClipLevel = setting(
        "token", "where r_s is bounded: token, sequence (GSPO-style geometric mean) or none (no bound: "
        "no clip, no CISPO truncation, no SAPO gate, no DPPO trust region)")
    eps_low: float = setting(
        0.2, "lower bound 1 - eps_low on r_s (PPO clip, CISPO truncation); 1 = no lower bound", ge=0.0, le=1.0)
    eps_high: float = setting(0.28, "upper bound 1 + eps_high on r_s (DAPO's clip-higher)", ge=0.0)
    dual_clip_c: float | None = setting(
        None, "ppo / clip_cov: for A < 0, bound the per-token loss by c |A| (dual clip); null = off", gt=1.0)
    sapo_tau_pos: float = setting(1.0, "sapo: gate temperature for A > 0", gt=0.0)
    sapo_tau_neg: float = setting(1.05, "sapo: gate temperature for A <= 0", gt=0.0)
    dppo_delta_low: float = setting(
        0.2, "dppo: for A < 0 a token carries no gradient once its probability fell by more than this "
        "(dppo_tv) / its binary KL exceeds this while falling (dppo_kl)", gt=0.0)
    dppo_delta_high: float = setting(
        0.2, "dppo: the same for A > 0 and a rising probability", gt=0.0)
    dppo_ratio_cap: float | None = setting(
        None, "dppo: truncate the (detached) ratio weight at this; null = untruncated", gt=1.0)
    cov_fraction: float = setting(
        0.0002, "clip_cov / kl_cov: fraction of the tokens with a policy term (kept, inside the policy-side "
        "masks) selected by covariance", gt=0.0, le=1.0)
    clip_cov_low: float = setting(1.0, "clip_cov: candidates have covariance > this")
    clip_cov_high: float = setting(5.0, "clip_cov: candidates have covariance < this")
    kl_cov_coef: float = setting(1.0, "kl_cov: coefficient of |log r_s| on the selected tokens", ge=0.0)
    entropy_coef: float = setting(
        0.0, "subtract coef x the aggregated per-token entropy (needs the entropy tensor)", ge=0.0)
    aggregation: Aggregation = setting(
        "token-mean", "token-mean: over counted tokens; seq-mean-token-mean: mean over sequences of "
        "their token mean; token-sum-norm: sum / (loss_norm_tokens x rows), Dr.GRPO-style; "
        "prompt-mean: mean over prompts of their token mean (SkyRL)")
    loss_norm_tokens: int | None = setting(
        None, "token budget per sequence of token-sum-norm (a job sets max_new_tokens); null = the "
        "batch's padded width", gt=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.mask_c_token is None and self.mask_low_token is None:
            fail(self, "mask_c_token", "a token mask needs a bound (mask_level: none turns masking off)")
        if self.mask_c_seq is None and self.mask_low_seq is None:
            fail(self, "mask_c_seq", "a sequence mask needs a bound (mask_level: none turns masking off)")
        if self.tis_level == "sequence" and self.tis_cap is None:
            fail(self, "tis_level", "a sequence-level TIS weight needs tis_cap")
        if self.dual_clip_c is not None and self.loss not in _PPO_CLIPPED:
            fail(self, "dual_clip_c", f"the dual clip bounds a PPO clip ({', '.join(_PPO_CLIPPED)}), "
                                      f"loss is {self.loss}")
        if self.loss in _TOKEN_ONLY and self.clip_level == "sequence":
            fail(self, "clip_level", f"loss {self.loss} is defined per token (token or none)")
        if not self.clip_cov_low < self.clip_cov_high:
            fail(self, "clip_cov_low", f"must be < clip_cov_high ({self.clip_cov_high})")

    @classmethod
    def paper(cls, c_ti: float = 1.003, c_stale: float = 1.004, **overrides) -> "CorrectionConfig":
        """The paper's setting: both factors bounded at sequence level by [1/c, c].

        r_d: geometric-mean sequence mask [1/c_ti, c_ti].
        r_s: sequence-level clip [1/c_stale, c_stale], i.e. eps_low = 1 - 1/c_stale, eps_high = c_stale - 1.
        """
        check_number("CorrectionConfig.paper", c_ti=c_ti, c_stale=c_stale)
        if not c_stale >= 1.0:
            raise ValueError(f"CorrectionConfig.paper: c_stale must be >= 1, got {c_stale!r}")
        kwargs = dict(mask_level="sequence", mask_c_seq=c_ti, clip_level="sequence",
                      eps_low=1.0 - 1.0 / c_stale, eps_high=c_stale - 1.0)
        kwargs.update(overrides)
        return cls(**kwargs)


# The keys of `advantage:` that only some estimators read (each estimator declares its own in
# `keys`, algorithms/estimators.py); the others (the overlong shaping) apply to every estimator.
ESTIMATOR_KEYS: tuple[str, ...] = ("std", "gamma", "lam", "whiten")


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimator (algorithms/estimators.py) and its keys. A job config may give just
    its name."""

    estimator: str = setting(
        "grpo", "a registered estimator (listed under 'Advantage estimators' below, each with the keys it "
        "reads) or an import path module:Class / path/to/file.py:Class of an AdvantageEstimator")
    std: GroupStd = setting(
        "sample", "grpo's std: sample (ddof 1, as veRL and TRL) or population (ddof 0)")
    overlong_buffer: int | None = setting(
        None, "DAPO's overlong reward shaping: a response longer than overlong_max_tokens - this loses "
        "overlong_penalty x (excess / this) of reward before the estimator; null = off", gt=0)
    overlong_penalty: float = setting(
        1.0, "the shaping's penalty at the budget (veRL's overlong_buffer.penalty_factor)", gt=0.0)
    overlong_max_tokens: int | None = setting(
        None, "L_max of the shaping: the response token budget (null in a job: sampling.max_new_tokens)", gt=0)
    gamma: float = setting(
        1.0, "discount per loss token (veRL's algorithm.gamma); below 1 every token of reinforce_plus_plus gets its "
        "own advantage (algorithms/discounted.py)", ge=0.0, le=1.0)
    lam: float = setting(
        1.0, "GAE's lambda (veRL's algorithm.lam); 1: the discounted return minus the value", ge=0.0, le=1.0)
    whiten: bool = setting(
        True, "whiten GAE's advantages over the step's loss tokens (mean 0, variance 1), as veRL does")

    def __post_init__(self) -> None:
        check_settings(self)
        from trajflow.algorithms.estimators import ESTIMATORS

        try:
            estimator = ESTIMATORS.resolve(self.estimator)
        except ValueError as e:
            raise SettingError("estimator", f"AdvantageConfig.estimator: {e}") from None
        object.__setattr__(self, "estimator", ESTIMATORS.canonical(self.estimator))
        for key in ESTIMATOR_KEYS:  # a key the estimator does not read, set away from its default
            if key not in estimator.keys and getattr(self, key) != type(self).__dataclass_fields__[key].default:
                readers = [name for name, cls in ESTIMATORS.parts().items() if key in cls.keys]
                fail(self, key, f"read by estimator{'s' * (len(readers) > 1)} {_listed(readers)} only, not "
                                f"{estimator.name}")
        if self.overlong_buffer is not None and self.overlong_max_tokens is not None \
                and self.overlong_buffer > self.overlong_max_tokens:
            fail(self, "overlong_buffer", f"must be <= overlong_max_tokens ({self.overlong_max_tokens})")


def _listed(names: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


@dataclass(frozen=True)
class KLConfig:
    """A KL penalty to a frozen reference model (algorithms/kl.py). beta 0 builds no reference."""

    beta: float = setting(0.0, "coefficient of the KL to the reference model; 0 = off", ge=0.0)
    estimator: KLEstimator = setting(
        "k3", "per-token estimator of KL(pi_theta || pi_ref): k1 (log ratio), k2 (half its square), k3 "
        "(exp(-x) - 1 + x), low_var (k3 clamped to [-10, 10], veRL's low_var_kl), abs (|log ratio|); "
        "k1+, k3+, low_var+, abs+: that value with k2's gradient (veRL's straight-through \"+\" types)")
    in_: Literal["loss", "reward"] = setting(
        "loss", "loss: beta x KL is added to the loss (TRL beta, veRL use_kl_loss); reward: subtracted "
        "from each trajectory's reward, summed over its tokens (veRL use_kl_in_reward)", key="in")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation from a teacher (a second model, `teacher:`; algorithms/distillation.py).
    Its terms enter the decoupled objective, so every correction strategy applies to them."""

    reverse_kl_coef: float = setting(
        1.0, "weight of the reverse KL(pi_theta || pi_teacher) per sampled token: -coef x (log pi_student - "
        "log pi_teacher) is the token's advantage (a policy-gradient term, clipped and masked as any)", ge=0.0)
    reverse_kl_student: StudentSide = setting(
        "current", "the student's log-prob in that advantage: current (pi_theta, recomputed in the update: "
        "AsyncOPD's correction for stale rollouts) or old (the strategy's pi_old, the student that "
        "generated the rollout, as a score cached at generation time holds)")
    forward_kl_coef: float = setting(
        0.0, "weight of the forward KL(pi_teacher || pi_theta) on the sampler's top-k support, the mass "
        "outside it one bucket (a supervised term; needs top_k_logprobs > 0)", ge=0.0)
    task_advantage_coef: float = setting(
        0.0, "weight of the task's own advantage (the reward's) added to the distillation's; 0 = pure "
        "distillation", ge=0.0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.reverse_kl_coef == 0 and self.forward_kl_coef == 0 and self.task_advantage_coef == 0:
            fail(self, "reverse_kl_coef", "every term has weight 0: nothing would be trained")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and the update it makes per train step (operators/train_step.py)."""

    lr: float = setting(1.5e-4, "learning rate", gt=0.0)
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay", ge=0.0)
    betas: tuple[float, float] = setting((0.9, 0.99), "AdamW's (beta1, beta2)", ge=0.0, lt=1.0)
    eps: float = setting(1e-8, "AdamW's epsilon", gt=0.0)
    grad_clip: float | None = setting(1.0, "clip the global gradient norm to this; null = off", gt=0.0)
    minibatches_per_step: int = setting(
        1, "optimizer updates per train step (per weight version); must divide the step's rows", ge=1)
    mixed_precision: Literal["no", "bf16"] = setting(
        "no", "bf16: autocast the forward passes of pi_theta and every pi_old (training numerics)")
    schedule: Schedule = setting(
        "constant", "learning-rate schedule after the warm-up: constant, linear or cosine decay to "
        "lr x min_lr_ratio at the last optimizer update (algorithms/schedules.py)")
    warmup_steps: int = setting(
        0, "linear warm-up over this many optimizer updates (not train steps: a step makes "
        "minibatches_per_step updates); 0 = none", ge=0)
    min_lr_ratio: float = setting(0.0, "linear / cosine: the last update's lr as a fraction of lr", ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        check_settings(self)
