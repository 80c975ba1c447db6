"""Held-out accuracy: greedy decoding on the task's test split, float32 (no Ray)."""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from trajflow.engines.tokenizer import decode_response, encode_prompt
from trajflow.engines.torch_engine import greedy_engine
from trajflow.tasks import is_environment


def heldout_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    task,
    n: int,
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean reward of greedy responses on the first n held-out prompts (= accuracy for 0/1 tasks).

    For an environment task: the mean reward of greedy multi-turn episodes (max_new_tokens per turn).
    """
    if is_environment(task):
        from trajflow.operators.episodes import heldout_success_rate

        return heldout_success_rate(model, tokenizer, task, n, max_new_tokens, batch_size)
    engine = greedy_engine(model, tokenizer, max_new_tokens)
    prompts = task.heldout(n)
    rewards = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        gens = engine.generate([encode_prompt(tokenizer, p.text) for p in chunk])
        rewards += [
            task.reward(p.text, p.answer, decode_response(tokenizer, g.response_tokens)) for p, g in zip(chunk, gens)
        ]
    return float(np.mean(rewards))
