"""trajflow.algorithms: the correction math as pure torch/numpy functions (no Ray, no I/O).

objective.py    the decoupled loss (r_d mask + r_s clip) and its config — the formula is there
proximal.py     where old log-probs come from per strategy; the STRATEGIES table
ewma.py         revised PPO-EWMA proximal weights with auto-reset
advantages.py   group-relative advantages (GRPO, Dr.GRPO, leave-one-out)
diagnostics.py  per-batch correction metrics
masked.py       masked reductions over right-padded [B, T] tensors
"""

from .advantages import (
    ESTIMATORS,
    dr_grpo,
    group_advantages,
    grpo,
    leave_one_out,
    zero_variance_groups,
)
from .diagnostics import correction_diagnostics, effective_sample_size, mismatch_kl, staleness_stats
from .ewma import EwmaProximal, ewma_beta, ewma_mean_age
from .masked import broadcast_to_tokens, masked_mean, masked_sum
from .objective import (
    AGGREGATIONS,
    CLIP_LEVELS,
    LOG_RATIO_CLAMP,
    MASK_LEVELS,
    CorrectionConfig,
    LossOutput,
    aggregation_weights,
    decoupled_loss,
    discrepancy_mask,
)
from .proximal import (
    STRATEGIES,
    Strategy,
    behavior_logprobs,
    format_strategies,
    linear_logprobs,
    loglinear_alpha,
    loglinear_logprobs,
    proximal_logprobs,
    recompute_logprobs,
)

__all__ = [
    "AGGREGATIONS", "CLIP_LEVELS", "ESTIMATORS", "LOG_RATIO_CLAMP", "MASK_LEVELS", "STRATEGIES",
    "CorrectionConfig", "EwmaProximal", "LossOutput", "Strategy",
    "aggregation_weights", "behavior_logprobs", "broadcast_to_tokens", "correction_diagnostics",
    "decoupled_loss", "discrepancy_mask", "dr_grpo", "effective_sample_size", "ewma_beta",
    "ewma_mean_age", "format_strategies", "group_advantages", "grpo", "leave_one_out",
    "linear_logprobs", "loglinear_alpha", "loglinear_logprobs", "masked_mean", "masked_sum",
    "mismatch_kl", "proximal_logprobs", "recompute_logprobs", "staleness_stats",
    "zero_variance_groups",
]
