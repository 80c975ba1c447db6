"""Reward: the workload's reward function on every trajectory (light stage, Arrow in and out).

Completions are decoded in one vectorised call (engines.tokenizer.decode_responses); the reward
function gets TRL's arguments: `prompts` (the `prompt` column as in the dataset), `completions`,
and every passthrough column (`answer`, ...) as a keyword list. A row whose reward failed (raised,
timed out, None/NaN, a result of the wrong length — see tasks.rewards.RewardRunner) keeps a null
reward, the filter reason `reward_error` and, in the column `reward_error`, why ("ValueError:
...", at most 200 characters; null on the rows that scored): it stays in the trajectory log, is
counted in the step's metrics (`reward/errors`, `reward/first_error`), and is never trained on.
Multi-turn episodes arrive already scored by their environment.

`FailedRewardSteps` stops a run whose reward fails on every row of `reward_max_failed_steps`
consecutive steps (the pipeline checks each step's metrics row): one line naming the reward and
the first error, instead of a run that trains on nothing.

The reward function is resolved on the driver and shipped with this object, so a user's module
that is not installed reaches the Ray worker by value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from trajflow.engines.tokenizer import decode_responses, stop_token_ids
from trajflow.schemas.columns import REWARD_ERROR, mark_filtered, replace_column
from trajflow.tasks.workload import Workload


class Reward:
    def __init__(self, model_path: str | Path, workload: Workload, stop: Sequence[str]) -> None:
        self.model_path = str(model_path)
        self.runner = workload.reward_runner()  # None: the environment scored the episodes
        self.columns = workload.columns()
        self.stop = tuple(stop)
        self._tokenizer = None
        self._stop_ids: list[int] = []

    def completions(self, batch: pa.Table) -> list[str]:
        """The decoded responses of `batch` (what the reward function sees)."""
        if self._tokenizer is None:  # built lazily: the instance is shipped to a Ray worker
            from trajflow.engines.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
            self._stop_ids = stop_token_ids(self._tokenizer, self.model_path)
        return decode_responses(self._tokenizer, batch["response_tokens"], self._stop_ids, self.stop)

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.runner is None:
            return batch
        completions = self.completions(batch)
        prompts = batch["prompt"].to_pylist()
        columns = {c: batch[c].to_pylist() for c in self.columns}
        scores, errors = self.runner(prompts, completions, columns)
        batch = replace_column(batch, "reward", pa.array(scores, pa.float32()))
        batch = replace_column(batch, REWARD_ERROR, pa.array(errors, pa.string()))
        failed = np.fromiter((e is not None for e in errors), bool, len(errors))
        return mark_filtered(batch, failed, REWARD_ERROR) if failed.any() else batch


class RewardFailed(RuntimeError):
    """The reward failed on every row of too many consecutive steps; the message is one line."""


class FailedRewardSteps:
    """Consecutive train steps whose reward failed on every row, counted from each step's metrics
    row (in step order): `check(metrics)` raises RewardFailed at the `limit`-th (0: never)."""

    def __init__(self, reward_name: str, limit: int) -> None:
        self.reward_name, self.limit = reward_name, limit
        self.steps: list[int] = []
        self.first_error: str | None = None

    def observe(self, metrics: dict) -> None:
        rows = int(metrics.get("rows") or 0)
        if not rows or metrics.get("reward/errors") != rows:
            self.steps, self.first_error = [], None
            return
        if not self.steps:
            self.first_error = metrics.get("reward/first_error")
        self.steps.append(int(metrics["step"]))

    def stop_line(self) -> str | None:
        """The one line to stop with, once `limit` failed steps are counted."""
        if not self.limit or len(self.steps) < self.limit:
            return None
        return (f"{self.reward_name} failed on every row of steps {self.steps[0]}-{self.steps[-1]} "
                f"(reward_max_failed_steps: {self.limit}); first error: {self.first_error}")

    def check(self, metrics: dict) -> None:
        self.observe(metrics)
        line = self.stop_line()
        if line is not None:
            raise RewardFailed(line)
