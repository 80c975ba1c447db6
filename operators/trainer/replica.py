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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.algorithms.objective import LossOutput, LossSum
from trajflow.algorithms.schedules import lr_multiplier
from trajflow.engines import lora
from trajflow.engines.models import load_model
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.trainer.collective import Collective, this_node
from trajflow.operators.trainer.correction import (Correction, PolicyHolder, StepBatch, correct, finite_loss_mask,
                                                   top_k_in_loss)
from trajflow.operators.trainer.fsdp import clip_grad_norm, full_tensors, local_bytes, shard_model
from trajflow.operators.trainer.spec import TrainStepConfig
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

    def __init__(self, store: PolicyStoreClient, spec: TrainStepConfig, version: int | None = None,
                 rebuilt: bool = False) -> None:
        torch.set_num_threads(spec.trainer.torch_threads)
        self.store = store
        self.spec = spec
        self.strategy = copy.deepcopy(spec.strategy)  # this worker's own, bound below
        self.correction = spec.correction
        self.sampling = spec.sampling
        self.numerics = spec.numerics
        self.grad_clip = spec.optimizer.grad_clip
        self.minibatches_per_step = spec.optimizer.minibatches_per_step
        self.sharded = spec.trainer.sharding == "fsdp"
        self.collective = Collective()  # world size 1 until a group is joined
        # The store's newest weights (version 0 on a fresh run, the resumed one later), or the
        # version worker 0 started from. A worker `rebuilt` after a fault loads its checkpoint next
        # (operators/trainer/recovery.py): the model directory's weights until then, since the
        # store may hold no tensors of its versions (weight_sync collective).
        self.version, weights = (store.latest_version(), {}) if rebuilt else store.weights(version)
        self.model = self._load_policy(weights)
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        if not self.sharded:
            self._start()

    def _load_policy(self, weights: Mapping[str, Tensor]) -> torch.nn.Module:
        """The policy: the model directory's weights, then `weights` (full weights, a LoRA
        adapter over the directory's base, or none), in the training numerics."""
        spec = self.spec
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
        model = model.eval() if self.sharded else spec.numerics.prepare(model)
        if spec.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model

    def reload_unsharded(self) -> None:
        """A sharded worker whose group is gone (a worker died): a fresh unsharded policy (FSDP
        does not re-shard a model in place), optimizer and strategy, to join a new group and load
        a checkpoint into (operators/trainer/recovery.py)."""
        self.model = self._load_policy({})
        self.optimizer, self.optimizer_steps = None, 0
        self.strategy = copy.deepcopy(self.spec.strategy)

    def join_group(self, collective: Collective) -> None:
        """Train in `collective`'s group from now on. A sharded worker shards its model over it
        (locally: each keeps its part), then builds its optimizer and binds its strategy."""
        self.collective = collective
        if self.sharded:
            shard_model(self.model, collective.mesh, self.spec.trainer.cpu_offload)
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
        if not self.spec.lora.enabled:
            return full_tensors(self.model.state_dict(), dtype)
        payload = TrainerReplica.version_payload(self)  # this worker's part, not worker 0's driver of all
        if not self.sharded:
            return full_tensors(lora.merged(dict(lora.base_weights(self.model)), payload), dtype)
        return _merged_in_step(lora.base_weights(self.model), lora.deltas(payload), dtype)

    def version_payload(self) -> dict[str, Tensor]:
        """What a LoRA trainer publishes and checkpoints per version: the adapter (engines/lora.py),
        whole. Sharded, the adapter is sharded with its layer (operators/trainer/fsdp.py): each
        tensor is all-gathered, a collective every worker runs in step."""
        payload = lora.adapter_payload(self.model, self.spec.lora.scaling)
        return dict(full_tensors(payload)) if self.sharded else payload

    def policy_copy(self) -> torch.nn.Module:
        """A frozen copy of the policy with the current weights; sharded like it (its forward
        passes are collectives too, run by every worker in step) when the trainer is sharded."""
        if not self.sharded:
            return super().policy_copy()
        model = load_model(self.spec.model_path)
        if self.spec.lora.enabled:  # the same module tree as the policy's, so its state dict loads
            model = lora.wrap(model, self.spec.lora)
        model = model.eval().requires_grad_(False)
        shard_model(model, self.collective.mesh, self.spec.trainer.cpu_offload, frozen=True)
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
        """Train this worker's share of a step: per minibatch, forward -> correct -> backward each
        micro-batch (the loss in sum form), reduce the gradients and the loss's (sum, count) over
        the workers, divide once by the global count, clip, step. Every worker calls this once per
        step with the same minibatches (one without rows in a minibatch still joins its reduce);
        sharded, a worker's missing micro-batches are dummy passes (operators/trainer/plan.py)."""
        result = ShardResult()
        minibatches = self._before_step(work)
        params = [p for p in self._parameters() if p.requires_grad]
        for minibatch in minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            if self.strategy.needs_update_pass:
                self._begin_update(minibatch)  # M2PO: a statistic of the whole update, before any backward
            loss = LossSum()
            for batch in minibatch:
                current, entropy, top_k = self._forward(batch)  # pi_theta under the training numerics
                fixed = correct(self.strategy, batch, current, self, self.correction, kl=self.spec.kl,
                                entropy=entropy, distill=self.spec.distill,
                                current_top_k=top_k)  # the strategy's pi_old, masks and loss
                loss += self._backward(batch, current, fixed, result)
            loss = self._reduce(params, loss, result)  # over the workers
            for p in params:
                p.grad.div_(loss.divisor)  # the aggregation's one division, by the update's global count
            result.losses.append(loss.mean)
            norm = clip_grad_norm(params, self.grad_clip or math.inf)
            if not math.isfinite(norm):  # never step on a NaN/inf gradient: count it instead
                result.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self._optimizer_step(norm, result)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _before_step(self, work: ShardWork) -> list[list[StepBatch]]:
        """This worker's micro-batches per minibatch (an empty one: a dummy batch), after the
        strategy's before-step hook on all its rows (sharded without rows: on a dummy batch, since
        the hook's forward passes, recompute's scoring, are collectives)."""
        local = {position: i for i, position in enumerate(work.positions)}
        batch = StepBatch.from_table(work.rows, work.trainer_version, width=work.width,
                                     rows=np.asarray(work.positions)) if work.positions else None
        if batch is not None:
            self.strategy.before_step(batch, self)
        elif self.sharded:
            self.strategy.before_step(self._dummy(work), self)
        return [[batch.select(torch.tensor([local[p] for p in micro])) if micro else self._dummy(work)
                 for micro in minibatch] for minibatch in work.microbatches]

    def _forward(self, batch: StepBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """pi_theta [B, T] with gradient, its per-token entropy when the loss has an entropy term,
        and pi_theta on the batch's top-k ids [B, T, K] when a term of the loss needs them."""
        entropy: list[Tensor] | None = [] if self.correction.entropy_coef > 0 else None
        top_k: list[Tensor] | None = [] if top_k_in_loss(self.strategy, self.spec.distill, batch) else None
        current = self.current(batch, grad=True, entropy=entropy, top_k=top_k)
        return current, entropy[0] if entropy else None, top_k[0] if top_k else None

    def _backward(self, batch: StepBatch, current: Tensor, fixed: Correction, result: ShardResult) -> LossSum:
        """Backpropagate the micro-batch's loss in sum form and record its per-token results; its
        (sum, count). A dummy pass sends a zero gradient through every parameter (a sharded
        worker's backward is a collective) and counts nothing."""
        if batch.dummy:
            (torch.where(torch.isfinite(current), current, 0.0).sum() * 0.0).backward()
            result.dummy_passes += 1
            return LossSum()
        fixed.loss.loss_sum.backward()
        detached = dataclasses.replace(fixed.loss, loss=fixed.loss.loss.detach(), loss_sum=fixed.loss.loss_sum.detach())
        result.parts.append((batch.rows, detached))
        result.olds.append((batch.rows, fixed.old))
        result.outside_support += fixed.outside_support
        result.microbatches += 1
        return LossSum(float(detached.loss_sum), float(detached.count))

    def _reduce(self, params: list[Tensor], loss: LossSum, result: ShardResult) -> LossSum:
        """The update's gradients and (loss sum, count) summed over the workers. Every worker
        steps every parameter (zeros where it had no rows). Replicated: one flat all-reduce of
        the gradients and both scalars; sharded: FSDP's reduce-scatters summed the gradients in
        the backward passes, so only the scalars are all-reduced."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.collective.world_size == 1:
            return loss
        started = time.perf_counter()
        if self.sharded:  # the gradients: summed by FSDP's reduce-scatters in the backward passes
            scalars = torch.tensor([loss.total, loss.count], dtype=torch.float64, device=self.collective.device)
            self.collective.all_reduce_sum(scalars)
        else:
            scalars = self._all_reduce(params, loss)
        result.allreduce_seconds += time.perf_counter() - started
        return LossSum(float(scalars[0]), float(scalars[1]))

    def _all_reduce(self, params: list[Tensor], loss: LossSum) -> Tensor:
        """Sum the gradients (replaced in place), the loss sum and the count over the workers in
        one flat all-reduce; returns the global (loss sum, count) as a tensor."""
        scalars = torch.tensor([loss.total, loss.count], dtype=params[0].grad.dtype, device=params[0].grad.device)
        flat = self.collective.all_reduce_sum(torch.cat([p.grad.reshape(-1) for p in params] + [scalars]))
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return flat[-2:]

    def _optimizer_step(self, norm: float, result: ShardResult) -> None:
        """The optimizer update at the schedule's learning rate, then the strategy's after-update hook."""
        result.norms.append(norm)
        result.lr = self._schedule_lr()
        self.optimizer.step()
        self.optimizer_steps += 1
        result.state_bytes = self.state_bytes()
        self.strategy.after_update(self)

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

    def _dummy(self, work: ShardWork) -> StepBatch:
        """A one-row batch without loss tokens: the input of a sharded worker's dummy pass."""
        token = [int(getattr(self.model.config, "bos_token_id", None) or 0)]
        width = work.width
        return StepBatch(prompts=[token], responses=[token], inference=torch.zeros((1, width)),
                         versions=torch.full((1, width), work.trainer_version, dtype=torch.int64),
                         loss_mask=torch.zeros((1, width), dtype=torch.bool), advantages=torch.zeros(1),
                         old=torch.zeros((1, width)), rows=torch.zeros(1, dtype=torch.int64),
                         groups=torch.zeros(1, dtype=torch.int64), reference=None, dummy=True)

    def _begin_update(self, minibatch: list[StepBatch]) -> None:
        """Hand the strategy the update's log-ratios (this worker's loss tokens, no gradient) and
        a gather over the workers, before any backward pass of the update (M2PO's cutoff)."""
        ratios = [torch.zeros(0)]
        for batch in minibatch:
            current = self.current(batch, grad=False)
            old = self.strategy.proximal(batch, current, self).detach()
            ratios.append((current - old)[finite_loss_mask(batch, current, old)])
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


def _merged_in_step(base: Iterator[tuple[str, Tensor]], deltas: dict[str, lora.Delta],
                    dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """A sharded LoRA policy's full weights, one tensor at a time: each base tensor gathered (in
    float32: the adapter is merged before any cast), its layer's adapter merged in, then cast."""
    for name, weight in full_tensors(dict(base)):
        if name in deltas:
            weight = deltas[name].apply(weight)
        yield name, weight.to(dtype) if dtype is not None and weight.is_floating_point() else weight


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

    def __init__(self, rank: int, world_size: int, store: PolicyStoreClient, spec: TrainStepConfig, version: int | None,
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

    def gather_adapter(self) -> None:
        """Take part in worker 0's `version_payload()` of a sharded LoRA trainer (tensors dropped)."""
        self.version_payload()
