"""Rollouts outside the pipeline: the multi-turn episode loop, and held-out evaluation.

`run_episodes` plays `n` episodes per prompt in lockstep turns. Each turn, the live episodes'
contexts (prompt + everything so far) go to `engine.generate` as prompts; a turn ends at eos or at
the per-turn limit (the engine's `sampling.max_new_tokens`, lowered to what is left of the token
budget). The environment then answers each turn; its observation text is tokenized with the
model's tokenizer and appended as environment tokens. The response of an episode is everything after the
prompt, policy and environment tokens concatenated, with per-token

    loss_mask   True on policy tokens, False on environment tokens (never trained)
    logprobs    the engine's log-prob on policy tokens, 0.0 on environment tokens
    versions    the engine version that sampled the token / that was resident when it was appended

`finish_reason`: "stop" when the environment said done, "length" at the turn limit or the token
budget, "abort" if the engine aborted. The reward is the sum of the environment's step rewards.

Two hooks let the caller move weights (operators/generate.py): `before_turn(engine, batch)` runs
before every turn, `between_steps(engine, batch)` after every decode step; both see the episodes
with the in-flight turn included (`EpisodeBatch.current`).

`heldout_rewards` / `heldout_mean_reward`: greedy decoding on the workload's held-out prompts,
float32, no Ray (the trainer's evaluation hook and `trajflow eval`). The held-out prompts are a
task's test split, or a dataset's `data.test_files`; responses are scored by the workload's reward
(in the mean, an item whose reward fails counts as 0); an environment's held-out score is its
greedy episodes' mean reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.tokenizer import decode_response, decode_responses, encode_prompt, stop_token_ids
from trajflow.engines.torch_engine import Generation, TorchEngine, greedy_engine
from trajflow.tasks.base import Prompt, Task
from trajflow.tasks.environments import EnvEpisode, Environment, is_environment
from trajflow.tasks.workload import Workload, rows_of_prompts, task_reward_runner


@dataclass
class Episode:
    prompt_index: int
    prompt_tokens: list[int]
    env: EnvEpisode
    response_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str = ""  # "" while running

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""


@dataclass
class EpisodeView:
    """An episode's response so far, including the tokens of a turn still being generated."""

    prompt_tokens: list[int]
    response_tokens: list[int]
    versions: list[int]
    loss_mask: list[bool]


class EpisodeBatch:
    """The episodes of one `run_episodes` call and the turn in flight."""

    def __init__(self, episodes: list[Episode]) -> None:
        self.episodes = episodes
        self._inflight: dict[int, Generation] = {}  # episode index -> its generation this turn

    def current(self) -> list[EpisodeView]:
        views = []
        for i, e in enumerate(self.episodes):
            g = self._inflight.get(i)
            extra = g.response_tokens if g is not None else []
            views.append(EpisodeView(
                e.prompt_tokens,
                e.response_tokens + list(extra),
                e.versions + (list(g.versions) if g is not None else []),
                e.loss_mask + [True] * len(extra),
            ))
        return views


Hook = Callable[[TorchEngine, EpisodeBatch], None]


def run_episodes(
    engine: TorchEngine,
    env: Environment,
    tokenizer,
    prompts: Sequence[Prompt],
    n: int = 1,
    *,
    prompt_tokens: Sequence[list[int]] | None = None,
    before_turn: Hook | None = None,
    between_steps: Hook | None = None,
) -> list[Episode]:
    """Play n episodes per prompt (prompt-major order, like `engine.generate`). `prompt_tokens`:
    the prompts' ids as the prompt source encoded them (default: `encode_prompt` of the text)."""
    if prompt_tokens is None:
        prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    batch = EpisodeBatch([
        Episode(i, list(ids), env.reset(p)) for i, (p, ids) in enumerate(zip(prompts, prompt_tokens)) for _ in range(n)
    ])
    episodes = batch.episodes
    budget = env.max_response_tokens
    base_sampling = engine.sampling
    turn_limit = base_sampling.max_new_tokens
    try:
        for _ in range(env.max_turns):
            live = [i for i, e in enumerate(episodes) if not e.finished]
            if not live:
                break
            if before_turn is not None:
                before_turn(engine, batch)
            remaining = {i: budget - len(episodes[i].response_tokens) for i in live}
            cap = min(turn_limit, max(remaining.values()))
            engine.sampling = dataclasses.replace(base_sampling, max_new_tokens=cap)

            def step_hook(eng: TorchEngine, gens: list[Generation]) -> None:
                batch._inflight = dict(zip(live, gens))
                if between_steps is not None:
                    between_steps(eng, batch)

            contexts = [episodes[i].prompt_tokens + episodes[i].response_tokens for i in live]
            gens = engine.generate(contexts, n=1, between_steps=step_hook)
            batch._inflight = {}
            for i, g in zip(live, gens):
                e = episodes[i]
                room = remaining[i]
                tokens, logprobs, versions = g.response_tokens[:room], g.logprobs[:room], g.versions[:room]
                e.response_tokens += tokens
                e.logprobs += logprobs
                e.versions += versions
                e.loss_mask += [True] * len(tokens)
                e.turns += 1
                if g.finish_reason == "abort":
                    e.finish_reason = "abort"
                    continue
                stop_ids = [engine.eos_id, *engine.stop_token_ids]
                result = e.env.step(decode_response(tokenizer, tokens, stop_ids, base_sampling.stop))
                e.reward += float(result.reward)
                obs = tokenizer.encode(result.observation, add_special_tokens=False) if result.observation else []
                left = budget - len(e.response_tokens)
                if result.done:
                    _append_env(e, obs[:left], engine.version)
                    e.finish_reason = "stop"
                elif left - len(obs) < 1 or e.turns >= env.max_turns:
                    e.finish_reason = "length"  # no room for another policy token, or no turn left
                else:
                    _append_env(e, obs, engine.version)
    finally:
        engine.sampling = base_sampling
        batch._inflight = {}
    for e in episodes:
        if not e.finished:
            e.finish_reason = "length"
    return episodes


def _append_env(e: Episode, tokens: list[int], version: int) -> None:
    e.response_tokens += tokens
    e.logprobs += [0.0] * len(tokens)
    e.versions += [version] * len(tokens)
    e.loss_mask += [False] * len(tokens)


def heldout_success_rate(
    model,
    tokenizer,
    env: Environment,
    n: int,
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean episode reward of greedy episodes on the first n held-out prompts (float32, no Ray).

    For the built-in 0/1 environments this is the success rate. `max_new_tokens` is the per-turn
    limit, as in training.
    """
    rewards = _episode_rewards(model, tokenizer, env, n, max_new_tokens, batch_size)
    return float(np.mean(rewards)) if rewards else 0.0


def _episode_rewards(model, tokenizer, env: Environment, n: int, max_new_tokens: int, batch_size: int) -> list[float]:
    engine = greedy_engine(model, tokenizer, max_new_tokens)
    prompts = env.heldout(n)
    rewards: list[float] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            rewards += [e.reward for e in run_episodes(engine, env, tokenizer, prompts[start:start + batch_size])]
    return rewards


def heldout_mean_reward(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task | Workload,
    n: int,
    max_new_tokens: int,
    batch_size: int = 256,
    stop: Sequence[str] = (),
) -> float:
    """Mean reward of greedy responses on the first n held-out prompts (= accuracy for 0/1
    rewards; an item whose reward fails counts as 0). See `heldout_rewards`."""
    rewards = heldout_rewards(model, tokenizer, task, n, max_new_tokens, batch_size, stop)
    return float(np.mean([0.0 if r is None else r for r in rewards])) if rewards else 0.0


@dataclass(frozen=True)
class SampledEvaluation:
    """A held-out evaluation by sampling: `samples` responses per prompt at `temperature`, from a
    generator seeded with `seed` (heldout_rewards)."""

    samples: int = 4
    temperature: float = 1.0
    seed: int = 0


def heldout_rewards(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task | Workload,
    n: int | None,
    max_new_tokens: int,
    batch_size: int = 256,
    stop: Sequence[str] = (),
    sampled: SampledEvaluation | None = None,
) -> list[float | None]:
    """The reward of the greedy response to each of the first n held-out prompts (None where the
    reward failed; n None: every row of a dataset's data.test_files). `sampled`: instead, the
    rewards of `sampled.samples` responses per prompt (prompt-major) sampled at
    `sampled.temperature` from a seeded generator: the same numbers on every call.

    For an environment: the reward of each greedy multi-turn episode (max_new_tokens per turn).
    """
    workload = task if isinstance(task, Workload) else None
    env = workload.environment() if workload is not None else (task if is_environment(task) else None)
    if env is not None and (workload is None or workload.data is None):
        return _episode_rewards(model, tokenizer, env, n, max_new_tokens, batch_size)
    if workload is None:  # a Task object
        rows, runner, columns = rows_of_prompts(0, task.heldout(n), tokenizer), task_reward_runner(task), ["answer"]
    else:
        rows, runner, columns = workload.heldout_rows(tokenizer, n), workload.reward_runner(), workload.columns()
    stop_ids = stop_token_ids(tokenizer, getattr(model, "name_or_path", None) or None)
    n = 1 if sampled is None else sampled.samples
    if sampled is None:
        engine = greedy_engine(model, tokenizer, max_new_tokens, stop_token_ids=stop_ids)
    else:
        engine = TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                             sampling=SamplingConfig(temperature=sampled.temperature, max_new_tokens=max_new_tokens),
                             seed=sampled.seed, stop_token_ids=stop_ids)
    prompts = rows["prompt"].to_pylist()
    tokens = rows["prompt_tokens"].to_pylist()
    rewards: list[float | None] = []
    step = max(1, batch_size // n)
    for start in range(0, rows.num_rows, step):
        gens = engine.generate(tokens[start:start + step], n)
        completions = decode_responses(tokenizer, [g.response_tokens for g in gens], stop_ids, stop)
        count = len(gens) // n
        chunk = {c: [v for v in rows[c].slice(start, count).to_pylist() for _ in range(n)] for c in columns}
        rewards += runner([p for p in prompts[start:start + count] for _ in range(n)], completions, chunk).scores
    return rewards
