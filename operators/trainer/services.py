"""What runs in the trainer's process after each train step, besides the step itself.

Each is a callable `hook(trainstep, batch, metrics)` that the train step runs, in order, after
its update (`TrainStep(after_step=[...])`): no extra actor and no extra Ray Data hop per step.

    PublishWeights      the new weights become version k + 1 in the policy store (generators wait on it)
    HeldoutEvaluation   greedy mean reward (an accuracy for 0/1 rewards) on the held-out prompts every
                        `every` versions (and of version 0, in a fresh run's first step)
    StoreStatistics     snapshot memory and the actors' timing counters, read from the store

The job's own hook (the run recorder: trajectory log, metrics file, checkpoints) runs after these.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa

from trajflow.tasks.workload import Workload

if TYPE_CHECKING:  # the services are built in the driver, which does not import torch (tasks/rollout.py does)
    from trajflow.tasks.rollout import SampledEvaluation


class AfterStep(Protocol):
    def __call__(self, trainstep, batch: pa.Table, metrics: dict) -> None: ...


class PublishWeights:
    """Publish the trainer's weights as its (new) version. A step with nothing to train publishes
    too (unchanged weights, new version): the rollouts of later steps wait on this version."""

    def __call__(self, trainstep, batch: pa.Table, metrics: dict) -> None:
        trainstep.publish()


class HeldoutEvaluation:
    """The greedy responses' mean reward on the workload's first `prompts` held-out prompts (a
    task's test split or `data.test_files`), every `every` versions, and once of the starting
    weights of a fresh run (in step 0's row: version 0 is the model at `model_path`, loaded for
    this alone; the trainer's copy is already updated when the hooks run). Named for what it is:
    `heldout/accuracy` (`heldout/accuracy_start`) when every reward is 0 or 1, else
    `heldout/mean_reward` (`heldout/mean_reward_start`); a failed reward counts 0. `sampled`:
    the mean reward of seeded samples instead of the greedy response's (tasks/rollout.py
    `SampledEvaluation`), under `heldout/sampled_accuracy` / `heldout/sampled_mean_reward`. The
    tokenizer loads on first use, in the trainer."""

    def __init__(self, model_path: str | Path, workload: Workload, every: int, prompts: int, max_new_tokens: int,
                 stop: Sequence[str] = (), sampled: SampledEvaluation | None = None) -> None:
        self.model_path, self.workload = str(model_path), workload
        self.every, self.prompts, self.max_new_tokens, self.stop = every, prompts, max_new_tokens, tuple(stop)
        self.sampled = sampled
        self._tokenizer = None

    def __call__(self, trainstep, batch: pa.Table, metrics: dict) -> None:
        if not self.every:
            return
        from trajflow.engines.models import load_model, load_tokenizer

        if self._tokenizer is None:  # this trainer's first step
            self._tokenizer = load_tokenizer(self.model_path)
            if trainstep.version == 1:  # it started from version 0 (a resumed run starts later)
                device = next(trainstep.policy.model.parameters()).device
                key, value = self._score(load_model(self.model_path).to(device))
                metrics[f"{key}_start"] = value
        if trainstep.version % self.every == 0:
            key, value = self._score(trainstep.unsharded_policy())
            metrics[key] = value

    def _score(self, model) -> tuple[str, float]:
        """(the metric's key, the mean reward of the greedy responses)."""
        from trajflow.tasks.rollout import heldout_rewards

        rewards = [0.0 if r is None else r for r in heldout_rewards(
            model, self._tokenizer, self.workload, self.prompts, self.max_new_tokens, stop=self.stop,
            sampled=self.sampled)]
        binary = all(r in (0.0, 1.0) for r in rewards)
        kind = ("sampled_" if self.sampled is not None else "") + ("accuracy" if binary else "mean_reward")
        return f"heldout/{kind}", float(np.mean(rewards)) if rewards else 0.0


class StoreStatistics:
    """The seconds the actors reported since the last step, and — for a strategy whose store keeps
    a version's weights after generation (snapshot, dedicated) — the versions and bytes held.
    A counter lands in the row of the step during which its work ended: a version's collective
    delivery overlaps the next step, so `weight_sync_bytes` may hold 0, 1 or 2 versions in a row
    (their running sum counts every version delivered by then)."""

    def __call__(self, trainstep, batch: pa.Table, metrics: dict) -> None:
        stats = trainstep.store.stats(reset_counters=True)
        if stats.keeps_history:
            metrics.update({
                "snapshot/versions_held": len(stats.versions_held),
                "snapshot/bytes": stats.snapshot_bytes,
                "snapshot/max_versions_held": stats.max_versions_held,
            })
        # a timing counter `<what>_seconds` is the metric `seconds/<what>` (one shape for durations)
        metrics.update({f"seconds/{k.removesuffix('_seconds')}" if k.endswith("_seconds") else k: v
                        for k, v in stats.counters.items()})
