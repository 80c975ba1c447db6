"""A team of agents on Ray, asynchronously: a rollout actor, and per learner an engine actor and a
trainer actor, each with its own resources.

The same operators as the team's loop in one process (pipelines/team.py), each learner in
processes of its own with its own resources — its config's `generator:` section for its engine,
its `trainer:` section for its train step (`num_cpus`, `num_gpus`; per agent through
`team.agents.<agent>`: a busy agent gets more) — and its own policy store actor (versions,
snapshots and its staleness bound, `max_staleness`):

    rollout actor     GenerateTeam: rollout r, one table per learner; it plays the episodes (the
                      environment's turn order) and has each turn sampled by the acting agent's
                      engine actor; before sampling it takes an admission permit from every
                      learner's store (rollout r waits until learner L's version r - max_staleness_L
                      exists), and each engine loads its learner's newest version
    engine actor L    learner L's engine and weights (operators/generate.py's Generate)
    learner actor L   its stages after the rollout (old log-probs, advantage, filter, ...) and its
                      train step, step after step; it publishes version r + 1 to its store

The driver submits every rollout and every learner's step at once (each actor runs its calls in
order) and gathers the metrics rows in step order. Nothing waits for the slowest learner but
what its bound demands: the rollouts run ahead of learner L by at most max_staleness_L steps,
and every other learner trains as soon as its rows exist. Staleness is bounded, not held (the
one-process loop holds it exactly, for studies that repeat): each row reports what it was. Each
engine is seeded per rollout as in one process, so with every bound 0 (rollout r sampled with
version r of every learner) the numbers are the one-process loop's at lag 0.

A learner whose process dies heals while the others run on: the driver sees its step fail
(the actor died), starts a new actor for it on the same store, whose train step rebuilds the
learner's state as it starts (operators/trainer/recovery.py: the last checkpoint, then the steps
since it retrained from the learner's trajectory log), and submits that learner's steps again
from the one that failed, on the rollouts the driver still holds: nothing is generated twice, the
generator and the other learners wait only as their bounds demand. A step the dead actor had
trained and logged before it died is not trained again; its metrics come from `logged` (the
learner's own run dir). `recovery.max_restarts` bounds the rebuilds per learner (its store counts
them). An engine or the episodes' actor that dies ends the run (`TeamProcessLost`, one line), as
does a store; `--resume` goes on from the checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pyarrow as pa

from trajflow.operators.contracts.stage import Stage
from trajflow.operators.contracts.store import POLICY, PolicyStoreClient
from trajflow.pipelines.local import build, run_stage
from trajflow.pipelines.team import (
    Saved,
    TeamPipeline,
    agent_metrics,
    agents_of,
    heldout,
    learner_row,
    rows_of,
)

# a learner's train-step metrics of a step from its own run (trained by an actor that died after
# logging it): logged(learner, step), None where not written
Logged = Callable[[str, int], dict | None]


class TeamProcessLost(RuntimeError):
    """A process of the team's rollout (an engine or the episodes' actor) died; one line."""


class EngineActor:
    """One learner's engine and weights in a process of its own (a single-agent `Generate`)."""

    def __init__(self, arguments: dict) -> None:
        from trajflow.operators.generate import Generate

        self.generate = Generate(**arguments)

    def describe(self) -> tuple:
        """(sampling, eos_id, stop_token_ids) of the engine."""
        engine = self.generate.engine
        return engine.sampling, engine.eos_id, engine.stop_token_ids

    def load_newest(self, pins: list[int]) -> int:
        """Load the store's newest version (pinned; a second pin on one of `pins` released); its number."""
        self.generate.load_newest(set(pins))
        return self.generate.engine.version

    def seed(self, value: int) -> None:
        self.generate.engine.generator.manual_seed(value)

    def sample(self, prompts: list[list[int]], n: int, sampling) -> list:
        engine = self.generate.engine
        base, engine.sampling = engine.sampling, sampling
        try:
            return engine.generate(prompts, n=n)
        finally:
            engine.sampling = base


class RemoteEngine:
    """An engine actor as the episodes see an engine (tasks/team.py): `generate` with this
    object's `sampling`, the `version` loaded for the rollout at hand."""

    def __init__(self, actor) -> None:
        import ray

        self.actor = actor
        self.sampling, self.eos_id, self.stop_token_ids = ray.get(actor.describe.remote())
        self.version = -1

    def generate(self, prompts: list[list[int]], n: int = 1) -> list:
        import ray

        return ray.get(self.actor.sample.remote(prompts, n, self.sampling))


class RemoteSide:
    """A learner's side of the team rollout (operators/generate_team.py `LearnerSide`) whose
    engine is an `EngineActor`; its store is the learner's store actor."""

    def __init__(self, actor, store: PolicyStoreClient) -> None:
        self.actor, self.store = actor, store
        self.engine = RemoteEngine(actor)

    def load_newest(self, pins: set[int]) -> None:
        import ray

        self.engine.version = ray.get(self.actor.load_newest.remote(sorted(pins)))
        pins.add(self.engine.version)

    def seed(self, value: int) -> None:
        import ray

        ray.get(self.actor.seed.remote(value))


class TeamGeneratorActor:
    """The team's rollouts in their own process: one table per learner per rollout step, each
    learner's turns sampled by its engine actor (`engines`, by learner)."""

    def __init__(self, arguments: dict, agents: dict[str, list[str]], engines: dict) -> None:
        from trajflow.operators.generate_team import GenerateTeam

        sides = {name: RemoteSide(actor, arguments["stores"][name]) for name, actor in engines.items()}
        self.generate = GenerateTeam(**arguments, sides=sides)
        self.agents = agents  # each learner's agents

    def rollout(self, prompt_rows: pa.Table) -> dict[str, pa.Table]:
        batch = run_stage(("generate", self.generate), prompt_rows)
        return {name: rows_of(batch, agents) for name, agents in self.agents.items()}


class LearnerActor:
    """One learner's stages after the rollout and its train step, in its own process."""

    def __init__(self, name: str, stages: list[Stage], store: PolicyStoreClient, agents: list[str]) -> None:
        self.name, self.store, self.agents = name, store, agents
        self.stages = [(stage.name, build(stage, store)) for stage in stages]

    def step(self, rollout: dict[str, pa.Table]) -> tuple[dict | None, dict]:
        """Train on this learner's rows of one rollout: its train row (None: the step was trained
        and logged by the actor this one replaced) and each of its agents' reward and staleness."""
        batch = rollout[self.name]
        for stage in self.stages[:-1]:
            batch = run_stage(stage, batch)
        version = self.store.latest_version()
        trained = run_stage(self.stages[-1], batch).to_pylist()
        agents = {}
        for agent in self.agents:
            agents.update(agent_metrics(batch, agent, version))
        return (trained[0] if trained else None), agents

    def ready(self) -> None:
        """Returns once the actor is built (a rebuilt learner: recovered)."""

    def close(self) -> None:
        for _, operator in self.stages:
            if hasattr(operator, "close"):
                operator.close()


def iter_team_on_ray(team: TeamPipeline, eval_every: int = 0, eval_prompts: int = 200, first_step: int = 0,
                     saved: Saved | None = None, logged: Logged | None = None) -> Iterator[dict]:
    """The team's metrics rows in step order (module docstring), Ray started embedded if it is not
    running; every `eval_every` steps the team's greedy held-out reward per agent. `first_step`
    k > 0 resumes a run whose learners' checkpoints hold version k (`saved(learner, k)`: their
    weights; each train step restores the rest through its hooks): the rollouts from step k on
    are sampled with version k and later."""
    import ray

    from trajflow.pipelines.ray.embedded import start_local_ray
    from trajflow.pipelines.policy_store import RayStore

    if first_step and saved is None:
        raise ValueError("first_step: resuming needs `saved`, the learners' weights of that version")
    start_local_ray()
    check_resources(team, ray.cluster_resources())
    steps = team.config.steps
    stores = {}
    for name, pipe in team.learners.items():
        c = pipe.config
        # a learner that may be rebuilt dies with the versions it put: its store owns them all
        final = steps if c.recovery.max_restarts == 0 else None
        stores[name] = RayStore.start(c.max_staleness, c.keeps_history(pipe.strategy), final_version=final)
        pipe.publish_start(stores[name], first_step, {POLICY: dict(saved(name, first_step))} if first_step else None)
    agents = {name: agents_of(team, name) for name in team.learners}
    arguments = team.generator_arguments(stores)
    engines = {}
    for name, pipe in team.learners.items():
        g = pipe.settings.generator
        engines[name] = ray.remote(EngineActor).options(
            num_cpus=g.num_cpus, num_gpus=g.num_gpus, resources=dict(g.resources)).remote(
            team.engine_arguments(name, stores[name]))
    # the episodes' bookkeeping only: the sampling is the engine actors'
    generator = ray.remote(TeamGeneratorActor).options(num_cpus=0).remote(arguments, agents, engines)

    def learner(name: str):
        trainer = team.learners[name].settings.trainer
        return ray.remote(LearnerActor).options(
            num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus, resources=dict(trainer.resources)).remote(
            name, team.learner_stages(name), stores[name], agents[name])

    learners = {name: learner(name) for name in team.learners}
    rollouts, trained, completed = [], {}, False
    try:
        rollouts = [generator.rollout.remote(team.prompt_rows(r)) for r in range(first_step, steps)]
        trained = {name: [actor.step.remote(rollout) for rollout in rollouts] for name, actor in learners.items()}
        for i, step in enumerate(range(first_step, steps)):
            row = {"step": step}
            for name in learners:
                while True:
                    try:
                        train_row, agent_rows = ray.get(trained[name][i])
                        break
                    except ray.exceptions.RayTaskError as failed:  # the step's input: the rollout's actors
                        if not rollout_process_died(failed):
                            raise
                        raise TeamProcessLost(f"a process of the team's rollout (an engine or the episodes' actor) "
                                              f"died by step {step}; trajflow run --resume goes on") from None
                    except ray.exceptions.ActorDiedError:  # this learner's own process: heal it (module docstring)
                        ray.kill(learners[name])
                        learners[name] = learner(name)
                        # one that cannot be rebuilt (no checkpoint, max_restarts spent) ends the run here
                        ray.get(learners[name].ready.remote())
                        trained[name][i:] = [learners[name].step.remote(rollout) for rollout in rollouts[i:]]
                if train_row is None and logged is not None:
                    train_row = logged(name, step)
                row.update(learner_row(name, train_row or {}))
                row.update(agent_rows)
            if eval_every and (step + 1) % eval_every == 0:
                row.update(heldout(team, stores, eval_prompts))
            yield row
        ray.get([actor.close.remote() for actor in learners.values()])
        completed = True
    finally:  # on an error the actors are killed as they are (a close would wait behind their queued steps)
        for actor in [generator, *engines.values(), *learners.values(), *(s.actor for s in stores.values())]:
            ray.kill(actor)
        # on an error every call left failed with them: taken here, so that Ray does not print each
        # as an "Unhandled error" when its reference goes (the run's one line says what happened)
        for ref in [] if completed else [*rollouts, *(ref for refs in trained.values() for ref in refs)]:
            try:
                ray.get(ref, timeout=10)
            except Exception:
                pass


def rollout_process_died(error: BaseException) -> bool:
    """Whether an actor's death is behind `error` (a rollout that failed because its engine or
    its own process died), found in its chain of causes or, across processes, in their text."""
    import ray

    seen, text = set(), str(error)
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ray.exceptions.ActorDiedError) and not isinstance(error, ray.exceptions.RayTaskError):
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return f"{ray.exceptions.ActorDiedError.__name__}: " in text  # the cause's type, named in its message


def check_resources(team: TeamPipeline, cluster: dict[str, float]) -> None:
    """Every learner's engine's and trainer's CPUs and GPUs fit the cluster (else Ray would wait
    for them forever): a ValueError naming the keys."""
    demand = {}
    for name, pipe in team.learners.items():
        demand.update({f"{name}'s generator": pipe.settings.generator, f"{name}'s trainer": pipe.settings.trainer})
    for kind in ("num_cpus", "num_gpus"):
        need = sum(getattr(resources, kind) for resources in demand.values())
        have = cluster.get("CPU" if kind == "num_cpus" else "GPU", 0.0)
        if need > have:
            parts = ", ".join(f"{who} {getattr(r, kind):g}" for who, r in demand.items())
            raise ValueError(f"{kind}: the team's actors need {need:g} ({parts}) and Ray has {have:g}; lower "
                             f"generator.{kind} / trainer.{kind} (per agent: team.agents.<agent>.generator / "
                             f".trainer)")
