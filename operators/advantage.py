"""Advantage: advantages from rewards (Ray Data task, Arrow in and out), as one AdvantageConfig
says (algorithms/advantages.py: the estimators, DAPO's overlong shaping).

A group's samples travel in one batch (the generator emits a whole step per block and the
pipeline keeps step-sized batches), so group statistics, and REINFORCE++'s batch statistics,
are complete. The shaping reads each row's response length (`response_tokens`); REINFORCE++
weighs each row by its loss tokens (`loss_mask`), as veRL whitens per token; with
`advantage.gamma` < 1 it gives every token its own advantage (`token_advantages`, a list aligned
with the response; `advantage` is then their mean over the row's loss tokens). The `reward` column
keeps the task's reward: shaping, and a KL penalty in the reward (`kl_penalty`, written by
operators/reference.py under `kl.in: reward`), change only the advantage.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.algorithms.advantages import compute_advantages
from trajflow.algorithms.config import AdvantageConfig
from trajflow.schemas.columns import (KL_PENALTY_COLUMN, TOKEN_ADVANTAGE_COLUMN, group_codes, list_values, padded,
                                      replace_column)


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
        if self.config.gamma < 1.0:
            return self._per_token(batch, rewards, scored, lengths)
        if scored.any():
            adv[scored] = compute_advantages(self.config, rewards[scored], groups[scored], lengths=lengths[scored],
                                     token_counts=token_counts[scored])
        return replace_column(batch, "advantage", pa.array(adv, pa.float32(), mask=None if scored.all() else ~scored))

    def _per_token(self, batch: pa.Table, rewards: np.ndarray, scored: np.ndarray, lengths: np.ndarray) -> pa.Table:
        """REINFORCE++ with the per-token discount: `token_advantages` (null where the reward
        failed) and `advantage`, their mean over the row's loss tokens."""
        from trajflow.algorithms.advantages import compute_token_advantages

        mask = padded(batch["loss_mask"], int(lengths.max(initial=0)), False, bool)
        tokens = np.zeros(mask.shape, np.float32)
        if scored.any():
            tokens[scored] = compute_token_advantages(self.config, rewards[scored], mask[scored],
                                                      lengths=lengths[scored])
        counts = mask.sum(axis=1)
        mean = np.where(counts > 0, tokens.sum(axis=1) / np.maximum(counts, 1), 0.0).astype(np.float32)
        rows = [t[:n].tolist() for t, n in zip(tokens, lengths)]
        nulls = None if scored.all() else ~scored
        batch = replace_column(batch, TOKEN_ADVANTAGE_COLUMN, pa.array(rows, pa.list_(pa.float32()), mask=nulls))
        return replace_column(batch, "advantage", pa.array(mean, pa.float32(), mask=nulls))
