"""Advantage: group-relative advantages from rewards (Ray Data task, Arrow in and out).

A group's samples travel in one batch (the generator emits a whole step per block and the
pipeline keeps step-sized batches), so group statistics are complete. `std` applies to GRPO:
"sample" (veRL's and TRL's convention, the default) or "population" (algorithms/advantages.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.algorithms.advantages import ESTIMATORS, GROUP_STDS, group_advantages
from trajflow.operators.columns import group_codes, replace_column


class Advantage:
    def __init__(self, estimator: str = "grpo", std: str = "sample") -> None:
        if estimator not in ESTIMATORS:
            raise ValueError(f"advantage: unknown estimator {estimator!r}; choose from {sorted(ESTIMATORS)}")
        if std not in GROUP_STDS:
            raise ValueError(f"advantage.std: {std!r} is not one of {', '.join(GROUP_STDS)}")
        self.estimator = estimator
        self.kwargs = {"std": std} if estimator == "grpo" else {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        rewards = batch["reward"].to_numpy().astype(np.float64)
        adv = group_advantages(self.estimator, rewards, group_codes(batch), **self.kwargs)
        return replace_column(batch, "advantage", pa.array(np.asarray(adv, dtype=np.float32), pa.float32()))
