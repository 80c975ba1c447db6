"""A learner's state on disk: what a checkpoint keeps of it (weights, optimizer, the learner's own
extra state: the policy's strategy) and how each worker loads it back (engines/checkpoint.py
holds the formats). `LearnerState` is the part of a `Learner` that does it; worker 0 drives every
worker and learner through it (TrainStep.save_checkpoint and restore, the rollback of a recovery).

Where a learner's files go in a checkpoint: the policy's at the checkpoint's root (so a
checkpoint is what it was before learners, and its export a plain model directory); every other
learner's in a subdirectory of its name (`checkpoints/step-000012/critic/`), in the same formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trajflow.engines import checkpoint as ckpt
from trajflow.operators.contracts.store import POLICY

if TYPE_CHECKING:
    import torch

    from trajflow.operators.trainer.collective import Collective

def learner_dir(checkpoint: str | Path, name: str) -> Path:
    """Where learner `name`'s files are in the checkpoint directory `checkpoint`."""
    return Path(checkpoint) if name == POLICY else Path(checkpoint) / name


def learner_weights(checkpoint: str | Path, names: list[str]) -> dict[str, dict]:
    """The weights (a LoRA policy: its adapter) of each learner in `names` that the checkpoint
    directory holds, by name: what a resumed run publishes as its first versions."""
    found = {}
    for name in names:
        directory = learner_dir(checkpoint, name)
        if directory.is_dir():
            found[name] = ckpt.Checkpoint(directory, -1).model_state()
    return found


class LearnerState:
    """Checkpoint I/O of one learner (a mixin of Learner, whose state it reads and writes)."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    collective: Collective
    sharded: bool
    adapter_only: bool  # LoRA: the trained state is the adapter (the base is the model directory's)
    optimizer_steps: int
    version: int

    def _start(self) -> None: ...  # Learner's: a fresh optimizer (and the learner's own start)

    def _reset(self) -> None: ...  # Learner's: its own state afresh (the policy's strategy)

    def extra_state(self) -> dict:
        """What the learner keeps besides weights and optimizer (the policy: its strategy's state)."""
        return {}

    def load_extra_state(self, state: dict | None) -> None:
        """Restore `extra_state()` (None: the checkpoint holds none)."""

    def checkpoint_state(self) -> dict:
        """What a replicated checkpoint keeps besides the weights: optimizer and extra state."""
        return {"optimizer": self.optimizer.state_dict(), "extra": self.extra_state()}

    def load_checkpoint_state(self, optimizer: dict | None, extra: dict | None) -> None:
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            self.optimizer_steps = _optimizer_steps(self.optimizer.state_dict())
        self.load_extra_state(extra)

    def write_checkpoint(self, directory: Path, weights) -> None:
        """A replicated learner's files into `directory` (its own, learner_dir): `weights` (the
        full weights, or a LoRA learner's adapter), optimizer and extra state."""
        state = self.checkpoint_state()
        ckpt.write_replica(directory, weights, state["optimizer"], state["extra"],
                           weights_file=ckpt.ADAPTER_FILE if self.adapter_only else "model.safetensors")

    def save_shards(self, directory: str) -> None:
        """Write this worker's shards of the weights, optimizer and extra state into a sharded
        checkpoint's directory for this learner (engines/checkpoint.py; every worker at once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        coordinator = self.collective.rank == 0
        ckpt.save_sharded(Path(directory), "model", self._trained_state(), coordinator)
        # an optimizer that never stepped has no state (reading it would make some: a zero-lr step)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer) if self.optimizer.state else {}
        ckpt.save_sharded(Path(directory), "optimizer", optimizer, coordinator)
        ckpt.save_sharded(Path(directory), "strategy", self.extra_state(), coordinator)

    def load_shards(self, directory: str) -> None:
        """Load this worker's shards of this learner's sharded checkpoint (every worker at once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        directory = Path(directory)
        self.model.load_state_dict(ckpt.load_sharded(directory, "model", self._trained_state),
                                   strict=not self.adapter_only)
        optimizer = ckpt.load_sharded(directory, "optimizer", lambda: get_optimizer_state_dict(self.model, self.optimizer))
        if optimizer:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer)
            self.optimizer_steps = _optimizer_steps(optimizer)
        self.load_extra_state(ckpt.load_sharded(directory, "strategy", self.extra_state))

    def _trained_state(self) -> dict:
        """The model state a sharded checkpoint keeps: all of it, or a LoRA learner's adapter
        only (its base is the model directory's, frozen)."""
        state = self.model.state_dict()
        return {k: v for k, v in state.items() if self.trained_key(k)} if self.adapter_only else state

    def trained_key(self, key: str) -> bool:
        """A LoRA learner's trained state dict entry (the adapter's)."""
        return "lora_" in key

    def load_checkpoint(self, directory: str, version: int) -> None:
        """Roll this learner back to its checkpoint `directory` of `version` (recovery): weights,
        optimizer and extra state. Replicated, the optimizer and extra state start afresh first,
        so nothing of the state since the checkpoint remains."""
        if self.sharded:
            self.load_shards(directory)
        else:
            checkpoint = ckpt.Checkpoint(Path(directory), version)
            self.load_weights(checkpoint.model_state())
            self._reset()
            self.optimizer_steps = 0
            self._start()
            self.load_checkpoint_state(checkpoint.optimizer_state(), checkpoint.strategy_state())
        self.version = version

    def load_weights(self, weights: dict) -> None:
        """Load a checkpoint's weights (full, or a LoRA learner's adapter) into the model."""
        self.model.load_state_dict(weights)


def _optimizer_steps(optimizer_state: dict) -> int:
    """The optimizer steps taken, from an optimizer state dict (AdamW's per-parameter `step`)."""
    steps = [float(s["step"]) for s in optimizer_state["state"].values() if "step" in s]
    return int(max(steps)) if steps else 0
