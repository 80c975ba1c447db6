"""What a run says at its end and records of where it ran (jobs/run.py, jobs/report.py), on
hand-written metrics rows: the held-out line of the summary (accuracy before and after with its
standard error), the report's version-0 accuracy, the rows whose reward failed (status line,
summary, report), whether the run can be replayed, and placement.json from the rows' `node/...`
columns (each stage-group actor reports its node on its first batch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from trajflow.jobs.console import WIDTH
from trajflow.jobs.recorder import RunPaths, write_table_atomic
from trajflow.jobs.report import load_runs, summarize
from trajflow.jobs.summary import heldout_line, record_placement, status_line, summary_table
from trajflow.pipelines.replay import replay_support


def write_metrics(root: Path, heldout: dict[int, float], start: float | None,
                  reward_errors: dict[int, int] | None = None) -> RunPaths:
    paths = RunPaths(root)
    for step in range(4):
        row = {"step": step, "version": step + 1, "reward/mean": 0.5, "rows": 8, "rows_trained": 8,
               "reward/errors": (reward_errors or {}).get(step, 0)}
        if row["reward/errors"]:
            row["reward/first_error"] = f"ValueError: step {step}"
        if step == 0 and start is not None:
            row["heldout/accuracy_start"] = start
        if step in heldout:
            row["heldout/accuracy"] = heldout[step]
        write_table_atomic(pa.Table.from_pylist([row]), paths.metrics_file(step))
    return paths


def test_heldout_line_gives_both_ends_and_the_standard_error_of_the_change(tmp_path):
    paths = write_metrics(tmp_path / "run", {1: 0.30, 3: 0.36}, start=0.25)
    metrics = pl.concat([pl.read_parquet(f) for f in sorted(paths.metrics_dir.glob("*.parquet"))],
                        how="diagonal_relaxed")
    # se = sqrt(p (1 - p) / n): 0.0433 at 0.25 and 0.0480 at 0.36 over 100 prompts; of the change, their hypot
    assert math.hypot(math.sqrt(0.25 * 0.75 / 100), math.sqrt(0.36 * 0.64 / 100)) == pytest.approx(0.0646, abs=1e-4)
    line = heldout_line(metrics, 100)
    assert line == "held-out accuracy on 100 prompts: 0.250 at version 0 -> 0.360 at version 4, +0.110 ± 0.065 (s.e.)"
    # one end only: that accuracy with its own standard error
    assert heldout_line(metrics.drop("heldout/accuracy"), 100) == \
        "held-out accuracy on 100 prompts: 0.250 ± 0.043 (s.e.) at version 0"
    assert heldout_line(metrics.drop("heldout/accuracy_start"), 100) == \
        "held-out accuracy on 100 prompts: 0.360 ± 0.048 (s.e.) at version 4"
    assert heldout_line(metrics.drop("heldout/accuracy_start", "heldout/accuracy"), 100) is None
    # a reward that is not 0/1 is no accuracy: the metric is the mean reward, and outside [0, 1]
    # it gets no binomial standard error
    rewards = metrics.rename({"heldout/accuracy": "heldout/mean_reward", "heldout/accuracy_start": "heldout/mean_reward_start"})
    assert heldout_line(rewards.with_columns(pl.col("heldout/mean_reward") * 10), 100) == \
        "held-out mean reward on 100 prompts: 0.250 at version 0 -> 3.600 at version 4, +3.350"

    summary = summary_table(paths, 4, 0, 10.0, [5.0, 1.0, 1.0, 1.0], heldout_prompts=100)
    assert line in summary.splitlines() and len(line) <= WIDTH
    assert "held-out" not in summary_table(paths, 4, 0, 10.0, [5.0, 1.0, 1.0, 1.0])  # evaluation off


def test_reward_errors_in_the_status_line_the_summary_and_the_report(tmp_path):
    paths = write_metrics(tmp_path / "run", {}, start=None, reward_errors={1: 3, 2: 8})
    assert "reward errors" not in status_line({"step": 0, "reward/mean": 0.5, "rows": 8, "reward/errors": 0}, 4)
    assert status_line({"step": 1, "reward/mean": 0.5, "rows": 8, "rows_trained": 5, "reward/errors": 3}, 4) == \
        "step 1 ( 50%) | reward 0.500 | rows 5/8 | reward errors 3"
    summary = summary_table(paths, 4, 0, 10.0, [5.0, 1.0, 1.0, 1.0]).splitlines()
    assert "reward errors: 11 of 32 rows, in 2 of 4 steps; first: ValueError: step 1" in summary
    header = summary[0].split("  ")
    assert "reward errors" in [h.strip() for h in header]
    (run,) = load_runs([paths.root]).values()
    assert summarize("run", run)["reward_errors"] == 11
    clean = write_metrics(tmp_path / "clean", {}, start=None)
    assert "reward errors" not in summary_table(clean, 4, 0, 10.0, [5.0, 1.0, 1.0, 1.0])  # none: no column, no line


def test_the_summary_says_whether_the_run_can_be_replayed(tmp_path):
    paths = write_metrics(tmp_path / "run", {}, start=None)
    line = replay_support(True, False, [2, 4])
    assert line.startswith("replay: not possible, save_all_versions is false (versions kept: 2, 4)")
    assert "under snapshot, dedicated, interrupt," in line  # the strategies that read each token's version
    summary = summary_table(paths, 4, 0, 10.0, [5.0, 1.0, 1.0, 1.0], replay=line)
    assert "replay: not possible" in summary
    assert all(len(x) <= WIDTH for x in summary.splitlines() if not x.startswith("run dir"))  # wrapped
    assert replay_support(True, True, []).startswith("replay: exact under any strategy")
    assert replay_support(False, True, []).startswith("replay: not possible (trajectory_log: false")


def test_report_shows_version_0_accuracy(tmp_path):
    root = write_metrics(tmp_path / "run", {3: 0.36}, start=0.25).root
    (run,) = load_runs([root]).values()
    row = summarize("run", run)
    assert row["start_heldout"] == 0.25 and row["final_heldout"] == 0.36 and row["heldout"] == "accuracy"
    (run,) = load_runs([write_metrics(tmp_path / "no_start", {3: 0.36}, start=None).root]).values()
    assert summarize("run", run)["start_heldout"] is None


def test_placement_json_comes_from_the_rows_node_columns(tmp_path, ray_session):
    here = ray_session.get_runtime_context().get_node_id()
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    placement: dict[str, list[str]] = {}
    first = {"step": 0, "node/Generate": here, "node/TrainStep": here, "seconds/stage/generate": 0.1}
    assert record_placement(paths, placement, first)
    assert placement == {"Generate": [here], "TrainStep": [here]}
    written = json.loads((paths.root / "placement.json").read_text())
    assert written["stages"] == placement and here in written["nodes"]
    assert "resources" in written["nodes"][here] and written["nodes"][here]["resources"].get("CPU", 0) > 0
    # later rows without node columns, or with nodes already known, change nothing
    assert not record_placement(paths, placement, {"step": 1, "seconds/stage/generate": 0.1})
    assert not record_placement(paths, placement, first)
    # a second generator actor of the pool reports from its own first batch: the stage lists both
    assert record_placement(paths, placement, {"step": 1, "node/Generate": "another-node"})
    assert json.loads((paths.root / "placement.json").read_text())["stages"]["Generate"] == [here, "another-node"]

