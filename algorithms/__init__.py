"""trajflow.algorithms: the correction math as pure torch/numpy functions (no Ray, no I/O).

config.py       the settings of the math (correction, advantage, optimizer): THE defaults, torch-free
objective.py    the decoupled loss (r_d mask + r_s clip, optional trust mask)
proximal.py     train-time proximal log-probs that are functions of the batch (behavior, loglinear)
m2po.py         M2PO's second-moment trust mask (a global value cutoff)
ewma.py         revised PPO-EWMA proximal weights with auto-reset
advantages.py   group-relative advantages (GRPO with sample or population std, Dr.GRPO, RLOO)
diagnostics.py  per-batch correction metrics
masked.py       masked reductions over right-padded [B, T] tensors

The strategies that compose these live in operators/strategies/ (one file each). The names below
load on first use (PEP 562): `trajflow.algorithms.config` is importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ESTIMATORS": "trajflow.algorithms.advantages",
    "dr_grpo": "trajflow.algorithms.advantages",
    "group_advantages": "trajflow.algorithms.advantages",
    "grpo": "trajflow.algorithms.advantages",
    "leave_one_out": "trajflow.algorithms.advantages",
    "zero_variance_groups": "trajflow.algorithms.advantages",
    "AGGREGATIONS": "trajflow.algorithms.config",
    "CLIP_LEVELS": "trajflow.algorithms.config",
    "GROUP_STDS": "trajflow.algorithms.config",
    "MASK_LEVELS": "trajflow.algorithms.config",
    "AdvantageConfig": "trajflow.algorithms.config",
    "CorrectionConfig": "trajflow.algorithms.config",
    "OptimizerConfig": "trajflow.algorithms.config",
    "correction_diagnostics": "trajflow.algorithms.diagnostics",
    "effective_sample_size": "trajflow.algorithms.diagnostics",
    "mismatch_kl": "trajflow.algorithms.diagnostics",
    "staleness_stats": "trajflow.algorithms.diagnostics",
    "EwmaProximal": "trajflow.algorithms.ewma",
    "ewma_beta": "trajflow.algorithms.ewma",
    "ewma_mean_age": "trajflow.algorithms.ewma",
    "M2Mask": "trajflow.algorithms.m2po",
    "m2_cutoff": "trajflow.algorithms.m2po",
    "m2po_mask": "trajflow.algorithms.m2po",
    "broadcast_to_tokens": "trajflow.algorithms.masked",
    "masked_mean": "trajflow.algorithms.masked",
    "masked_sum": "trajflow.algorithms.masked",
    "LOG_RATIO_CLAMP": "trajflow.algorithms.objective",
    "LossOutput": "trajflow.algorithms.objective",
    "aggregation_weights": "trajflow.algorithms.objective",
    "decoupled_loss": "trajflow.algorithms.objective",
    "discrepancy_mask": "trajflow.algorithms.objective",
    "loss_denominator": "trajflow.algorithms.objective",
    "behavior_logprobs": "trajflow.algorithms.proximal",
    "linear_logprobs": "trajflow.algorithms.proximal",
    "loglinear_alpha": "trajflow.algorithms.proximal",
    "loglinear_logprobs": "trajflow.algorithms.proximal",
    "recompute_logprobs": "trajflow.algorithms.proximal",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .advantages import ESTIMATORS, dr_grpo, group_advantages, grpo, leave_one_out, zero_variance_groups
    from .config import AGGREGATIONS, CLIP_LEVELS, GROUP_STDS, MASK_LEVELS, AdvantageConfig, CorrectionConfig, OptimizerConfig
    from .diagnostics import correction_diagnostics, effective_sample_size, mismatch_kl, staleness_stats
    from .ewma import EwmaProximal, ewma_beta, ewma_mean_age
    from .m2po import M2Mask, m2_cutoff, m2po_mask
    from .masked import broadcast_to_tokens, masked_mean, masked_sum
    from .objective import LOG_RATIO_CLAMP, LossOutput, aggregation_weights, decoupled_loss, discrepancy_mask, loss_denominator
    from .proximal import behavior_logprobs, linear_logprobs, loglinear_alpha, loglinear_logprobs, recompute_logprobs


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
