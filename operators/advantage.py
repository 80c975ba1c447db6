"""Advantage: group-relative advantages from rewards (Ray Data task, Arrow in and out).

A group's samples travel in one batch (the generator emits a whole step per block and the
pipeline keeps step-sized batches), so group statistics are complete. `std` applies to GRPO:
"sample" (veRL's and TRL's convention, the default) or "population" (algorithms/advantages.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.algorithms.advantages import group_advantages
from trajflow.algorithms.config import AdvantageConfig
from trajflow.operators.columns import group_codes, replace_column


class Advantage:
    def __init__(self, config: AdvantageConfig) -> None:
        self.estimator = config.estimator
        self.kwargs = {"std": config.std} if config.estimator == "grpo" else {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        rewards = batch["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
        scored = np.isfinite(rewards)  # a row whose reward failed (null) has no advantage, and
        if scored.all():               # its group's statistics come from the other samples
            adv = group_advantages(self.estimator, rewards, group_codes(batch), **self.kwargs)
            adv = np.asarray(adv, np.float32)
            return replace_column(batch, "advantage", pa.array(adv, pa.float32()))
        adv = np.zeros(len(rewards), np.float32)
        if scored.any():
            adv[scored] = group_advantages(self.estimator, rewards[scored], group_codes(batch)[scored],
                                           **self.kwargs)
        return replace_column(batch, "advantage", pa.array(adv, pa.float32(), mask=~scored))
