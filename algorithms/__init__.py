"""trajflow.algorithms: the correction math as pure torch/numpy functions (no Ray, no I/O).

objective.py    the decoupled loss (r_d mask + r_s clip, optional trust mask) and its config
proximal.py     train-time proximal log-probs that are functions of the batch (behavior, loglinear)
m2po.py         M2PO's second-moment trust mask (a global value cutoff)
ewma.py         revised PPO-EWMA proximal weights with auto-reset
advantages.py   group-relative advantages (GRPO with sample or population std, Dr.GRPO, RLOO)
diagnostics.py  per-batch correction metrics
masked.py       masked reductions over right-padded [B, T] tensors

The strategies that compose these live in operators/strategies/ (one file each).
"""

from .advantages import (
    ESTIMATORS,
    GROUP_STDS,
    dr_grpo,
    group_advantages,
    grpo,
    leave_one_out,
    zero_variance_groups,
)
from .diagnostics import correction_diagnostics, effective_sample_size, mismatch_kl, staleness_stats
from .ewma import EwmaProximal, ewma_beta, ewma_mean_age
from .m2po import M2Mask, m2_cutoff, m2po_mask
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
    loss_denominator,
)
from .proximal import (
    behavior_logprobs,
    linear_logprobs,
    loglinear_alpha,
    loglinear_logprobs,
    recompute_logprobs,
)

__all__ = [
    "AGGREGATIONS", "CLIP_LEVELS", "ESTIMATORS", "GROUP_STDS", "LOG_RATIO_CLAMP", "MASK_LEVELS",
    "CorrectionConfig", "EwmaProximal", "LossOutput", "M2Mask",
    "aggregation_weights", "behavior_logprobs", "broadcast_to_tokens", "correction_diagnostics",
    "decoupled_loss", "discrepancy_mask", "dr_grpo", "effective_sample_size", "ewma_beta",
    "ewma_mean_age", "group_advantages", "grpo", "leave_one_out", "loss_denominator",
    "linear_logprobs", "loglinear_alpha", "loglinear_logprobs", "m2_cutoff", "m2po_mask", "masked_mean",
    "masked_sum", "mismatch_kl", "recompute_logprobs", "staleness_stats",
    "zero_variance_groups",
]
