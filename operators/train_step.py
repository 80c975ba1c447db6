"""Train step: one step of the policy per rollout step (Ray Data actor).

Batch in: all rows of one rollout step (trajectories with rewards, advantages, filter reasons and,
for the exact strategies, old log-probs). Batch out: one metrics row.

The step, top to bottom:
1. Staleness bound where tokens are trained: lag = trainer version - token version. Tokens with
   lag > max_staleness are removed from the loss and counted (rows left with no token: reason
   `over_stale`). Admission already bounds lag; this makes the bound hold whatever Ray Data does.
2. Per minibatch (and per micro-batch of at most `max_tokens_per_microbatch`, gradients
   accumulating), on each of `num_workers` data-parallel workers (operators/data_parallel.py:
   the rows are shared out, gradients summed and the loss normalised over all workers, so N
   workers give the one-worker update): pi_theta under the training numerics (engines/training_numerics.py: dropout
   off, the same autocast as every pi_old), then the strategy's correction (operators/correction.py:
   its proximal, tokens outside the sampling support taken out and counted, its trust mask, the
   decoupled loss), backward, gradient clip and the optimizer update. An update whose gradient
   is not finite is skipped and counted (`grad/nonfinite_skipped`), never applied.
3. The strategy's after-update / after-step hooks (EWMA update and reset, M2PO's metrics); the
   trainer now holds version k + 1.
4. The `after_step` services (operators/after_step.py: publish, held-out evaluation, store
   statistics), then the job's `on_step` hook — all in this process.

`TrainerReplica` is one worker's state and update (model, optimizer, strategy): `TrainStep`
(worker 0, the Ray Data operator) and `TrainerRank` (workers 1..N-1) are both replicas, so
every worker runs the same code. The trainer's state lives only in these processes: a train
step that finds it was restarted (the store already registered a trainer) or loses a worker
stops with `TrainerStateLost` (`--resume` restores the state from the last checkpoint) rather
than training on with a fresh optimizer.

Public for the jobs layer: `version`, `strategy`, `policy()`, `policy_state_dict()`,
`checkpoint_state()` / `load_checkpoint_state()` (optimizer + strategy state, for resume).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.config import CorrectionConfig, KLConfig, OptimizerConfig
from trajflow.algorithms.objective import LossOutput
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingParams
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.after_step import AfterStep
from trajflow.operators.columns import PROXIMAL_COLUMN, apply_staleness_bound, replace_column, step_metrics
from trajflow.operators.correction import (
    PolicyHolder,
    StepBatch,
    correct,
    finite_loss_mask,
    merge_outputs,
    old_column,
    step_diagnostics,
)
from trajflow.operators.data_parallel import (
    RESUME_HINT,
    Collective,
    DataParallel,
    TrainerGroup,
    TrainerStateLost,
    node_address,
    plan_shards,
)
from trajflow.operators.store import PolicyStoreClient
from trajflow.operators.strategies.base import Strategy
from trajflow.schemas import conform


@dataclass(frozen=True)
class TrainerSpec:
    """What every data-parallel worker of a train step is built from: the run's typed settings
    (pipelines/config.py holds their defaults; each worker binds its own copy of the strategy)."""

    model_path: str
    strategy: Strategy
    correction: CorrectionConfig
    kl: KLConfig
    optimizer: OptimizerConfig
    sampling: SamplingParams
    numerics: TrainingNumerics
    data_parallel: DataParallel
    torch_threads: int


@dataclass
class StepHooks:
    """The job's hooks, run in the train step's process (jobs/recorder.py): `on_start(trainstep)`
    once before the first step (a resumed job restores optimizer and strategy state there) and
    `on_step(trainstep, batch, metrics)` after each step's services (logs, checkpoints)."""

    on_start: Callable[["TrainStep"], None] | None = None
    on_step: Callable[["TrainStep", pa.Table, dict], None] | None = None


@dataclass
class ShardResult:
    """What one worker's update of its rows gives back for the step's diagnostics."""

    parts: list[tuple[Tensor, LossOutput]] = field(default_factory=list)  # (step rows, per-token fields)
    olds: list[tuple[Tensor, Tensor]] = field(default_factory=list)       # (step rows, pi_old as used)
    outside_support: int = 0
    losses: list[float] = field(default_factory=list)  # per minibatch (global: the same on every worker)
    norms: list[float] = field(default_factory=list)
    skipped: int = 0
    microbatches: int = 0
    allreduce_seconds: float = 0.0


class TrainerReplica(PolicyHolder):
    """One data-parallel worker: the policy, its optimizer and strategy, and the update of its rows."""

    def __init__(self, store: PolicyStoreClient, spec: TrainerSpec, version: int | None = None) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.store = store
        self.spec = spec
        self.strategy = copy.deepcopy(spec.strategy)  # this worker's own, bound below
        self.correction = spec.correction
        self.sampling = spec.sampling
        self.numerics = spec.numerics
        self.grad_clip = spec.optimizer.grad_clip
        self.minibatches_per_step = spec.optimizer.minibatches_per_step
        self.collective = Collective()  # world size 1 until a group is joined
        # The store's newest weights (version 0 on a fresh run, the resumed one later), or the
        # version worker 0 started from.
        self.version, weights = store.weights(version)
        self.model = spec.numerics.prepare(load_model(spec.model_path))
        self.model.load_state_dict(weights)
        if spec.data_parallel.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        o = spec.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.optimizer_steps = 0
        self.strategy.bind(self)

    # -- state ------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps besides the weights: optimizer and strategy state."""
        return {"optimizer": self.optimizer.state_dict(), "strategy": self.strategy.state_dict()}

    def load_checkpoint_state(self, optimizer: dict | None, strategy: dict | None) -> None:
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            steps = [float(s["step"]) for s in self.optimizer.state_dict()["state"].values() if "step" in s]
            self.optimizer_steps = int(max(steps)) if steps else 0
        if strategy:
            self.strategy.load_state_dict(strategy)
        elif self.strategy.state_dict():
            raise RuntimeError(f"resume: the checkpoint holds no state of strategy {self.strategy.name}")

    # -- the update of this worker's rows ------------------------------------------------------
    def update_shard(self, rows: pa.Table, positions: list[int], microbatches: list[list[list[int]]],
                     trainer_version: int, width: int) -> ShardResult:
        """Train this worker's `rows` (at `positions` in the step): per minibatch, forward and
        backward each micro-batch (lists of step positions) with the loss in sum form, then one
        all-reduce of gradients, loss sums and aggregation counts over the workers, the division
        by the global count, the clip and the optimizer update. Every worker calls this once per
        step with the same number of minibatches (a worker without rows in one still joins its
        all-reduce)."""
        result = ShardResult()
        batch = StepBatch.from_table(rows, trainer_version, width=width, rows=np.asarray(positions)) if len(positions) else None
        if batch is not None:
            self.strategy.before_step(batch, self)
        local = {position: i for i, position in enumerate(positions)}
        params = [p for p in self.model.parameters() if p.requires_grad]
        for minibatch in microbatches:
            self.optimizer.zero_grad(set_to_none=True)
            if self.strategy.needs_update_pass:
                self._begin_update([batch.select(torch.tensor([local[p] for p in micro])) for micro in minibatch])
            loss_sum, count, first_part = 0.0, 0.0, len(result.parts)
            for micro in minibatch:
                shard = batch.select(torch.tensor([local[p] for p in micro]))
                fixed = correct(self.strategy, shard, self.current(shard, grad=True), self, self.correction,
                                denominator=1.0, kl=self.spec.kl)
                fixed.loss.loss.backward()
                loss_sum += float(fixed.loss.loss.detach())
                count += fixed.denominator
                result.outside_support += fixed.outside_support
                result.parts.append((shard.rows, dataclasses.replace(fixed.loss, loss=fixed.loss.loss.detach())))
                result.olds.append((shard.rows, fixed.old))
                result.microbatches += 1
            for p in params:  # every worker steps every parameter (zeros where it had no rows)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.collective.world_size > 1:  # one flat all-reduce: gradients, loss sum, count
                started = time.perf_counter()
                scalars = torch.tensor([loss_sum, count], dtype=params[0].grad.dtype, device=params[0].grad.device)
                flat = self.collective.all_reduce_sum(torch.cat([p.grad.reshape(-1) for p in params] + [scalars]))
                result.allreduce_seconds += time.perf_counter() - started
                offset = 0
                for p in params:
                    p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                loss_sum, count = float(flat[-2]), float(flat[-1])
            denominator = max(count, 1.0)
            for p in params:
                p.grad.div_(denominator)
            result.losses.append(loss_sum / denominator)
            for i in range(first_part, len(result.parts)):  # the weights each token had in the global loss
                rows_i, out = result.parts[i]
                result.parts[i] = (rows_i, dataclasses.replace(out, token_weights=out.token_weights / denominator))
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip or math.inf))
            if not math.isfinite(norm):  # never step on a NaN/inf gradient: count it instead
                result.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            result.norms.append(norm)
            self.optimizer.step()
            self.optimizer_steps += 1
            self.strategy.after_update(self)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _begin_update(self, shards: list[StepBatch]) -> None:
        """Hand the strategy the update's log-ratios (this worker's loss tokens, no gradient) and
        a gather over the workers, before any backward pass of the update (M2PO's cutoff)."""
        ratios = [torch.zeros(0)]
        for shard in shards:
            current = self.current(shard, grad=False)
            old = self.strategy.proximal(shard, current, self).detach()
            ratios.append((current - old)[finite_loss_mask(shard, current, old)])
        self.strategy.begin_update(torch.cat(ratios), self.collective.all_gather)

    def finish_step(self, diagnostics: dict) -> dict:
        """The strategy's after-step hook with the step's (global) diagnostics; the worker then
        holds the next version."""
        out = self.strategy.after_step(self, diagnostics)
        self.version += 1
        return out

    def advance_version(self) -> None:
        """A step with nothing to train: no update, the next version all the same."""
        self.version += 1


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass, with dropout still off.

    Hugging Face checkpoints a layer only when that layer is in training mode; RL keeps the
    model in eval mode (dropout off). So only the layers' own `training` flag is set (not their
    submodules', whose dropout keeps reading eval mode)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module.training = True


class TrainerRank(TrainerReplica):
    """Worker `rank` (1..N-1) of a data-parallel train step: a Ray actor started by worker 0,
    holding the same state as worker 0 (its checkpoint state is passed in)."""

    def __init__(self, rank: int, world_size: int, state: dict, store: PolicyStoreClient, spec: TrainerSpec,
                 version: int) -> None:
        super().__init__(store, spec, version)
        self.rank, self.world_size = rank, world_size
        self.load_checkpoint_state(state["optimizer"], state["strategy"])

    def node_id(self) -> str:
        return node_address()[0]

    def join(self, host: str, port: int, timeout_seconds: float) -> None:
        self.collective = Collective(self.rank, self.world_size, host=host, port=port,
                                     device=self.numerics.torch_device(), timeout_seconds=timeout_seconds)

    def update(self, rows: pa.Table, positions: list[int], microbatches: list[list[list[int]]],
               trainer_version: int, width: int) -> ShardResult:
        return self.update_shard(rows, positions, microbatches, trainer_version, width)


class TrainStep(TrainerReplica):
    """Worker 0: the Ray Data operator. Workers 1..N-1 are built from the same `spec`."""

    def __init__(self, store: PolicyStoreClient, spec: TrainerSpec, max_staleness: int,
                 after_step: Sequence[AfterStep], hooks: StepHooks) -> None:
        data_parallel = spec.data_parallel
        # One train step per store: a second one means this process replaced a trainer that died
        # (Ray Data restarts actors and retries the step), and that trainer's optimizer and
        # strategy state died with it (its published weights too). Refuse to train on.
        self.node = node_address()[0]
        self.group: TrainerGroup | None = None
        self.lost: TrainerStateLost | None = None
        if store.claim_trainer() > 0:
            self.lost = TrainerStateLost(
                f"trainer worker 0 of {data_parallel.num_workers} (node {self.node[:12]}) was restarted after its "
                f"process died; the trainer's optimizer and strategy state is lost: {RESUME_HINT}")
            return
        super().__init__(store, spec)
        self.max_staleness = max_staleness
        self.data_parallel = data_parallel
        self.after_step = list(after_step)
        self.on_step = hooks.on_step  # the job's hook (trajectory log, metrics file, checkpoints), after the services
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        if hooks.on_start is not None:
            hooks.on_start(self)  # e.g. a resumed job restores optimizer and strategy state here
        if data_parallel.num_workers > 1:
            self.group = TrainerGroup(
                TrainerRank, dict(state=self.checkpoint_state(), store=store, spec=spec, version=self.version),
                data_parallel, device=self.numerics.torch_device())
            self.collective = self.group.collective

    def publish(self) -> None:
        """Make the trainer's current weights version `self.version` in the policy store (the
        after-step service `PublishWeights` calls it)."""
        self.store.publish(self.policy_state_dict(), self.version)

    @property
    def nodes(self) -> list[str]:
        """The node id of each worker, by rank."""
        return self.group.nodes if self.group is not None else [self.node]

    def close(self) -> None:
        """End the other workers and free their placement group (they also end with this process)."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.collective = Collective()

    # -- the step ----------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.lost is not None:
            raise self.lost
        started = time.perf_counter()
        steps = np.unique(batch["rollout_step"].to_numpy())
        if len(steps) != 1:
            raise RuntimeError(f"a train batch must hold exactly one rollout step, got steps {steps.tolist()}")
        trainer_version = self.version
        batch, trained, stale_tokens = apply_staleness_bound(batch, trainer_version, self.max_staleness)
        metrics = step_metrics(batch, trainer_version, int(steps[0]), trained, stale_tokens)
        metrics["strategy"] = self.strategy.name

        diagnostics: dict = {}
        if len(trained):
            diagnostics, old_used, parallel = self._update(batch.take(pa.array(trained)), trainer_version)
            metrics.update(diagnostics)
            metrics.update(parallel)
            # pi_old as the loss used it, under its own name: `old_logprobs` stays what arrived
            # (the exact strategies' upstream scores, or null), so each column has one meaning
            old = np.full(batch.num_rows, None, dtype=object)
            old[trained] = old_used
            batch = replace_column(batch, PROXIMAL_COLUMN, pa.array(old.tolist(), pa.list_(pa.float32())))
        metrics.update(self._finish_step(diagnostics))
        metrics["version"] = self.version
        metrics["optimizer_steps"] = self.optimizer_steps
        metrics["trainer/num_workers"] = self.data_parallel.num_workers
        metrics["trainer/nodes"] = ",".join(self.nodes)
        for hook in self.after_step:
            hook(self, batch, metrics)
        metrics["train_seconds"] = time.perf_counter() - started
        self.busy_seconds += metrics["train_seconds"]
        metrics["trainer_busy_frac"] = self.busy_seconds / max(time.perf_counter() - self.started, 1e-9)
        if self.on_step is not None:
            self.on_step(self, conform(batch), metrics)
        return pa.Table.from_pylist([metrics])

    def _finish_step(self, diagnostics: dict) -> dict:
        """Every worker's strategy after-step hook on the same (global) diagnostics."""
        if not diagnostics:  # nothing trained: no update, the version still advances
            self.advance_version()
            if self.group is not None:
                self.group.get(self.group.submit("advance_version"))
            return {}
        refs = self.group.submit("finish_step", [diagnostics] * (self.group.world_size - 1)) if self.group else []
        out = self.finish_step(diagnostics)
        if refs:
            self.group.get(refs)
        return out

    def _update(self, table: pa.Table, trainer_version: int) -> tuple[dict, list, dict]:
        batch = StepBatch.from_table(table, trainer_version)
        lengths = np.array([len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)])
        dp = self.data_parallel
        plan = plan_shards(lengths, self.minibatches_per_step, dp.num_workers, dp.max_tokens_per_microbatch)
        refs = []
        if self.group is not None:
            shards = [plan.rows(rank) for rank in range(1, dp.num_workers)]
            refs = self.group.submit("update", [table.take(pa.array(r, pa.int64())) for r in shards], shards,
                                     plan.microbatches[1:], [trainer_version] * len(shards), [batch.width] * len(shards))
        mine = plan.rows(0)
        try:
            results = [self.update_shard(table.take(pa.array(mine, pa.int64())), mine, plan.microbatches[0],
                                         trainer_version, batch.width)]
        except Exception as e:  # with workers: name the one that died, or surface a worker's own error
            if self.group is None:
                raise
            raise self.group.failure(e, refs) from e
        results += self.group.get(refs) if refs else []

        parts = [part for r in results for part in r.parts]
        merged = merge_outputs(parts, batch.loss_mask.shape, loss=float(np.mean(results[0].losses)))
        olds = torch.zeros_like(batch.inference)
        for rows, old in (o for r in results for o in r.olds):
            olds[rows] = old
        outside = sum(r.outside_support for r in results)
        diagnostics = step_diagnostics(merged, batch, trainer_version, outside)
        diagnostics["grad/norm"] = float(np.mean(results[0].norms)) if results[0].norms else None
        diagnostics["grad/nonfinite_skipped"] = float(results[0].skipped)
        parallel = {"trainer/microbatches": sum(r.microbatches for r in results),
                    "trainer/allreduce_seconds": max(r.allreduce_seconds for r in results)}
        return diagnostics, old_column(olds, [len(r) for r in batch.responses]), parallel
