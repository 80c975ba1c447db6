"""A team of agents on Ray, asynchronously: one generator actor, one actor per learner.

The same operators as the team's loop in one process (pipelines/team.py), each learner in a
process of its own with its own resources — its config's `trainer:` section (`num_cpus`,
`num_gpus`: a busy agent gets more) — and its own policy store actor (versions, snapshots and
its staleness bound, `max_staleness`):

    generator actor   GenerateTeam: rollout r, one table per learner; before sampling it takes an
                      admission permit from every learner's store (rollout r waits until learner
                      L's version r - max_staleness_L exists), then each learner's newest version
    learner actor L   its stages after the rollout (old log-probs, advantage, filter, ...) and its
                      train step, step after step; it publishes version r + 1 to its store

The driver submits every rollout and every learner's step at once (each actor runs its calls in
order) and gathers the metrics rows in step order. Nothing waits for the slowest learner but
what its bound demands: the generator runs ahead of learner L by at most max_staleness_L steps,
and every other learner trains as soon as its rows exist. Staleness is bounded, not held (the
one-process loop holds it exactly, for studies that repeat): each row reports what it was.

Not yet: a learner whose process dies is not restarted (the run fails; a team on Ray does not
resume). Tried and left: Ray restarted such an actor (`max_restarts`, `max_task_retries`) but the
retried step never ran on it, and the run waited.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from trajflow.operators.contracts.stage import Stage
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.pipelines.local import build, run_stage
from trajflow.pipelines.team import TeamPipeline, agent_metrics, agents_of, heldout, rows_of


class TeamGeneratorActor:
    """The team's generator in its own process: one table per learner per rollout step."""

    def __init__(self, arguments: dict, agents: dict[str, list[str]]) -> None:
        from trajflow.operators.generate_team import GenerateTeam

        self.generate = GenerateTeam(**arguments)
        self.agents = agents  # each learner's agents

    def rollout(self, prompt_rows: pa.Table) -> dict[str, pa.Table]:
        batch = run_stage(("generate", self.generate), prompt_rows)
        return {name: rows_of(batch, agents) for name, agents in self.agents.items()}


class LearnerActor:
    """One learner's stages after the rollout and its train step, in its own process."""

    def __init__(self, name: str, stages: list[Stage], store: PolicyStoreClient, agents: list[str]) -> None:
        self.name, self.store, self.agents = name, store, agents
        self.stages = [(stage.name, build(stage, store)) for stage in stages]

    def step(self, rollout: dict[str, pa.Table]) -> dict:
        """Train on this learner's rows of one rollout; its metrics under `<learner>/` and each of
        its agents' reward and staleness."""
        batch = rollout[self.name]
        for stage in self.stages[:-1]:
            batch = run_stage(stage, batch)
        version = self.store.latest_version()
        row = {}
        for train_row in run_stage(self.stages[-1], batch).to_pylist():
            row.update({f"{self.name}/{k}": v for k, v in train_row.items() if k != "step"})
        for agent in self.agents:
            row.update(agent_metrics(batch, agent, version))
        return row

    def close(self) -> None:
        for _, operator in self.stages:
            if hasattr(operator, "close"):
                operator.close()


def iter_team_on_ray(team: TeamPipeline, eval_every: int = 0, eval_prompts: int = 200) -> Iterator[dict]:
    """The team's metrics rows in step order (module docstring), Ray started embedded if it is not
    running; every `eval_every` steps the team's greedy held-out reward per agent."""
    import ray

    from trajflow.pipelines.ray.embedded import start_local_ray
    from trajflow.pipelines.policy_store import RayStore

    start_local_ray()
    check_resources(team, ray.cluster_resources())
    steps = team.config.steps
    stores = {}
    for name, pipe in team.learners.items():
        c = pipe.config
        stores[name] = RayStore.start(c.max_staleness, c.keeps_history(pipe.strategy), final_version=steps)
        pipe.publish_start(stores[name], 0)
    first = next(iter(team.learners.values())).settings.generator
    agents = {name: agents_of(team, name) for name in team.learners}
    generator = ray.remote(TeamGeneratorActor).options(num_cpus=first.num_cpus, num_gpus=first.num_gpus,
                                                      resources=dict(first.resources)).remote(
        team.generator_arguments(stores), agents)
    learners = {}
    for name, pipe in team.learners.items():
        trainer = pipe.settings.trainer
        learners[name] = ray.remote(LearnerActor).options(
            num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus, resources=dict(trainer.resources)).remote(
            name, team.learner_stages(name), stores[name], agents[name])
    try:
        rollouts = [generator.rollout.remote(team.prompt_rows(r)) for r in range(steps)]
        trained = {name: [actor.step.remote(rollout) for rollout in rollouts] for name, actor in learners.items()}
        for step in range(steps):
            row = {"step": step}
            for name in learners:
                row.update(ray.get(trained[name][step]))
            if eval_every and (step + 1) % eval_every == 0:
                row.update(heldout(team, stores, eval_prompts))
            yield row
    finally:
        ray.get([actor.close.remote() for actor in learners.values()])
        for actor in [generator, *learners.values(), *(store.actor for store in stores.values())]:
            ray.kill(actor)


def check_resources(team: TeamPipeline, cluster: dict[str, float]) -> None:
    """The generator's and every learner's CPUs and GPUs fit the cluster (else Ray would wait for
    them forever): a ValueError naming the keys."""
    demand = {"generator": next(iter(team.learners.values())).settings.generator}
    demand.update({f"{name}'s trainer": pipe.settings.trainer for name, pipe in team.learners.items()})
    for kind in ("num_cpus", "num_gpus"):
        need = sum(getattr(resources, kind) for resources in demand.values())
        have = cluster.get("CPU" if kind == "num_cpus" else "GPU", 0.0)
        if need > have:
            parts = ", ".join(f"{who} {getattr(r, kind):g}" for who, r in demand.items())
            raise ValueError(f"{kind}: the team's actors need {need:g} ({parts}) and Ray has {have:g}; lower "
                             f"generator.{kind} / trainer.{kind} (team.agents.<agent>.trainer.{kind} per agent)")
