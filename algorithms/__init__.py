"""trajflow.algorithms: the correction math as pure torch/numpy functions (no Ray, no I/O).

config.py       the settings of the math (correction, advantage, kl, optimizer): THE defaults, torch-free
objective.py    the decoupled loss (r_d mask and weight, policy-side masks, the loss's policy term on
                r_s, aggregation and its denominator, optional KL and entropy terms)
losses.py       the policy term of each loss: ppo, cispo, sapo, dppo_tv/kl, clip_cov, kl_cov
kl.py           KL to a reference model: per-token estimators, in the loss or in the reward
distributions.py  TV and KL on a captured top-k support (plus the tail), the mask on them
distillation.py on-policy distillation: reverse-KL advantages, forward KL on the top-k support
score_centering.py  Score Centering's coefficients on the sampler's top-k (arXiv 2609.20807)
schedules.py    learning-rate multiplier per optimizer update (warm-up, constant/linear/cosine)
old_logprobs.py train-time pi_old that are functions of the batch (behavior, loglinear)
m2po.py         M2PO's second-moment trust mask (a global value cutoff)
ewma.py         revised PPO-EWMA proximal weights with auto-reset
advantages.py   advantages (GRPO with sample or population std, Dr.GRPO, RLOO, REINFORCE++ and its
                baseline variant) and DAPO's overlong reward shaping
estimators.py   the advantage estimators' registry: each estimator, the keys it reads, torch-free
discounted.py   REINFORCE++ with a per-token discount gamma: per-token returns, whitened per token
rejection.py    veRL's chained rejection criteria on r_d (k1/k2/k3 per token, sequence sum/mean/max)
diagnostics.py  per-batch correction metrics
masked.py       masked reductions over right-padded [B, T] tensors

The strategies that compose these live in operators/strategies/ (one file each). The names below
load on first use (PEP 562): `trajflow.algorithms.config` is importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.lazy import lazy_exports

_EXPORTS = {
    "compute_advantages": "trajflow.algorithms.advantages",
    "dr_grpo": "trajflow.algorithms.advantages",
    "grpo": "trajflow.algorithms.advantages",
    "leave_one_out": "trajflow.algorithms.advantages",
    "overlong_penalty": "trajflow.algorithms.advantages",
    "reinforce_plus_plus": "trajflow.algorithms.advantages",
    "reinforce_plus_plus_baseline": "trajflow.algorithms.advantages",
    "zero_variance_groups": "trajflow.algorithms.advantages",
    "AGGREGATIONS": "trajflow.algorithms.config",
    "CLIP_LEVELS": "trajflow.algorithms.config",
    "GROUP_STDS": "trajflow.algorithms.config",
    "KL_ESTIMATORS": "trajflow.algorithms.config",
    "LOSSES": "trajflow.algorithms.config",
    "MASK_LEVELS": "trajflow.algorithms.config",
    "SCHEDULES": "trajflow.algorithms.config",
    "AdvantageConfig": "trajflow.algorithms.config",
    "CorrectionConfig": "trajflow.algorithms.config",
    "DistillConfig": "trajflow.algorithms.config",
    "KLConfig": "trajflow.algorithms.config",
    "OptimizerConfig": "trajflow.algorithms.config",
    "correction_diagnostics": "trajflow.algorithms.diagnostics",
    "ESTIMATORS": "trajflow.algorithms.estimators",
    "AdvantageEstimator": "trajflow.algorithms.estimators",
    "effective_sample_size": "trajflow.algorithms.diagnostics",
    "mismatch_kl": "trajflow.algorithms.diagnostics",
    "staleness_stats": "trajflow.algorithms.diagnostics",
    "distillation_advantages": "trajflow.algorithms.distillation",
    "forward_kl_tokens": "trajflow.algorithms.distillation",
    "distribution_keep": "trajflow.algorithms.distributions",
    "support_kl": "trajflow.algorithms.distributions",
    "support_tv": "trajflow.algorithms.distributions",
    "EwmaProximal": "trajflow.algorithms.ewma",
    "ewma_beta": "trajflow.algorithms.ewma",
    "ewma_mean_age": "trajflow.algorithms.ewma",
    "ReferenceKL": "trajflow.algorithms.kl",
    "kl_estimate": "trajflow.algorithms.kl",
    "kl_metrics": "trajflow.algorithms.kl",
    "kl_penalized_rewards": "trajflow.algorithms.kl",
    "PolicyTerm": "trajflow.algorithms.losses",
    "cispo_term": "trajflow.algorithms.losses",
    "covariance_selection": "trajflow.algorithms.losses",
    "dppo_term": "trajflow.algorithms.losses",
    "dppo_trust_region": "trajflow.algorithms.losses",
    "kl_cov_term": "trajflow.algorithms.losses",
    "ppo_term": "trajflow.algorithms.losses",
    "sapo_term": "trajflow.algorithms.losses",
    "token_covariance": "trajflow.algorithms.losses",
    "M2Mask": "trajflow.algorithms.m2po",
    "m2_cutoff": "trajflow.algorithms.m2po",
    "m2po_mask": "trajflow.algorithms.m2po",
    "LOG_RATIO_CLAMP": "trajflow.algorithms.masked",
    "broadcast_to_tokens": "trajflow.algorithms.masked",
    "log_ratio": "trajflow.algorithms.masked",
    "masked_mean": "trajflow.algorithms.masked",
    "masked_sum": "trajflow.algorithms.masked",
    "LossOutput": "trajflow.algorithms.objective",
    "LossSum": "trajflow.algorithms.objective",
    "WholeUpdate": "trajflow.algorithms.objective",
    "aggregation_weights": "trajflow.algorithms.objective",
    "decoupled_loss": "trajflow.algorithms.objective",
    "discrepancy_mask": "trajflow.algorithms.objective",
    "discrepancy_weights": "trajflow.algorithms.objective",
    "loss_denominator": "trajflow.algorithms.objective",
    "off_policy_sequence_mask": "trajflow.algorithms.objective",
    "prompt_token_counts": "trajflow.algorithms.objective",
    "behavior_logprobs": "trajflow.algorithms.old_logprobs",
    "linear_logprobs": "trajflow.algorithms.old_logprobs",
    "loglinear_alpha": "trajflow.algorithms.old_logprobs",
    "loglinear_logprobs": "trajflow.algorithms.old_logprobs",
    "recompute_logprobs": "trajflow.algorithms.old_logprobs",
    "centering_coefficients": "trajflow.algorithms.score_centering",
    "centering_term": "trajflow.algorithms.score_centering",
    "lr_multiplier": "trajflow.algorithms.schedules",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .advantages import (
        compute_advantages, dr_grpo, grpo, leave_one_out, overlong_penalty, reinforce_plus_plus,
        reinforce_plus_plus_baseline, zero_variance_groups)
    from .config import (
        AGGREGATIONS, CLIP_LEVELS, GROUP_STDS, KL_ESTIMATORS, LOSSES, MASK_LEVELS, SCHEDULES,
        AdvantageConfig, CorrectionConfig, DistillConfig, KLConfig, OptimizerConfig)
    from .diagnostics import correction_diagnostics
    from .estimators import ESTIMATORS, AdvantageEstimator
    from .distillation import distillation_advantages, forward_kl_tokens
    from .distributions import distribution_keep, support_kl, support_tv, effective_sample_size, mismatch_kl, staleness_stats
    from .ewma import EwmaProximal, ewma_beta, ewma_mean_age
    from .kl import ReferenceKL, kl_estimate, kl_metrics, kl_penalized_rewards
    from .losses import (
        PolicyTerm, cispo_term, covariance_selection, dppo_term, dppo_trust_region, kl_cov_term,
        ppo_term, sapo_term, token_covariance)
    from .m2po import M2Mask, m2_cutoff, m2po_mask
    from .masked import LOG_RATIO_CLAMP, broadcast_to_tokens, log_ratio, masked_mean, masked_sum
    from .objective import (
        LossOutput, LossSum, WholeUpdate, aggregation_weights, decoupled_loss, discrepancy_mask,
        discrepancy_weights, loss_denominator, off_policy_sequence_mask, prompt_token_counts)
    from .old_logprobs import (
        behavior_logprobs, linear_logprobs, loglinear_alpha, loglinear_logprobs, recompute_logprobs)
    from .schedules import lr_multiplier
    from .score_centering import centering_coefficients, centering_term


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
