"""`trajflow run`: one job on an embedded (or given) Ray, writing a run directory (see recorder.py).

    run_job(config)                 a new run
    resume_job(run_dir)             continue a killed run from its last complete checkpoint

The config is validated and the run dir prepared before Ray starts. The driver shows a progress
bar and a short status line per step; the durable record (trajectories, metrics, checkpoints) is
written by the trainer actor itself (RunRecorder), so it does not depend on the driver surviving.
At the end the per-step metrics are gathered into metrics.parquet and a summary table is printed.
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
from trajflow.jobs.recorder import (
    RunPaths,
    RunRecorder,
    pid_alive,
    read_metrics,
    read_state,
    same_host,
    truncate_after,
    write_state,
    write_table_atomic,
)

log = logging.getLogger("trajflow")

# Environment for every Ray worker of a job: offline hub, no per-worker progress bars.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}

STATUS_KEYS = (
    ("reward", "reward_mean", "{:.3f}"),
    ("mask", "mask/token_kept_frac", "{:.3f}"),
    ("clip", "clip/frac", "{:.3f}"),
    ("active", "active_frac", "{:.3f}"),
    ("k3", "mismatch/k3", "{:.1e}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("loss", "loss", "{:+.4f}"),
)

SUMMARY_COLUMNS = [
    "step", "reward_mean", "rows_trained", "mask/token_kept_frac", "clip/frac", "active_frac",
    "mismatch/k3", "staleness/mean", "staleness/max", "loss", "train_seconds",
]


class RunError(RuntimeError):
    """A run cannot start or resume; the message is one line."""


class RunFailed(RuntimeError):
    """A started run stopped and can only go on with `--resume` (e.g. a trainer worker died);
    the message is one line (the CLI prints it and exits 1)."""


def trainer_state_lost(error: BaseException) -> str | None:
    """The one-line message of a TrainerStateLost behind `error` (which Ray Data wraps in its
    own exceptions; across processes only the text of the cause may survive), else None."""
    import re

    from trajflow.operators.data_parallel import TrainerStateLost

    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, TrainerStateLost):
            return str(e)
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    found = re.search(rf"{TrainerStateLost.__name__}: ([^\n]+)", str(error))
    return found.group(1).strip() if found else None


def default_run_dir(config: JobConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(config.runs_root) / f"{config.name}-{config.build_strategy().name}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def start_ray(config: JobConfig) -> None:
    """Embedded Ray (dashboard off, or on 127.0.0.1), or connect to `ray_address`/RAY_ADDRESS."""
    import ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
            runtime_env = None  # a submitted job: Ray refuses to merge a driver env into the job's
        ray.init(address=address, runtime_env=runtime_env, configure_logging=False)
    else:
        # address="local": a new Ray even if `ray start` left a cluster file in /tmp/ray
        kwargs = dict(address="local", include_dashboard=config.dashboard)
        if config.dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"
        ray.init(runtime_env=runtime_env, configure_logging=False, **kwargs)


def quiet_ray_data() -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    try:  # the memory-request advice is about Ray's defaults, not actionable by a job's user
        ctx.issue_detectors_config.detectors = []
    except AttributeError:
        pass
    for name in ("ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)


def size_estimate(config: JobConfig, model_path: Path) -> str:
    nbytes = ckpt.weights_nbytes(model_path)
    versions = config.steps + 1
    return (f"save_all_versions: {versions} versions x {_human(nbytes)} = {_human(nbytes * versions)} "
            f"of weights under versions/")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def status_line(row: dict, steps: int) -> str:
    parts = [f"step {int(row['step']) + 1:>{len(str(steps))}}/{steps}", f"v{row.get('version')}",
             f"trained {row.get('rows_trained', 0)}/{row.get('rows', 0)}"]
    for label, key, fmt in STATUS_KEYS:
        value = row.get(key)
        if value is not None:
            parts.append(f"{label} {fmt.format(value)}")
    if row.get("train_seconds") is not None:
        parts.append(f"{row['train_seconds']:.2f}s")
    if row.get("checkpoint") is not None:
        parts.append(f"ckpt {row['checkpoint']}")
    return " | ".join(parts)


class _TensorBoard:
    """Scalars of each metrics row, if tensorboard is installed (the `plots` extra)."""

    def __init__(self, logdir: Path, purge_step: int | None) -> None:
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("trajflow: tensorboard is not installed (pip install 'trajflow[plots]'); "
                  "skipping event files", file=sys.stderr)
            return
        self.writer = SummaryWriter(str(logdir), purge_step=purge_step, flush_secs=10)

    def add(self, row: dict) -> None:
        if self.writer is None:
            return
        step = int(row["step"])
        for key, value in row.items():
            if key in ("step",) or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def record_placement(paths: RunPaths) -> dict[str, list[str]]:
    """Which node each stage's actors run on (Ray state API, which needs the cluster's dashboard:
    on an embedded Ray without one this records nothing). Written to placement.json with the
    nodes' custom resources, e.g. {"stages": {"Generate": [node]}, "nodes": {node: {...}}}."""
    import json

    import ray

    try:
        from ray.util.state import list_actors

        actors = list_actors(limit=1000, timeout=10, raise_on_missing_output=False)
    except Exception:
        return {}
    placement: dict[str, list[str]] = {}
    for actor in actors:
        name = getattr(actor, "class_name", "") or ""
        if "MapBatches(" not in name and "PolicyStore" not in name:
            continue
        # a process running several stages is named after all of them: Generate+Reward+...
        for stage in name.split("MapBatches(")[-1].rstrip(")").split("+") if "MapBatches(" in name else [name]:
            placement.setdefault(stage, [])
            if actor.node_id and actor.node_id not in placement[stage]:
                placement[stage].append(actor.node_id)
    if placement:
        nodes = {n["NodeID"]: {"address": n.get("NodeManagerAddress"), "resources": n.get("Resources", {})}
                 for n in ray.nodes() if n.get("Alive")}
        ckpt.atomic_write_text(paths.root / "placement.json",
                               json.dumps({"stages": placement, "nodes": nodes}, indent=1, sort_keys=True))
    return placement


def summary_table(paths: RunPaths, started: float, steps: int, first_step: int) -> str:
    import polars as pl

    metrics = read_metrics(paths)
    if metrics.is_empty():
        return "no steps were trained"
    cols = [c for c in SUMMARY_COLUMNS if c in metrics.columns]
    shown = metrics.select(cols)
    if shown.height > 12:
        idx = sorted(set(list(range(0, shown.height, max(1, shown.height // 10))) + [shown.height - 1]))
        shown = shown[idx]
    with pl.Config(tbl_rows=20, tbl_cols=-1, tbl_width_chars=200, float_precision=4,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        table = str(shown)
    rewards = metrics["reward_mean"]
    head, tail = rewards.head(min(5, len(rewards))).mean(), rewards.tail(min(5, len(rewards))).mean()
    checkpoints = [c.version for c in ckpt.list_checkpoints(paths.checkpoints)]
    lines = [
        table,
        f"steps logged {metrics.height}/{steps} (this session: {first_step}..{steps - 1}) | "
        f"reward first-5 {head:.3f} -> last-5 {tail:.3f} | wall {time.time() - started:.1f}s",
        f"checkpoints kept: {checkpoints} | run dir: {paths.root}",
    ]
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------
def prepare_new_run(config: JobConfig) -> RunPaths:
    root = Path(config.run_dir) if config.run_dir is not None else default_run_dir(config)
    if root.exists() and any(root.iterdir()):
        raise RunError(f"run dir {root} already exists and is not empty (use --resume {root} to continue it)")
    root = root.resolve()
    paths = RunPaths(root)
    root.mkdir(parents=True, exist_ok=True)
    resolved = config.model_copy(update={"run_dir": root})
    ckpt.atomic_write_text(paths.config, resolved.to_yaml())
    return paths


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> JobConfig:
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise RunError(f"{run_dir}: not a run dir (no config.yaml)")
    return build_job_config(parse_config_text(paths.config.read_text(), str(paths.config)), overrides)


def run_job(config: JobConfig, *, progress: bool = True) -> Path:
    """Start a new run; returns its run dir."""
    paths = prepare_new_run(config)
    _execute(config, paths, first_step=0, checkpoint=None, progress=progress)
    return paths.root


def resume_job(run_dir: str | os.PathLike, overrides: list[str] | None = None, *, progress: bool = True) -> Path:
    """Continue a killed run from its last complete checkpoint (a fresh start if it has none)."""
    root = Path(run_dir).resolve()
    paths = RunPaths(root)
    config = load_run_config(root, overrides)
    state = read_state(paths)
    if state.get("state") == "running" and same_host(state) and state.get("pid") and pid_alive(int(state["pid"])) \
            and int(state["pid"]) != os.getpid():
        raise RunError(f"{root}: the run is still active (pid {state['pid']}); stop it before resuming")
    latest = ckpt.latest_checkpoint(paths.checkpoints)
    first_step = latest.version if latest is not None else 0
    check_same_data(config, latest)
    if overrides:
        ckpt.atomic_write_text(paths.config, config.model_copy(update={"run_dir": root}).to_yaml())
    removed = truncate_after(paths, first_step)
    where = f"checkpoint {latest.path.name}" if latest is not None else "the start (no checkpoint)"
    print(f"trajflow: resuming {root} from {where}: steps {first_step}..{config.steps - 1}"
          + (f" (discarded partial logs of steps {removed[0]}..{removed[-1]})" if removed else ""), flush=True)
    _execute(config, paths, first_step=first_step, checkpoint=latest, progress=progress)
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


def _execute(config: JobConfig, paths: RunPaths, first_step: int, checkpoint: ckpt.Checkpoint | None,
             progress: bool) -> None:
    from tqdm.auto import tqdm

    from trajflow.engines.models import WARM_START_DIR
    from trajflow.pipelines.rl_loop import RLPipeline

    started = time.time()
    model_path = Path(config.model or WARM_START_DIR)
    if config.save_all_versions:
        print(f"trajflow: {size_estimate(config, model_path)}", flush=True)
    write_state(paths, state="running", pid=os.getpid(), host=socket.gethostname(), started=started,
                first_step=first_step, steps=config.steps)
    if first_step >= config.steps:
        print(f"trajflow: all {config.steps} steps are done")
        _finish(config, paths, started, first_step)
        return

    start_ray(config)
    quiet_ray_data()
    pipeline = RLPipeline(config.pipeline_config(), model_path=model_path)
    recorder = RunRecorder(
        run_dir=str(paths.root),
        steps=config.steps,
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.keep_checkpoints,
        save_all_versions=config.save_all_versions,
        trajectory_log=config.trajectory_log,
        resume_from=str(checkpoint.path) if checkpoint is not None else None,
        data_state=pipeline.data_state(),
    )
    pipeline.train_step_kwargs.update(on_start=recorder.on_start, on_step=recorder.on_step)
    weights = checkpoint.model_state() if checkpoint is not None else None
    pipeline.start_store(initial_version=first_step, initial_weights=weights)
    print(pipeline.describe(), flush=True)
    print(f"trajflow: run dir {paths.root}", flush=True)

    tb = _TensorBoard(paths.tensorboard, purge_step=first_step if first_step else None) if config.tensorboard else None
    interactive = progress and sys.stderr.isatty()
    bar = tqdm(total=config.steps, initial=first_step, desc=f"trajflow {pipeline.strategy.name}", disable=not interactive,
               file=sys.stderr, dynamic_ncols=True)
    placement_done = False

    def on_sigterm(signum, frame):  # `trajflow stop` / `ray job stop` send SIGTERM: record it, exit
        raise SystemExit(128 + signum)

    try:
        previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (e.g. called from a notebook worker thread)
        previous_sigterm = None
    try:
        for row in pipeline.iter_metrics(first_step=first_step):
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", v=row["version"])
            if tb is not None:
                tb.add(row)
            if config.status_every and (int(row["step"]) % config.status_every == 0
                                        or int(row["step"]) == config.steps - 1):
                line = status_line(row, config.steps)
                bar.write(line) if interactive else print(line, flush=True)
            if not placement_done:
                placement = record_placement(paths)
                placement_done = True
                if placement:
                    print("trajflow: placement " + ", ".join(f"{k} on {[n[:8] for n in v]}"
                                                           for k, v in sorted(placement.items())), flush=True)
    except BaseException as e:
        stopped = isinstance(e, (KeyboardInterrupt, SystemExit))
        write_state(paths, state="stopped" if stopped else "failed", error=f"{type(e).__name__}: {e}"[:500],
                    ended=time.time())
        lost = None if stopped else trainer_state_lost(e)
        if lost is not None:
            raise RunFailed(lost.replace("RUN_DIR", str(paths.root))) from None
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        bar.close()
        if tb is not None:
            tb.close()
    _finish(config, paths, started, first_step)


def _finish(config: JobConfig, paths: RunPaths, started: float, first_step: int) -> None:
    metrics = read_metrics(paths)
    if not metrics.is_empty():
        write_table_atomic(metrics.to_arrow(), paths.metrics)
    summary = summary_table(paths, started, config.steps, first_step)
    ckpt.atomic_write_text(paths.summary, summary + "\n")
    print(summary, flush=True)
    missing = sorted(set(range(config.steps)) - set(metrics["step"].to_list() if not metrics.is_empty() else []))
    if missing:
        write_state(paths, state="failed", error=f"steps without metrics: {missing}", ended=time.time())
        raise RunError(f"the run ended with steps {missing} missing from the metrics")
    write_state(paths, state="finished", ended=time.time())
