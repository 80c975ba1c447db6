"""One data-parallel worker of the train step: `TrainerReplica` (the policy, its optimizer and
strategy, and the update of its rows) and `TrainerRank` (workers 1..N-1, started through a worker
group, operators/trainer/group.py). Worker 0, the train step itself (operators/train_step.py), is
a replica too, so every worker runs the same update code.

The update of one worker's rows, per minibatch (operators/trainer/plan.py deals the rows):
forward each micro-batch under the training numerics, correct it (the strategy's pi_old and
masks, the decoupled loss: operators/trainer/correction.py), backward the loss in sum form, reduce
the gradients, loss sums and counts over the workers, divide by the global count, clip, step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.objective import LossOutput
from trajflow.algorithms.schedules import lr_multiplier
from trajflow.engines import lora
from trajflow.engines.models import load_model
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.trainer.collective import Collective, this_node
from trajflow.operators.trainer.correction import PolicyHolder, StepBatch, correct, finite_loss_mask
from trajflow.operators.trainer.fsdp import clip_grad_norm, full_tensors, local_bytes, shard_model
from trajflow.operators.trainer.spec import TrainerSpec
from trajflow.operators.trainer.state import ReplicaState


@dataclass
class ShardWork:
    """One worker's share of a step: its `rows` (at `positions` in the step's trained rows), cut
    into `microbatches` per minibatch (lists of step positions; an empty one: a dummy pass),
    trained at `trainer_version`, padded to the step's `width`."""

    rows: pa.Table
    positions: list[int]
    microbatches: list[list[list[int]]]
    trainer_version: int
    width: int


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


class TrainerReplica(ReplicaState, PolicyHolder):
    """One data-parallel worker: the policy, its optimizer and strategy, and the update of its rows.

    Replicated (`trainer.sharding: none`), a worker is ready when built. Sharded (`fsdp`), it
    shards its model when it joins the group (`join_group`) and only then builds its optimizer
    (over the shards) and binds its strategy; from then on every forward and backward pass of the
    policy is a collective, so the workers run the same passes in the same order."""

    def __init__(self, store: PolicyStoreClient, spec: TrainerSpec, version: int | None = None,
                 rebuilt: bool = False) -> None:
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
        # version worker 0 started from. A worker `rebuilt` after a fault loads its checkpoint next
        # (operators/trainer/recovery.py): the model directory's weights until then, since the
        # store may hold no tensors of its versions (weight_sync collective).
        self.version, weights = (store.latest_version(), {}) if rebuilt else store.weights(version)
        model = load_model(spec.model_path)
        if lora.is_adapter(weights):  # a resumed LoRA run: the model directory's base + the version's adapter
            model = lora.wrap(model, spec.lora)
            lora.load_adapter(model, weights)
        else:
            if weights:
                model.load_state_dict(weights)
            if spec.lora.enabled:
                model = lora.wrap(model, spec.lora)
        # sharded, the model reaches the device shard by shard (operators/trainer/fsdp.py), never whole
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
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
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

    # -- the update of this worker's rows ------------------------------------------------------
    def update(self, work: ShardWork) -> ShardResult:
        """Train this worker's `rows` (at `positions` in the step): per minibatch, forward and
        backward each micro-batch (lists of step positions) with the loss in sum form, then one
        all-reduce of gradients, loss sums and aggregation counts over the workers, the division
        by the global count, the clip and the optimizer update. Every worker calls this once per
        step with the same number of minibatches (a worker without rows in one still joins its
        all-reduce). Sharded, the gradients are summed by FSDP in the backward passes (only the
        loss sums and counts are all-reduced), and an empty micro-batch is a dummy pass: the
        same forward, proximal and backward passes on a one-row batch, with weight 0."""
        rows, positions, microbatches = work.rows, work.positions, work.microbatches
        trainer_version, width = work.trainer_version, work.width
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
            norm = clip_grad_norm(params, self.grad_clip or math.inf)
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

    def __init__(self, rank: int, world_size: int, store: PolicyStoreClient, spec: TrainerSpec, version: int | None,
                 rebuilt: bool = False) -> None:
        super().__init__(store, spec, version, rebuilt)
        self.rank, self.world_size = rank, world_size

    def node_id(self) -> str:
        return this_node()

    def join(self, host: str, port: int, timeout_seconds: float) -> None:
        self.join_group(Collective(self.rank, self.world_size, host=host, port=port, device=self.numerics.torch_device(),
                                   timeout_seconds=timeout_seconds, default_group=self.sharded))

    def gather_weights(self, dtype: torch.dtype | None) -> None:
        """Take part in worker 0's `full_weights()`: the same gathers in step (their tensors dropped)."""
        for _ in self.full_weights(dtype):
            pass
