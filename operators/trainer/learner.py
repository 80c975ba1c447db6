"""A learner: one trained model of the train step, addressed by name (`policy`, `critic`).

A learner is its model, its optimizer and lr schedule, its loss, its state on disk
(operators/trainer/state.py) and its version: everything the train step keeps per trained model.
Every data-parallel worker holds every learner of the run (operators/trainer/replica.py), so the
learners of one step train in one place, in one process group, one after another; a frozen model
(reference, teacher) is not a learner. The policy (operators/trainer/policy.py) is the first, the
critic (operators/trainer/critic.py) the second, both built from these parts:

    build_model(weights)     the learner's module from its model directory and a version's payload
    join_group(collective)   train in that group from now on (sharded: shard the model first)
    update(minibatches)      per minibatch: zero grads; per micro-batch forward, loss in sum form,
                             backward (`microbatch`); reduce gradients and (loss sum, count) over
                             the workers; divide once by the global count; clip; step
    full_weights(), version_payload()   what is published as its next version
    checkpoint I/O           LearnerState (weights, optimizer, extra state)

Replicated (`trainer.sharding: none`), a learner is ready when built. Sharded (`fsdp`), it shards
its model when it joins the group and only then builds its optimizer over the shards; every
forward and backward pass is then a collective, so every worker runs the same passes in the same
order (a worker without rows makes zero-weight dummy passes: operators/trainer/plan.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from trajflow.algorithms.config import OptimizerConfig
from trajflow.algorithms.objective import LossSum
from trajflow.algorithms.schedules import lr_multiplier
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.trainer.collective import Collective
from trajflow.operators.trainer.fsdp import clip_grad_norm, full_tensors, local_bytes, shard_model
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.state import LearnerState


@dataclass
class UpdateResult:
    """What one learner's update of a worker's rows gives back for the step's diagnostics."""

    losses: list[float] = field(default_factory=list)  # per minibatch (global: the same on every worker)
    norms: list[float] = field(default_factory=list)
    skipped: int = 0
    microbatches: int = 0  # with rows
    dummy_passes: int = 0  # a sharded worker's passes without rows (lockstep)
    allreduce_seconds: float = 0.0
    state_bytes: dict[str, int] = field(default_factory=dict)  # after the last optimizer step (Learner.state_bytes)
    lr: float | None = None  # the learning rate of the last optimizer update
    seconds: float = 0.0  # the update's wall time on this worker (the strategy's before-step hook included)


Batch = TypeVar("Batch")
Result = TypeVar("Result", bound=UpdateResult)


class Learner(LearnerState, Generic[Batch, Result]):
    """One trained model on one worker (module docstring). Subclasses give `build_model`,
    `microbatch` and, where they keep more, `_started`, `_reset` and the extra state."""

    def __init__(self, name: str, model_path: str, optimizer: OptimizerConfig, numerics: TrainingNumerics,
                 trainer: TrainerConfig, total_updates: int | None, weights: Mapping[str, Tensor],
                 adapter_only: bool = False) -> None:
        self.name = name
        self.model_path = model_path
        self.optimizer_config = optimizer
        self.numerics = numerics
        self.trainer = trainer
        self.total_updates = total_updates
        self.adapter_only = adapter_only
        self.sharded = trainer.sharding == "fsdp"
        self.collective = Collective()  # world size 1 until a group is joined
        self.version = -1  # the worker sets it
        self.model = self._prepared(self.build_model(weights))
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        if not self.sharded:
            self._start()

    # -- what a learner is ------------------------------------------------------------------------
    def build_model(self, weights: Mapping[str, Tensor]) -> torch.nn.Module:
        """The learner's module from its model directory and `weights` (a version's payload, or
        {}: the directory's own), not yet on the device."""
        raise NotImplementedError

    def microbatch(self, batch: Batch, result: Result) -> LossSum:
        """Forward one micro-batch, its loss in sum form, backward; record its per-token results
        in `result`; its (sum, count). A dummy batch sends a zero gradient through every
        parameter (a sharded worker's backward is a collective) and counts nothing."""
        raise NotImplementedError

    def before_update(self, minibatch: list[Batch]) -> None:
        """Before an optimizer update's micro-batches (the policy: M2PO's pass over the update)."""

    def _started(self) -> None:
        """After the optimizer is built (the policy binds its strategy)."""

    # -- building ---------------------------------------------------------------------------------
    def _prepared(self, model: torch.nn.Module) -> torch.nn.Module:
        # sharded, the model reaches the device shard by shard (operators/trainer/fsdp.py), never whole
        model = model.eval() if self.sharded else self.numerics.prepare(model)
        if self.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model

    def reload_unsharded(self) -> None:
        """A sharded learner whose group is gone (a worker died): a fresh unsharded model (FSDP does
        not re-shard a model in place), optimizer and extra state, to join a new group and load a
        checkpoint into (operators/trainer/recovery.py)."""
        self.model = self._prepared(self.build_model({}))
        self.optimizer, self.optimizer_steps = None, 0
        self._reset()

    def join_group(self, collective: Collective) -> None:
        """Train in `collective`'s group from now on. Sharded: shard the model over it (each
        worker keeps its part), then build the optimizer."""
        self.collective = collective
        if self.sharded:
            shard_model(self.model, collective.mesh, self.trainer.cpu_offload)
            self._start()

    def _start(self) -> None:
        o = self.optimizer_config
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter only
        # fused: one kernel per step instead of a dozen passes over every tensor (real_model.md);
        # not for FSDP's sharded (DTensor) parameters
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, fused=not self.sharded)
        self._started()

    # -- the weights ------------------------------------------------------------------------------
    def full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of the current version's full weights, one at a time, in state-dict
        order (tied weights: the same tensor under each name), on the training device. Sharded,
        each tensor is cast on its shard and all-gathered: a collective every worker of the group
        runs in step, to the end."""
        return full_tensors(self.model.state_dict(), dtype)

    def version_payload(self) -> dict[str, Tensor]:
        """What is published and kept per version: the full weights (a LoRA policy: its adapter)."""
        return dict(self.full_weights())

    def state_dict_held(self) -> dict[str, Tensor]:
        """The weights as this worker holds them (a sharded learner: its shards)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

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

    # -- the update -------------------------------------------------------------------------------
    def update(self, minibatches: list[list[Batch]], result: Result) -> Result:
        """Train this worker's share of a step: per minibatch, `microbatch` each of its
        micro-batches (the loss in sum form), reduce the gradients and the loss's (sum, count)
        over the workers, divide once by the global count, clip, step. Every worker calls this
        once per step with the same number of minibatches (one without rows in a minibatch still
        joins its reduce)."""
        params = [p for p in self._parameters() if p.requires_grad]
        for minibatch in minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            self.before_update(minibatch)
            loss = LossSum()
            for batch in minibatch:
                loss += self.microbatch(batch, result)
            loss = self._reduce(params, loss, result)  # over the workers
            for p in params:
                p.grad.div_(loss.divisor)  # the aggregation's one division, by the update's global count
            result.losses.append(loss.mean)
            norm = clip_grad_norm(params, self.optimizer_config.grad_clip or math.inf)
            if not math.isfinite(norm):  # never step on a NaN/inf gradient: count it instead
                result.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self._optimizer_step(norm, result)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _reduce(self, params: list[Tensor], loss: LossSum, result: UpdateResult) -> LossSum:
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

    def _optimizer_step(self, norm: float, result: UpdateResult) -> None:
        """The optimizer update at the schedule's learning rate, then `after_update`."""
        result.norms.append(norm)
        result.lr = self._schedule_lr()
        self.optimizer.step()
        self.optimizer_steps += 1
        result.state_bytes = self.state_bytes()
        self.after_update()

    def after_update(self) -> None:
        """After each optimizer update (the policy: its strategy's hook)."""

    def _schedule_lr(self) -> float:
        """Set the lr of the next optimizer update from the schedule (algorithms/schedules.py).
        The update index is AdamW's own step count, which every checkpoint (replicated or
        sharded) holds, so a resumed run continues the schedule where it stopped; a skipped
        (non-finite) update does not advance it."""
        o = self.optimizer_config
        lr = o.lr * lr_multiplier(self.optimizer_steps, self.total_updates, o)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def dummy_backward(self, output: Tensor) -> None:
        """A sharded worker's pass without rows: a zero gradient through every parameter."""
        (torch.where(torch.isfinite(output), output, 0.0).sum() * 0.0).backward()

    def bos_token(self) -> int:
        """A token for a dummy pass's one-token prompt and response."""
        config: Any = getattr(self.model, "config", None)
        return int(getattr(config, "bos_token_id", None) or 0)


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
