"""The correction of one (mini)batch under a strategy, shared by the train step and diagnose.

    StepBatch.from_table(rows, k)       the step's tensors from Arrow (right-padded [B, T])
    correct(strategy, batch, current, trainer, config)
        1. old = strategy.proximal(...)                        pi_old, detached
        2. tokens whose current, old or inference log-prob is not finite leave the loss: a token
           outside the sampling filter's support (top-k / top-p) scores -inf under training
           numerics. They are counted (`support/outside_tokens`) and never reach the loss, its
           denominator or the diagnostics, so they can never turn into a NaN gradient.
        3. strategy.trust_mask(...)                            e.g. M2PO's second-moment mask
        4. decoupled_loss(..., strategy.correction(config))   algorithms/objective.py
    merge_outputs(...)                  minibatch LossOutputs -> one step-sized LossOutput
    step_diagnostics(...)               the metrics a train (or diagnose) step reports

`PolicyHolder` is what the train step and diagnose have in common as a strategy's `Trainer`:
the policy model, the training numerics, and scoring under them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.config import KLConfig
from trajflow.algorithms.diagnostics import correction_diagnostics
from trajflow.algorithms.kl import kl_estimate
from trajflow.algorithms.objective import CorrectionConfig, LossOutput, decoupled_loss
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.schemas.columns import REFERENCE_COLUMN, TOKEN_ADVANTAGE_COLUMN, group_codes, padded


@dataclass
class StepBatch:
    """The trained rows of one step (or a minibatch of them) as tensors, padded to the step's width."""

    prompts: list[list[int]]
    responses: list[list[int]]
    inference: Tensor   # [B, T] float32
    versions: Tensor    # [B, T] int64 (padding: the trainer's version)
    loss_mask: Tensor   # [B, T] bool
    advantages: Tensor  # [B] float32, or [B, T] with per-token advantages (token_advantages)
    old: Tensor | None  # [B, T] the old_logprobs column; None when the rows carry none
    rows: Tensor        # [B] int64: positions in the step's batch
    groups: Tensor      # [B] int64: the prompt (group) of each row, a code shared by the step's rows
    reference: Tensor | None  # [B, T] reference_logprobs (the KL's pi_ref); None without a reference
    # a one-row batch without loss tokens that keeps a sharded worker's passes in step with the
    # others' (operators/trainer/replica.py): its loss is not counted
    dummy: bool = False

    @classmethod
    def from_table(cls, table: pa.Table, trainer_version: int, width: int | None = None,
                   rows: np.ndarray | None = None, groups: np.ndarray | None = None) -> "StepBatch":
        """`width`: pad to it (a data-parallel shard pads to its step's width, so that every
        [B, T] result has the step's shape); `rows`: the rows' positions in the step (default 0..);
        `groups`: the rows' prompt codes in the step (default: coded within this table)."""
        responses = table["response_tokens"].to_pylist()
        width = width if width is not None else max(len(r) for r in responses)
        old_column = table["old_logprobs"]
        reference = table[REFERENCE_COLUMN] if REFERENCE_COLUMN in table.column_names else None
        if TOKEN_ADVANTAGE_COLUMN in table.column_names:  # REINFORCE++ with a per-token discount
            advantages = torch.from_numpy(padded(table[TOKEN_ADVANTAGE_COLUMN], width, 0.0))
        else:
            advantages = torch.from_numpy(table["advantage"].to_numpy(zero_copy_only=False).astype(np.float32))
        return cls(
            prompts=table["prompt_tokens"].to_pylist(),
            responses=responses,
            inference=torch.from_numpy(padded(table["inference_logprobs"], width, 0.0)),
            versions=torch.from_numpy(padded(table["versions"], width, trainer_version, np.int64)),
            loss_mask=torch.from_numpy(padded(table["loss_mask"], width, False, bool)),
            advantages=advantages,
            old=None if old_column.null_count else torch.from_numpy(padded(old_column, width, 0.0)),
            rows=torch.arange(table.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.int64),
            groups=torch.as_tensor(groups) if groups is not None else torch.from_numpy(group_codes(table))
            if "group_id" in table.column_names else torch.arange(table.num_rows),  # hand-built rows: one prompt each
            reference=None if reference is None or reference.null_count else torch.from_numpy(
                padded(reference, width, 0.0)),
        )

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def width(self) -> int:
        return self.inference.shape[1]

    def select(self, idx: Tensor) -> "StepBatch":
        """The rows `idx` (positions in this batch), keeping the width."""
        picked = idx.tolist()
        return StepBatch(
            prompts=[self.prompts[i] for i in picked],
            responses=[self.responses[i] for i in picked],
            inference=self.inference[idx],
            versions=self.versions[idx],
            loss_mask=self.loss_mask[idx],
            advantages=self.advantages[idx],
            old=None if self.old is None else self.old[idx],
            rows=self.rows[idx],
            groups=self.groups[idx],
            reference=None if self.reference is None else self.reference[idx],
        )


class PolicyHolder:
    """The policy model and the numerics it is scored in: a strategy's view of the trainer."""

    model: torch.nn.Module
    numerics: TrainingNumerics
    sampling: SamplingConfig
    version: int
    minibatches_per_step: int

    def policy(self) -> torch.nn.Module:
        return self.model

    def policy_state_dict(self) -> dict[str, Tensor]:
        """The policy's weights as the policy holds them (a sharded trainer: its shards): what
        `policy_copy().load_state_dict` takes."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def policy_copy(self) -> torch.nn.Module:
        """A frozen copy of the policy with the current weights, in the training numerics."""
        return self.numerics.prepare(copy.deepcopy(self.model)).requires_grad_(False)

    @torch.no_grad()
    def score(self, model: torch.nn.Module, batch: StepBatch) -> Tensor:
        return self.numerics.logprobs(model, batch.prompts, batch.responses, self.sampling, width=batch.width)

    def current(self, batch: StepBatch, grad: bool, entropy: list[Tensor] | None = None) -> Tensor:
        """pi_theta [B, T] of the batch under the policy's current weights; `entropy`: a list
        that receives its per-token entropy [B, T] from the same forward pass."""
        with torch.set_grad_enabled(grad):
            return self.numerics.logprobs(self.model, batch.prompts, batch.responses, self.sampling,
                                          width=batch.width, grad=grad, entropy=entropy)


@dataclass
class Correction:
    loss: LossOutput         # with its sum form and count (the train step adds shards' before dividing)
    old: Tensor              # [B, T] pi_old as used (detached)
    outside_support: int     # loss tokens taken out: a non-finite current, old or inference log-prob


def correct(strategy: Strategy, batch: StepBatch, current: Tensor, trainer: Trainer,
            config: CorrectionConfig, *, kl: KLConfig = KLConfig(), entropy: Tensor | None = None,
            group_counts: Tensor | None = None, cov_selected: Tensor | None = None) -> Correction:
    """The strategy's loss on `batch` (see the module docstring). `group_counts` /
    `cov_selected`: prompt-mean's per-prompt counts and Clip-Cov/KL-Cov's token selection over
    the whole update (None: this batch's own). `kl`: the KL to the reference (`batch.reference`)
    enters the loss when `kl.in_` is "loss"; `entropy` [B, T] when `config.entropy_coef` > 0."""
    old = strategy.proximal(batch, current, trainer).detach()
    loss_mask = finite_loss_mask(batch, current, old)
    trust = strategy.trust_mask(batch, current.detach(), old, loss_mask)
    config = strategy.correction(config)
    in_loss = batch.reference is not None and kl.in_ == "loss"
    out = decoupled_loss(current, old, batch.inference, batch.advantages, loss_mask, config,
                         trust_mask=trust,
                         reference_logprobs=batch.reference if in_loss else None, kl=kl, entropy=entropy,
                         groups=batch.groups, group_counts=group_counts, cov_selected=cov_selected)
    if batch.reference is not None and not in_loss:  # the KL is in the reward: measure it, as the loss would
        ref = torch.where(loss_mask, batch.reference, current.detach())
        out = dataclasses.replace(out, kl=torch.where(loss_mask, kl_estimate(current.detach(), ref, kl.estimator), 0.0))
    return Correction(out, old, int((batch.loss_mask & ~loss_mask).sum()))


def finite_loss_mask(batch: StepBatch, current: Tensor, old: Tensor) -> Tensor:
    """The loss tokens whose current, old, inference (and reference) log-probs are all finite
    (step 2 above)."""
    finite = torch.isfinite(current.detach()) & torch.isfinite(old) & torch.isfinite(batch.inference)
    if batch.reference is not None:
        finite &= torch.isfinite(batch.reference)
    return batch.loss_mask & finite


def merge_outputs(parts: list[tuple[Tensor, LossOutput]], shape: torch.Size, loss: float | None = None) -> LossOutput:
    """Per-minibatch LossOutputs (with their rows in the step) -> one with step-sized [B, T] fields.

    Every field of LossOutput is merged: [b, T] tensors are placed at their rows; the sum form
    and the count add up; the loss is averaged over the parts — or set to `loss` when the parts
    are shards of updates (workers, micro-batches) whose losses only add up after the all-reduce.
    """
    if len(parts) == 1 and loss is None:
        return parts[0][1]
    merged = {}
    for f in dataclasses.fields(LossOutput):
        values = [getattr(out, f.name) for _, out in parts]
        if f.name in ("loss_sum", "count"):
            merged[f.name] = torch.stack([v.detach() for v in values]).sum()
        elif values[0].dim() == 0:
            merged[f.name] = (torch.tensor(loss, dtype=values[0].dtype) if loss is not None
                              else torch.stack([v.detach() for v in values]).mean())
        elif values[0].dim() == 2:
            full = torch.zeros(shape, dtype=values[0].dtype)
            for (rows, _), part in zip(parts, values):
                full[rows, : part.shape[1]] = part.detach()
            merged[f.name] = full
        else:
            raise TypeError(f"merge_outputs: LossOutput.{f.name} has {values[0].dim()} dims, expected 0 or 2")
    return LossOutput(**merged)


def step_diagnostics(merged: LossOutput, batch: StepBatch, trainer_version: int, outside_support: int) -> dict:
    """The correction metrics of one step (see algorithms/diagnostics.py for the keys); with a
    reference, `kl/mean`: the policy's KL to it on the step's loss tokens (correct() fills
    LossOutput.kl in either place of the KL)."""
    d = correction_diagnostics(merged, versions=batch.versions, trainer_version=trainer_version,
                               advantages=batch.advantages, reference=batch.reference is not None)
    d["loss"] = float(merged.loss.detach())
    d["support/outside_tokens"] = float(outside_support)
    d["rows_spanning_versions"] = sum(len(set(v)) > 1 for v in (batch.versions[i, : len(r)].tolist()
                                                                  for i, r in enumerate(batch.responses)))
    return d


def old_column(old: Tensor, lengths: list[int]) -> list[list[float]]:
    """pi_old as used, per row; a token with no finite pi_old (outside the support) is -inf."""
    old = torch.where(torch.isfinite(old), old, float("-inf"))
    return [row[:n].tolist() for row, n in zip(old.numpy(), lengths)]
