"""Generate for a team of agents: the rollout of one train step per call, one row per agent.

Batch in: the prompt rows of one step, as for `Generate`. Each prompt is played `group_size`
times as a team episode (tasks/team.py): the environment decides whose turn it is and each turn
is sampled by the acting agent's policy. Batch out: for every episode one row per agent (schema
v1 plus `agent` and `token_agents`), agent-major, so each agent's rows are one block:

    prompt_tokens        the prompt in the row's agent's view (ending with its role prompt, if any)
    response_tokens      the whole episode after the prompt (every agent's and the environment's)
    loss_mask            true on the row's agent's own tokens only: the others' are its context
    inference_logprobs   each token's producer's log-prob (0.0 on environment tokens)
    versions             the row's agent's versions: the one that sampled each own token, the
                         one resident when another's token was appended (an environment token's
                         convention)
    token_agents         each token's producer; null on environment tokens
    reward               the agent's own reward of the episode
    group_id             the prompt's group and the agent ("s000001-p003/lead"): advantages are
                         normalised within one agent's samples of one prompt

Each agent's policy is a learner of its own (`learner_of[agent]`), with its own store: its
versions, snapshots and staleness bound. Before sampling, the operator takes an admission permit
from each learner's store (rollout step b starts once that learner's version b - max_staleness
exists) and loads its newest version. Agents that share a policy name one learner: one engine,
one store, one stream of versions.

A learner's side of the rollout (`LearnerSide`: its store, engine, weights) is a `Generate` in
this process by default; the team on Ray gives each learner's engine a process of its own with
its own resources (pipelines/team_ray.py), through the same three calls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from trajflow.engines.models import load_tokenizer
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.contracts.rollout import EngineConfig, RolloutConfig
from trajflow.operators.generate import Generate, rollout_step_of, PROMPT_ROW_COLUMNS
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.schemas import SamplingSemantics, conform
from trajflow.tasks.team import TeamEnvironment, run_team_episodes
from trajflow.tasks.workload import Workload, prompt_of


class LearnerSide(Protocol):
    """One learner's side of a team rollout: its store (admission, pins, counters), the engine its
    agents' turns are sampled with (`TorchEngine`'s `generate`, `sampling`, `version`, `eos_id`,
    `stop_token_ids`), and its weights."""

    store: PolicyStoreClient

    @property
    def engine(self): ...

    def load_newest(self, pins: set[int]) -> None:
        """Load the store's newest version into the engine; its pin added to `pins`."""

    def seed(self, value: int) -> None:
        """Seed the engine's sampling generator."""


class LocalSide:
    """A learner's side in this process: a single-agent `Generate` (its store, engine, weights)."""

    def __init__(self, generate: Generate) -> None:
        self.generate = generate
        self.store = generate.store

    @property
    def engine(self):
        return self.generate.engine

    def load_newest(self, pins: set[int]) -> None:
        self.generate.load_newest(pins)

    def seed(self, value: int) -> None:
        self.generate.engine.generator.manual_seed(value)


class GenerateTeam:
    """The team rollout of one train step per call (see the module docstring)."""

    def __init__(self, stores: Mapping[str, PolicyStoreClient], learner_of: Mapping[str, str],
                 model_paths: Mapping[str, str | Path], workload: Workload, environment: TeamEnvironment,
                 rollout: RolloutConfig, engine: EngineConfig, numerics: TrainingNumerics,
                 weight_sync: WeightSyncConfig, torch_threads: int, role_prompts: Mapping[str, str] | None = None,
                 sides: Mapping[str, LearnerSide] | None = None) -> None:
        """`sides`: each learner's side, built elsewhere (default: a `Generate` per learner here,
        from the other arguments)."""
        missing = [a for a in environment.agents if a not in learner_of]
        if missing:
            raise ValueError(f"GenerateTeam: no learner for agent(s) {missing}")
        if rollout.partial_rollout or rollout.scores_at_switch or rollout.top_k_logprobs:
            raise ValueError("GenerateTeam: team episodes take each learner's newest version once per step "
                             "(no partial_rollout, interrupt or top_k_logprobs yet)")
        self.environment = environment
        self.learner_of = dict(learner_of)
        self.role_prompts = dict(role_prompts or {})
        # one side per learner: its store, admission, weights and engine
        self.generators = dict(sides) if sides is not None else {
            name: LocalSide(Generate(stores[name], model_paths[name], workload, rollout, engine, numerics,
                                     weight_sync, torch_threads))
            for name in dict.fromkeys(self.learner_of.values())}
        self.tokenizer = load_tokenizer(next(iter(model_paths.values())))
        self.group_size = rollout.group_size
        self.seed = rollout.seed
        self.semantics = SamplingSemantics(rollout.sampling.temperature, rollout.sampling.top_p,
                                           rollout.sampling.top_k)

    def __call__(self, batch: pa.Table) -> pa.Table:
        step = rollout_step_of(batch)
        started = time.perf_counter()
        waited = 0.0
        pins: dict[str, set[int]] = {}
        for index, (name, generator) in enumerate(self.generators.items()):
            t0 = time.perf_counter()
            generator.store.admit(step)
            waited += time.perf_counter() - t0
            pins[name] = set()
            generator.load_newest(pins[name])
            generator.seed((self.seed * 1_000_003 + step) * 64 + index)
        engines = {agent: self.generators[learner].engine for agent, learner in self.learner_of.items()}
        prompts = [prompt_of(row) for row in batch.to_pylist()]
        prompt_tokens = batch["prompt_tokens"].to_pylist()
        episodes = run_team_episodes(engines, self.environment, self.tokenizer, prompts, self.group_size,
                                     prompt_tokens=prompt_tokens, role_prompts=self.role_prompts)
        for name, generator in self.generators.items():
            used = {v for e in episodes for a, learner in self.learner_of.items() if learner == name
                    for v in e.versions[a]}
            for version in pins[name] - used:
                generator.store.release(version)
            generator.store.add_counters({"generate_seconds": time.perf_counter() - started - waited,
                                          "admission_wait_seconds": waited})
        return self._to_table(step, batch, episodes)

    def _to_table(self, step: int, rows: pa.Table, episodes) -> pa.Table:
        n, agents = self.group_size, self.environment.agents
        prompt_idx = np.repeat(np.arange(rows.num_rows), n)
        sample_idx = np.tile(np.arange(n), rows.num_rows)
        prompt_ids = rows["prompt_id"].to_pylist()
        int_list, float_list = pa.list_(pa.int32()), pa.list_(pa.float32())
        order = [(agent, i) for agent in agents for i in range(len(episodes))]  # agent-major
        passthrough = rows.drop_columns(list(PROMPT_ROW_COLUMNS)).take(
            pa.array([prompt_idx[i] for _, i in order], pa.int64()))
        columns = {
            "trajectory_id": [f"s{step:06d}-p{prompt_idx[i]:03d}-n{sample_idx[i]:03d}/{a}" for a, i in order],
            "group_id": [f"s{step:06d}-p{prompt_idx[i]:03d}/{a}" for a, i in order],
            "prompt_id": [prompt_ids[prompt_idx[i]] for _, i in order],
            "prompt_tokens": pa.array([episodes[i].prompt_of(a) for a, i in order], int_list),
            "response_tokens": pa.array([episodes[i].response_tokens for _, i in order], int_list),
            "loss_mask": pa.array([[p == a for p in episodes[i].agents] for a, i in order], pa.list_(pa.bool_())),
            "inference_logprobs": pa.array([episodes[i].logprobs for _, i in order], float_list),
            "versions": pa.array([episodes[i].versions[a] for a, i in order], int_list),
            "old_logprobs": pa.nulls(len(order), float_list),
            "finish_reason": [episodes[i].finish_reason for _, i in order],
            "reward": pa.array([episodes[i].rewards[a] for a, i in order], pa.float32()),
            "advantage": pa.nulls(len(order), pa.float32()),
        }
        for name in passthrough.column_names:
            columns[name] = passthrough[name]
        columns["rollout_step"] = pa.array(np.full(len(order), step, dtype=np.int32))
        columns["turns"] = pa.array([episodes[i].turns for _, i in order], pa.int32())
        columns["agent"] = pa.array([a for a, _ in order], pa.string())
        columns["token_agents"] = pa.array([episodes[i].agents for _, i in order], pa.list_(pa.string()))
        return conform(pa.table(columns), self.semantics)
