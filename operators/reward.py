"""Reward: the workload's reward function on every trajectory (light stage, Arrow in and out).

Completions are decoded in one vectorised call (engines.tokenizer.decode_responses); the reward
function gets TRL's arguments: `prompts` (the `prompt` column as in the dataset), `completions`,
and every passthrough column (`answer`, ...) as a keyword list. A row whose reward failed (raised,
timed out, None/NaN — see tasks.rewards.RewardRunner) keeps a null reward and the filter reason
`reward_error`: it stays in the trajectory log, is counted in the step's metrics, and is never
trained on. Multi-turn episodes arrive already scored by their environment.

The reward function is resolved on the driver and shipped with this object, so a user's module
that is not installed reaches the Ray worker by value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from trajflow.engines.tokenizer import decode_responses, stop_token_ids
from trajflow.operators.columns import mark_filtered, replace_column
from trajflow.tasks.workload import Workload

REWARD_ERROR = "reward_error"


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
        scores = self.runner(prompts, completions, columns)
        batch = replace_column(batch, "reward", pa.array(scores, pa.float32()))
        errors = np.fromiter((s is None for s in scores), bool, len(scores))
        return mark_filtered(batch, errors, REWARD_ERROR) if errors.any() else batch
