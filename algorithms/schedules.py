r"""Learning-rate schedules: the multiplier of `OptimizerConfig.lr` for each optimizer update.

Counted in optimizer updates u = 0, 1, ... (a train step makes `minibatches_per_step` of them),
with W = warmup_steps, N = total_updates, m = min_lr_ratio:

    warm-up   u < W:  (u + 1) / W            the first update already moves (1/W), update W-1 has lr
    constant          1
    linear            1 - (1 - m) p          p = (u - W) / max(1, N - W), clipped to [0, 1]
    cosine            m + (1 - m) (1 + cos(pi p)) / 2

so the first update after the warm-up has the full lr and update N (one past the last) has
lr x m. For torch: `LambdaLR(optimizer, lambda u: lr_multiplier(u, N, config))`, whose counter
is the update index (it survives a checkpoint in the scheduler's state_dict).

Peers: HF Trainer / TRL `lr_scheduler_type` (default linear, to 0), `warmup_steps` /
`warmup_ratio`; their warm-up gives lr x u / W to update u, i.e. 0 to the first update, and their
decay reaches 0 at N. veRL `optim.lr_scheduler_type: constant | cosine`, `lr_warmup_steps`
(or `lr_warmup_steps_ratio`), `min_lr_ratio`, `num_cycles` (0.5 = this cosine). SkyRL
`optimizer_config.scheduler` (constant_with_warmup), `num_warmup_steps`.
"""

from __future__ import annotations

import math

from trajflow.settings import check_number

from .config import OptimizerConfig


def lr_multiplier(update: int, total_updates: int | None, config: OptimizerConfig) -> float:
    """The lr multiplier of optimizer update `update` (0-based) of `total_updates` (module
    docstring). `total_updates` may be None for the constant schedule."""
    check_number("lr_multiplier", update=update, total_updates=total_updates)
    if not isinstance(update, int) or update < 0:
        raise ValueError(f"lr_multiplier: update must be an integer >= 0, got {update!r}")
    warmup = config.warmup_steps
    if update < warmup:
        return (update + 1) / warmup
    if config.schedule == "constant":
        return 1.0
    if total_updates is None or total_updates < 1:
        raise ValueError(f"lr_multiplier: the {config.schedule} schedule needs total_updates >= 1, "
                         f"got {total_updates!r}")
    progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
    floor = config.min_lr_ratio
    if config.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
