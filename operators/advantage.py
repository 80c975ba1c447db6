"""Advantage: advantages from rewards (Ray Data task, Arrow in and out), as one AdvantageConfig
says (algorithms/advantages.py: the estimators, DAPO's overlong shaping).

With `estimator: gae` the advantages are per token, from a learned critic's values
(algorithms/gae.py): when they are the values scored at behavior time (`critic.values_at:
rollout`, the `values` column), here; when they are the trainer's current critic's (`train`),
in the train step (`gae_columns`, the same function), and this stage leaves the rows to it.
GAE writes `token_advantages`, `advantage` (their mean over the row's loss tokens) and `returns`.

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
from trajflow.algorithms.config import AdvantageConfig, KLConfig
from trajflow.algorithms.estimators import ESTIMATORS
from trajflow.schemas.columns import (KL_PENALTY_COLUMN, REFERENCE_COLUMN, RETURNS_COLUMN, TOKEN_ADVANTAGE_COLUMN,
                                      VALUES_COLUMN, group_codes, list_values, padded, replace_column)


class Advantage:
    """`gae_values`: the column holding GAE's values (`values`, scored at rollout time; a replay
    of a `values_at: train` log diagnoses on its `train_values`), or None: the train step computes
    GAE; ignored by the other estimators. `kl`: the KL penalty's settings, which GAE takes per
    token when it is in the reward."""

    def __init__(self, config: AdvantageConfig, gae_values: str | None = VALUES_COLUMN,
                 kl: KLConfig = KLConfig()) -> None:
        if not isinstance(config, AdvantageConfig):
            raise TypeError(f"Advantage takes an AdvantageConfig, got {type(config).__name__}")
        self.config = config
        self.gae_values = gae_values
        self.kl = kl

    def __call__(self, batch: pa.Table) -> pa.Table:
        if ESTIMATORS.resolve(self.config.estimator).needs_values:  # GAE: on a critic's values
            if self.gae_values is None:
                return batch  # the train step's (critic.values_at: train)
            width = max(1, max((len(r) for r in batch["response_tokens"].to_pylist()), default=1))
            return gae_columns(batch, padded(batch[self.gae_values], width, 0.0), self.config, self.kl)
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


def gae_columns(batch: pa.Table, values: np.ndarray, config: AdvantageConfig, kl: KLConfig) -> pa.Table:
    """GAE on every scored row of `batch` with `values` [rows, width] (algorithms/gae.py): the
    reward on each row's last loss token, minus beta x the per-token KL to the reference (mu
    against pi_ref) when the KL is in the reward; advantages whitened over the rows' loss tokens
    (`config.whiten`). Writes `token_advantages`, `advantage` (their mean over the row's loss
    tokens) and `returns`; null on a row whose reward failed."""
    import torch

    from trajflow.algorithms.gae import gae, token_rewards, whiten
    from trajflow.algorithms.kl import kl_estimate

    width = values.shape[1]
    rewards = batch["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
    scored = np.isfinite(rewards)
    mask = torch.from_numpy(padded(batch["loss_mask"], width, False, bool) & scored[:, None])
    per_token_kl, beta = None, 0.0
    if kl.in_ == "reward" and kl.beta > 0 and REFERENCE_COLUMN in batch.column_names:
        mu = torch.from_numpy(padded(batch["inference_logprobs"], width, 0.0))
        ref = torch.from_numpy(padded(batch[REFERENCE_COLUMN], width, 0.0))
        ref = torch.where(mask & torch.isfinite(ref), ref, mu)  # outside the reference's support: no KL
        per_token_kl, beta = kl_estimate(mu, ref, kl.estimator), kl.beta
    r = token_rewards(torch.from_numpy(np.where(scored, rewards, 0.0)), mask, per_token_kl, beta)
    advantages, returns = gae(r, torch.from_numpy(values).double(), mask, config.gamma, config.lam)
    if config.whiten:
        advantages = whiten(advantages, mask)
    advantages = torch.where(mask, advantages, 0.0).float().numpy()
    counts = mask.sum(dim=1).numpy()
    mean = np.where(counts > 0, advantages.sum(axis=1) / np.maximum(counts, 1), 0.0).astype(np.float32)
    lengths = [len(r) for r in batch["response_tokens"].to_pylist()]
    nulls = None if scored.all() else ~scored
    batch = replace_column(batch, TOKEN_ADVANTAGE_COLUMN, pa.array(
        [a[:n].tolist() for a, n in zip(advantages, lengths)], pa.list_(pa.float32()), mask=nulls))
    batch = replace_column(batch, RETURNS_COLUMN, pa.array(
        [r[:n].tolist() for r, n in zip(returns.float().numpy(), lengths)], pa.list_(pa.float32()), mask=nulls))
    return replace_column(batch, "advantage", pa.array(mean, pa.float32(), mask=nulls))
