"""The settings of the math, declared once (trajflow/settings.py): the objective (`correction:`),
the advantage estimator (`advantage:`) and the optimizer (`optimizer:`).

These dataclasses hold THE defaults: a job config's YAML sections are built from them
(pipelines/config.py), so `decoupled_loss(..., CorrectionConfig())` in a notebook is exactly the
objective a YAML job with no `correction:` key trains with. Torch-free, so validating a job
config imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trajflow.settings import check_settings, setting

MaskLevel = Literal["token", "sequence", "none"]
ClipLevel = Literal["token", "sequence", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "token-sum-norm"]
Estimator = Literal["grpo", "dr_grpo", "leave_one_out"]
GroupStd = Literal["sample", "population"]

MASK_LEVELS: tuple[str, ...] = ("token", "sequence", "none")
CLIP_LEVELS: tuple[str, ...] = ("token", "sequence", "none")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "token-sum-norm")
ESTIMATOR_NAMES: tuple[str, ...] = ("grpo", "dr_grpo", "leave_one_out")
GROUP_STDS: tuple[str, ...] = ("sample", "population")


@dataclass(frozen=True)
class CorrectionConfig:
    """Thresholds of the decoupled objective (algorithms/objective.py has the formula)."""

    mask_level: MaskLevel = setting(
        "sequence", "where the symmetric r_d mask acts: token, sequence (geometric mean of r_d over "
        "the sequence's loss tokens) or none")
    mask_c_token: float = setting(2.0, "token mask keeps 1/c <= r_d <= c", ge=1.0)
    mask_c_seq: float = setting(1.05, "sequence mask keeps 1/c <= exp(mean_t log r_d) <= c", ge=1.0)
    tis_cap: float | None = setting(
        None, "truncated IS weight min(r_d, C) on kept tokens (TIS); null = off", gt=0.0)
    clip_level: ClipLevel = setting(
        "token", "the PPO clip on r_s: token, sequence (GSPO-style geometric mean) or none")
    eps_low: float = setting(0.2, "lower clip bound 1 - eps_low on r_s", ge=0.0, lt=1.0)
    eps_high: float = setting(0.28, "upper clip bound 1 + eps_high on r_s (DAPO's clip-higher)", ge=0.0)
    dual_clip_c: float | None = setting(
        None, "for A < 0, bound the per-token loss by c |A| (dual clip); null = off", gt=1.0)
    aggregation: Aggregation = setting(
        "token-mean", "token-mean: over kept tokens; seq-mean-token-mean: mean over sequences of "
        "their token mean; token-sum-norm: sum / (loss_norm_tokens x rows), Dr.GRPO-style")
    loss_norm_tokens: int | None = setting(
        None, "token budget per sequence of token-sum-norm (a job sets max_new_tokens); null = the "
        "batch's padded width", gt=0)

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def paper(cls, c_ti: float = 1.003, c_stale: float = 1.004, **overrides) -> "CorrectionConfig":
        """The paper's setting: both factors bounded at sequence level by [1/c, c].

        r_d: geometric-mean sequence mask [1/c_ti, c_ti].
        r_s: sequence-level clip [1/c_stale, c_stale], i.e. eps_low = 1 - 1/c_stale, eps_high = c_stale - 1.
        """
        if isinstance(c_stale, bool) or not c_stale >= 1.0:
            raise ValueError(f"CorrectionConfig.paper: c_stale must be >= 1, got {c_stale!r}")
        kwargs = dict(mask_level="sequence", mask_c_seq=c_ti, clip_level="sequence",
                      eps_low=1.0 - 1.0 / c_stale, eps_high=c_stale - 1.0)
        kwargs.update(overrides)
        return cls(**kwargs)


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimator (algorithms/advantages.py). A job config may give just its name."""

    estimator: Estimator = setting(
        "grpo", "grpo: (r - group mean) / group std; dr_grpo: r - group mean; leave_one_out: RLOO")
    std: GroupStd = setting(
        "sample", "grpo's std: sample (ddof 1, as veRL and TRL) or population (ddof 0)")

    def __post_init__(self) -> None:
        check_settings(self)


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

    def __post_init__(self) -> None:
        check_settings(self)
