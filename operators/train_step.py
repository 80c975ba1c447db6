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
   workers give the one-worker update; each worker a full replica, or 1/N of the model with
   `trainer.sharding: fsdp`, operators/fsdp.py): pi_theta under the training numerics
   (engines/training_numerics.py: dropout
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
rebuilds that state from the last checkpoint and the trajectory log (operators/recovery.py, up
to `recovery.max_restarts` times), else stops with `TrainerStateLost` (`--resume` restores the
state from the last checkpoint) rather than training on with a fresh optimizer.

Public for the jobs layer: `version`, `strategy`, `full_weights()` (the current version's full
tensors, one at a time: every worker takes part under FSDP), `publish()`, `save_checkpoint()` /
`restore()` (weights, optimizer and strategy state on every worker), `unsharded_policy()`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.config import CorrectionConfig, KLConfig, OptimizerConfig
from trajflow.algorithms.objective import LossOutput
from trajflow.algorithms.schedules import lr_multiplier
from trajflow.engines import checkpoint as ckpt
from trajflow.engines import lora
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
    remove_placement_group_named,
)
from trajflow.operators.fsdp import full_tensors, grad_norm, local_bytes, shard_model
from trajflow.operators.recovery import (
    RECOVERY_PREFIX,
    Fault,
    RecoveryConfig,
    TrainerSource,
    event_metrics,
    refusal,
    replay_plan,
)
from trajflow.operators.reward import FailedRewardSteps
from trajflow.operators.store import PolicyStoreClient
from trajflow.operators.strategies.base import Strategy
from trajflow.operators.weight_sync import WeightServer, WeightSyncConfig
from trajflow.schemas import conform

NO_METRICS = pa.table({})  # a step that trains nothing here emits no metrics row


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
    total_updates: int | None = None  # optimizer updates in the run (steps x minibatches_per_step): the lr schedule's N
    lora: lora.LoraSettings = lora.LoraSettings()  # r > 0: train and publish an adapter (engines/lora.py)


@dataclass
class StepHooks:
    """The job's hooks, run in the train step's process (jobs/recorder.py): `on_start(trainstep)`
    once before the first step (a resumed job restores optimizer and strategy state there),
    `on_step(trainstep, batch, metrics)` after each step's services (logs, checkpoints), and
    `source`, where a trainer rebuilt after a fault finds its state (operators/recovery.py)."""

    on_start: Callable[["TrainStep"], None] | None = None
    on_step: Callable[["TrainStep", pa.Table, dict], None] | None = None
    # the step's rows as trained, before its version is published: a version a reader may hold
    # always has its rows in the log, so a rebuilt trainer can reproduce it (operators/recovery.py)
    on_rows: Callable[["TrainStep", pa.Table, int], None] | None = None
    source: TrainerSource | None = None
    on_lost: Callable[[str], None] | None = None  # the TrainerStateLost line, as the step raises it


@dataclass
class ShardResult:
    """What one worker's update of its rows gives back for the step's diagnostics."""

    parts: list[tuple[Tensor, LossOutput]] = field(default_factory=list)  # (step rows, per-token fields)
    olds: list[tuple[Tensor, Tensor]] = field(default_factory=list)       # (step rows, pi_old as used)
    outside_support: int = 0
    losses: list[float] = field(default_factory=list)  # per minibatch (global: the same on every worker)
    norms: list[float] = field(default_factory=list)
    skipped: int = 0
    microbatches: int = 0  # with rows
    dummy_passes: int = 0  # a sharded worker's passes without rows (lockstep)
    allreduce_seconds: float = 0.0
    state_bytes: dict[str, int] = field(default_factory=dict)  # after the last optimizer step: TrainerReplica.state_bytes
    lr: float | None = None  # the learning rate of the last optimizer update


class TrainerReplica(PolicyHolder):
    """One data-parallel worker: the policy, its optimizer and strategy, and the update of its rows.

    Replicated (`trainer.sharding: none`), a worker is ready when built. Sharded (`fsdp`), it
    shards its model when it joins the group (`join_group`) and only then builds its optimizer
    (over the shards) and binds its strategy; from then on every forward and backward pass of the
    policy is a collective, so the workers run the same passes in the same order."""

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
        self.sharded = spec.data_parallel.sharding == "fsdp"
        self.collective = Collective()  # world size 1 until a group is joined
        # The store's newest weights (version 0 on a fresh run, the resumed one later), or the
        # version worker 0 started from.
        self.version, weights = store.weights(version)
        model = load_model(spec.model_path)
        if lora.is_adapter(weights):  # a resumed LoRA run: the model directory's base + the version's adapter
            model = lora.wrap(model, spec.lora)
            lora.load_adapter(model, weights)
        else:
            model.load_state_dict(weights)
            if spec.lora.enabled:
                model = lora.wrap(model, spec.lora)
        # sharded, the model reaches the device shard by shard (operators/fsdp.py), never whole
        self.model = model.eval() if self.sharded else spec.numerics.prepare(model)
        if spec.data_parallel.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        if not self.sharded:
            self._start()

    def join_group(self, collective: Collective) -> None:
        """Train in `collective`'s group from now on. A sharded worker shards its model over it
        (locally: each keeps its part), then builds its optimizer and binds its strategy."""
        self.collective = collective
        if self.sharded:
            shard_model(self.model, collective.mesh, self.spec.data_parallel.cpu_offload)
            self._start()

    def _start(self) -> None:
        o = self.spec.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter only
        # fused: one kernel per step instead of a dozen passes over every tensor; measured on
        # SmolLM2-135M on 2 CPU cores, 2.3 s per step against 18.8 s (benchmarks/results/real_model.md).
        # Not for FSDP's sharded (DTensor) parameters.
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, fused=not self.sharded)
        self.strategy.bind(self)

    # -- the weights ------------------------------------------------------------------------------
    def full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of the current version's full weights, one at a time, in state-dict
        order (tied weights: the same tensor under each name), on the training device.

        Replicated: the model's own tensors (detached, not copied; cast to `dtype` if given).
        Sharded: each tensor is cast on its shard and all-gathered, which is a collective: every
        worker of the group runs this iteration in step, to the end (`TrainStep.full_weights`
        drives workers 1..N-1; they drop what they gather). LoRA: the base with the adapter merged
        in, under the plain model's names."""
        if self.spec.lora.enabled:
            return full_tensors(lora.merged(dict(lora.base_weights(self.model)), self.version_payload()), dtype)
        return full_tensors(self.model.state_dict(), dtype)

    def version_payload(self) -> dict[str, Tensor]:
        """What a LoRA trainer publishes and checkpoints per version: the adapter (engines/lora.py)."""
        return lora.adapter_payload(self.model, self.spec.lora.scaling)

    def policy_copy(self) -> torch.nn.Module:
        """A frozen copy of the policy with the current weights; sharded like it (its forward
        passes are collectives too, run by every worker in step) when the trainer is sharded."""
        if not self.sharded:
            return super().policy_copy()
        model = load_model(self.spec.model_path).eval().requires_grad_(False)
        shard_model(model, self.collective.mesh, self.spec.data_parallel.cpu_offload, frozen=True)
        model.load_state_dict(self.model.state_dict())
        return model

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds of the parameters, their gradients and the optimizer state
        (its shards when sharded, FSDP's padding included)."""
        params = self._parameters()
        return {"parameter": local_bytes(params),
                "gradient": local_bytes(p.grad for p in params if p.grad is not None),
                "optimizer": local_bytes(t for state in self.optimizer.state.values() for t in state.values()
                                         if isinstance(t, Tensor))}

    def _parameters(self) -> list[Tensor]:
        """The parameters as the optimizer holds them: sharded, FSDP registers the unsharded ones
        on the model between a forward and its backward (or after a no-grad forward)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # -- state ------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """What a replicated checkpoint keeps besides the weights: optimizer and strategy state."""
        return {"optimizer": self.optimizer.state_dict(), "strategy": self.strategy.state_dict()}

    def load_checkpoint_state(self, optimizer: dict | None, strategy: dict | None) -> None:
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            self.optimizer_steps = _optimizer_steps(self.optimizer.state_dict())
        self._load_strategy_state(strategy)

    def _load_strategy_state(self, strategy: dict | None) -> None:
        if strategy:
            self.strategy.load_state_dict(strategy)
        elif self.strategy.state_dict():
            raise RuntimeError(f"resume: the checkpoint holds no state of strategy {self.strategy.name}")

    def save_shards(self, directory: str) -> None:
        """Write this worker's shards of the weights, optimizer and strategy state into a sharded
        checkpoint's directory (engines/checkpoint.py; every worker at once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        coordinator = self.collective.rank == 0
        ckpt.save_sharded(Path(directory), "model", self.model.state_dict(), coordinator)
        # an optimizer that never stepped has no state (reading it would make some: a zero-lr step)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer) if self.optimizer.state else {}
        ckpt.save_sharded(Path(directory), "optimizer", optimizer, coordinator)
        ckpt.save_sharded(Path(directory), "strategy", self.strategy.state_dict(), coordinator)

    def load_shards(self, directory: str) -> None:
        """Load this worker's shards of a sharded checkpoint (every worker at once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        directory = Path(directory)
        self.model.load_state_dict(ckpt.load_sharded(directory, "model", self.model.state_dict))
        optimizer = ckpt.load_sharded(directory, "optimizer", lambda: get_optimizer_state_dict(self.model, self.optimizer))
        if optimizer:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer)
            self.optimizer_steps = _optimizer_steps(optimizer)
        self._load_strategy_state(ckpt.load_sharded(directory, "strategy", self.strategy.state_dict))

    def load_checkpoint(self, directory: str, version: int) -> None:
        """Roll this worker back to checkpoint `directory` of `version` (recovery): weights,
        optimizer and strategy state. Replicated, the optimizer and strategy start afresh first,
        so nothing of the state since the checkpoint remains."""
        if self.sharded:
            self.load_shards(directory)
        else:
            checkpoint = ckpt.Checkpoint(Path(directory), version)
            self.model.load_state_dict(checkpoint.model_state())
            self.strategy = copy.deepcopy(self.spec.strategy)
            self.optimizer_steps = 0
            self._start()
            self.load_checkpoint_state(checkpoint.optimizer_state(), checkpoint.strategy_state())
        self.version = version

    # -- the update of this worker's rows ------------------------------------------------------
    def update_shard(self, rows: pa.Table, positions: list[int], microbatches: list[list[list[int]]],
                     trainer_version: int, width: int) -> ShardResult:
        """Train this worker's `rows` (at `positions` in the step): per minibatch, forward and
        backward each micro-batch (lists of step positions) with the loss in sum form, then one
        all-reduce of gradients, loss sums and aggregation counts over the workers, the division
        by the global count, the clip and the optimizer update. Every worker calls this once per
        step with the same number of minibatches (a worker without rows in one still joins its
        all-reduce). Sharded, the gradients are summed by FSDP in the backward passes (only the
        loss sums and counts are all-reduced), and an empty micro-batch is a dummy pass: the
        same forward, proximal and backward passes on a one-row batch, with weight 0."""
        result = ShardResult()
        batch = StepBatch.from_table(rows, trainer_version, width=width, rows=np.asarray(positions)) if len(positions) else None
        if batch is not None:
            self.strategy.before_step(batch, self)
        elif self.sharded:  # the strategy's forward passes (recompute's scoring) are collectives
            self.strategy.before_step(self._dummy(trainer_version, width), self)
        local = {position: i for i, position in enumerate(positions)}
        params = [p for p in self._parameters() if p.requires_grad]
        for minibatch in microbatches:
            self.optimizer.zero_grad(set_to_none=True)
            shards = [batch.select(torch.tensor([local[p] for p in micro])) if micro
                      else self._dummy(trainer_version, width) for micro in minibatch]
            if self.strategy.needs_update_pass:
                self._begin_update(shards)
            loss_sum, count, first_part = 0.0, 0.0, len(result.parts)
            for micro, shard in zip(minibatch, shards):
                entropy: list[Tensor] | None = [] if self.correction.entropy_coef > 0 else None
                current = self.current(shard, grad=True, entropy=entropy)
                fixed = correct(self.strategy, shard, current, self, self.correction, denominator=1.0,
                                kl=self.spec.kl, entropy=entropy[0] if entropy else None)
                if not micro:  # every parameter takes part in the backward, with gradient 0
                    (torch.where(torch.isfinite(current), current, 0.0).sum() * 0.0).backward()
                    result.dummy_passes += 1
                    continue
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
            if self.collective.world_size > 1:
                started = time.perf_counter()
                if self.sharded:  # gradients: summed by FSDP's reduce-scatters in the backward passes
                    scalars = torch.tensor([loss_sum, count], dtype=torch.float64, device=self.collective.device)
                    self.collective.all_reduce_sum(scalars)
                    loss_sum, count = float(scalars[0]), float(scalars[1])
                else:  # one flat all-reduce: gradients, loss sum, count
                    loss_sum, count = self._all_reduce(params, loss_sum, count)
                result.allreduce_seconds += time.perf_counter() - started
            denominator = max(count, 1.0)
            for p in params:
                p.grad.div_(denominator)
            result.losses.append(loss_sum / denominator)
            for i in range(first_part, len(result.parts)):  # the weights each token had in the global loss
                rows_i, out = result.parts[i]
                result.parts[i] = (rows_i, dataclasses.replace(out, token_weights=out.token_weights / denominator))
            norm = grad_norm(params, self.grad_clip or math.inf)
            if not math.isfinite(norm):  # never step on a NaN/inf gradient: count it instead
                result.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            result.norms.append(norm)
            result.lr = self._schedule_lr()
            self.optimizer.step()
            self.optimizer_steps += 1
            result.state_bytes = self.state_bytes()
            self.strategy.after_update(self)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _schedule_lr(self) -> float:
        """Set the lr of the next optimizer update from the schedule (algorithms/schedules.py).
        The update index is AdamW's own step count, which every checkpoint (replicated or
        sharded) holds, so a resumed run continues the schedule where it stopped; a skipped
        (non-finite) update does not advance it."""
        o = self.spec.optimizer
        lr = o.lr * lr_multiplier(self.optimizer_steps, self.spec.total_updates, o)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _all_reduce(self, params: list[Tensor], loss_sum: float, count: float) -> tuple[float, float]:
        """Sum the gradients (replaced in place), loss sums and counts over the workers in one
        flat all-reduce; returns the global (loss sum, count)."""
        scalars = torch.tensor([loss_sum, count], dtype=params[0].grad.dtype, device=params[0].grad.device)
        flat = self.collective.all_reduce_sum(torch.cat([p.grad.reshape(-1) for p in params] + [scalars]))
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return float(flat[-2]), float(flat[-1])

    def _dummy(self, trainer_version: int, width: int) -> StepBatch:
        """A one-row batch without loss tokens: the input of a sharded worker's dummy pass."""
        token = [int(getattr(self.model.config, "bos_token_id", None) or 0)]
        return StepBatch(prompts=[token], responses=[token], inference=torch.zeros((1, width)),
                         versions=torch.full((1, width), trainer_version, dtype=torch.int64),
                         loss_mask=torch.zeros((1, width), dtype=torch.bool), advantages=torch.zeros(1),
                         old=torch.zeros((1, width)), rows=torch.zeros(1, dtype=torch.int64),
                         groups=torch.zeros(1, dtype=torch.int64), reference=None)

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


def _optimizer_steps(optimizer_state: dict) -> int:
    """The optimizer steps taken, from an optimizer state dict (AdamW's per-parameter `step`)."""
    steps = [float(s["step"]) for s in optimizer_state["state"].values() if "step" in s]
    return int(max(steps)) if steps else 0


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
    """Worker `rank` (1..N-1) of a data-parallel train step: a Ray actor started by worker 0 from
    the same spec and version; worker 0 restores its checkpoint state when resuming."""

    def __init__(self, rank: int, world_size: int, store: PolicyStoreClient, spec: TrainerSpec, version: int) -> None:
        super().__init__(store, spec, version)
        self.rank, self.world_size = rank, world_size

    def node_id(self) -> str:
        return node_address()[0]

    def join(self, host: str, port: int, timeout_seconds: float) -> None:
        self.join_group(Collective(self.rank, self.world_size, host=host, port=port, device=self.numerics.torch_device(),
                                   timeout_seconds=timeout_seconds, default_group=self.sharded))

    def update(self, rows: pa.Table, positions: list[int], microbatches: list[list[list[int]]],
               trainer_version: int, width: int) -> ShardResult:
        return self.update_shard(rows, positions, microbatches, trainer_version, width)

    def gather_weights(self, dtype: torch.dtype | None) -> None:
        """Take part in worker 0's `full_weights()`: the same gathers in step (their tensors dropped)."""
        for _ in self.full_weights(dtype):
            pass


class TrainStep(TrainerReplica):
    """Worker 0: the Ray Data operator. Workers 1..N-1 are built from the same `spec`."""

    def __init__(self, store: PolicyStoreClient, spec: TrainerSpec, max_staleness: int,
                 after_step: Sequence[AfterStep], hooks: StepHooks,
                 recovery: RecoveryConfig = RecoveryConfig(), failed_rewards: FailedRewardSteps | None = None,
                 weight_sync: WeightSyncConfig = WeightSyncConfig(), reader_dtypes: Sequence[str] = ()) -> None:
        data_parallel = spec.data_parallel
        self.failed_rewards = failed_rewards
        # One train step per store: a second one means this process replaced a trainer that died
        # (Ray Data restarts actors and retries the step), and that trainer's optimizer and
        # strategy state died with it (its published weights too). Rebuild it at the first step
        # (operators/recovery.py), or refuse to train on.
        self.node = node_address()[0]
        self.group: TrainerGroup | None = None
        self.weight_server: WeightServer | None = None
        self.lost: TrainerStateLost | None = None
        self.recovery, self.source, self.fault, self.on_lost = recovery, hooks.source, None, hooks.on_lost
        self.recovered: dict = {}  # a recovery's metrics, for the next step trained
        self.restarts = store.claim_trainer()
        if self.restarts > 0:
            what = (f"trainer worker 0 of {data_parallel.num_workers} (node {self.node[:12]}) was restarted after "
                    "its process died")
            why = refusal(recovery, hooks.source, self.restarts)
            if why is not None:
                self.lost = TrainerStateLost(f"{what}; the trainer's optimizer and strategy state is lost ({why}): "
                                             f"{RESUME_HINT}")
                return
            self.fault = Fault(what, time.time())
            remove_placement_group_named(data_parallel.group_name)  # the dead worker 0's: its bundles are held
        super().__init__(store, spec)
        self.max_staleness = max_staleness
        self.data_parallel = data_parallel
        self.after_step = list(after_step)
        self.on_step = hooks.on_step  # the job's hook (metrics file, checkpoints), after the services
        self.on_rows = hooks.on_rows  # the job's trajectory log, before them
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        if data_parallel.num_workers > 1:
            self.group = TrainerGroup(TrainerRank, dict(store=store, spec=spec, version=self.version), data_parallel,
                                      device=self.numerics.torch_device())
            self.join_group(self.group.collective)
        elif self.sharded:  # one worker: FSDP over a group of one (the same code path)
            self.join_group(Collective(device=self.numerics.torch_device(), default_group=True))
        if hooks.on_start is not None and self.fault is None:  # a rebuilt trainer's state is the recovery's
            hooks.on_start(self)  # e.g. a resumed job restores every worker's optimizer and strategy state here
        if weight_sync.method == "collective":  # versions go to the readers from here (operators/weight_sync.py)
            self.weight_server = WeightServer(store, weight_sync, self.model.state_dict(), reader_dtypes,
                                              device=str(self.numerics.torch_device()))
            # gathered once in float32 if any reader takes it (each cast from it), else in the one dtype;
            # the version it started from is the store's (readers take it there, not waiting for this process)
            self.gather_dtype = torch.float32 if "float32" in reader_dtypes else getattr(torch, reader_dtypes[0])

    def publish(self) -> None:
        """Make the trainer's current weights version `self.version` in the policy store (the
        after-step service `PublishWeights` calls it): the full tensors (`full_weights()`,
        gathered from every worker when sharded) as one float32 copy in the object store; with
        LoRA, the adapter only. A version the store holds already was published by the process
        this one replaced (recovery): the same weights, kept.

        `weight_sync.method: collective`: the full tensors are packed into the weight server's
        buckets in each reader's dtype and sent to every reader while the next step trains; the
        store registers the version (its number) once every reader has it."""
        if self.weight_server is not None:
            self.weight_server.offer(self.version, self.full_weights(self.gather_dtype))
            return
        if self.store.latest_version() >= self.version:
            return
        payload = self.version_payload() if self.spec.lora.enabled else dict(self.full_weights())
        self.store.publish(payload, self.version)

    def full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """`TrainerReplica.full_weights` on worker 0, with workers 1..N-1 running the same gathers
        meanwhile when sharded. Iterate to the end: a consumer that stops early still finishes the
        gathers (the other workers are in them), so the workers stay in step."""
        if self.group is None or not self.sharded:
            yield from super().full_weights(dtype)
            return
        refs = self.group.submit("gather_weights", [dtype] * (self.group.world_size - 1))
        gathered = super().full_weights(dtype)
        try:
            for item in gathered:  # not `yield from`: closing this generator must not close `gathered`
                yield item
        except Exception as e:
            raise self.group.failure(e, refs) from e
        finally:
            for _ in gathered:
                pass
        self.group.get(refs)

    def unsharded_policy(self) -> torch.nn.Module:
        """The policy as one module in this process, for work outside the workers' lockstep
        (held-out evaluation): the model itself when replicated; sharded, a full copy loaded
        from `full_weights()` (every worker takes part in the gathers)."""
        if not self.sharded and not self.spec.lora.enabled:
            return self.model
        model = self.numerics.prepare(load_model(self.spec.model_path))  # LoRA: the adapter merged in
        model.load_state_dict(dict(self.full_weights()))
        return model

    def save_checkpoint(self, root: Path, meta: dict, export: bool = False) -> ckpt.Checkpoint:
        """Checkpoint version `self.version` under `root` (engines/checkpoint.py): replicated,
        this worker writes the weights, optimizer and strategy state; sharded, every worker
        writes its shards. `export`: the checkpoint is also a plain Hugging Face model directory
        (full float32 weights, the model's config and tokenizer files)."""
        dp = self.data_parallel
        meta = {**meta, "sharding": {"method": dp.sharding, "workers": dp.num_workers}}
        with ckpt.writing_checkpoint(root, self.version, meta) as tmp:
            if self.sharded:
                self._on_every_worker("save_shards", str(tmp))
            else:
                state = self.checkpoint_state()
                if self.spec.lora.enabled:  # the adapter: the base is the model directory's
                    ckpt.write_replica(tmp, self.version_payload(), state["optimizer"], state["strategy"],
                                       weights_file=ckpt.ADAPTER_FILE)
                else:
                    ckpt.write_replica(tmp, self.policy_state_dict(), state["optimizer"], state["strategy"])
            if export:
                ckpt.export_model(tmp, self.full_weights(), self.spec.model_path)
        return ckpt.Checkpoint(ckpt.checkpoint_dir(root, self.version), self.version, meta)

    def restore(self, path: Path) -> None:
        """Load checkpoint `path`'s optimizer and strategy state (and, sharded, each worker's
        shards of the weights) into every worker: a resumed run's state. The weights also came
        with the store's version, which the trainer started from."""
        checkpoint = ckpt.Checkpoint(Path(path), -1)
        if checkpoint.sharded != self.sharded:
            kind = "a sharded" if checkpoint.sharded else "a replicated"
            raise RuntimeError(f"resume: checkpoint {path} was written by {kind} trainer, and trainer.sharding is "
                               f"{self.data_parallel.sharding}; resume with the sharding the run used")
        if self.sharded:
            self._on_every_worker("load_shards", str(path))
        else:
            self._on_every_worker("load_checkpoint_state", checkpoint.optimizer_state(), checkpoint.strategy_state())

    def _on_every_worker(self, method: str, *args) -> list:
        """`method(*args)` on every worker at once (the collectives inside stay in step): workers
        1..N-1 through the group, then this one; the results by rank."""
        refs = self.group.submit(method, *([a] * (self.group.world_size - 1) for a in args)) if self.group else []
        try:
            mine = getattr(self, method)(*args)
        except Exception as e:  # with workers: name the one that died, or surface a worker's own error
            if self.group is None:
                raise
            raise self.group.failure(e, refs) from e
        return [mine, *(self.group.get(refs) if refs else [])]

    @property
    def nodes(self) -> list[str]:
        """The node id of each worker, by rank."""
        return self.group.nodes if self.group is not None else [self.node]

    def close(self) -> None:
        """End the other workers and free their placement group (they also end with this process),
        and leave the process group."""
        if self.weight_server is not None:
            self.weight_server.close()
            self.weight_server = None
        if self.group is not None:
            self.group.close()
            self.group = None
        if getattr(self, "collective", None) is not None:
            self.collective.close()
        self.collective = Collective()

    # -- the step ----------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        steps = np.unique(batch["rollout_step"].to_numpy())
        if len(steps) != 1:
            raise RuntimeError(f"a train batch must hold exactly one rollout step, got steps {steps.tolist()}")
        step = int(steps[0])
        if self.failed_rewards is not None and self.failed_rewards.stop_line() is not None:
            # reward_max_failed_steps is reached: the driver stops the run at the metrics row of the
            # last failed step (RLPipeline.iter_metrics); the steps already on their way train and
            # log nothing (raising here would race the driver's one line with Ray's error report)
            return NO_METRICS
        try:
            if self.lost is not None:
                raise self.lost
            try:
                trained = self._step(batch, step)
            except TrainerStateLost as lost:  # a worker died: rebuild the group, roll back, train the step again
                self._rebuild_group(lost)
                trained = self._step(batch, step)
        except TrainerStateLost as lost:
            if self.on_lost is not None:
                self.on_lost(str(lost))
            raise
        if trained is None:  # trained and logged by the trainer this one replaced: no second metrics row
            return NO_METRICS
        batch, metrics = trained
        metrics.update(self.recovered)
        self.recovered = {}
        logged = conform(batch) if self.on_rows is not None or self.on_step is not None else None
        if self.on_rows is not None:
            self.on_rows(self, logged, step)
        metrics[f"{RECOVERY_PREFIX}restarts"] = self.restarts
        for hook in self.after_step:
            hook(self, batch, metrics)
        metrics["train_seconds"] = time.perf_counter() - started
        self.busy_seconds += metrics["train_seconds"]
        metrics["trainer_busy_frac"] = self.busy_seconds / max(time.perf_counter() - self.started, 1e-9)
        if self.on_step is not None:
            self.on_step(self, logged, metrics)
        if self.failed_rewards is not None:
            self.failed_rewards.observe(metrics)
        return pa.Table.from_pylist([metrics])

    def _step(self, batch: pa.Table, step: int) -> tuple[pa.Table, dict] | None:
        """Recover first when a fault is pending; then train the step, or None for a step the
        rebuilt trainer has already retrained from the log (a retried task's earlier steps)."""
        if self.fault is not None:
            self.recovered = self._recover(step)
        if step < self.version:
            return None
        return self._train(batch, step)

    def _train(self, batch: pa.Table, step: int) -> tuple[pa.Table, dict]:
        """Train one step's rows: the batch as trained (its pi_old column) and the step's metrics."""
        trainer_version = self.version
        batch, trained, stale_tokens = apply_staleness_bound(batch, trainer_version, self.max_staleness)
        metrics = step_metrics(batch, trainer_version, step, trained, stale_tokens)
        metrics["strategy"] = self.strategy.name

        diagnostics: dict = {}
        # pi_old as the loss used it, under its own name: `old_logprobs` stays what arrived (the
        # exact strategies' upstream scores, or null), so each column has one meaning; null on
        # untrained rows, present on every step so the log has one schema
        old = np.full(batch.num_rows, None, dtype=object)
        if len(trained):
            diagnostics, old_used, parallel = self._update(batch.take(pa.array(trained)), trainer_version)
            metrics.update(diagnostics)
            metrics.update(parallel)
            old[trained] = old_used
        batch = replace_column(batch, PROXIMAL_COLUMN, pa.array(old.tolist(), pa.list_(pa.float32())))
        metrics.update(self._finish_step(diagnostics))
        metrics["version"] = self.version
        metrics["optimizer_steps"] = self.optimizer_steps
        metrics["trainer/num_workers"] = self.data_parallel.num_workers
        metrics["trainer/nodes"] = ",".join(self.nodes)
        return batch, metrics

    # -- recovery (operators/recovery.py) ---------------------------------------------------------
    def _rebuild_group(self, lost: TrainerStateLost) -> None:
        """A worker of the group died: start a new group (a fault to recover at this step), or
        raise `lost` when the fault is not to be recovered."""
        self.restarts = self.store.claim_trainer()  # the store counts every trainer rebuilt
        why = refusal(self.recovery, self.source, self.restarts)
        if why is not None or self.group is None or self.sharded:  # a sharded model is not re-sharded in place
            raise lost
        self.fault = Fault(str(lost).split(";")[0], time.time())
        self.close()
        ranks = dict(store=self.store, spec=self.spec, version=None)  # the checkpoint's weights come next
        self.group = TrainerGroup(TrainerRank, ranks, self.data_parallel, device=self.numerics.torch_device())
        self.join_group(self.group.collective)

    def _recover(self, step: int) -> dict:
        """Roll every worker back to the last checkpoint and train the steps since it again from
        their logged rows (nothing published or logged: it all was); the `recovery/*` metrics."""
        fault, self.fault = self.fault, None
        try:
            directory, version, batches = replay_plan(self.source, step)
        except RuntimeError as e:
            raise TrainerStateLost(f"{fault.what}; the trainer's state cannot be rebuilt ({e}): {RESUME_HINT}") from None
        self._on_every_worker("load_checkpoint", directory, version)
        for k, rows in enumerate(batches, start=version):
            rows, metrics = self._train(rows, k)
            if not self.source.metrics_logged(k) and self.on_step is not None:
                self.on_step(self, conform(rows), metrics)  # it died between the step's rows and its metrics
        # `self.version`: the step the run goes on from (past `step` when it retrained later logged steps)
        return event_metrics(fault, self.version, version, len(batches), time.time() - fault.noticed, self.restarts)

    def _finish_step(self, diagnostics: dict) -> dict:
        """Every worker's strategy after-step hook on the same (global) diagnostics."""
        if not diagnostics:  # nothing trained: no update, the version still advances
            self._on_every_worker("advance_version")
            return {}
        return self._on_every_worker("finish_step", diagnostics)[0]

    def _update(self, table: pa.Table, trainer_version: int) -> tuple[dict, list, dict]:
        batch = StepBatch.from_table(table, trainer_version)
        lengths = np.array([len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)])
        dp = self.data_parallel
        plan = plan_shards(lengths, self.minibatches_per_step, dp.num_workers, dp.max_tokens_per_microbatch,
                           lockstep=self.sharded)
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
        diagnostics["optimizer/lr"] = results[0].lr
        parallel = {"trainer/microbatches": sum(r.microbatches for r in results),
                    "trainer/allreduce_seconds": max(r.allreduce_seconds for r in results),
                    **({"trainer/dummy_passes": sum(r.dummy_passes for r in results)} if self.sharded else {}),
                    **{f"trainer/{kind}_bytes": max(r.state_bytes.get(kind, 0) for r in results)
                       for kind in ("parameter", "gradient", "optimizer") if results[0].state_bytes}}
        return diagnostics, old_column(olds, [len(r) for r in batch.responses]), parallel
