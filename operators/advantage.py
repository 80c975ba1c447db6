"""Advantage: advantages from rewards (Ray Data task, Arrow in and out), as one AdvantageConfig
says (algorithms/advantages.py: the estimators, DAPO's overlong shaping).

A group's samples travel in one batch (the generator emits a whole step per block and the
pipeline keeps step-sized batches), so group statistics, and REINFORCE++'s batch statistics,
are complete. The shaping reads each row's response length (`response_tokens`); REINFORCE++
weighs each row by its loss tokens (`loss_mask`), as veRL whitens per token. The `reward` column
keeps the task's reward: shaping, and a KL penalty in the reward (`kl_penalty`, written by
operators/reference.py under `kl.in: reward`), change only the advantage.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.algorithms.advantages import compute_advantages
from trajflow.algorithms.config import AdvantageConfig
from trajflow.schemas.columns import KL_PENALTY_COLUMN, group_codes, list_values, replace_column


class Advantage:
    def __init__(self, config: AdvantageConfig) -> None:
        if not isinstance(config, AdvantageConfig):
            raise TypeError(f"Advantage takes an AdvantageConfig, got {type(config).__name__}")
        self.config = config

    def __call__(self, batch: pa.Table) -> pa.Table:
        rewards = batch["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
        if KL_PENALTY_COLUMN in batch.column_names:  # the KL to the reference, in the reward (kl.in: reward)
            rewards = rewards - batch[KL_PENALTY_COLUMN].to_numpy(zero_copy_only=False).astype(np.float64)
        groups = group_codes(batch)
        lengths = np.diff(list_values(batch["response_tokens"])[1])
        mask, offsets = list_values(batch["loss_mask"])
        token_counts = np.diff(np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])[offsets])
        # A row whose reward failed (null) has no advantage, and its group's statistics come from
        # the other samples.
        scored = np.isfinite(rewards)
        adv = np.zeros(len(rewards), np.float32)
        if scored.any():
            adv[scored] = compute_advantages(self.config, rewards[scored], groups[scored], lengths=lengths[scored],
                                     token_counts=token_counts[scored])
        return replace_column(batch, "advantage", pa.array(adv, pa.float32(), mask=None if scored.all() else ~scored))
