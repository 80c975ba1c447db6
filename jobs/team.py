"""`trajflow run` of a config with a `team:` section: the team's loop in this process, a run dir.

    RUN/config.yaml              the team's config
    RUN/metrics.parquet          one row per step: each learner's train-step metrics under
                                 `<learner>/`, each agent's reward, staleness, version, and the
                                 team's held-out reward per agent (pipelines/team.py)
    RUN/agents/<learner>/        each learner's own run dir, as a single-agent run writes it: its
                                 config.yaml (the team's config without `team:`, with its agent's
                                 keys), trajectories (the rows it trained: `agent`, `token_agents`),
                                 checkpoints, versions, metrics; `trajflow report`, `replay` and
                                 `eval` read it as one run
    RUN/summary.txt, run.json

`team.run_on: process` (default): the team's loop in this process (pipelines/team.py); `ray`: per
learner an engine actor and a train-step actor (pipelines/team_ray.py), a learner whose process
dies rebuilt from its own checkpoint and trajectory log while the others run on. `--resume` continues a
killed team run from the newest version every learner has a checkpoint of: in one process as the
uninterrupted run would have gone on (with lags, the versions its rollouts in flight were sampled
with come from versions/: save_all_versions); on Ray with every rollout from there sampled anew.
"""

from __future__ import annotations

import os
import socket
import time
from functools import partial

import polars as pl
import pyarrow as pa

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import JobConfig
from trajflow.jobs.errors import RunError, RunFailed, trainer_state_lost
from trajflow.jobs.recorder import RunPaths, RunRecorder, read_metrics, truncate_after, write_state, write_table_atomic

AGENTS_DIR = "agents"


def learner_paths(paths: RunPaths, learner: str) -> RunPaths:
    """A learner's own run dir inside the team's."""
    return RunPaths(paths.root / AGENTS_DIR / learner)


def run_team_job(config: JobConfig, paths: RunPaths, progress: bool = True, resume: bool = False,
                 verbose: bool = False) -> None:
    """Run the team `config` describes into `paths` (prepared by jobs/run.py: config.yaml
    written); `resume`: continue it from the newest version every learner has a checkpoint of
    (team_resume_point); `verbose`: Ray's workers' lines printed (else in RUN/workers.log)."""
    from trajflow.pipelines.team import TeamPipeline

    started = time.time()
    pipeline_config = config.pipeline_config()  # validated once
    try:
        team = TeamPipeline.from_config(pipeline_config, config.model)
    except ValueError as e:  # a key the environment's agents contradict (team.agents, team.role_prompts)
        raise RunError(str(e)) from None
    settings = pipeline_config.settings.team
    on_ray = settings.run_on == "ray"
    # on Ray no rollout in flight is kept: a resumed run samples every step from the resume point anew
    lags = {} if on_ray else settings.lags
    first_step, checkpoints = team_resume_point(paths, list(team.learners), lags) if resume else (0, {})
    for name, pipe in team.learners.items():
        own = learner_paths(paths, name)
        own.root.mkdir(parents=True, exist_ok=True)
        learner_config = JobConfig(**(pipe.config.model_dump() | _run_options(config) | {"run_dir": own.root}))
        ckpt.atomic_write_text(own.config, learner_config.to_yaml())
        truncate_after(own, first_step)
        RunRecorder(run_dir=str(own.root), steps=config.steps, checkpoint_every=config.checkpoint_every,
                    keep_checkpoints=config.keep_checkpoints, save_all_versions=config.save_all_versions,
                    trajectory_log=config.trajectory_log, checkpoint_start=on_ray and config.recovery.max_restarts > 0,
                    resume_from=str(checkpoints[name].path) if name in checkpoints else None).install(pipe.hooks)
    truncate_after(paths, first_step)
    write_state(paths, state="running", started=started, steps=config.steps, first_step=first_step, team=True,
                pid=os.getpid(), host=socket.gethostname())
    agents = team.environment.agents
    saved = partial(saved_version, paths, checkpoints) if first_step else None
    if first_step:
        print(f"trajflow: resuming the team from version {first_step} of every learner: steps "
              f"{first_step}..{config.steps - 1}", flush=True)
    if on_ray:
        bounds = ", ".join(f"{n} (max_staleness {p.config.max_staleness})" for n, p in team.learners.items())
        print(f"team: {team.environment.name}, agents {', '.join(agents)}; on Ray, learners {bounds}", flush=True)
        from trajflow.jobs.run import start_ray
        from trajflow.pipelines.ray import patches as ray_patches
        from trajflow.pipelines.team_ray import iter_team_on_ray

        start_ray(config)
        ray_patches.worker_output.to(None if verbose else paths.workers_log)  # once Ray forwards lines
        rows = iter_team_on_ray(team, config.eval_every, config.eval_prompts, first_step, saved,
                                logged=partial(logged_train_row, paths))
        start = {}
    else:
        lags = ", ".join(f"{n} (lag {settings.lags.get(n, 0)})" for n in team.learners)
        print(f"team: {team.environment.name}, agents {', '.join(agents)}; learners {lags}", flush=True)
        rows, start = _in_process(config, team, settings.lags, first_step, saved)
    last = started
    try:
        for row in rows:
            if row["step"] == 0:
                row.update({f"{key}_start": value for key, value in start.items()})
            row["seconds/step_end"] = now = time.time()
            write_table_atomic(pa.Table.from_pylist([row]), paths.metrics_file(int(row["step"])))
            for name in team.learners:  # a learner rebuilt on Ray (pipelines/team_ray.py)
                if row.get(f"{name}/recovery/event"):
                    print(f"trajflow: recovered learner {name}: {row[f'{name}/recovery/event']}", flush=True)
            if progress and config.status_every and (row["step"] % config.status_every == 0
                                                      or row["step"] == config.steps - 1):
                print(team_status_line(row, agents, config.steps, now - last), flush=True)
            last = now
    except Exception as e:
        write_state(paths, state="failed", ended=time.time(), error=f"{type(e).__name__}: {e}"[:500])
        lost = trainer_state_lost(e)
        if lost is not None:  # a learner not rebuilt (no checkpoint yet, max_restarts spent): one line
            raise RunFailed(f"{lost} (team run {paths.root})") from None
        if on_ray:
            from trajflow.pipelines.team_ray import TeamProcessLost

            if isinstance(e, TeamProcessLost):  # a rollout process died: its message is the line
                raise RunFailed(f"{e} (team run {paths.root})") from None
        raise
    metrics = read_metrics(paths)
    write_table_atomic(metrics.to_arrow(), paths.metrics)
    for name in team.learners:
        own = learner_paths(paths, name)
        write_table_atomic(read_metrics(own).to_arrow(), own.metrics)
    summary = team_summary(metrics, agents, time.time() - started)
    ckpt.atomic_write_text(paths.summary, summary + "\n")
    print(summary, flush=True)
    write_state(paths, state="finished", ended=time.time())


def _in_process(config: JobConfig, team, lags: dict[str, int], first_step: int, saved):
    """The rows of the team's loop in this process from `first_step` (a resume: > 0, its
    learners' versions from `saved`) and the held-out rewards of version 0 (a fresh run with
    eval_every)."""
    from trajflow.pipelines.team import heldout, iter_team_in_process, new_store

    stores = {name: new_store(pipe, max(0, first_step - lags.get(name, 0)),
                              saved(name, max(0, first_step - lags.get(name, 0))) if saved else None)
              for name, pipe in team.learners.items()}
    start = heldout(team, stores, config.eval_prompts) if config.eval_every and not first_step else {}
    rows = iter_team_in_process(team, lags, config.eval_every, config.eval_prompts, stores=stores,
                                first_step=first_step, saved=saved)
    return (row for _, row in rows), start


def team_resume_point(paths: RunPaths, learners: list[str], lags: dict[str, int]
                      ) -> tuple[int, dict[str, ckpt.Checkpoint]]:
    """The step a killed team run resumes at — the newest version of which every learner has an
    intact checkpoint (0: none) — and those checkpoints. Learner L's rollouts in flight need its
    versions k - lag .. k - 1 too: kept with save_all_versions (RunError naming it otherwise)."""
    kept = {name: {c.version: c for c in ckpt.list_checkpoints(learner_paths(paths, name).checkpoints)
                   if ckpt.checkpoint_problem(c) is None} for name in learners}
    common = set.intersection(*(set(v) for v in kept.values())) if kept else set()
    first_step = max(common, default=0)
    for name in learners:
        missing = [v for v in range(max(0, first_step - lags.get(name, 0)), first_step)
                   if ckpt.saved_version(learner_paths(paths, name).versions, v) is None]
        if missing:
            raise RunError(f"{paths.root}: learner {name}'s versions {missing} (its rollouts in flight at step "
                           f"{first_step}) are not kept; a team run with lags resumes with save_all_versions: true")
    return first_step, {name: kept[name][first_step] for name in learners if first_step in kept[name]}


def saved_version(paths: RunPaths, checkpoints: dict[str, ckpt.Checkpoint], learner: str, version: int):
    """A learner's weights of `version`: its checkpoint's at the resume point, else versions/."""
    checkpoint = checkpoints.get(learner)
    if checkpoint is not None and checkpoint.version == version:
        return checkpoint.model_state()
    path = ckpt.saved_version(learner_paths(paths, learner).versions, version)
    if path is None:
        raise RunError(f"{paths.root}: learner {learner}'s version {version} is not kept (save_all_versions)")
    return ckpt.load_version(path)


def logged_train_row(paths: RunPaths, learner: str, step: int) -> dict | None:
    """A learner's train-step metrics of `step` as its own run dir holds them (None: not written)."""
    path = learner_paths(paths, learner).metrics_file(step)
    return pl.read_parquet(path).row(0, named=True) if path.is_file() else None


def _run_options(config: JobConfig) -> dict:
    """The run options of `config` (JobConfig's own keys, not the pipeline's)."""
    from trajflow.pipelines.config import PipelineConfig

    return {k: v for k, v in config.model_dump().items() if k not in PipelineConfig.model_fields}


def team_status_line(row: dict, agents: tuple[str, ...], steps: int, seconds: float) -> str:
    """`step 3 (40%) | 1.2s | lead 0.312 s2 | finish 0.312 s1`: each agent's mean reward and
    staleness, within 100 columns."""
    line = f"step {row['step']:>{len(str(steps - 1))}} ({100 * (row['step'] + 1) // steps:>3}%) | {seconds:.1f}s"
    for agent in agents:
        field = f"{agent} {row[f'{agent}/reward/mean']:.3f} s{row[f'{agent}/staleness/max']}"
        if len(line) + 3 + len(field) > 100:
            break
        line += " | " + field
    return line


def team_summary(metrics: pl.DataFrame, agents: tuple[str, ...], seconds: float) -> str:
    """Steps, wall time, and per agent its reward (first and last 5 steps) and held-out reward."""
    lines = [f"steps logged: {metrics.height} | {seconds:.1f} s"]
    for agent in agents:
        reward = metrics[f"{agent}/reward/mean"].to_list()
        line = f"{agent}: reward {sum(reward[:5]) / len(reward[:5]):.3f} -> {sum(reward[-5:]) / len(reward[-5:]):.3f}"
        key = f"heldout/{agent}"
        if key in metrics.columns and metrics[key].drop_nulls().len():
            start = metrics[f"{key}_start"][0] if f"{key}_start" in metrics.columns else None
            line += f" | held-out {'' if start is None else f'{start:.3f} -> '}{metrics[key].drop_nulls()[-1]:.3f}"
        lines.append(line)
    return "\n".join(lines)

