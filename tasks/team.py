"""Team environments: episodes in which several agents take turns, each sampled by its own policy.

A team environment is a `Task` (prompts, held-out split, single-turn `reward`) that also runs
episodes whose turn order it decides:

    episode = env.reset(prompt)
    agent = episode.next_agent()              # "lead": who acts now
    step = episode.step(agent, "4", stopped=False)   # the turn's text (eos stripped)
    step.observation, step.rewards, step.done        # "", {"lead": 0.0, "finish": 0.0}, False

`stopped` says whether the turn ended at a stop token (else at its token limit,
`env.turn_tokens(agent)`). Rewards are per agent (a team reward is the same number for each); an
episode's reward for an agent is the sum over its steps.

`run_team_episodes` plays them: per round, the live episodes are grouped by the agent that acts
and each group is sampled by that agent's engine (`engines[agent]`; one engine object for several
agents is a shared policy). Every token records its producer (`agents`, None for the
environment's observation tokens) and, for every agent, the version of that agent's engine when
the token was appended (`versions[agent]`): for the producer the version that sampled it, for
everyone else the version resident then, as an environment token carries in a single-agent
episode (tasks/rollout.py). So an agent's view of the episode is a single-agent episode in which
the other agents are its environment (operators/generate_team.py makes one row per agent of it).
`role_prompts` (per agent, optional): text appended to the prompt in that agent's view only —
its turns are sampled after it, its row's prompt ends with it — so one policy shared by several
agents is told which one it acts as.

Built in: `RelayEnv` ("relay"): two agents write one answer of a single-turn task together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from trajflow.engines.tokenizer import decode_response, encode_prompt
from trajflow.engines.torch_engine import TorchEngine, greedy_engine
from trajflow.settings import check_number
from trajflow.tasks.base import Prompt, Task


@dataclass(frozen=True)
class TeamStep:
    """The environment's answer to one agent's turn."""

    observation: str  # text appended after the turn (seen by every agent); may be ""
    rewards: Mapping[str, float]  # this step's reward per agent (a missing agent: 0)
    done: bool


class TeamEpisode(Protocol):
    """The state of one team episode; `step` must tolerate arbitrary text and never raise."""

    def next_agent(self) -> str:
        """The agent whose turn it is (asked only while the episode runs)."""
        ...

    def step(self, agent: str, action: str, stopped: bool) -> TeamStep: ...


@runtime_checkable
class TeamEnvironment(Task, Protocol):
    """A task whose trajectories are episodes of several agents (module docstring)."""

    agents: tuple[str, ...]  # every agent's name, in a fixed order
    max_turns: int  # turns per episode, all agents together
    max_response_tokens: int  # token budget of the response: every agent's and the environment's

    def turn_tokens(self, agent: str) -> int:
        """The most tokens `agent` samples in one turn."""
        ...

    def reset(self, prompt: Prompt) -> TeamEpisode:
        """Start an episode on `prompt` (deterministic: same prompt, same episode)."""
        ...


def is_team_environment(task: object) -> bool:
    """True if `task` runs team episodes."""
    return isinstance(task, TeamEnvironment)


# -- the relay ---------------------------------------------------------------------------------


class RelayEpisode:
    """One episode of `RelayEnv`."""

    def __init__(self, task: Task, prompt: Prompt) -> None:
        self.task, self.prompt = task, prompt
        self.written = ""
        self.turns = 0

    def next_agent(self) -> str:
        return "lead" if self.turns == 0 else "finish"

    def step(self, agent: str, action: str, stopped: bool) -> TeamStep:
        self.turns += 1
        self.written += action if isinstance(action, str) else ""
        done = agent == "finish" or stopped
        reward = float(self.task.reward(self.prompt.text, self.prompt.answer, self.written)) if done else 0.0
        return TeamStep("", {"lead": reward, "finish": reward}, done)


class RelayEnv:
    """Two agents write one answer: `lead` writes its first `lead_tokens` tokens, `finish`
    continues from there to the end (eos or `finish_tokens`); both get the task's reward of the
    whole answer (a team reward). If the lead's turn stops first (a short answer), the episode
    ends there and the finisher has no turn. Prompts, held-out split and single-turn reward are
    the wrapped task's (`task`, any single-turn task, e.g. addition)."""

    name = "relay"
    agents = ("lead", "finish")
    max_turns = 2

    def __init__(self, task: Task, lead_tokens: int = 1, finish_tokens: int = 8) -> None:
        check_number("RelayEnv", lead_tokens=lead_tokens, finish_tokens=finish_tokens)
        if lead_tokens < 1 or finish_tokens < 1:
            raise ValueError(f"relay: lead_tokens ({lead_tokens}) and finish_tokens ({finish_tokens}) must be >= 1")
        self.task = task
        self.lead_tokens, self.finish_tokens = lead_tokens, finish_tokens
        self.max_response_tokens = lead_tokens + finish_tokens

    def turn_tokens(self, agent: str) -> int:
        return self.lead_tokens if agent == "lead" else self.finish_tokens

    def reset(self, prompt: Prompt) -> RelayEpisode:
        return RelayEpisode(self.task, prompt)

    def prompts(self, split: str, seed: int):
        return self.task.prompts(split, seed)

    def heldout(self, n: int) -> list[Prompt]:
        return self.task.heldout(n)

    def reward(self, prompt_text: str, answer: str, response_text: str) -> float:
        return self.task.reward(prompt_text, answer, response_text)

    def __repr__(self) -> str:
        return f"RelayEnv({self.task!r}, lead_tokens={self.lead_tokens}, finish_tokens={self.finish_tokens})"


# -- playing team episodes ---------------------------------------------------------------------


@dataclass
class TeamEpisodeRecord:
    """One played team episode: the response (every agent's and the environment's tokens)."""

    prompt_index: int
    prompt_tokens: list[int]
    env: TeamEpisode
    roles: Mapping[str, list[int]] = field(default_factory=dict)  # an agent's role prompt's tokens
    response_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the producer's; 0.0 on environment tokens
    agents: list[str | None] = field(default_factory=list)  # each token's producer (None: environment)
    versions: dict[str, list[int]] = field(default_factory=dict)  # per agent (module docstring)
    rewards: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    finish_reason: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""

    def prompt_of(self, agent: str) -> list[int]:
        """The prompt in `agent`'s view: the episode's, then its role prompt (if any)."""
        return self.prompt_tokens + list(self.roles.get(agent, ()))

    def append(self, tokens: Sequence[int], logprobs: Sequence[float], producer: str | None,
               engines: Mapping[str, TorchEngine]) -> None:
        self.response_tokens += tokens
        self.logprobs += logprobs
        self.agents += [producer] * len(tokens)
        for agent, engine in engines.items():
            self.versions.setdefault(agent, []).extend([engine.version] * len(tokens))


def run_team_episodes(engines: Mapping[str, TorchEngine], env: TeamEnvironment, tokenizer,
                      prompts: Sequence[Prompt], n: int = 1, *, prompt_tokens: Sequence[list[int]] | None = None,
                      role_prompts: Mapping[str, str] | None = None) -> list[TeamEpisodeRecord]:
    """Play n team episodes per prompt (prompt-major), each turn sampled by the acting agent's
    engine (module docstring). `prompt_tokens`: the prompts' ids as the prompt source encoded
    them (default: `encode_prompt` of the text); `role_prompts`: per agent, text its view of the
    prompt ends with."""
    missing = [a for a in env.agents if a not in engines]
    unknown = sorted(set(role_prompts or {}) - set(env.agents))
    if missing or unknown:
        raise ValueError(f"run_team_episodes: no engine for agent(s) {missing}" if missing else
                         f"run_team_episodes: role_prompts for {unknown}, not agents of {env.agents}")
    if prompt_tokens is None:
        prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    roles = {a: tokenizer.encode(text, add_special_tokens=False) for a, text in (role_prompts or {}).items() if text}
    episodes = [TeamEpisodeRecord(i, list(ids), env.reset(p), roles, rewards={a: 0.0 for a in env.agents})
                for i, (p, ids) in enumerate(zip(prompts, prompt_tokens)) for _ in range(n)]
    budget = env.max_response_tokens
    for _ in range(env.max_turns):
        live = [e for e in episodes if not e.finished]
        if not live:
            break
        by_agent: dict[str, list[TeamEpisodeRecord]] = {}
        for e in live:
            by_agent.setdefault(e.env.next_agent(), []).append(e)
        for agent in env.agents:  # a fixed order: the same episodes, the same draws
            group = by_agent.get(agent, [])
            if group:
                _play_turn(agent, group, engines, env, tokenizer, budget)
    for e in episodes:
        if not e.finished:
            e.finish_reason = "length"
    return episodes


def _play_turn(agent: str, group: list[TeamEpisodeRecord], engines: Mapping[str, TorchEngine],
               env: TeamEnvironment, tokenizer, budget: int) -> None:
    engine = engines[agent]
    base = engine.sampling
    remaining = [budget - len(e.response_tokens) for e in group]
    engine.sampling = dataclasses.replace(base, max_new_tokens=max(1, min(env.turn_tokens(agent), max(remaining))))
    try:
        gens = engine.generate([e.prompt_of(agent) + e.response_tokens for e in group], n=1)
    finally:
        engine.sampling = base
    stop_ids = [engine.eos_id, *engine.stop_token_ids]
    for e, g, room in zip(group, gens, remaining):
        tokens = g.response_tokens[:room]
        e.append(tokens, g.logprobs[:room], agent, engines)
        e.turns += 1
        if g.finish_reason == "abort":
            e.finish_reason = "abort"
            continue
        stopped = g.finish_reason == "stop" and len(tokens) == len(g.response_tokens)
        result = e.env.step(agent, decode_response(tokenizer, tokens, stop_ids, base.stop), stopped)
        for name, value in result.rewards.items():
            e.rewards[name] = e.rewards.get(name, 0.0) + float(value)
        obs = tokenizer.encode(result.observation, add_special_tokens=False) if result.observation else []
        left = budget - len(e.response_tokens)
        e.append(obs[:left], [0.0] * len(obs[:left]), None, engines)
        if result.done:
            e.finish_reason = "stop"
        elif left - len(obs) < 1 or e.turns >= env.max_turns:
            e.finish_reason = "length"


def heldout_team_rewards(models: Mapping[str, torch.nn.Module], env: TeamEnvironment, tokenizer, n: int,
                         batch_size: int = 256, role_prompts: Mapping[str, str] | None = None) -> dict[str, float]:
    """Each agent's mean reward over greedy team episodes on the first n held-out prompts
    (float32, no Ray); `models[agent]`: the agent's policy (one object for a shared policy)."""
    engines: dict[int, TorchEngine] = {}
    by_agent = {a: engines.setdefault(id(models[a]), greedy_engine(models[a], tokenizer, 1)) for a in env.agents}
    prompts = env.heldout(n)
    totals = {a: [] for a in env.agents}
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            for e in run_team_episodes(by_agent, env, tokenizer, prompts[start:start + batch_size],
                                       role_prompts=role_prompts):
                for a in env.agents:
                    totals[a].append(e.rewards[a])
    return {a: float(np.mean(v)) if v else 0.0 for a, v in totals.items()}

