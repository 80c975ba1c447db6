"""`trajflow replay`: a logged trajectory dataset replayed under one or more strategies.

    replay_job(trajectories, checkpoints, ["snapshot", "recompute"])            diagnostics per step
    replay_job(trajectories, checkpoints, ["ewma"], mode="train")               retrain on the log

The job around `pipelines.replay.Replay`: it finds the run's config beside the log (or takes the
one given), checks every input before Ray starts, runs the replay on an embedded Ray and writes
OUT (default RUN/replay/MODE-STRATEGIES-TIME): metrics.parquet, config.yaml, quarantine.parquet
(rows with NaN/inf log-probs, when asked to quarantine them), workers.log (what the Ray worker
processes printed; `--verbose` prints it instead, as for a run) and, in train mode, model.safetensors.
Everything is written into a temp dir renamed at the end: no half-written output. A diagnose
replay under the run's own strategy prints how closely it reproduces the logged diagnostics.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import JobConfigError, load_job_config
from trajflow.jobs.console import format_table
from trajflow.jobs.recorder import RunPaths, read_metrics, write_table_atomic
from trajflow.jobs.run import start_ray
from trajflow.pipelines.replay import Replay, format_versions
from trajflow.schemas import DISTRIBUTION_LOGPROB_COLUMNS, LOGPROB_COLUMNS, SchemaError, nonfinite_rows

# (header, metrics key, format) of the printed table
TABLE_COLUMNS = (
    ("step", "step", "{:d}"), ("strategy", "strategy", "{}"), ("trained", "rows_trained", "{:d}"),
    ("mask", "mask/token_kept_frac", "{:.3f}"), ("clip", "clip/frac", "{:.3f}"),
    ("active", "active_frac", "{:.3f}"), ("grad cos", "grad/cos_vs_exact", "{:.3f}"), ("k3", "mismatch/k3", "{:.1e}"), ("ess", "is/ess", "{:.3f}"),
    ("stale", "staleness/mean", "{:.2f}"), ("loss", "loss", "{:+.4f}"),
)


class ReplayArgumentError(ValueError):
    """A replay argument that cannot be used (the log's path, --out, a log the flags refuse); the
    message is one line naming it."""


def _find_run_config(trajectories: Path) -> Path | None:
    """The config.yaml of the run a log belongs to: beside it or up to three levels above."""
    path = trajectories.resolve()
    for candidate in [path, *path.parents][:4]:
        if (candidate / "config.yaml").is_file():
            return candidate / "config.yaml"
    return None


def replay_job(trajectories: str | os.PathLike, checkpoints: str | os.PathLike, strategies: Sequence[str], *,
               mode: str = "diagnose", config: str | os.PathLike | None = None, overrides: Sequence[str] = (),
               out: str | os.PathLike | None = None, quarantine_nonfinite: bool = False,
               gradients: bool = False, progress: bool = True, verbose: bool = False) -> Path:
    """Replay the log under `strategies` ("diagnose": metrics only; "train": one strategy, trained
    on the logged rows); returns the output dir. `config`: the job config (default: the run's,
    found beside the log), with `overrides` (`--set key=value`) applied. `gradients` (diagnose): each
    strategy's parameter gradient compared with the exact strategy's on the same batch. `progress`:
    a bar over the logged steps when stderr is a terminal."""
    trajectories = Path(trajectories)
    if not trajectories.exists():
        raise ReplayArgumentError(f"{trajectories}: no such file or directory")
    config_path = Path(config) if config else _find_run_config(trajectories)
    if config_path is None:
        raise JobConfigError(f"config error: no config.yaml found beside {trajectories}; pass --config FILE")
    job = load_job_config(config_path, list(overrides))
    strategies = list(strategies)
    run_root = config_path.parent
    if out is None:
        out = run_root / "replay" / f"{mode}-{'+'.join(strategies)}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReplayArgumentError(f"--out {out} already exists and is not an empty directory")
    try:  # checks every input before Ray starts
        replay = Replay(job.pipeline_config(), trajectories, checkpoints, strategies, mode,
                        quarantine_nonfinite=quarantine_nonfinite, gradients=gradients)
    except SchemaError as e:
        if e.column in (*LOGPROB_COLUMNS, *DISTRIBUTION_LOGPROB_COLUMNS) and "non-finite" in str(e):
            where = str(e).rsplit(" (", 1)[0]
            raise ReplayArgumentError(f"{where}; --quarantine-nonfinite replays the log without such rows "
                                      "(counted)") from None
        raise
    print(f"trajflow: replay ({mode}) of {len(replay.steps)} steps under {', '.join(strategies)}; "
          f"{len(replay.weights)} versions", flush=True)
    if replay.quarantined:
        print(f"trajflow: quarantined {sum(replay.quarantined.values())} rows with NaN/inf log-probs "
              f"(steps {format_versions(replay.quarantined)}): not trained, not in the diagnostics", flush=True)
    tmp = out.with_name(f".{out.name}.tmp")  # renamed to OUT at the end; kept, with its log, if the replay fails
    tmp.mkdir(parents=True, exist_ok=True)
    start_ray(job, verbose)
    from trajflow.pipelines.ray import patches as ray_patches

    # what the Ray workers print goes to OUT/workers.log, as a run's to RUN/workers.log (--verbose: printed)
    ray_patches.worker_output.to(None if verbose else tmp / "workers.log")
    metrics = replay.run(progress=progress and sys.stderr.isatty(), verbose=verbose)
    write_table_atomic(metrics.to_arrow(), tmp / "metrics.parquet")
    ckpt.atomic_write_text(tmp / "config.yaml", job.to_yaml())
    if replay.quarantined:
        import pyarrow as pa

        bad = pa.concat_tables([t.filter(pa.array(nonfinite_rows(t))) for t in replay.steps.values()],
                               promote_options="permissive")
        write_table_atomic(bad.filter(pa.array(nonfinite_rows(bad))), tmp / "quarantine.parquet")
    if mode == "train":
        ckpt.save_weights(replay.final_weights, tmp / "model.safetensors")
    if out.exists():
        out.rmdir()
    tmp.rename(out)

    rows = metrics.to_dicts()
    print(format_table(rows[:40], TABLE_COLUMNS))
    if len(strategies) > 1 or len(rows) > 40:
        import polars.selectors as cs

        # numbers only: a row also names things (trainer/nodes, node/<stage class>)
        means = metrics.group_by("strategy", maintain_order=True).agg(cs.numeric().mean()).to_dicts()
        print("mean over steps:")
        print(format_table(means, [c for c in TABLE_COLUMNS if c[0] != "step"]))
    _compare_with_logged(metrics, run_root, job.build_strategy().name, mode)
    print(f"trajflow: replay written to {out}")
    return out


def _compare_with_logged(metrics, run_root: Path, logged_strategy: str, mode: str) -> None:
    """Diagnosing a run under its own strategy should reproduce its logged diagnostics: say how close."""
    import polars as pl

    if mode != "diagnose" or "strategy" not in metrics.columns:
        return
    logged = read_metrics(RunPaths(run_root))
    mine = metrics.filter(pl.col("strategy") == logged_strategy)
    if logged.is_empty() or mine.is_empty():
        return
    prefixes = ("mask/", "clip/", "mismatch/", "is/", "staleness/", "active_frac", "loss")
    keys = [k for k in mine.columns if k.startswith(prefixes) and k in logged.columns]
    joined = mine.select("step", *keys).join(logged.select("step", *keys), on="step", suffix="_logged")
    worst = 0.0
    for k in keys:
        diff = (joined[k] - joined[f"{k}_logged"]).abs().max()
        worst = max(worst, float(diff or 0.0))
    print(f"trajflow: {logged_strategy} replay vs the logged run: {joined.height} steps, {len(keys)} keys, "
          f"max |difference| {worst:.2e}")
