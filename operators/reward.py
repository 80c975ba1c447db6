"""Reward: the task's verifier on each response (Ray Data task, Arrow in and out).

Responses are decoded in one batched call; the verifier itself is a string comparison per row,
which is the task's business (an external task may call a sandbox here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from trajflow.engines.models import load_tokenizer
from trajflow.engines.tokenizer import decode_response
from trajflow.operators.columns import replace_column
from trajflow.tasks import get_task, is_environment


class Reward:
    def __init__(self, model_path: str | Path, task: str) -> None:
        self.model_path = model_path
        self.task_name = task
        self._tokenizer = None
        self._task = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._tokenizer is None:  # built lazily: the instance is shipped to Ray workers
            self._tokenizer = load_tokenizer(self.model_path)
            self._task = get_task(self.task_name)
        if is_environment(self._task):
            return batch  # multi-turn episodes: the environment set the reward during generation
        tok = self._tokenizer
        prompts = [tok.decode(ids[1:], skip_special_tokens=True) for ids in batch["prompt_tokens"].to_pylist()]
        responses = [decode_response(tok, ids) for ids in batch["response_tokens"].to_pylist()]
        answers = batch["answer"].to_pylist()
        rewards = np.array(
            [self._task.reward(p, a, r) for p, a, r in zip(prompts, answers, responses)], dtype=np.float32
        )
        return replace_column(batch, "reward", pa.array(rewards, pa.float32()))
