"""A team of agents, each its own policy: the RL loop for team episodes, in this process.

Every agent's policy is a learner of its own: an `RLPipeline` built from its own config (its
optimizer, strategy, trainer, store), of which the team uses every stage after generate and
reward (old log-probs, advantage, filter, train step: the same operators as a single-agent run).
One `GenerateTeam` (operators/generate_team.py) plays the episodes, each turn sampled by the
acting agent's policy, and writes one row per agent per episode; each agent's rows go through
its own learner's stages. Agents may share one policy (`share_policy=True` in `TeamPipeline.of`:
one learner, one store, both agents' rows in its train step, parameter sharing); the rows are
still per agent (groups per agent, per-agent metrics).

Staleness per learner, held exactly (`lags`, as `run_in_process(lag=S)` holds it for one
policy): learner L's tokens of rollout step b come from its version max(0, b - S_L), and it
trains them at version b. So the agents' policies run at different lags behind their rollouts:

    for r in steps:
        generate rollout r (each learner's newest: L's version r - S_L)
        run each learner's stages before its train step on its rows (as in the pipeline, where
            they follow generation)
        for each learner L: train L on rollout r - S_L's rows (publishes L's version r - S_L + 1)

Per step one metrics row: each learner's train row under `<learner>/` (`lead/loss`,
`lead/clip/frac`, ...; a shared learner's mask, clip and mismatch split by agent too, under
`<agent>/`: learner_row), and per agent from its trained rows `<agent>/reward/mean`,
`<agent>/staleness/mean`, `<agent>/staleness/max` (the learner's version at its train step minus
each own token's version) and `<agent>/version`; every `eval_every` steps the team's greedy
held-out reward per agent (`heldout/<agent>`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch import Tensor

from trajflow.operators.contracts.stage import Stage
from trajflow.operators.contracts.store import POLICY, PolicyStoreClient
from trajflow.operators.contracts.rollout import EngineConfig, RolloutConfig
from trajflow.operators.generate_team import GenerateTeam
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.config.team import SHARED
from trajflow.pipelines.local import build, run_stage
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.settings import check_number
from trajflow.tasks.team import RelayEnv, TeamEnvironment, is_team_environment
from trajflow.user_code import load_object

# a learner's weights of a version from disk (a resumed run): saved(learner, version)
Saved = Callable[[str, int], Mapping[str, Tensor]]

# the stages a single-agent pipeline runs before the team's rows exist
ROLLOUT_STAGES = ("generate", "reward")


@dataclass
class TeamPipeline:
    """The team: its environment, one `RLPipeline` per learner and which learner each agent is."""

    environment: TeamEnvironment
    learners: dict[str, RLPipeline]
    learner_of: dict[str, str]
    role_prompts: dict[str, str] = field(default_factory=dict)  # per agent (tasks/team.py)

    def __post_init__(self) -> None:
        unknown = {a: n for a, n in self.learner_of.items() if n not in self.learners}
        if unknown or set(self.learner_of) != set(self.environment.agents):
            raise ValueError(f"TeamPipeline: learner_of must name a learner for every agent of "
                             f"{self.environment.agents}, got {self.learner_of}")
        strangers = sorted(set(self.role_prompts) - set(self.environment.agents))
        if strangers:
            raise ValueError(f"team.role_prompts: {strangers} are not agents of {self.environment.name} "
                             f"{self.environment.agents}")
        for name, pipe in self.learners.items():
            if pipe.config.eval_every:
                raise ValueError(f"TeamPipeline: learner {name!r} has eval_every {pipe.config.eval_every}; the team "
                                 "evaluates its episodes itself (run_team_in_process's eval_every)")

    @classmethod
    def of(cls, config: PipelineConfig, environment: TeamEnvironment, share_policy: bool = False,
           agent_configs: Mapping[str, PipelineConfig] | None = None,
           role_prompts: Mapping[str, str] | None = None) -> "TeamPipeline":
        """The team on `config`: one learner per agent (each on `agent_configs[agent]` if given,
        else `config`), or with `share_policy` one learner for every agent; `role_prompts`: per
        agent, text its view of the prompt ends with."""
        roles = dict(role_prompts or {})
        if share_policy:
            if agent_configs:
                raise ValueError("TeamPipeline.of: agent_configs need a policy per agent (share_policy=False)")
            return cls(environment, {SHARED: RLPipeline(config)}, {a: SHARED for a in environment.agents}, roles)
        configs = dict(agent_configs or {})
        return cls(environment, {a: RLPipeline(configs.get(a, config)) for a in environment.agents},
                   {a: a for a in environment.agents}, roles)

    @classmethod
    def from_config(cls, config: PipelineConfig, model_path: str | Path | None = None) -> "TeamPipeline":
        """The team a config's `team:` section describes: its environment on the config's task,
        and each learner on the config without `team:` and with its agent's keys; the learners
        evaluate nothing (the team does, run_team_in_process's eval_every)."""
        team = config.settings.team
        if team is None:
            raise ValueError("TeamPipeline.from_config: the config has no team: section")
        base = config.model_dump(exclude={"team"}) | {"eval_every": 0}
        environment = team_environment(team.environment, config)
        if team.share_policy:
            learners = {SHARED: RLPipeline(PipelineConfig(**base), model_path)}
            return cls(environment, learners, {a: SHARED for a in environment.agents}, dict(team.role_prompts))
        unknown = sorted(set(team.agents) - set(environment.agents))
        if unknown:
            raise ValueError(f"team.agents: {unknown} are not agents of {environment.name} {environment.agents}")
        learners = {a: RLPipeline(PipelineConfig(**merged(base, team.agents.get(a, {}))), model_path)
                    for a in environment.agents}
        return cls(environment, learners, {a: a for a in environment.agents}, dict(team.role_prompts))

    @property
    def config(self) -> PipelineConfig:
        """The rollout's settings (group size, sampling, numerics, seed, steps): the first learner's."""
        return next(iter(self.learners.values())).config

    def generator(self, stores: Mapping[str, PolicyStoreClient]) -> GenerateTeam:
        """The team's generate operator on the learners' `stores` (by learner name)."""
        return GenerateTeam(**self.generator_arguments(stores))

    def generator_arguments(self, stores: Mapping[str, PolicyStoreClient]) -> dict:
        """`GenerateTeam`'s arguments (for an actor to build it), with the first learner's rollout
        settings."""
        c, first = self.config, next(iter(self.learners.values()))
        s = first.settings
        rollout = RolloutConfig(group_size=c.group_size, sampling=first.sampling, seed=c.seed)
        engine = EngineConfig(name=c.engine, inference_dtype=c.inference_dtype, settings=s.engine)
        return dict(stores=dict(stores), learner_of=self.learner_of,
                    model_paths={n: p.model_path for n, p in self.learners.items()}, workload=first.workload,
                    environment=self.environment, rollout=rollout, engine=engine, numerics=s.numerics,
                    weight_sync=s.weight_sync, torch_threads=s.generator.torch_threads,
                    role_prompts=self.role_prompts)

    def engine_arguments(self, learner: str, store: PolicyStoreClient) -> dict:
        """A learner's `Generate` arguments (its engine and weights in a process of its own), with
        the rollout settings every learner's engine shares (generator_arguments)."""
        a = self.generator_arguments({learner: store})
        return dict(store=store, model_path=a["model_paths"][learner], workload=a["workload"], rollout=a["rollout"],
                    engine=a["engine"], numerics=a["numerics"], weight_sync=a["weight_sync"],
                    torch_threads=a["torch_threads"])

    def learner_stages(self, learner: str) -> list[Stage]:
        """A learner's stages after the rollout: old log-probs, advantage, filter, ..., its train step last."""
        return [s for s in self.learners[learner].stages if s.name not in ROLLOUT_STAGES]

    def prompt_rows(self, step: int) -> pa.Table:
        """The prompt rows of rollout step `step` (the first learner's prompt source)."""
        return next(iter(self.learners.values())).prompts.step_rows(step)


def run_team_in_process(team: TeamPipeline, lags: Mapping[str, int] | None = None, eval_every: int = 0,
                        eval_prompts: int = 200):
    """Run the team for its config's steps here; the metrics as a polars DataFrame, one row per
    step (module docstring). `lags`: per learner, how many steps its rollouts run ahead of its
    trainer (default 0; at most its max_staleness); every `eval_every` steps (0: never) the team's
    greedy held-out reward on `eval_prompts` prompts."""
    import polars as pl

    rows = [row for _, row in iter_team_in_process(team, lags, eval_every, eval_prompts)]
    return pl.from_dicts(rows, infer_schema_length=None)


def iter_team_in_process(team: TeamPipeline, lags: Mapping[str, int] | None = None, eval_every: int = 0,
                         eval_prompts: int = 200, stores: Mapping[str, PolicyStoreClient] | None = None,
                         first_step: int = 0, saved: Saved | None = None
                         ) -> Iterator[tuple[dict[str, pa.Table], dict]]:
    """The loop itself: per step, each learner's batch as it reached its train step and the
    step's metrics row. `stores`: each learner's policy store holding its first version (default:
    new in-process ones with its model as version 0).

    `first_step` k > 0 resumes a run whose learners hold version k (each learner's train step
    restores its own state, e.g. a job's checkpoint by its hooks): learner L's rollouts of steps
    k .. k + S_L - 1 were sampled with its versions k - S_L .. k - 1, so its store starts at
    version k - S_L and, where the uninterrupted run trained steps k - S_L .. k - 1, takes those
    versions' weights from `saved(L, version)` (a run's versions/ and checkpoint) instead: every
    rollout from step k on is sampled with the weights it had, and each train step is built once
    its store holds version k."""
    check_number("run_team_in_process", eval_every=eval_every, eval_prompts=eval_prompts, first_step=first_step,
                 **(lags or {}))
    unknown = sorted(set(lags or {}) - set(team.learners))
    if unknown:
        raise ValueError(f"lags: {unknown} name no learner of the team ({sorted(team.learners)})")
    lags = {name: int((lags or {}).get(name, 0)) for name in team.learners}
    for name, lag in lags.items():
        if not 0 <= lag <= team.learners[name].config.max_staleness:
            raise ValueError(f"lags: {name}'s {lag} must be in [0, its max_staleness = "
                             f"{team.learners[name].config.max_staleness}]")
    if first_step and saved is None:
        raise ValueError("first_step: resuming needs `saved`, the versions the rollouts in flight were sampled with")
    steps = team.config.steps
    if stores is None:
        stores = {name: new_store(pipe, max(0, first_step - lags[name]),
                                  saved(name, max(0, first_step - lags[name])) if first_step else None)
                  for name, pipe in team.learners.items()}
    generate = team.generator(stores)
    before = {name: [(s.name, build(s, stores[name])) for s in team.learner_stages(name)[:-1]]
              for name in team.learners}
    train: dict[str, Callable[[pa.Table], pa.Table]] = {}  # built once the store holds version first_step
    ready: dict[str, dict[int, pa.Table]] = {name: {} for name in team.learners}  # before the train step
    rows: dict[int, dict] = {}
    batches: dict[int, dict[str, pa.Table]] = {}
    try:
        for r in range(first_step, steps + max(lags.values())):
            if r < steps:
                batch = run_stage(("generate", generate), team.prompt_rows(r))
                for name, learner_stages in before.items():
                    mine = rows_of(batch, agents_of(team, name))
                    for stage in learner_stages:
                        mine = run_stage(stage, mine)
                    ready[name][r] = mine
            for name in team.learners:
                step = r - lags[name]
                if step < first_step:  # trained before the resume: its version from disk
                    if step >= 0:
                        stores[name].publish(saved(name, step + 1), step + 1)
                    continue
                if step >= steps:
                    continue
                if name not in train:
                    train[name] = build(team.learner_stages(name)[-1], stores[name])
                trained = ready[name].pop(step)
                batches.setdefault(step, {})[name] = trained
                version = stores[name].latest_version()
                row = rows.setdefault(step, {"step": step})
                for train_row in run_stage(("train", train[name]), trained).to_pylist():
                    row.update(learner_row(name, train_row))
                for agent in agents_of(team, name):
                    row.update(agent_metrics(trained, agent, version))
            done = r - max(lags.values())
            if first_step <= done < steps:
                row = rows.pop(done)
                if eval_every and (done + 1) % eval_every == 0:
                    row.update(heldout(team, stores, eval_prompts))
                yield batches.pop(done), row
    finally:
        for operator in [op for stages in before.values() for _, op in stages] + list(train.values()):
            if hasattr(operator, "close"):
                operator.close()


def team_environment(spec: str, config: PipelineConfig) -> TeamEnvironment:
    """The environment `spec` names (relay, or module:Class / file.py:Class) on `config`'s task."""
    task = config.workload().task_object()
    if spec == "relay":
        return RelayEnv(task, finish_tokens=config.sampling.max_new_tokens)
    environment = load_object(spec, "team.environment")(task)
    if not is_team_environment(environment):
        raise ValueError(f"team.environment: {spec} did not build a TeamEnvironment (agents, max_turns, "
                         "max_response_tokens, turn_tokens, reset)")
    return environment


def merged(base: dict, changes: Mapping) -> dict:
    """`base` with `changes` applied key by key, nested mappings merged (an agent's keys)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def new_store(pipe: RLPipeline, version: int = 0, weights: Mapping[str, Tensor] | None = None) -> InProcessStore:
    """An in-process store for a learner's pipeline, holding `weights` (default: its model) as
    `version`."""
    store = InProcessStore(pipe.config.max_staleness, pipe.config.keeps_history(pipe.strategy))
    pipe.publish_start(store, version, None if weights is None else {POLICY: dict(weights)})
    return store


def rows_of(batch: pa.Table, agents: list[str]) -> pa.Table:
    """The rows of `batch` whose agent is one of `agents` (a learner's)."""
    return batch.filter(pc.is_in(batch["agent"], pa.array(agents, pa.string())))


def agents_of(team: TeamPipeline, learner: str) -> list[str]:
    """The agents whose policy is `learner`."""
    return [a for a, n in team.learner_of.items() if n == learner]


def learner_row(learner: str, train_row: Mapping) -> dict:
    """A learner's train row in the team's row: `<learner>/<key>`, and a shared learner's split by
    agent (`agent/<agent>/<key>`, operators/trainer/correction.py) as `<agent>/<key>`, the keys
    an agent's own learner has."""
    out = {}
    for key, value in train_row.items():
        if key.startswith("agent/"):
            agent, rest = key.removeprefix("agent/").split("/", 1)
            out[f"{agent}/{rest}"] = value
        elif key != "step":
            out[f"{learner}/{key}"] = value
    return out


def agent_metrics(batch: pa.Table, agent: str, version: int) -> dict[str, float]:
    """`agent`'s reward and staleness on its rows of `batch`, trained at its learner's `version`."""
    mine = batch.filter(pc.equal(batch["agent"], agent))
    own = [v for vs, mask in zip(mine["versions"].to_pylist(), mine["loss_mask"].to_pylist())
           for v, m in zip(vs, mask) if m]
    staleness = version - np.asarray(own, np.int64) if own else np.zeros(0, np.int64)
    return {f"{agent}/reward/mean": float(pc.mean(mine["reward"]).as_py() or 0.0),
            f"{agent}/staleness/mean": float(staleness.mean()) if own else 0.0,
            f"{agent}/staleness/max": int(staleness.max()) if own else 0,
            f"{agent}/loss_tokens": len(own),
            f"{agent}/version": version}


def heldout(team: TeamPipeline, stores: Mapping[str, PolicyStoreClient], n: int) -> dict[str, float]:
    """The team's greedy held-out reward per agent, each learner at its newest version."""
    from trajflow.engines.models import load_model, load_tokenizer
    from trajflow.tasks.team import heldout_team_rewards

    models = {}
    for name, pipe in team.learners.items():
        model = load_model(pipe.model_path)
        model.load_state_dict(dict(stores[name].weights()[1]))
        models[name] = model.eval()
    tokenizer = load_tokenizer(next(iter(team.learners.values())).model_path)
    rewards = heldout_team_rewards({a: models[n_] for a, n_ in team.learner_of.items()}, team.environment,
                                   tokenizer, n, role_prompts=team.role_prompts)
    return {f"heldout/{a}": v for a, v in rewards.items()}
