"""Where a run's numbers also go: TensorBoard, Weights & Biases, MLflow (`report_to`, TRL's name).

    report_to: [tensorboard, wandb, mlflow]    # default [tensorboard]; [] for none
    tracker_project: trajflow                  # W&B project, MLflow experiment
    wandb_mode: null                           # null: WANDB_MODE, else online with a W&B key, else offline
    mlflow_tracking_uri: null                  # null: MLFLOW_TRACKING_URI, else RUN/mlflow/mlflow.db

Trackers are registered parts (trajflow/registry.py, `TRACKERS`): `report_to` names registered
trackers or import paths module:Class / path/to/file.py:Class of a `Tracker` subclass, which says
the package it needs, how it opens on a run and what it does with a row and with the summary.

Each tracker gets, from the driver: the resolved config (W&B config, MLflow params, and
config.yaml as a file), every per-step metrics row at its step (the step index, as everywhere),
the summary at the end (the report's numbers: W&B summary, MLflow metrics `summary/<key>`;
summary.txt as a file) and the run's PNGs (RUN/report.png, drawn at the end, and any other
RUN/*.png) as artifacts. A resumed run continues the same W&B run (its id is kept in
RUN/trackers.json) and the same MLflow run. W&B offline (no key, or `wandb_mode: offline`) writes
RUN/wandb/offline-run-*/ that `wandb sync` uploads later. A tracker's package is an optional
extra; a missing one is refused when the config is validated (`check_installed`), before Ray
starts, naming the extra. What the tracker libraries print of their own stays out of the output.

One module on purpose: the base class, the three built-in trackers and `Trackers` (which opens,
feeds and finishes those of a run) are one contract read together when adding a tracker. Reading
a tracker's run back (`trajflow compare`) is jobs/tracked_runs.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from trajflow.registry import Registry

STATE_FILE = "trackers.json"  # the run's tracker run ids, so that a resume continues them


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker opens on: the run dir, the resolved job config (its keys: `tracker_project`,
    `wandb_mode`, ...), the first step of this session and the tracker's own run id from an
    earlier session of the run (None: a new run)."""

    root: Path
    config: Mapping[str, Any]
    first_step: int
    run_id: str | None = None


class Tracker:
    """Where a run's numbers also go (one entry of `report_to`).

    name      its registered name (`report_to: [NAME]`)
    package   the import name of the library it needs (None: nothing beyond trajflow), refused
              when the config is validated if it is missing, with `install` (pip's argument)
    files     it also takes the run's files at the end (config.yaml, summary.txt, the PNGs)
    run_id    an id to continue on `--resume` (kept in RUN/trackers.json), or None
    """

    name: ClassVar[str]
    package: ClassVar[str | None] = None
    install: ClassVar[str] = ""
    files: ClassVar[bool] = True
    run_id: str | None = None

    @classmethod
    def open(cls, run: TrackedRun) -> "Tracker":
        """The tracker, opened on `run` (a thread of its own runs this while the pipeline starts)."""
        raise NotImplementedError(f"tracker {cls.name!r} does not define open()")

    def log(self, row: Mapping[str, Any]) -> None:
        """One metrics row (its `step` is the step index)."""
        raise NotImplementedError(f"tracker {self.name!r} does not define log()")

    def finish(self, summary: Mapping[str, Any], files: list[Path], state: str) -> None:
        """The summary, the run's files (when `files`) and how it ended (`finished` or not)."""

    def where(self) -> str | None:
        """Where its numbers are, for the run's `reporting to` line (None: nothing to say)."""
        return None


TRACKERS: Registry[Tracker] = Registry("tracker", Tracker, ("trajflow.jobs.trackers",), key="report_to")


def check_installed(report_to: Iterable[str]) -> None:
    """ValueError (one line) naming the install when a tracker's package is not installed."""
    for spec in report_to:
        tracker = TRACKERS.resolve(spec)
        if tracker.package is None:
            continue
        try:
            found = importlib.util.find_spec(tracker.package) is not None
        except (ImportError, ValueError):  # a package whose import was blocked (sys.modules[name] = None)
            found = False
        if not found:
            raise ValueError(f"{tracker.name} is not installed: pip install {tracker.install} (or remove {spec} "
                             "from report_to)")


def numeric_items(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's numbers (not the step, not booleans, strings or None; NaN/inf kept as they are)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optimizer.lr": "0.0003", ...}: a nested config as MLflow params (values as text)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


@contextmanager
def quiet_loggers(*names: str):
    """Library loggers at WARNING for the block (MLflow logs INFO lines as it creates its tables)."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for logger, _ in saved:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


# -- the trackers ----------------------------------------------------------------------------------
@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    """TensorBoard (RUN/tensorboard/): scalars of each metrics row (global step = the step index);
    the summary as scalars `summary/<key>` at the last step."""

    package = "tensorboard"
    install = "tensorboard"  # a dependency of trajflow itself
    files = False

    def __init__(self, logdir: Path, purge_step: int | None) -> None:
        # TensorBoard's own event writer (torch's SummaryWriter wraps it, and would bring torch
        # into the driver for it)
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(logdir), flush_secs=10)
        if purge_step is not None:  # a resumed run: TensorBoard drops the earlier run's events from here on
            self.writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.last_step = 0

    @classmethod
    def open(cls, run: TrackedRun) -> "TensorBoardTracker":
        return cls(run.root / "tensorboard", purge_step=run.first_step or None)

    def _scalars(self, values: Mapping[str, float], step: int, prefix: str = "") -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        for key, value in values.items():
            summary = Summary(value=[Summary.Value(tag=f"{prefix}{key}", simple_value=float(value))])
            self.writer.add_event(Event(wall_time=now, step=step, summary=summary))

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        self.last_step = step
        self._scalars(numeric_items(row), step)

    def finish(self, summary: Mapping[str, Any], files: list[Path], state: str) -> None:
        self._scalars(numeric_items(summary), self.last_step, "summary/")
        self.writer.flush()
        self.writer.close()


@TRACKERS.register("wandb")
class WandbTracker(Tracker):
    """Weights & Biases (the extra trajflow[wandb]): one W&B run per trajflow run (resumed with it),
    in project `tracker_project`; offline unless a key, WANDB_MODE or `wandb_mode` says otherwise."""

    package = "wandb"
    install = "'trajflow[wandb]'"

    def __init__(self, root: Path, config: Mapping[str, Any], project: str, mode: str | None,
                 run_id: str | None) -> None:
        import wandb

        self.mode = mode or os.environ.get("WANDB_MODE") or ("online" if _wandb_key() else "offline")
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False, x_save_requirements=False, show_info=False)
        self.run = wandb.init(project=project, name=root.name, id=run_id, resume="allow" if run_id else None,
                              dir=str(root), config=dict(config), mode=self.mode, settings=settings,
                              reinit="create_new")
        self.root = root

    @classmethod
    def open(cls, run: TrackedRun) -> "WandbTracker":
        return cls(run.root, run.config, run.config["tracker_project"], run.config["wandb_mode"], run.run_id)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, row: Mapping[str, Any]) -> None:
        self.run.log(numeric_items(row), step=int(row["step"]))

    def where(self) -> str:
        where = (f"offline, `wandb sync {Path(self.run.dir).parent}` uploads it" if self.mode == "offline"
                 else self.run.url or "online")
        return f"W&B run {self.run_id} ({where})"

    def finish(self, summary: Mapping[str, Any], files: list[Path], state: str) -> None:
        import shutil

        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        for path in files:  # the run's files directory is uploaded with the run
            shutil.copy(path, Path(self.run.dir) / path.name)
        self.run.finish(exit_code=0 if state == "finished" else 1)


@TRACKERS.register("mlflow")
class MlflowTracker(Tracker):
    """MLflow (the extra trajflow[mlflow]): one MLflow run per trajflow run, in experiment
    `tracker_project`, on `mlflow_tracking_uri` (null: MLFLOW_TRACKING_URI, else RUN/mlflow/mlflow.db)."""

    package = "mlflow"
    install = "'trajflow[mlflow]'"

    def __init__(self, root: Path, config: Mapping[str, Any], project: str, uri: str, run_id: str | None) -> None:
        from mlflow import MlflowClient

        self.uri = uri
        with quiet_loggers("mlflow", "alembic"):
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (root / "mlflow" / "artifacts").as_uri() if uri.startswith("sqlite:") else None
                experiment_id = self.client.create_experiment(project, artifact_location=artifacts)
        if run_id is None:
            run_id = self.client.create_run(experiment_id, run_name=root.name, tags={"trajflow.run_dir": str(root)}
                                            ).info.run_id
            params = flat_config(config)
            from mlflow.entities import Param

            items = [Param(k, v[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=items[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    @classmethod
    def open(cls, run: TrackedRun) -> "MlflowTracker":
        (run.root / "mlflow").mkdir(parents=True, exist_ok=True)
        uri = run.config["mlflow_tracking_uri"] or default_mlflow_uri(run.root)
        return cls(run.root, run.config, run.config["tracker_project"], uri, run.run_id)

    def where(self) -> str:
        return f"MLflow run {self.run_id} at {self.uri}"

    def log(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        import time

        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(k, v, now, step) for k, v in numeric_items(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, summary: Mapping[str, Any], files: list[Path], state: str) -> None:
        from mlflow.entities import Metric

        import time

        now = int(time.time() * 1000)
        numbers = [Metric(f"summary/{k}", v, now, 0) for k, v in numeric_items(summary).items()]
        if numbers:
            self.client.log_batch(self.run_id, metrics=numbers)
        self.client.set_tag(self.run_id, "trajflow.summary", json.dumps(dict(summary), default=str)[:5000])
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FINISHED" if state == "finished" else "FAILED")


def default_mlflow_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI, else a SQLite store under the run dir (MLflow's default backend)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"


class Trackers:
    """The run's trackers together: log a row to each, finish each (a tracker that fails says so in
    one line and is dropped: the run's own record is the run dir). They open in a thread while the
    pipeline starts (MLflow creating its store takes seconds); the first row waits for them."""

    def __init__(self, root: Path, report_to: Iterable[str], config: Mapping[str, Any], first_step: int) -> None:
        import threading

        self.root = root
        self.trackers: dict[str, Tracker] = {}
        self._described = False
        args = (list(report_to), dict(config), first_step)
        self._opening = threading.Thread(target=self._open, args=args, name="trajflow-trackers", daemon=True)
        self._opening.start()

    def _open(self, report_to: list[str], config: dict, first_step: int) -> None:
        ids = self._ids()
        for spec in report_to:
            try:
                cls = TRACKERS.resolve(spec)
                tracker = cls.open(TrackedRun(self.root, config, first_step, ids.get(cls.name)))
            except Exception as e:  # noqa: BLE001 - a tracker's service or files: the run goes on
                self._dropped(spec, e)
                continue
            self.trackers[cls.name] = tracker
        ids.update({name: t.run_id for name, t in self.trackers.items() if t.run_id is not None})
        if ids:
            (self.root / STATE_FILE).write_text(json.dumps(ids, indent=1, sort_keys=True) + "\n")

    def _ids(self) -> dict:
        try:
            return json.loads((self.root / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _dropped(self, name: str, error: BaseException) -> None:
        text = " ".join(str(error).split())[:200]
        print(f"trajflow: report_to {name}: {type(error).__name__}: {text}; not reporting to it", file=sys.stderr,
              flush=True)

    def _ready(self) -> None:
        self._opening.join()
        if not self._described:  # in the caller's thread, once: where the numbers go besides the run dir
            self._described = True
            line = self.describe()
            if line:
                from trajflow.jobs.console import wrap

                print(wrap(line), flush=True)

    def log(self, row: Mapping[str, Any]) -> None:
        self._ready()
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(row)
            except Exception as e:  # noqa: BLE001
                self._dropped(name, e)
                del self.trackers[name]

    def finish(self, summary: Mapping[str, Any], state: str) -> None:
        """The summary and the run's files (config.yaml, summary.txt, the PNGs) to each tracker."""
        self._ready()
        files = [p for p in (self.root / "config.yaml", self.root / "summary.txt") if p.is_file()]
        if any(tracker.files for tracker in self.trackers.values()):
            files += run_pngs(self.root)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.finish(summary, files if tracker.files else [], state)
            except Exception as e:  # noqa: BLE001
                self._dropped(name, e)
        self.trackers.clear()

    def describe(self) -> str | None:
        """One line on where the numbers also go (None when no tracker has anything to say)."""
        parts = [where for where in (tracker.where() for tracker in self.trackers.values()) if where]
        return f"trajflow: reporting to {'; '.join(parts)}" if parts else None


def open_trackers(config, root: Path, first_step: int) -> Trackers:
    """The trackers a job config's `report_to` names, opening on its run dir; at the first row
    they say where the numbers go besides the run dir (W&B, MLflow)."""
    return Trackers(root, config.report_to, config.model_dump(mode="json"), first_step)


def tracked_summary(root: Path) -> dict:
    """The run's summary as `trajflow report` computes it (jobs/report.py summarize), {} without metrics."""
    from trajflow.jobs.report import ReportError, load_run, summarize

    try:
        return summarize(root.name, load_run(root))
    except ReportError:
        return {}


def run_pngs(root: Path) -> list[Path]:
    """RUN/report.png (drawn now from the run's metrics; `trajflow report` draws the same) and any
    other PNG at the top of the run dir."""
    from trajflow.jobs.report import load_run, plot_runs

    try:
        plot_runs({root.name: load_run(root)}, root / "report.png")
    except Exception as e:  # noqa: BLE001 - no metrics (a run that failed at once): nothing to draw
        print(f"trajflow: report.png not drawn ({type(e).__name__}: {' '.join(str(e).split())[:120]})",
              file=sys.stderr, flush=True)
    return sorted(root.glob("*.png"))


def _wandb_key() -> bool:
    """Whether a W&B API key is configured (WANDB_API_KEY, or a netrc entry for the W&B host)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    return host in hosts
