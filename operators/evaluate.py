"""Held-out accuracy: greedy decoding on the workload's held-out prompts, float32 (no Ray).

The held-out prompts are a task's test split, or a dataset's `data.test_files`; responses are
scored by the workload's reward (an item whose reward fails counts as 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trajflow.engines.tokenizer import decode_responses, stop_token_ids
from trajflow.engines.torch_engine import greedy_engine
from trajflow.tasks import Task, is_environment
from trajflow.tasks.workload import Workload, rows_of_prompts, task_reward_runner


def heldout_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task | Workload,
    n: int,
    max_new_tokens: int,
    batch_size: int = 256,
    stop: Sequence[str] = (),
) -> float:
    """Mean reward of greedy responses on the first n held-out prompts (= accuracy for 0/1 rewards).

    For an environment: the mean reward of greedy multi-turn episodes (max_new_tokens per turn).
    """
    workload = task if isinstance(task, Workload) else None
    env = workload.environment() if workload is not None else (task if is_environment(task) else None)
    if env is not None and (workload is None or workload.data is None):
        from trajflow.tasks.rollout import heldout_success_rate

        return heldout_success_rate(model, tokenizer, env, n, max_new_tokens, batch_size)
    if workload is None:  # a Task object
        rows, runner, columns = rows_of_prompts(0, task.heldout(n), tokenizer), task_reward_runner(task), ["answer"]
    else:
        rows, runner, columns = workload.heldout_rows(tokenizer, n), workload.reward_runner(), workload.columns()
    stop_ids = stop_token_ids(tokenizer, getattr(model, "name_or_path", None) or None)
    engine = greedy_engine(model, tokenizer, max_new_tokens, stop_token_ids=stop_ids)
    prompts = rows["prompt"].to_pylist()
    tokens = rows["prompt_tokens"].to_pylist()
    rewards: list[float] = []
    for start in range(0, rows.num_rows, batch_size):
        gens = engine.generate(tokens[start:start + batch_size])
        completions = decode_responses(tokenizer, [g.response_tokens for g in gens], stop_ids, stop)
        chunk = {c: rows[c].slice(start, len(gens)).to_pylist() for c in columns}
        scores = runner(prompts[start:start + len(gens)], completions, chunk)
        rewards += [0.0 if s is None else s for s in scores]
    return float(np.mean(rewards)) if rewards else 0.0
