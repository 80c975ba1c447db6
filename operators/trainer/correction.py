"""The correction of one (mini)batch under a strategy, shared by the train step and diagnose.

    StepBatch.from_table(rows, k)       the step's tensors from Arrow (right-padded [B, T])
    correct(strategy, batch, current, trainer, config)
        1. old = strategy.old_logprobs(...)                        pi_old, detached
        2. tokens whose current, old or inference log-prob is not finite leave the loss: a token
           outside the sampling filter's support (top-k / top-p) scores -inf under training
           numerics. They are counted (`support/outside_tokens`) and never reach the loss, its
           denominator or the diagnostics, so they can never turn into a NaN gradient.
        3. strategy.trust_mask(...)                            e.g. M2PO's second-moment mask
        4. the distribution-level mask (`dist_mask`: mu against strategy.old_top_k on the
           top-k ids) and, distilling, the per-token advantages (algorithms/distillation.py)
        5. decoupled_loss(..., strategy.correction(config))   algorithms/objective.py
        6. added in sum form: the forward KL to the teacher (distilling), strategy.extra_loss
           (Score Centering's term)
    merge_outputs(...)                  minibatch LossOutputs -> one step-sized LossOutput
    step_diagnostics(...)               the metrics a train (or diagnose) step reports

`PolicyHolder` is what the train step and diagnose have in common as a strategy's `Trainer`:
the policy model, the training numerics, and scoring under them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.config import DistillConfig, KLConfig
from trajflow.algorithms.diagnostics import correction_diagnostics
from trajflow.algorithms.distillation import distillation_advantages, distillation_diagnostics, forward_kl_tokens
from trajflow.algorithms.distributions import distribution_diagnostics, distribution_keep, mismatch
from trajflow.algorithms.kl import ReferenceKL, kl_estimate
from trajflow.algorithms.objective import CorrectionConfig, LossOutput, LossSum, WholeUpdate, decoupled_loss
from trajflow.algorithms.rejection import rejection_metrics
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.schemas.columns import (
    REFERENCE_COLUMN,
    TOKEN_ADVANTAGE_COLUMN,
    group_codes,
    padded,
    padded_nested,
)


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
    # the distributions (top_k_logprobs K > 0; None without them): the sampler's ids [B, T, K]
    # int64 (padding: 0), mu and pi_old on them [B, T, K] (padding: -inf)
    top_k_ids: Tensor | None = None
    top_k_inference: Tensor | None = None
    top_k_old: Tensor | None = None
    # distillation: the teacher's log-prob of each sampled token [B, T], and on the top-k ids
    teacher: Tensor | None = None
    top_k_teacher: Tensor | None = None

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
            top_k_ids=_nested(table, "top_k_ids", width, 0, np.int64),
            top_k_inference=_nested(table, "top_k_inference_logprobs", width, float("-inf")),
            top_k_old=_nested(table, "top_k_old_logprobs", width, float("-inf")),
            teacher=None if "teacher_logprobs" not in table.column_names or table["teacher_logprobs"].null_count
            else torch.from_numpy(padded(table["teacher_logprobs"], width, 0.0)),
            top_k_teacher=_nested(table, "top_k_teacher_logprobs", width, float("-inf")),
        )

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def width(self) -> int:
        return self.inference.shape[1]

    def lengths(self) -> np.ndarray:
        """Each row's tokens, prompt and response: what a micro-batch's budget counts."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompts, self.responses)])

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
            **{name: None if getattr(self, name) is None else getattr(self, name)[idx] for name in _DISTRIBUTIONS},
        )


_DISTRIBUTIONS = ("top_k_ids", "top_k_inference", "top_k_old", "teacher", "top_k_teacher")


def _nested(table: pa.Table, column: str, width: int, fill: float, dtype=np.float32) -> Tensor | None:
    """A top-k column of the rows as [B, width, K] (None: absent, or a row without it)."""
    if column not in table.column_names or table[column].null_count:
        return None
    return torch.from_numpy(padded_nested(table[column], width, fill, dtype))


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

    def current(self, batch: StepBatch, grad: bool, entropy: list[Tensor] | None = None,
                top_k: list[Tensor] | None = None) -> Tensor:
        """pi_theta [B, T] of the batch under the policy's current weights; `entropy`: a list
        that receives its per-token entropy [B, T] from the same forward pass; `top_k`: one that
        receives pi_theta on the batch's top-k ids [B, T, K] (same pass)."""
        with torch.set_grad_enabled(grad):
            return self.numerics.logprobs(self.model, batch.prompts, batch.responses, self.sampling,
                                          width=batch.width, grad=grad, entropy=entropy,
                                          top_k_ids=batch.top_k_ids if top_k is not None else None, top_k=top_k)


@dataclass
class Correction:
    loss: LossOutput         # with its sum form and count (the train step adds shards' before dividing)
    old: Tensor              # [B, T] pi_old as used (detached)
    outside_support: int     # loss tokens taken out: a non-finite current, old or inference log-prob


def correct(strategy: Strategy, batch: StepBatch, current: Tensor, trainer: Trainer,
            config: CorrectionConfig, *, kl: KLConfig = KLConfig(), entropy: Tensor | None = None,
            group_counts: Tensor | None = None, cov_selected: Tensor | None = None,
            distill: DistillConfig | None = None, current_top_k: Tensor | None = None) -> Correction:
    """The strategy's loss on `batch` (see the module docstring). `group_counts` /
    `cov_selected`: prompt-mean's per-prompt counts and Clip-Cov/KL-Cov's token selection over
    the whole update (the loss's WholeUpdate; None: this batch's own). `kl`: the KL to the reference (`batch.reference`)
    enters the loss when `kl.in_` is "loss"; `entropy` [B, T] when `config.entropy_coef` > 0.
    `distill`: the distillation's terms (the batch carries the teacher's log-probs);
    `current_top_k`: pi_theta on the top-k ids [B, T, K] with gradient, when a term needs it."""
    old = strategy.old_logprobs(batch, current, trainer).detach()
    loss_mask = finite_loss_mask(batch, current, old)
    trust = strategy.trust_mask(batch, current.detach(), old, loss_mask)
    config = strategy.correction(config)
    keep = None
    real = not batch.dummy  # a sharded worker's dummy pass carries no distributions and counts nothing
    if config.dist_mask is not None and real:
        distance = mismatch(batch.top_k_inference.double(), strategy.old_top_k(batch).double(),
                            config.dist_mask_metric)
        keep = distribution_keep(distance, loss_mask, config.dist_mask, config.dist_mask_level)
    advantages = batch.advantages
    if distill is not None and real:
        student = current.detach() if distill.reverse_kl_student == "current" else old
        advantages = distillation_advantages(student, batch.teacher, batch.advantages, distill.reverse_kl_coef,
                                             distill.task_advantage_coef)
    in_loss = batch.reference is not None and kl.in_ == "loss"
    out = decoupled_loss(current, old, batch.inference, advantages, loss_mask, config, trust_mask=trust,
                         entropy=entropy, reference=ReferenceKL(batch.reference, kl) if in_loss else None,
                         whole=WholeUpdate(groups=batch.groups, group_counts=group_counts, cov_selected=cov_selected),
                         distribution_keep=keep)
    if batch.reference is not None and not in_loss:  # the KL is in the reward: measure it, as the loss would
        ref = torch.where(loss_mask, batch.reference, current.detach())
        out = dataclasses.replace(out, kl=torch.where(loss_mask, kl_estimate(current.detach(), ref, kl.estimator), 0.0))
    extra = [strategy.extra_loss(batch, current_top_k, out, advantages, config)] if real else []
    if distill is not None and distill.forward_kl_coef > 0 and real:
        # off the counted tokens the teacher is replaced by the student itself (KL 0): nothing of
        # theirs, not even 0 x NaN, reaches the gradient
        teacher = torch.where(out.counted[..., None], batch.top_k_teacher, current_top_k.detach())
        forward = forward_kl_tokens(teacher, current_top_k)
        extra.append(distill.forward_kl_coef * torch.where(out.counted, forward * out.token_weights, 0.0).sum())
    extra = [term for term in extra if term is not None]
    if extra:  # in sum form, counted like the rest: the one division stays the aggregation's
        total = LossSum(out.loss_sum + sum(extra), out.count)
        out = dataclasses.replace(out, loss_sum=total.total, loss=total.mean)
    return Correction(out, old, int((batch.loss_mask & ~loss_mask).sum()))


def top_k_in_loss(strategy: Strategy, distill: DistillConfig | None, batch: StepBatch) -> bool:
    """Whether the loss needs pi_theta on the batch's top-k ids (Score Centering, the forward KL)."""
    wanted = strategy.uses_current_top_k or (distill is not None and distill.forward_kl_coef > 0)
    return wanted and batch.top_k_ids is not None


def finite_loss_mask(batch: StepBatch, current: Tensor, old: Tensor) -> Tensor:
    """The loss tokens whose current, old, inference (and reference, teacher) log-probs are all
    finite, and whose top-k log-probs hold no NaN or +inf (-inf is an id outside a support)
    (step 2 above)."""
    finite = torch.isfinite(current.detach()) & torch.isfinite(old) & torch.isfinite(batch.inference)
    for extra in (batch.reference, batch.teacher):
        if extra is not None:
            finite &= torch.isfinite(extra)
    for support in (batch.top_k_inference, batch.top_k_old, batch.top_k_teacher):
        if support is not None:
            finite &= ~(torch.isnan(support) | (support == float("inf"))).any(dim=-1)
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


def step_diagnostics(merged: LossOutput, batch: StepBatch, trainer_version: int, outside_support: int,
                     strategy: Strategy | None = None, config: CorrectionConfig | None = None) -> dict:
    """The correction metrics of one step (see algorithms/diagnostics.py for the keys); with a
    reference, `kl/mean`: the policy's KL to it on the step's loss tokens (correct() fills
    LossOutput.kl in either place of the KL); with the rows' top-k, the distribution-level
    mismatch of mu and the `strategy`'s pi_old (algorithms/distributions.py); with a teacher,
    how far mu is from it (algorithms/distillation.py). `config`: with a `dist_mask`, the
    fraction of loss tokens it keeps (`mask/dist_kept_frac`); with `rejection` rules, the fraction
    of loss tokens and of sequences each rule alone rejects (`rejection/<statistic>/token_frac`,
    `/seq_frac`: algorithms/rejection.py)."""
    d = correction_diagnostics(merged, versions=batch.versions, trainer_version=trainer_version,
                               advantages=batch.advantages, reference=batch.reference is not None)
    if config is not None and config.rejection:  # on the step's loss tokens, as the loss applied them
        d.update(rejection_metrics(merged.log_rd, merged.loss_mask, config.rejection))
    if batch.top_k_inference is not None:
        old_top_k = strategy.old_top_k(batch) if strategy is not None else None
        d.update(distribution_diagnostics(batch.top_k_inference, old_top_k, merged.loss_mask))
        if config is not None and config.dist_mask is not None and old_top_k is not None:
            distance = mismatch(batch.top_k_inference.double(), old_top_k.double(), config.dist_mask_metric)
            kept = distribution_keep(distance, merged.loss_mask, config.dist_mask, config.dist_mask_level)
            d["mask/dist_kept_frac"] = float(kept.sum()) / max(float(merged.loss_mask.sum()), 1.0)
    if batch.teacher is not None:
        d.update(distillation_diagnostics(batch.inference, batch.teacher, batch.top_k_inference, batch.top_k_teacher,
                                          merged.loss_mask))
    d["loss"] = float(merged.loss.detach())
    d["support/outside_tokens"] = float(outside_support)
    d["rows_spanning_versions"] = sum(len(set(v)) > 1 for v in (batch.versions[i, : len(r)].tolist()
                                                                  for i, r in enumerate(batch.responses)))
    return d


# a shared learner's per-agent split of its step (a team: pipelines/team.py), under `agent/<agent>/`
AGENT_KEYS = ("mask/token_kept_frac", "mask/seq_kept_frac", "clip/frac", "mismatch/k1", "mismatch/k3",
              "mismatch/max_abs_log_rd")


def agent_diagnostics(merged: LossOutput, batch: StepBatch, agents: Sequence[str], trainer_version: int) -> dict:
    """When the step's rows belong to several agents (`agents`, per row: one learner shared by a
    team's agents), AGENT_KEYS of each agent's rows alone as `agent/<agent>/<key>`; else nothing
    (a learner of one agent: its step's diagnostics are that agent's)."""
    if len(set(agents)) < 2:
        return {}
    out = {}
    for agent in sorted(set(agents)):
        rows = torch.tensor([i for i, a in enumerate(agents) if a == agent])
        part = LossOutput(**{f.name: value[rows] if value.dim() == 2 else value
                             for f in dataclasses.fields(LossOutput) for value in [getattr(merged, f.name)]})
        d = correction_diagnostics(part, versions=batch.versions[rows], trainer_version=trainer_version)
        out.update({f"agent/{agent}/{key}": d[key] for key in AGENT_KEYS})
    return out


def old_column(old: Tensor, lengths: list[int]) -> list[list[float]]:
    """pi_old as used, per row; a token with no finite pi_old (outside the support) is -inf."""
    old = torch.where(torch.isfinite(old), old, float("-inf"))
    return [row[:n].tolist() for row, n in zip(old.numpy(), lengths)]
