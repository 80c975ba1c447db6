"""The critic learner: PPO's value function V(s_t), the train step's second learner.

Its micro-batch: the values of the rows' response tokens under the training numerics
(engines/value_model.py), the clipped value loss against the returns GAE gave them
(algorithms/gae.py `value_loss`, around the clip's anchor: `critic.clip_anchor`), backward in
sum form. It has no extra state. Its versions are published to the store's `critic` stream
after every step, where the `values` stage (operators/values.py) reads the newest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.config import AdvantageConfig, KLConfig
from trajflow.algorithms.gae import explained_variance, value_loss
from trajflow.algorithms.objective import LossSum
from trajflow.engines.value_model import load_value_model, values
from trajflow.operators.contracts.store import CRITIC
from trajflow.operators.trainer.critic_config import CriticConfig
from trajflow.operators.trainer.learner import Learner, UpdateResult
from trajflow.operators.trainer.plan import ShardPlan
from trajflow.operators.trainer.spec import TrainStepConfig
from trajflow.schemas.columns import (RETURNS_COLUMN, TOKEN_ADVANTAGE_COLUMN, TRAIN_VALUES_COLUMN,
                                      VALUE_VERSIONS_COLUMN, VALUES_COLUMN, padded, replace_column)


@dataclass
class CriticBatch:
    """The critic's rows of one micro-batch, padded to the step's width [B, T]."""

    prompts: list[list[int]]
    responses: list[list[int]]
    returns: Tensor   # [B, T] GAE's returns
    anchor: Tensor    # [B, T] the values the clip is anchored on
    mask: Tensor      # [B, T] bool: the loss tokens
    rows: Tensor      # [B] positions in the step
    dummy: bool = False

    def select(self, idx: Tensor) -> "CriticBatch":
        picked = idx.tolist()
        return CriticBatch([self.prompts[i] for i in picked], [self.responses[i] for i in picked], self.returns[idx],
                           self.anchor[idx], self.mask[idx], self.rows[idx])


@dataclass
class CriticResult(UpdateResult):
    """The critic's update of one worker's rows: per micro-batch its step rows, the values its
    forward predicted [b, T] and where the value clip bound [b, T]."""

    parts: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)


class CriticLearner(Learner[CriticBatch, CriticResult]):
    """The critic of one worker (module docstring)."""

    def __init__(self, spec: TrainStepConfig, weights: Mapping[str, Tensor]) -> None:
        self.spec = spec
        self.settings = spec.critic
        updates = None if spec.total_updates is None else (
            spec.total_updates // spec.optimizer.minibatches_per_step * self.settings.optimizer.minibatches_per_step)
        super().__init__(CRITIC, spec.critic_model_path, self.settings.optimizer, spec.numerics, spec.trainer, updates,
                         weights)

    def build_model(self, weights: Mapping[str, Tensor]) -> torch.nn.Module:
        model = load_value_model(self.model_path)
        if weights:
            model.load_state_dict(weights)
        return model

    def values(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], width: int,
               grad: bool = False) -> Tensor:
        """V(s_t) [B, width] under the training numerics (no gradient unless `grad`)."""
        with self.numerics.autocast():
            return values(self.model, prompts, responses, width=width, grad=grad)

    def microbatch(self, batch: CriticBatch, result: CriticResult) -> LossSum:
        predicted = self.values(batch.prompts, batch.responses, batch.returns.shape[1], grad=True)
        if batch.dummy:
            self.dummy_backward(predicted)
            result.dummy_passes += 1
            return LossSum()
        out = value_loss(predicted, batch.returns, batch.anchor, batch.mask, self.settings.cliprange_value)
        out.loss_sum.backward()
        result.parts.append((batch.rows, predicted.detach(), out.clipped))
        result.microbatches += 1
        return LossSum(float(out.loss_sum.detach()), float(out.count))

    def dummy(self, width: int) -> CriticBatch:
        """A one-row batch without loss tokens: the input of a sharded worker's dummy pass."""
        token = [self.bos_token()]
        zeros = torch.zeros((1, width))
        return CriticBatch([token], [token], zeros, zeros, torch.zeros((1, width), dtype=torch.bool),
                           torch.zeros(1, dtype=torch.int64), dummy=True)


@dataclass
class CriticWork:
    """One worker's share of the critic's update: its rows' prompts and responses (at
    `positions` in the step's trained rows), their returns and clip anchors [rows, width] and
    loss masks, cut into `microbatches` per minibatch (lists of step positions; an empty one: a
    dummy pass)."""

    batch: CriticBatch | None
    positions: list[int]
    microbatches: list[list[list[int]]]

    def minibatches(self, dummy: CriticBatch) -> list[list[CriticBatch]]:
        local = {position: i for i, position in enumerate(self.positions)}
        return [[self.batch.select(torch.tensor([local[p] for p in micro])) if micro else dummy
                 for micro in minibatch] for minibatch in self.microbatches]


@dataclass
class CriticInputs:
    """What the critic trains on in one step, for the step's trained rows [N, width]: GAE's
    returns, the value clip's anchor, the values GAE used and their critic versions (None: the
    trainer's own), the loss mask and GAE's advantages."""

    prompts: list[list[int]]
    responses: list[list[int]]
    returns: Tensor
    anchor: Tensor
    used: Tensor
    versions: Tensor | None
    mask: Tensor
    advantages: Tensor

    def shard(self, plan: ShardPlan, rank: int) -> CriticWork:
        """Worker `rank`'s share under the critic's plan."""
        rows = plan.rows(rank)
        if not rows:
            return CriticWork(None, rows, plan.microbatches[rank])
        idx = torch.as_tensor(rows, dtype=torch.int64)
        batch = CriticBatch([self.prompts[i] for i in rows], [self.responses[i] for i in rows], self.returns[idx],
                            self.anchor[idx], self.mask[idx], idx)
        return CriticWork(batch, rows, plan.microbatches[rank])

    def diagnostics(self, results: list[CriticResult], trainer_version: int) -> dict:
        """The critic's metrics of the step (`critic/...`, `advantage/...`): its loss and clip
        fraction, how well the values GAE used explain the returns, value and return means, the
        values' staleness per token (trainer version - value version), GAE's advantages."""
        m = self.mask
        counted = max(int(m.sum()), 1)
        clipped = sum(int(c.sum()) for r in results for _, _, c in r.parts)
        staleness = (trainer_version - self.versions)[m].float() if self.versions is not None else torch.zeros(1)
        advantages = self.advantages[m].double()
        first = results[0]
        return {
            "critic/value_loss": float(np.mean(first.losses)) if first.losses else None,
            "critic/clip_frac": clipped / counted,
            "critic/explained_variance": explained_variance(self.used, self.returns, m),
            "critic/value_mean": float(self.used[m].double().mean()) if m.any() else None,
            "critic/return_mean": float(self.returns[m].double().mean()) if m.any() else None,
            "critic/value_staleness_mean": float(staleness.mean()) if m.any() else None,
            "critic/value_staleness_max": float(staleness.max()) if m.any() else None,
            "critic/grad_norm": float(np.mean(first.norms)) if first.norms else None,
            "critic/lr": first.lr,
            "advantage/mean": float(advantages.mean()) if m.any() else None,
            "advantage/std": float(advantages.std()) if int(m.sum()) > 1 else None,
            "advantage/min": float(advantages.min()) if m.any() else None,
            "advantage/max": float(advantages.max()) if m.any() else None,
        }


def critic_inputs(table: pa.Table, width: int, settings: CriticConfig) -> CriticInputs:
    """The critic's inputs from the step's trained rows (their columns: `returns`, GAE's values
    `values` or `train_values`, the anchor's, `value_versions`, `token_advantages`)."""
    def column(name: str) -> Tensor:
        return torch.from_numpy(padded(table[name], width, 0.0))

    columns = {"rollout": VALUES_COLUMN, "train": TRAIN_VALUES_COLUMN}
    versions = None
    if settings.values_at == "rollout":
        versions = torch.from_numpy(padded(table[VALUE_VERSIONS_COLUMN], width, 0, np.int64))
    return CriticInputs(table["prompt_tokens"].to_pylist(), table["response_tokens"].to_pylist(),
                        column(RETURNS_COLUMN), column(columns[settings.anchor]), column(columns[settings.values_at]),
                        versions, torch.from_numpy(padded(table["loss_mask"], width, False, bool)),
                        column(TOKEN_ADVANTAGE_COLUMN))


def train_time_columns(batch: pa.Table, trained: np.ndarray, values_now: np.ndarray, settings: CriticConfig,
                       advantage: AdvantageConfig, kl: KLConfig) -> pa.Table:
    """`train_values` (the trainer's current critic's values [trained rows, width]) on the
    trained rows of the step, null on the others; with `critic.values_at: train`, GAE on them
    too (operators/advantage.py `gae_columns`, whitened over the trained rows)."""
    from trajflow.operators.advantage import gae_columns

    lengths = [len(r) for r in batch["response_tokens"].to_pylist()]
    where = {int(i): j for j, i in enumerate(trained)}
    column = [values_now[where[i], :n].tolist() if i in where else None for i, n in enumerate(lengths)]
    batch = replace_column(batch, TRAIN_VALUES_COLUMN, pa.array(column, pa.list_(pa.float32())))
    if settings.values_at != "train":
        return batch
    rows = gae_columns(batch.take(pa.array(trained)), values_now, advantage, kl)
    for name in (TOKEN_ADVANTAGE_COLUMN, RETURNS_COLUMN, "advantage"):
        merged = [None] * batch.num_rows
        for j, value in enumerate(rows[name].to_pylist()):
            merged[int(trained[j])] = value
        batch = replace_column(batch, name, pa.array(merged, rows[name].type))
    return batch
