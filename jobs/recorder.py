"""The run directory, and the hooks that write it durably from inside the trainer actor.

    RUN/
      config.yaml                       the resolved job config
      run.json                          state (running / finished / failed), pid, host, times, and
                                        one entry per session (the first run, each resume), with
                                        the session's `recoveries` (operators/trainer/recovery.py)
      trainer_lost.txt                  the one line of a trainer that could not be rebuilt
      metrics/step=000012.parquet       one row per train step (written by the trainer, atomically)
      metrics.parquet                   all steps in one file (rewritten at the end)
      trajectories/step=000012/part-0.parquet   every trajectory of train step 12, schema v1 +
                                        extras (answer, rollout_step, filter_reason, trainer_version)
      quarantine/step=000012.parquet    rows with non-finite log-probs (not schema-valid; rare)
      checkpoints/step-000012/          weights + optimizer (+ strategy, e.g. EWMA) state of version 12
                                        (+ the dataset position and fingerprint in meta.json, for a dataset run;
                                        each worker's shards under trainer.sharding: fsdp; the last one is also
                                        a plain Hugging Face model directory: engines/checkpoint.py)
      versions/v000012.safetensors      every version's weights (save_all_versions only); a LoRA
                                        run's: versions/v000012/, the adapter in PEFT's format, and
                                        versions/base/, the base weights once (engines/checkpoint.py)
      tensorboard/                      event files (when tensorboard is installed)
      summary.txt                       the final summary table
      workers.log                       what the Ray worker processes printed (warnings, notices);
                                        `--verbose` prints it instead
      ray-logs/                         a failed run's embedded Ray logs (its session dir's logs/;
                                        a finished run's session dir is removed at exit)

Step s is trained by the trainer at version s and produces version s + 1. Before version s + 1
is published, `RunRecorder.on_rows` writes the version file s + 1 and then the trajectory
partition of step s (so every version a reader may hold is on disk when every version is kept,
and a logged step's version is); after it, `on_step` writes the metrics row of step s, then
(every `checkpoint_every` steps, and at the end) checkpoint s + 1. With recovery on, `on_start` also
writes checkpoint 0 (the starting version) of a new run. Each file is written atomically, so a
kill at any point leaves complete files; a complete checkpoint k implies complete logs of steps
< k. Resuming from checkpoint k deletes whatever exists of steps >= k (`truncate_after`) and
re-runs them, so no step is repeated or skipped in the logs.

The recorder is also the trainer's `TrainerSource` (operators/trainer/recovery.py): a trainer process
that dies is rebuilt in the run from the newest checkpoint and the logged rows of the steps since;
and the policy store's `VersionArchive` (pipelines/store_recovery.py): a store that dies is
rebuilt from the versions on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trajflow.engines import checkpoint as ckpt
from trajflow.schemas.io import atomic_write

STEP_DIR = "step={:06d}"


def step_of(name: str) -> int | None:
    """6 from 'step=000006' or 'step=000006.parquet'; None for anything else."""
    if not name.startswith("step="):
        return None
    try:
        return int(name[5:].split(".")[0])
    except ValueError:
        return None


def version_of(name: str) -> int | None:
    """12 from 'v000012.safetensors' (a version file); None for anything else."""
    if not name.startswith(ckpt.VERSION_PREFIX):
        return None
    try:
        return int(name[len(ckpt.VERSION_PREFIX):].split(".")[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def state(self) -> Path:
        return self.root / "run.json"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.parquet"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def summary(self) -> Path:
        return self.root / "summary.txt"

    @property
    def workers_log(self) -> Path:
        return self.root / "workers.log"

    @property
    def trainer_lost(self) -> Path:
        """The one line of a TrainerStateLost, written by the train step as it raises it (Ray Data
        may lose the error's text on the way to the driver)."""
        return self.root / "trainer_lost.txt"

    def trajectory_file(self, step: int) -> Path:
        return self.trajectories / STEP_DIR.format(step) / "part-0.parquet"

    def metrics_file(self, step: int) -> Path:
        return self.metrics_dir / (STEP_DIR.format(step) + ".parquet")


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """pyarrow Parquet write via temp file + fsync + rename (for non-trajectory tables)."""
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_state(paths: RunPaths, **fields) -> None:
    current = read_state(paths)
    current.update(fields)
    ckpt.atomic_write_text(paths.state, json.dumps(current, indent=1, sort_keys=True))


def read_state(paths: RunPaths) -> dict:
    try:
        return json.loads(paths.state.read_text())
    except (OSError, ValueError):
        return {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def same_host(state: dict) -> bool:
    return state.get("host") == socket.gethostname()


def truncate_after(paths: RunPaths, first_step: int) -> list[int]:
    """Delete everything logged for steps >= first_step (and versions > first_step, checkpoints >
    first_step, temp files). Returns the steps whose logs were removed."""
    removed: set[int] = set()
    for parent in (paths.trajectories, paths.metrics_dir, paths.quarantine):
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                continue
            step = step_of(path.name)
            if step is not None and step >= first_step:
                removed.add(step)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            elif path.is_dir():  # leftovers of an interrupted atomic write inside a partition
                for tmp in path.glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
    if paths.versions.is_dir():
        for path in paths.versions.iterdir():  # files, and a LoRA run's adapter directories
            if path.name.startswith(".") or ((version := version_of(path.name)) is not None and version > first_step):
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    ckpt.clean_partial(paths.checkpoints)
    for c in ckpt.list_checkpoints(paths.checkpoints):
        if c.version > first_step:
            shutil.rmtree(c.path)
    return sorted(removed)


def logged_steps(paths: RunPaths) -> list[int]:
    if not paths.metrics_dir.is_dir():
        return []
    return sorted(s for s in (step_of(p.name) for p in paths.metrics_dir.glob("step=*.parquet")) if s is not None)


# metric keys renamed to the one style (docs/design.md §4a) -> their names now; a run written
# before reads under the new names. heldout_accuracy was the held-out mean reward whatever the
# reward (an accuracy only for 0/1 rewards), so that is what it reads as. Durations were
# `seconds/<what>_seconds`, `trainer/allreduce_seconds`, `stage_seconds/` and `startup_seconds/`.
RENAMED_METRICS = {
    "reward_mean": "reward/mean",
    "heldout_accuracy": "heldout/mean_reward",
    "heldout_accuracy_start": "heldout/mean_reward_start",
    "snapshot_versions_held": "snapshot/versions_held",
    "snapshot_bytes": "snapshot/bytes",
    "snapshot_max_versions_held": "snapshot/max_versions_held",
    "trainer_busy_frac": "trainer/busy_frac",
    "train_seconds": "seconds/train",
    "over_stale_tokens_dropped": "staleness/over_stale_tokens",
    "trainer/allreduce_seconds": "seconds/allreduce",
    "time/step_end": "seconds/step_end",
    "staleness_ratio/max_abs_log": "staleness/max_abs_log_ratio",
    "seconds/old_logprob_seconds": "seconds/old_logprobs",
}
RENAMED_METRIC_PREFIXES = {"stage_seconds/": "seconds/stage/", "startup_seconds/": "seconds/startup/"}


def current_metric_name(key: str) -> str:
    """A metric key as it is named now (unchanged when it never was renamed)."""
    if key in RENAMED_METRICS:
        return RENAMED_METRICS[key]
    for old, new in RENAMED_METRIC_PREFIXES.items():
        if key.startswith(old):
            return new + key.removeprefix(old)
    if key.startswith("seconds/") and key.endswith("_seconds"):
        return key.removesuffix("_seconds")
    return key


def current_metric_names(metrics):
    """A metrics DataFrame with the keys renamed since it was written under their names now."""
    renamed = {k: current_metric_name(k) for k in metrics.columns}
    renamed = {old: new for old, new in renamed.items() if new != old and new not in metrics.columns}
    return metrics.rename(renamed) if renamed else metrics


def read_metrics(paths: RunPaths):
    """All per-step metrics rows as one polars DataFrame, sorted by step, under today's keys."""
    import polars as pl

    files = sorted(paths.metrics_dir.glob("step=*.parquet")) if paths.metrics_dir.is_dir() else []
    if not files:
        return pl.DataFrame()
    frames = [pl.read_parquet(f) for f in files]
    return current_metric_names(pl.concat(frames, how="diagonal_relaxed").sort("step"))


@dataclass
class RunRecorder:
    """The trainer-side hooks of a job run (picklable: shipped to the trainer actor).

    on_start: restores optimizer and strategy state when resuming, and saves the starting
    version's weights when every version is kept. on_rows: writes each step's trajectory log
    (before its version is published); on_step: its metrics, version file and checkpoints. Both use only the train step's public methods: version, strategy, full_weights(),
    save_checkpoint(), restore() (the last three drive every worker of a sharded trainer).
    """

    run_dir: str
    steps: int
    checkpoint_every: int
    keep_checkpoints: int
    save_all_versions: bool
    trajectory_log: bool
    resume_from: str | None = None  # checkpoint dir whose optimizer/strategy state the trainer restores
    # checkpoint the starting version too (recovery on): a trainer lost before the first periodic
    # checkpoint is then rebuilt from it instead of stopping the run
    checkpoint_start: bool = False
    data_state: dict | None = None  # a dataset run: fingerprint, epoch_size, ... (RLPipeline.data_state)

    @property
    def paths(self) -> RunPaths:
        return RunPaths(Path(self.run_dir))

    def install(self, hooks) -> None:
        """Make this recorder the train step's hooks (operators/trainer/spec.py StepHooks) and its
        source after a fault."""
        hooks.on_start, hooks.on_rows, hooks.on_step = self.on_start, self.on_rows, self.on_step
        hooks.source, hooks.on_lost = self, self.on_lost

    # -- hooks (called inside the TrainStep actor) ------------------------------------------
    def on_start(self, trainstep) -> None:
        if self.resume_from is not None:
            checkpoint = ckpt.Checkpoint(Path(self.resume_from), -1)
            meta = json.loads((checkpoint.path / "meta.json").read_text())
            if trainstep.version != meta["version"]:
                raise RuntimeError(
                    f"resume: the trainer starts at version {trainstep.version}, "
                    f"checkpoint {checkpoint.path} holds version {meta['version']}"
                )
            trainstep.restore(checkpoint.path)
        elif self.checkpoint_start and self.last_checkpoint(trainstep.version) is None:
            self._checkpoint(trainstep, trainstep.version, final=False)
        if self.save_all_versions and ckpt.saved_version(self.paths.versions, trainstep.version) is None:
            trainstep.save_version(self.paths.versions)

    def on_step(self, trainstep, batch: pa.Table, metrics: dict) -> None:
        import ray

        paths = self.paths
        step, version = int(metrics["step"]), int(metrics["version"])
        # which node trained (get_runtime_context() would start a Ray outside of one: check first)
        metrics["trainer_node"] = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        metrics["seconds/step_end"] = time.time()  # Unix time: report's seconds_per_step is its difference
        if self.data_state is not None:
            metrics["data/epoch"] = step * self.data_state["prompts_per_step"] // self.data_state["epoch_size"]
            metrics["data/prompts_too_long"] = self.data_state["prompts_dropped_too_long"]
        write_table_atomic(pa.Table.from_pylist([_plain(metrics)]), paths.metrics_file(step))
        final = version >= self.steps
        if final or (self.checkpoint_every and version % self.checkpoint_every == 0):
            self._checkpoint(trainstep, version, final)
            metrics["checkpoint"] = version

    def _checkpoint(self, trainstep, version: int, final: bool) -> None:
        paths = self.paths
        trainstep.save_checkpoint(
            paths.checkpoints,
            meta={"steps_done": version, "time": time.time(), "strategy": trainstep.strategy.name,
                  **({"data": data_position(self.data_state, version)} if self.data_state else {})},
            export=final,
        )
        ckpt.prune_checkpoints(paths.checkpoints, self.keep_checkpoints)

    def on_rows(self, trainstep, batch: pa.Table, step: int) -> None:
        if self.save_all_versions:  # the version this step made, before it is published
            trainstep.save_version(self.paths.versions)
        if self.trajectory_log:
            self._log_trajectories(self.paths, step, batch)

    def on_lost(self, line: str) -> None:
        ckpt.atomic_write_text(self.paths.trainer_lost, line + "\n")

    # -- the trainer's source after a fault (operators/trainer/recovery.py TrainerSource) --------------
    def refusal(self) -> str | None:
        return None if self.trajectory_log else "trajectory_log is off: no logged rows to retrain"

    def last_checkpoint(self, at_most: int) -> tuple[str, int] | None:
        found = [c for c in ckpt.list_checkpoints(self.paths.checkpoints) if c.version <= at_most]
        return (str(found[-1].path), found[-1].version) if found else None

    def last_logged_step(self) -> int:
        root = self.paths.trajectories
        found = (step_of(p.name) for p in root.glob("step=*") if p.is_dir()) if root.is_dir() else ()
        return max((s for s in found if s is not None and self.paths.trajectory_file(s).is_file()), default=-1)

    # -- the policy store's source after a fault (pipelines/store_recovery.py VersionArchive) ------
    def kept_versions(self, adapters: bool = False) -> list[int]:
        """Versions whose published payload is on disk: the checkpoints, and the versions/ kept
        with save_all_versions of the run's kind (`adapters`: a LoRA run's adapter directories,
        else full-weight files)."""
        found = {c.version for c in ckpt.list_checkpoints(self.paths.checkpoints)}
        if self.paths.versions.is_dir():
            for entry in self.paths.versions.iterdir():
                version = version_of(entry.name)
                saved = ckpt.saved_version(self.paths.versions, version) if version is not None else None
                if saved is not None and saved.is_dir() == adapters:
                    found.add(version)
        return sorted(found)

    def version_weights(self, version: int):
        """The published payload of a kept version: its checkpoint's (an adapter for LoRA), else
        its file or adapter directory under versions/."""
        checkpoint = next((c for c in ckpt.list_checkpoints(self.paths.checkpoints) if c.version == version), None)
        if checkpoint is not None:
            return checkpoint.model_state()
        return ckpt.load_version(ckpt.saved_version(self.paths.versions, version))

    def metrics_logged(self, step: int) -> bool:
        return self.paths.metrics_file(step).is_file()

    def logged_rows(self, step: int) -> pa.Table | None:
        """Step `step`'s rows as the train step received them (None: not logged, or some rows were
        quarantined, so the step cannot be trained again exactly)."""
        from trajflow.schemas import read_parquet

        paths = self.paths
        path = paths.trajectory_file(step)
        if not path.is_file() or (paths.quarantine / (STEP_DIR.format(step) + ".parquet")).is_file():
            return None
        return read_parquet(path).drop_columns(["trainer_version"])

    def _log_trajectories(self, paths: RunPaths, step: int, batch: pa.Table) -> None:
        from trajflow.schemas import nonfinite_rows, write_parquet

        batch = batch.append_column("trainer_version", pa.array(np.full(batch.num_rows, step, np.int32)))
        bad = nonfinite_rows(batch)
        if bad.any():  # quarantined rows are not schema-valid (NaN log-probs): keep them apart
            write_table_atomic(batch.filter(pa.array(bad)), paths.quarantine / (STEP_DIR.format(step) + ".parquet"))
            batch = batch.filter(pa.array(~bad))
        write_parquet(batch, paths.trajectory_file(step))


def data_position(data_state: dict, next_step: int) -> dict:
    """The dataset position a checkpoint records: where step `next_step` starts (epoch, index in
    the epoch) and the dataset's identity, which a resume checks."""
    start = next_step * data_state["prompts_per_step"]
    return {**data_state, "next_step": next_step, "epoch": start // data_state["epoch_size"],
            "index_in_epoch": start % data_state["epoch_size"]}


def _plain(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out
