"""The policy learner: the model whose log-probs the loss corrects, and its correction strategy.

Its micro-batch, top to bottom: forward pi_theta under the training numerics, correct it (the
strategy's pi_old and masks, the decoupled loss: operators/trainer/correction.py), backward the
loss in sum form. Its extra state is its strategy's (EWMA's weights, M2PO's statistics). It is
also the `Trainer` a strategy sees (operators/strategies/base.py): the policy, its numerics,
scoring under them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trajflow.algorithms.objective import LossOutput, LossSum
from trajflow.engines import lora
from trajflow.engines.models import load_model
from trajflow.operators.trainer.correction import (Correction, PolicyHolder, StepBatch, correct, finite_loss_mask,
                                                   top_k_in_loss)
from trajflow.operators.trainer.fsdp import full_tensors, shard_model
from trajflow.operators.trainer.learner import Learner, UpdateResult
from trajflow.operators.trainer.spec import TrainStepConfig
from trajflow.operators.contracts.store import POLICY


@dataclass
class PolicyResult(UpdateResult):
    """The policy's update of one worker's rows, with its per-token results."""

    parts: list[tuple[Tensor, LossOutput]] = field(default_factory=list)  # (step rows, per-token fields)
    olds: list[tuple[Tensor, Tensor]] = field(default_factory=list)       # (step rows, pi_old as used)
    outside_support: int = 0


class PolicyLearner(Learner[StepBatch, PolicyResult], PolicyHolder):
    """The policy of one worker (module docstring)."""

    def __init__(self, spec: TrainStepConfig, weights: Mapping[str, Tensor]) -> None:
        self.spec = spec
        self.strategy = copy.deepcopy(spec.strategy)  # this worker's own, bound when the optimizer is built
        self.correction = spec.correction
        self.sampling = spec.sampling
        self.minibatches_per_step = spec.optimizer.minibatches_per_step
        super().__init__(POLICY, spec.model_path, spec.optimizer, spec.numerics, spec.trainer, spec.total_updates,
                         weights, adapter_only=spec.lora.enabled)

    def build_model(self, weights: Mapping[str, Tensor]) -> torch.nn.Module:
        """The model directory's weights, then `weights` (full weights, a LoRA adapter over the
        directory's base, or none)."""
        model = load_model(self.spec.model_path)
        if lora.is_adapter(weights):  # a resumed LoRA run: the model directory's base + the version's adapter
            model = lora.wrap(model, self.spec.lora)
            lora.load_adapter(model, weights)
            return model
        if weights:
            model.load_state_dict(weights)
        return lora.wrap(model, self.spec.lora) if self.spec.lora.enabled else model

    def _started(self) -> None:
        self.strategy.bind(self)

    def _reset(self) -> None:
        self.strategy = copy.deepcopy(self.spec.strategy)

    def extra_state(self) -> dict:
        return self.strategy.state_dict()

    def load_extra_state(self, state: dict | None) -> None:
        if state:
            self.strategy.load_state_dict(state)
        elif self.strategy.state_dict():
            raise RuntimeError(f"resume: the checkpoint holds no state of strategy {self.strategy.name}")

    def load_weights(self, weights: dict) -> None:
        if lora.is_adapter(weights):  # a LoRA trainer's checkpoint: its adapter over the model directory's base
            lora.load_adapter(self.model, weights)
        else:
            self.model.load_state_dict(weights)

    # -- the weights ------------------------------------------------------------------------------
    def full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Learner.full_weights; LoRA: the base with the adapter merged in, under the plain model's
        names (sharded: each base tensor gathered, its layer's adapter merged, then cast)."""
        if not self.spec.lora.enabled:
            return super().full_weights(dtype)
        payload = PolicyLearner.version_payload(self)
        if not self.sharded:
            return full_tensors(lora.merged(dict(lora.base_weights(self.model)), payload), dtype)
        return _merged_in_step(lora.base_weights(self.model), lora.deltas(payload), dtype)

    def version_payload(self) -> dict[str, Tensor]:
        """What a LoRA policy publishes and checkpoints per version: the adapter (engines/lora.py),
        whole (sharded: each tensor all-gathered, a collective every worker runs in step); else
        the full weights."""
        if not self.spec.lora.enabled:
            return super().version_payload()
        payload = lora.adapter_payload(self.model, self.spec.lora.scaling)
        return dict(full_tensors(payload)) if self.sharded else payload

    def policy_state_dict(self) -> dict[str, Tensor]:
        return self.state_dict_held()

    def policy_copy(self) -> torch.nn.Module:
        """A frozen copy of the policy with the current weights; sharded like it (its forward
        passes are collectives too, run by every worker in step) when the trainer is sharded."""
        if not self.sharded:
            return super().policy_copy()
        model = load_model(self.spec.model_path)
        if self.spec.lora.enabled:  # the same module tree as the policy's, so its state dict loads
            model = lora.wrap(model, self.spec.lora)
        model = model.eval().requires_grad_(False)
        shard_model(model, self.collective.mesh, self.trainer.cpu_offload, frozen=True)
        model.load_state_dict(self.model.state_dict())
        return model

    # -- the update -------------------------------------------------------------------------------
    def before_step(self, batch: StepBatch | None, dummy: StepBatch) -> None:
        """The strategy's before-step hook on this worker's rows of the step (sharded without
        rows: on a dummy batch, since the hook's forward passes, recompute's scoring, are
        collectives)."""
        if batch is not None:
            self.strategy.before_step(batch, self)
        elif self.sharded:
            self.strategy.before_step(dummy, self)

    def before_update(self, minibatch: list[StepBatch]) -> None:
        """Hand the strategy the update's log-ratios (this worker's loss tokens, no gradient) and
        a gather over the workers, before any backward pass of the update (M2PO's cutoff)."""
        if not self.strategy.needs_update_pass:
            return
        ratios = [torch.zeros(0)]
        for batch in minibatch:
            current = self.current(batch, grad=False)
            old = self.strategy.old_logprobs(batch, current, self).detach()
            ratios.append((current - old)[finite_loss_mask(batch, current, old)])
        self.strategy.begin_update(torch.cat(ratios), self.collective.all_gather)

    def microbatch(self, batch: StepBatch, result: PolicyResult) -> LossSum:
        current, entropy, top_k = self._forward(batch)  # pi_theta under the training numerics
        fixed = correct(self.strategy, batch, current, self, self.correction, kl=self.spec.kl, entropy=entropy,
                        distill=self.spec.distill, current_top_k=top_k)  # the strategy's pi_old, masks and loss
        return self._backward(batch, current, fixed, result)

    def _forward(self, batch: StepBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """pi_theta [B, T] with gradient, its per-token entropy when the loss has an entropy term,
        and pi_theta on the batch's top-k ids [B, T, K] when a term of the loss needs them."""
        entropy: list[Tensor] | None = [] if self.correction.entropy_coef > 0 else None
        top_k: list[Tensor] | None = [] if top_k_in_loss(self.strategy, self.spec.distill, batch) else None
        current = self.current(batch, grad=True, entropy=entropy, top_k=top_k)
        return current, entropy[0] if entropy else None, top_k[0] if top_k else None

    def _backward(self, batch: StepBatch, current: Tensor, fixed: Correction, result: PolicyResult) -> LossSum:
        if batch.dummy:
            self.dummy_backward(current)
            result.dummy_passes += 1
            return LossSum()
        fixed.loss.loss_sum.backward()
        detached = fixed.loss.detached()
        result.parts.append((batch.rows, detached))
        result.olds.append((batch.rows, fixed.old))
        result.outside_support += fixed.outside_support
        result.microbatches += 1
        return LossSum(float(detached.loss_sum), float(detached.count))

    def after_update(self) -> None:
        self.strategy.after_update(self)

    def finish_step(self, diagnostics: dict) -> dict:
        """The strategy's after-step hook with the step's (global) diagnostics."""
        return self.strategy.after_step(self, diagnostics)

    def dummy(self, width: int, version: int) -> StepBatch:
        """A one-row batch without loss tokens: the input of a sharded worker's dummy pass."""
        token = [self.bos_token()]
        return StepBatch(prompts=[token], responses=[token], inference=torch.zeros((1, width)),
                         versions=torch.full((1, width), version, dtype=torch.int64),
                         loss_mask=torch.zeros((1, width), dtype=torch.bool), advantages=torch.zeros(1),
                         old=torch.zeros((1, width)), rows=torch.zeros(1, dtype=torch.int64),
                         groups=torch.zeros(1, dtype=torch.int64), reference=None, dummy=True)


def _merged_in_step(base: Iterator[tuple[str, Tensor]], deltas: dict[str, lora.Delta],
                    dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """A sharded LoRA policy's full weights, one tensor at a time: each base tensor gathered (in
    float32: the adapter is merged before any cast), its layer's adapter merged in, then cast."""
    for name, weight in full_tensors(dict(base)):
        if name in deltas:
            weight = deltas[name].apply(weight)
        yield name, weight.to(dtype) if dtype is not None and weight.is_floating_point() else weight
