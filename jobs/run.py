"""`trajflow run`: one job on an embedded (or given) Ray, writing a run directory (see recorder.py).

    run_job(config)                 a new run
    resume_job(run_dir)             continue a killed run from its last complete checkpoint

The config is validated and the run dir prepared before Ray starts. The driver shows a progress
bar and a status line per step, printed as the step's metrics row arrives (nothing slow runs
between rows: where the stages run, placement.json, comes in the rows themselves); the durable
record (trajectories, metrics, checkpoints) is written by the trainer actor itself (RunRecorder),
so it does not depend on the driver surviving. At the end the per-step metrics are gathered into
metrics.parquet and a summary is printed, held-out accuracy before and after training included.

Steps are numbered from 0 everywhere (status lines, the summary, metrics, TensorBoard, trajectory
partitions): step s trains on weight version s and publishes version s + 1. A checkpoint holds a
version: `checkpoints/step-000005/` is version 5, the state before step 5, from which `--resume`
continues with step 5. Output lines fit 100 columns.

run.json keeps the run's state and one entry per session (a first run, then each resume): when
it started and ended, by which process, the steps it trained and how it ended.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import JobConfig, build_job_config, parse_config_text
from trajflow.jobs.console import WIDTH, format_table, wrap
from trajflow.jobs.trackers import Trackers, open_trackers, tracked_summary
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
from trajflow.pipelines.colocation import NODE_AREA
from trajflow.pipelines.local_ray import WORKER_ENV, keep_session_logs, session_logs_to, start_local_ray
from trajflow.pipelines.quiet import quiet_ray, quiet_run

log = logging.getLogger("trajflow")

NODE_PREFIX = f"{NODE_AREA}/"  # metrics-row columns naming the node of a stage's process
RAY_LOGS = "ray-logs"  # a failed run's embedded Ray logs (pipelines/local_ray.py), in the run dir

# (label, metrics key, format) of a status line, in the order they are dropped last to first
STATUS_KEYS = (
    ("reward", "reward_mean", "{:.3f}"),
    ("mask", "mask/token_kept_frac", "{:.3f}"),
    ("clip", "clip/frac", "{:.3f}"),
    ("k3", "mismatch/k3", "{:.1e}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("loss", "loss", "{:+.4f}"),
)

# (header, metrics key, format) of the summary table
SUMMARY_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("trained", "rows_trained", "{:d}"),
    ("reward errors", "reward/errors", "{:d}"),  # shown when the reward failed on some row
    ("mask", "mask/token_kept_frac", "{:.3f}"),
    ("clip", "clip/frac", "{:.3f}"),
    ("k3", "mismatch/k3", "{:.1e}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("stale max", "staleness/max", "{:.0f}"),
    ("loss", "loss", "{:+.4f}"),
    ("train s", "train_seconds", "{:.2f}"),
)


class RunError(RuntimeError):
    """A run cannot start or resume; the message is one line."""


class RunFailed(RuntimeError):
    """A started run stopped and can only go on with `--resume` (e.g. a trainer worker died, or
    the reward failed on every row of too many steps); the message is one line (the CLI prints
    it and exits 1)."""


def trainer_state_lost(error: BaseException) -> str | None:
    """The one-line message of a TrainerStateLost behind `error`, else None (`stop_line`)."""
    from trajflow.operators.data_parallel import TrainerStateLost

    return stop_line(error, TrainerStateLost)


def stop_line(error: BaseException, kind: type[BaseException]) -> str | None:
    """The one-line message of a `kind` exception behind `error`, else None.

    Ray Data wraps the step's error (UserCodeException, RayTaskError), appends its retry advice
    ("To change retry attempts, ... `ray.data.DataContext` ...") to the message of the exception
    it re-raises, and across processes only the text of the cause may survive. So the message is
    taken from the first line after `<kind>: ` in any text of the chain, never from a whole
    `str(e)` (whose last lines may be Ray's advice)."""
    import re

    pattern = re.compile(rf"{kind.__name__}: ([^\n]+)")
    for e, text in _chain_texts(error):
        if isinstance(e, kind) and e.args and isinstance(e.args[0], str) and e.args[0].strip():
            return e.args[0].strip().splitlines()[0]
        found = pattern.search(text)
        if found:
            return found.group(1).strip()
    return None


def store_lost(error: BaseException) -> str | None:
    """One line when the policy store's actor died behind `error` (Ray names its class in the
    ActorDiedError that the operator calling it raised), else None: a run that does not rebuild
    its store (`recovery.max_restarts: 0`, or weight_sync collective; pipelines/store_recovery.py)."""
    from trajflow.operators.data_parallel import RESUME_HINT
    from trajflow.pipelines.policy_store import PolicyStoreActor

    for _, text in _chain_texts(error):
        if f"class_name: {PolicyStoreActor.__name__}" in text and ("actor died" in text or "actor is dead" in text):
            return f"the policy store's process died; the run stops: {RESUME_HINT}"
    return None


def _chain_texts(error: BaseException):
    """(exception, text) for each exception behind `error` and each of its texts (its message and,
    for Ray's errors, the traceback of the remote process), cause chain included."""
    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for text in (str(e), getattr(e, "traceback_str", None)):
            if isinstance(text, str):
                yield e, text
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]


def default_run_dir(config: JobConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(config.runs_root) / f"{config.name}-{config.build_strategy().name}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def start_ray(config: JobConfig, verbose: bool = False, logs: Path | None = None) -> None:
    """The embedded Ray (pipelines/local_ray.py: 127.0.0.1 only, ended with this process, its
    session dir removed at exit; kept in `logs` if the run fails), or a connection to
    `ray_address` / RAY_ADDRESS."""
    import ray

    if ray.is_initialized():
        return
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:  # torch and transformers (the pipeline's model code) load while Ray starts
        start_local_ray(dashboard=config.dashboard, verbose=verbose, imports=("trajflow.engines.models",))
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


def local_gpus() -> int:
    """GPUs an embedded Ray would find here: CUDA_VISIBLE_DEVICES if set, else the NVIDIA
    driver's devices (no torch import: it would delay the start)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


GPU_KEYS = ("generator", "scorer", "trainer")  # the sections with a num_gpus


def check_gpus_here(config: JobConfig) -> None:
    """A GPU asked of an embedded Ray on a machine without one: one line before Ray starts (Ray
    would wait for it forever)."""
    if config.ray_address or os.environ.get("RAY_ADDRESS"):
        return  # the cluster's GPUs are checked once connected (check_cluster)
    asked = [f"{key}.num_gpus" for key in GPU_KEYS if getattr(config, key).num_gpus > 0]
    if asked and local_gpus() == 0:
        raise RunError(f"{asked[0]}: {getattr(config, asked[0].split('.')[0]).num_gpus:g} GPU asked, but this "
                       "machine has no GPU (set it to 0, or give ray_address of a cluster with GPUs)")


def check_cluster(pipeline) -> None:
    """The pipeline's actors (RLPipeline.resource_demand) fit the Ray they will run on: each actor on
    one node, all of them at once in the cluster's total. Ray would otherwise wait for resources
    that never come, without a word. RunError (one line, exit 2) before anything is written."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value
    need: dict[str, float] = {}
    parts: dict[str, list[str]] = {}
    for which, count, bundle in pipeline.resource_demand():
        asked = {k: v for k, v in bundle.items() if v > 0}
        if not any(all(node.get(k, 0.0) >= v - 1e-9 for k, v in asked.items()) for node in nodes):
            key, value = next((k, v) for k, v in asked.items() if not any(n.get(k, 0.0) >= v - 1e-9 for n in nodes))
            have = max((n.get(key, 0.0) for n in nodes), default=0.0)
            raise RunError(f"resources: {which} asks {value:g} {key} per actor, but no node of the Ray cluster has "
                           f"that much (the largest has {have:g}); lower its {_resource_key(which, key)}")
        for key, value in asked.items():
            need[key] = need.get(key, 0.0) + count * value
            parts.setdefault(key, []).append(f"{which} {f'{count} x ' if count > 1 else ''}{value:g}")
    for key, value in need.items():
        if value > total.get(key, 0.0) + 1e-9:
            raise RunError(f"resources: the run's actors ask {value:g} {key} at once ({', '.join(parts[key])}), but "
                           f"the Ray cluster has {total.get(key, 0.0):g}; lower trainer.num_workers, num_generators "
                           f"or the stages' {_resource_key('', key)}")


def _resource_key(which: str, resource: str) -> str:
    name = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(resource, f"resources.{resource}")
    return f"trainer.{name}" if which == "trainer.num_workers" else name


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def check_version_space(config: JobConfig, model_path: Path, root: Path) -> str:
    """The disk space save_all_versions will take; RunError if the run dir's disk lacks it."""
    nbytes = ckpt.weights_nbytes(model_path)
    versions = config.steps + 1
    total = nbytes * versions
    estimate = f"save_all_versions: {versions} versions x {_human(nbytes)} = {_human(total)} of weights"
    free = shutil.disk_usage(root).free
    if total > free:
        raise RunError(f"{estimate}, but only {_human(free)} is free under {root} "
                       "(set save_all_versions: false, or fewer steps)")
    return estimate + " under versions/"


def status_line(row: dict, steps: int, seconds: float | None = None) -> str:
    """`step 4 (25%) | reward 0.219 | 1.2s | rows 16/32 | mask ...` within WIDTH columns: the
    step index, the share of the run done, the step's numbers (`reward errors N` when the reward
    failed on N rows), the wall time since the previous line (for the first line: since the run
    started, so it shows the start-up)."""
    step = int(row["step"])
    parts = [f"step {step:>{len(str(steps - 1))}} ({100 * (step + 1) // steps:>3}%)"]
    fields = [f"reward {row['reward_mean']:.3f}"] if row.get("reward_mean") is not None else []
    fields.append(f"rows {row.get('rows_trained', 0)}/{row.get('rows', 0)}")
    if row.get("reward/errors"):
        fields.append(f"reward errors {row['reward/errors']}")
    fields += [f"{label} {fmt.format(row[key])}" for label, key, fmt in STATUS_KEYS[1:] if row.get(key) is not None]
    if seconds is not None:
        fields.insert(2, f"{seconds:.1f}s")
    line = parts[0]
    for field in fields:
        if len(line) + 3 + len(field) > WIDTH:
            break
        line += " | " + field
    return line


def record_placement(paths: RunPaths, placement: dict[str, list[str]], row: dict) -> bool:
    """Add the nodes a metrics row reports to `placement` ({stage class: [node ids]}): each
    stage-group actor reports its node in the `node/<stage class>` columns of the row of its first
    batch (pipelines/colocation.py). When that adds a node, placement.json is rewritten with the
    nodes' custom resources, e.g. {"stages": {"Generate": [node]}, "nodes": {node: {...}}}, and
    True returned. (Not Ray's state API: it needs the dashboard, and an embedded Ray has none.)"""
    import json

    import ray

    changed = False
    for key, node in row.items():
        if not (key.startswith(NODE_PREFIX) and node):
            continue
        where = placement.setdefault(key.removeprefix(NODE_PREFIX), [])
        if node not in where:
            where.append(node)
            changed = True
    if changed:
        nodes = {n["NodeID"]: {"address": n.get("NodeManagerAddress"), "resources": n.get("Resources", {})}
                 for n in ray.nodes() if n.get("Alive")}
        ckpt.atomic_write_text(paths.root / "placement.json",
                               json.dumps({"stages": placement, "nodes": nodes}, indent=1, sort_keys=True))
    return changed


def heldout_line(metrics, prompts: int) -> str | None:
    """Held-out accuracy of the starting weights (version 0) and of the last version evaluated,
    with the standard error sqrt(p (1 - p) / n) over the n held-out prompts (exact for a 0/1
    reward, an upper bound for rewards in [0, 1]); of the change, sqrt(se0² + se1²) (the same
    prompts both times, so conservative). None without an evaluation. `metrics`: polars, by step."""
    import math

    def se(p: float | None) -> float | None:
        return math.sqrt(p * (1 - p) / prompts) if p is not None and 0.0 <= p <= 1.0 else None

    def last(column: str):
        values = metrics.select("version", column).drop_nulls() if column in metrics.columns else metrics.clear()
        return (float(values[column][-1]), int(values["version"][-1])) if values.height else (None, None)

    start, _ = last("heldout_accuracy_start")
    end, version = last("heldout_accuracy")
    if start is not None and end is not None:
        errors = (se(start), se(end))
        interval = f" ± {math.hypot(*errors):.3f} (s.e.)" if None not in errors else ""
        text = f"{start:.3f} at version 0 -> {end:.3f} at version {version}, {end - start:+.3f}{interval}"
    elif start is not None or end is not None:
        p = start if start is not None else end
        text = f"{p:.3f}" + (f" ± {se(p):.3f} (s.e.)" if se(p) is not None else "") + \
            f" at version {0 if start is not None else version}"
    else:
        return None
    return f"held-out accuracy on {prompts} prompts: {text}"


def reward_errors_line(metrics) -> str | None:
    """`reward errors: 12 of 96 rows, in 3 of 6 steps; first: ValueError: ...`, or None when the
    reward never failed. `metrics`: polars, by step."""
    if "reward/errors" not in metrics.columns or not metrics["reward/errors"].sum():
        return None
    errors = metrics["reward/errors"].fill_null(0)
    first = metrics["reward/first_error"].drop_nulls() if "reward/first_error" in metrics.columns else []
    return (f"reward errors: {int(errors.sum())} of {int(metrics['rows'].sum())} rows, in {int((errors > 0).sum())} "
            f"of {metrics.height} steps" + (f"; first: {first[0]}" if len(first) else ""))


def summary_table(paths: RunPaths, steps: int, first_step: int, session_seconds: float,
                  step_seconds: list[float], heldout_prompts: int = 0, replay: str | None = None) -> str:
    """Every step of a short run, or about 10 evenly spaced ones and the last; then the reward
    at both ends, the rows whose reward failed (if any), held-out accuracy before and after
    (over `heldout_prompts`), the time per step, the checkpoints, whether the run can be replayed
    (`replay`: pipelines.replay.replay_support) and the run dir."""
    metrics = read_metrics(paths)
    if metrics.is_empty():
        return "no steps were trained"
    rows = metrics.to_dicts()
    shown = rows if len(rows) <= 12 else [rows[i] for i in sorted({*range(0, len(rows), len(rows) // 10), len(rows) - 1})]
    rewards = metrics["reward_mean"]
    n = min(5, len(rewards))
    checkpoints = [c.path.name for c in ckpt.list_checkpoints(paths.checkpoints)]
    timing = f"this session: steps {first_step}..{steps - 1} in {session_seconds:.1f}s"
    if step_seconds:
        timing += f" ({step_seconds[0]:.1f}s to the first step"
        if len(step_seconds) > 1:
            rest = step_seconds[1:]
            timing += f", then {sum(rest) / len(rest):.2f}s per step"
        timing += ")"
    errors = reward_errors_line(metrics)
    columns = [c for c in SUMMARY_COLUMNS if errors or c[1] != "reward/errors"]
    lines = [
        format_table(shown, columns),
        f"steps logged: {metrics.height} of {steps} | reward: mean of the first {n} steps "
        f"{rewards.head(n).mean():.3f}, of the last {n} {rewards.tail(n).mean():.3f}",
    ]
    if errors:
        lines.append(wrap(errors))
    heldout = heldout_line(metrics, heldout_prompts) if heldout_prompts else None
    if heldout is not None:
        lines.append(wrap(heldout))
    lines += [
        timing,
        f"checkpoints kept: {', '.join(checkpoints) or 'none'}",
        *([wrap(replay)] if replay else []),
        f"run dir: {paths.root}",
    ]
    return "\n".join(lines)


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
    """Add a recovery (operators/recovery.py) to this session's entry in run.json: what died and
    where, the step it ended at, the checkpoint's replayed steps and the seconds it took."""
    state = read_state(paths)
    sessions = state.get("sessions") or [{}]
    sessions[-1].setdefault("recoveries", []).append(
        {"event": row["recovery/event"], "step": int(row["step"]), "seconds": float(row["recovery/seconds"]),
         "replayed_steps": int(row["recovery/replayed_steps"]), "restarts": int(row["recovery/restarts"]),
         "time": time.time()})
    write_state(paths, sessions=sessions)


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


def check_same_data(config: JobConfig, checkpoint: ckpt.Checkpoint | None) -> None:
    """A resumed dataset run must see the dataset (and settings) its checkpoint was made with."""
    import json

    if checkpoint is None or config.data is None:
        return
    recorded = json.loads((checkpoint.path / "meta.json").read_text()).get("data", {}).get("fingerprint")
    now = config.workload().fingerprint(config.model_path, config.seed, config.prompts_per_step)
    if recorded != now:
        raise RunError(f"resume: data.train_files (or the tokenizer, seed, prompts_per_step or data settings) changed "
                       f"since checkpoint {checkpoint.path.name} (fingerprint {recorded} -> {now}); resume needs "
                       "the data the run started with")


def _execute(config: JobConfig, paths: RunPaths, pipeline, first_step: int, checkpoint: ckpt.Checkpoint | None,
             progress: bool, verbose: bool = False) -> None:
    """Run `pipeline` (prepare_pipeline; None when every step is trained) from `first_step`."""
    from tqdm.auto import tqdm

    from trajflow.pipelines import ray_patches

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
            pipeline.version_source = recorder  # and a policy store that dies
            weights = checkpoint.model_state() if checkpoint is not None else None
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
        from trajflow.operators.weight_sync import WeightSyncError

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
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
            trackers.log(row)
            if row.get("recovery/event"):
                say(f"trajflow: recovered: {row['recovery/event']}")
                record_recovery(paths, row)
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
