"""A worker's state on disk: what a checkpoint keeps of it (weights, optimizer, strategy) and how
each worker loads it back (engines/checkpoint.py holds the formats). `ReplicaState` is the part of
a `TrainerReplica` that does it; worker 0 drives every worker through it (TrainStep.save_checkpoint
and restore, and the rollback of a recovery)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from trajflow.engines import checkpoint as ckpt
from trajflow.engines import lora

if TYPE_CHECKING:
    import torch

    from trajflow.operators.strategies.base import Strategy
    from trajflow.operators.trainer.collective import Collective
    from trajflow.operators.trainer.spec import TrainStepConfig


class ReplicaState:
    """Checkpoint I/O of one worker (a mixin of TrainerReplica, whose state it reads and writes)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    spec: TrainStepConfig
    collective: Collective
    sharded: bool
    optimizer_steps: int
    version: int

    def _start(self) -> None: ...  # TrainerReplica's: a fresh optimizer, the strategy bound

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
        ckpt.save_sharded(Path(directory), "model", self._trained_state(), coordinator)
        # an optimizer that never stepped has no state (reading it would make some: a zero-lr step)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer) if self.optimizer.state else {}
        ckpt.save_sharded(Path(directory), "optimizer", optimizer, coordinator)
        ckpt.save_sharded(Path(directory), "strategy", self.strategy.state_dict(), coordinator)

    def load_shards(self, directory: str) -> None:
        """Load this worker's shards of a sharded checkpoint (every worker at once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        directory = Path(directory)
        self.model.load_state_dict(ckpt.load_sharded(directory, "model", self._trained_state),
                                   strict=not self.spec.lora.enabled)
        optimizer = ckpt.load_sharded(directory, "optimizer", lambda: get_optimizer_state_dict(self.model, self.optimizer))
        if optimizer:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer)
            self.optimizer_steps = _optimizer_steps(optimizer)
        self._load_strategy_state(ckpt.load_sharded(directory, "strategy", self.strategy.state_dict))

    def _trained_state(self) -> dict:
        """The model state a sharded checkpoint keeps: all of it, or a LoRA trainer's adapter
        only (its base is the model directory's, frozen)."""
        state = self.model.state_dict()
        return {k: v for k, v in state.items() if "lora_" in k} if self.spec.lora.enabled else state

    def load_checkpoint(self, directory: str, version: int) -> None:
        """Roll this worker back to checkpoint `directory` of `version` (recovery): weights,
        optimizer and strategy state. Replicated, the optimizer and strategy start afresh first,
        so nothing of the state since the checkpoint remains."""
        if self.sharded:
            self.load_shards(directory)
        else:
            checkpoint = ckpt.Checkpoint(Path(directory), version)
            weights = checkpoint.model_state()
            if lora.is_adapter(weights):  # a LoRA trainer's checkpoint: its adapter over the model directory's base
                lora.load_adapter(self.model, weights)
            else:
                self.model.load_state_dict(weights)
            self.strategy = copy.deepcopy(self.spec.strategy)
            self.optimizer_steps = 0
            self._start()
            self.load_checkpoint_state(checkpoint.optimizer_state(), checkpoint.strategy_state())
        self.version = version


def _optimizer_steps(optimizer_state: dict) -> int:
    """The optimizer steps taken, from an optimizer state dict (AdamW's per-parameter `step`)."""
    steps = [float(s["step"]) for s in optimizer_state["state"].values() if "step" in s]
    return int(max(steps)) if steps else 0
