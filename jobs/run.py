"""`trajflow run`: one job on an embedded (or given) Ray, writing a run directory (see recorder.py).

    run_job(config)                 a new run
    resume_job(run_dir)             continue a killed run from its last complete checkpoint

The config is validated and the run dir prepared before Ray starts (preflight.py). The driver shows a progress
bar and a status line per step, printed as the step's metrics row arrives (nothing slow runs
between rows: where the stages run, placement.json, comes in the rows themselves); the durable
record (trajectories, metrics, checkpoints) is written by the trainer actor itself (RunRecorder),
so it does not depend on the driver surviving. At the end the per-step metrics are gathered into
metrics.parquet and a summary is printed (summary.py). A failure ends with one line (errors.py).

Steps are numbered from 0 everywhere (status lines, the summary, metrics, TensorBoard, trajectory
partitions): step s trains on weight version s and publishes version s + 1. A checkpoint holds a
version: `checkpoints/step-000005/` is version 5, the state before step 5, from which `--resume`
continues with step 5. Output lines fit 100 columns.

run.json keeps the run's state and one entry per session (a first run, then each resume): when
it started and ended, by which process, the steps it trained and how it ended, the trainer's
and store's recoveries (`recoveries`) and the stage processes Ray restarted (`restarts`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import JobConfig, build_job_config, parse_config_text
from trajflow.jobs.console import wrap
from trajflow.jobs.errors import RunError, RunFailed, stop_line, store_lost, trainer_state_lost
from trajflow.jobs.preflight import check_cluster, check_gpus_here, check_same_data, check_version_space
from trajflow.jobs.recorder import (
    RunPaths,
    RunRecorder,
    logged_steps,
    pid_alive,
    read_metrics,
    read_state,
    same_host,
    truncate_after,
    write_state,
    write_table_atomic,
)
from trajflow.jobs.summary import record_placement, status_line, summary_table
from trajflow.jobs.trackers import Trackers, open_trackers, tracked_summary
from trajflow.operators.trainer.recovery import RESTARTED_PREFIX
from trajflow.operators.trainer.state import learner_weights
from trajflow.pipelines.ray.embedded import WORKER_ENV, keep_session_logs, session_logs_to, start_local_ray
from trajflow.pipelines.ray.quiet import quiet_ray, quiet_run

log = logging.getLogger("trajflow")

RAY_LOGS = "ray-logs"  # a failed run's embedded Ray logs (pipelines/ray/embedded.py), in the run dir


def default_run_dir(config: JobConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(config.runs_root) / f"{config.name}-{config.build_strategy().name}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def start_ray(config: JobConfig, verbose: bool = False, logs: Path | None = None) -> None:
    """The embedded Ray (pipelines/ray/embedded.py: 127.0.0.1 only, ended with this process, its
    session dir removed at exit; kept in `logs` if the run fails), or a connection to
    `ray_address` / RAY_ADDRESS."""
    import ray

    if ray.is_initialized():
        return
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:  # the pipeline's modules (Ray Data; never torch: the actors' own) load while Ray starts
        start_local_ray(dashboard=config.dashboard, verbose=verbose, imports=("trajflow.pipelines.rl_loop",))
        if logs is not None:
            session_logs_to(logs)
        return
    quiet_ray(verbose)
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        runtime_env = None  # a submitted job: Ray refuses to merge a driver env into the job's
    try:
        ray.init(address=address, runtime_env=runtime_env, configure_logging=False)
    except (ConnectionError, TimeoutError) as e:
        raise RunError(f"ray_address {address}: cannot connect to the Ray cluster ({str(e).splitlines()[0]})") from None


# -- run.json: state and sessions -----------------------------------------------------------------
def _begin_session(paths: RunPaths, first_step: int, steps: int) -> None:
    state = read_state(paths)
    sessions = state.get("sessions")
    if sessions is None:  # a run dir written before sessions were recorded: keep what it said
        sessions = [{k: state[k] for k in ("started", "ended", "pid", "host", "first_step", "state", "error")
                     if k in state}] if state else []
    for previous in sessions:  # a session still "running" here was killed before it could say so
        if previous.get("state") == "running":
            previous.update(state="killed", steps_trained=max(0, first_step - int(previous.get("first_step", 0))))
    session = {"started": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "first_step": first_step,
               "steps": steps, "state": "running"}
    write_state(paths, state="running", pid=session["pid"], host=session["host"], started=session["started"],
                first_step=first_step, steps=steps, ended=None, error=None, sessions=[*sessions, session])


def record_recovery(paths: RunPaths, row: dict) -> None:
    """Add a recovery (operators/trainer/recovery.py) to this session's entry in run.json: what died and
    where, the step it ended at, the checkpoint's replayed steps and the seconds it took."""
    state = read_state(paths)
    sessions = state.get("sessions") or [{}]
    sessions[-1].setdefault("recoveries", []).append(
        {"event": row["recovery/event"], "step": int(row["step"]), "seconds": float(row["recovery/seconds"]),
         "replayed_steps": int(row["recovery/replayed_steps"]), "restarts": int(row["recovery/restarts"]),
         "time": time.time()})
    write_state(paths, sessions=sessions)


def record_restarts(paths: RunPaths, row: dict) -> list[str]:
    """The stage processes Ray restarted after they died (a generator, a scorer: the
    `recovery/restarted/<process>` counts of the row, pipelines/colocation.py), added to this
    session's entry in run.json; one line each for the console."""
    restarted = [(key.removeprefix(RESTARTED_PREFIX), int(count)) for key, count in row.items()
                 if key.startswith(RESTARTED_PREFIX) and count]
    if not restarted:
        return []
    state = read_state(paths)
    sessions = state.get("sessions") or [{}]
    lines = []
    for process, count in restarted:
        times = "" if count == 1 else f" ({count} times)"
        event = (f"the {process} process died{times}; Ray restarted it and Ray Data retried the batch it held "
                 f"(noticed at step {int(row['step'])})")
        sessions[-1].setdefault("restarts", []).append(
            {"process": process, "count": count, "step": int(row["step"]), "event": event, "time": time.time()})
        lines.append(event)
    write_state(paths, sessions=sessions)
    return lines


def _end_session(paths: RunPaths, state: str, error: str | None = None) -> None:
    current = read_state(paths)
    sessions = current.get("sessions") or [{}]
    ended = time.time()
    done = logged_steps(paths)
    first = sessions[-1].get("first_step", 0)
    sessions[-1].update(state=state, ended=ended, error=error,
                        steps_trained=len([s for s in done if s >= first]))
    write_state(paths, state=state, ended=ended, error=error, sessions=sessions)


# -- the run -------------------------------------------------------------------------------------
def resolved_model_path(config: JobConfig) -> Path:
    from trajflow.engines.paths import WARM_START_DIR

    return Path(config.model or WARM_START_DIR).resolve()


def plan_new_run(config: JobConfig) -> tuple[RunPaths, JobConfig, str | None]:
    """Check the run dir and the disk (writing nothing): the paths, the config with run dir and
    model path resolved, and the save_all_versions size estimate (if any)."""
    root = Path(config.run_dir) if config.run_dir is not None else default_run_dir(config)
    if root.exists() and not root.is_dir():
        raise RunError(f"run dir {root} exists and is not a directory")
    if root.exists() and any(root.iterdir()):
        raise RunError(f"run dir {root} already exists and is not empty (use --resume {root} to continue it)")
    root = root.resolve()
    resolved = config.model_copy(update={"run_dir": root, "model": resolved_model_path(config)})
    existing = next((p for p in [root, *root.parents] if p.exists()), Path("/"))
    estimate = check_version_space(resolved, resolved.model, existing) if config.save_all_versions else None
    return RunPaths(root), resolved, estimate


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> JobConfig:
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise RunError(f"{run_dir}: not a run dir (no config.yaml)")
    return build_job_config(parse_config_text(paths.config.read_text(), str(paths.config)), overrides)


def prepare_pipeline(config: JobConfig, verbose: bool = False):
    """Ray up and the run's pipeline built, its actors checked against the cluster's resources
    (check_cluster): a cluster that cannot be reached or cannot hold the run ends here, before
    anything is written."""
    check_gpus_here(config)
    start_ray(config, verbose, logs=Path(config.run_dir) / RAY_LOGS if config.run_dir is not None else None)
    with quiet_run(verbose):
        from trajflow.pipelines.rl_loop import RLPipeline

        pipeline = RLPipeline(config.pipeline_config(), model_path=resolved_model_path(config))
    check_cluster(pipeline)
    return pipeline


def run_job(config: JobConfig, *, progress: bool = True, verbose: bool = False) -> Path:
    """Start a new run; returns its run dir."""
    paths, config, estimate = plan_new_run(config)
    if config.team is not None:  # a team (jobs/team.py): in this process or on Ray
        from trajflow.jobs.team import run_team_job

        paths.root.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_text(paths.config, config.to_yaml())
        print(f"trajflow: run dir {paths.root}", flush=True)
        with quiet_run(verbose):
            run_team_job(config, paths, progress, verbose=verbose)
        return paths.root
    pipeline = prepare_pipeline(config, verbose)
    paths.root.mkdir(parents=True, exist_ok=True)
    ckpt.atomic_write_text(paths.config, config.to_yaml())
    if estimate:
        print(f"trajflow: {estimate}", flush=True)
    _execute(config, paths, pipeline, first_step=0, checkpoint=None, progress=progress, verbose=verbose)
    return paths.root


def resume_job(run_dir: str | os.PathLike, overrides: list[str] | None = None, *, progress: bool = True,
               verbose: bool = False) -> Path:
    """Continue a killed run from its last complete checkpoint (a fresh start if it has none); a
    newer checkpoint with a truncated or corrupt file is passed over, saying so. A finished run is
    left untouched."""
    root = Path(run_dir).resolve()
    paths = RunPaths(root)
    config = load_run_config(root, overrides)
    state = read_state(paths)
    if state.get("state") == "running" and same_host(state) and state.get("pid") and pid_alive(int(state["pid"])) \
            and int(state["pid"]) != os.getpid():
        raise RunError(f"{root}: the run is still active (pid {state['pid']}); stop it before resuming")
    if config.team is not None:  # in this process (jobs/team.py): every learner from its checkpoint
        from trajflow.jobs.team import run_team_job

        if state.get("state") == "finished":
            print(f"trajflow: {root} already finished all {config.steps} steps; nothing to do")
            return root
        with quiet_run(verbose):
            run_team_job(config, paths, progress, resume=True, verbose=verbose)
        return root
    latest, damaged = ckpt.latest_intact_checkpoint(paths.checkpoints)  # checked before anything is written
    first_step = latest.version if latest is not None else 0
    for checkpoint, problem in damaged:
        fallback = latest.path.name if latest is not None else "the start"
        print(f"trajflow: checkpoint {checkpoint.path.name} is damaged ({problem}); falling back to {fallback}",
              flush=True)
    if first_step >= config.steps and state.get("state") == "finished":
        sessions = len(state.get("sessions") or [state])
        print(f"trajflow: {root} already finished all {config.steps} steps ({sessions} session"
              f"{'s' if sessions > 1 else ''}); nothing to do (to train longer: --set steps=N)")
        return root
    check_same_data(config, latest)
    pipeline = prepare_pipeline(config, verbose) if first_step < config.steps else None
    if overrides:
        ckpt.atomic_write_text(paths.config, config.model_copy(update={"run_dir": root}).to_yaml())
    removed = truncate_after(paths, first_step)
    where = f"checkpoint {latest.path.name}" if latest is not None else "the start (no checkpoint)"
    print(f"trajflow: resuming from {where}: steps {first_step}..{config.steps - 1}"
          + (f" (discarded partial logs of steps {removed[0]}..{removed[-1]})" if removed else ""), flush=True)
    _execute(config, paths, pipeline, first_step=first_step, checkpoint=latest, progress=progress, verbose=verbose)
    return root


def _execute(config: JobConfig, paths: RunPaths, pipeline, first_step: int, checkpoint: ckpt.Checkpoint | None,
             progress: bool, verbose: bool = False) -> None:
    """Run `pipeline` (prepare_pipeline; None when every step is trained) from `first_step`."""
    from tqdm.auto import tqdm

    from trajflow.pipelines.ray import patches as ray_patches

    started = time.time()
    trackers = None
    _begin_session(paths, first_step, config.steps)
    paths.trainer_lost.unlink(missing_ok=True)  # a previous session's
    if first_step >= config.steps:  # killed after its last checkpoint, before the summary
        print(f"trajflow: all {config.steps} steps are trained; writing the summary")
        _finish(config, paths, first_step, started, [])
        return
    interactive = progress and sys.stderr.isatty()
    step_seconds: list[float] = []
    try:
        # the workers' lines: to workers.log for the rest of the process (a worker's last lines
        # can reach the driver after the pipeline has ended), printed as Ray does with --verbose
        ray_patches.worker_output.to(None if verbose else paths.workers_log)
        with quiet_run(verbose):
            recorder = RunRecorder(
                run_dir=str(paths.root),
                steps=config.steps,
                checkpoint_every=config.checkpoint_every,
                keep_checkpoints=config.keep_checkpoints,
                save_all_versions=config.save_all_versions,
                trajectory_log=config.trajectory_log,
                resume_from=str(checkpoint.path) if checkpoint is not None else None,
                checkpoint_start=config.recovery.max_restarts > 0,
                data_state=pipeline.data_state(),
            )
            recorder.install(pipeline.hooks)  # also the source a trainer that dies is rebuilt from
            pipeline.version_archive = recorder  # and a policy store that dies
            weights = learner_weights(checkpoint.path, pipeline.learner_names) if checkpoint is not None else None
            pipeline.start_store(initial_version=first_step, initial_weights=weights)
            print(wrap(pipeline.describe()), flush=True)
            print(f"trajflow: run dir {paths.root}", flush=True)
            trackers = open_trackers(config, paths.root, first_step)  # report_to (jobs/trackers.py)
            _stream(config, paths, pipeline, first_step, started, interactive, step_seconds, tqdm, trackers)
    except BaseException as e:
        from trajflow.operators.reward import RewardFailed
        from trajflow.pipelines.store_recovery import StoreLost

        stopped = isinstance(e, (KeyboardInterrupt, SystemExit))
        _end_session(paths, "stopped" if stopped else "failed", f"{type(e).__name__}: {e}"[:500])
        if not stopped:  # the embedded Ray's logs survive the process, in RUN/ray-logs
            keep_session_logs()
        if trackers is not None:
            trackers.finish(tracked_summary(paths.root), "stopped" if stopped else "failed")
        if isinstance(e, (RewardFailed, StoreLost)):  # the reward is broken, or a store not rebuilt: one line
            raise RunFailed(str(e).replace("RUN_DIR", str(paths.root))) from None
        written = paths.trainer_lost.read_text().strip() if paths.trainer_lost.is_file() else None
        lost = None if stopped else (written or trainer_state_lost(e) or store_lost(e))
        if lost is not None:  # a trainer worker died: its optimizer state is gone; say how to go on
            raise RunFailed(lost.replace("RUN_DIR", str(paths.root))) from None
        from trajflow.operators.trainer.weight_sync import WeightSyncError

        sync = None if stopped else stop_line(e, WeightSyncError)
        if sync is not None:  # a weight reader or the trainer was lost mid-transfer (weight_sync collective)
            raise RunFailed(sync.removeprefix("trajflow: ")) from None
        raise
    _finish(config, paths, first_step, started, step_seconds, trackers)


def _stream(config, paths, pipeline, first_step, started, interactive, step_seconds, tqdm, trackers) -> None:
    bar = tqdm(total=config.steps, initial=first_step, desc=f"trajflow {pipeline.strategy.name}", disable=not interactive,
               file=sys.stderr, dynamic_ncols=True, leave=False)
    say = bar.write if interactive else (lambda line: print(line, flush=True))
    placement: dict[str, list[str]] = {}
    last = started

    def on_sigterm(signum, frame):  # `trajflow stop` / `ray job stop` send SIGTERM: record it, exit
        raise SystemExit(128 + signum)

    try:
        previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (e.g. called from a notebook worker thread)
        previous_sigterm = None
    try:
        for row in pipeline.iter_metrics(first_step=first_step):
            now = time.time()
            step_seconds.append(now - last)
            last = now
            step = int(row["step"])
            if config.status_every and (step % config.status_every == 0 or step == config.steps - 1):
                say(status_line(row, config.steps, step_seconds[-1]))  # first: the line shows the step's end
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}")
            trackers.log(row)
            if row.get("recovery/event"):
                say(f"trajflow: recovered: {row['recovery/event']}")
                record_recovery(paths, row)
            for line in record_restarts(paths, row):
                say(wrap(f"trajflow: restarted: {line}"))
            if row.get("checkpoint") is not None:
                say(f"trajflow: checkpoint of version {row['checkpoint']} (resumes at step {row['checkpoint']})")
            if record_placement(paths, placement, row) and len({n for v in placement.values() for n in v}) > 1:
                say(wrap("trajflow: placement " + ", ".join(f"{k} on {[n[:8] for n in v]}"
                                                            for k, v in sorted(placement.items()))))
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        bar.close()


def _finish(config: JobConfig, paths: RunPaths, first_step: int, started: float, step_seconds: list[float],
            trackers: Trackers | None = None) -> None:
    metrics = read_metrics(paths)
    if not metrics.is_empty():
        write_table_atomic(metrics.to_arrow(), paths.metrics)
    from trajflow.pipelines.replay import replay_support

    kept = [c.version for c in ckpt.list_checkpoints(paths.checkpoints)]
    summary = summary_table(paths, config.steps, first_step, time.time() - started, step_seconds,
                            heldout_prompts=config.eval_prompts if config.eval_every else 0,
                            replay=replay_support(config.trajectory_log, config.save_all_versions, kept))
    ckpt.atomic_write_text(paths.summary, summary + "\n")
    print(summary, flush=True)
    missing = sorted(set(range(config.steps)) - set(metrics["step"].to_list() if not metrics.is_empty() else []))
    state = "failed" if missing else "finished"
    if missing:
        keep_session_logs()
    _end_session(paths, state, f"steps without metrics: {missing}" if missing else None)
    if trackers is not None:  # the summary and the run's files (PNGs drawn now) to W&B / MLflow / TensorBoard
        trackers.finish(tracked_summary(paths.root), state)
    if missing:
        raise RunError(f"the run ended with steps {missing} missing from the metrics")
