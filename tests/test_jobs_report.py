"""report / compare and the run's own output, without Ray: run dirs written in the recorder's
format (per-step metrics Parquet, config.yaml, run.json with sessions), numbers checked by hand.

- runs are identified by path: a/X and b/X are two runs, labelled by their shortest distinct tails;
- seconds_per_step is the wall time between consecutive steps' metrics rows, across a resume
  only within a session; final_reward says over how many steps it averages;
- the PNG has every panel (evaluation off says so) and is never silently overwritten;
- status lines and tables fit 100 columns, even with extreme values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from trajflow.jobs.cli import main
from trajflow.jobs.console import WIDTH, format_table
from trajflow.jobs.recorder import RunPaths, write_table_atomic
from trajflow.jobs.report import comparison_table, load_runs, plot_runs, short_labels, step_seconds, summarize
from trajflow.jobs.summary import SUMMARY_COLUMNS, status_line


def write_run(root: Path, rewards: list[float], step_ends: list[float] | None = None, *, strategy: str = "snapshot",
              sessions: list[dict] | None = None, heldout: dict[int, float] | None = None,
              old_keys: bool = False) -> Path:
    """A run dir as the recorder writes it; `old_keys`: with the metric keys of runs written
    before they took one style (reward_mean, heldout_accuracy, timings as seconds/train_seconds,
    stage_seconds/<stage>, time/step_end)."""
    paths = RunPaths(root)
    reward_key, heldout_key, seconds_key, stage_key, end_key = (
        ("reward_mean", "heldout_accuracy", "seconds/train_seconds", "stage_seconds/generate", "time/step_end")
        if old_keys else ("reward/mean", "heldout/accuracy", "seconds/train", "seconds/stage/generate", "seconds/step_end"))
    for step, reward in enumerate(rewards):
        row = {"step": step, "version": step + 1, "strategy": strategy, reward_key: reward, "rows": 32,
               "rows_trained": 16, "mask/token_kept_frac": 0.99, "clip/frac": 0.01, "staleness/mean": 1.0,
               "staleness/max": 1, seconds_key: 0.1, stage_key: 0.2}
        if step_ends is not None:
            row[end_key] = step_ends[step]
        if heldout and step in heldout:
            row[heldout_key] = heldout[step]
        write_table_atomic(pa.Table.from_pylist([row]), paths.metrics_file(step))
    paths.config.write_text(yaml.safe_dump({"name": "quickstart", "strategy": strategy}))
    if sessions is not None:
        paths.state.write_text(json.dumps({"state": "finished", "sessions": sessions}))
    return root


def test_short_labels_tell_same_named_runs_apart():
    paths = [Path("/r/a/x"), Path("/r/b/x"), Path("/r/b/y")]
    assert short_labels(paths) == ["a/x", "b/x", "y"]
    assert short_labels([Path("/r/one"), Path("/r/two")]) == ["one", "two"]


def test_compare_keeps_both_runs_with_the_same_directory_name(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "run", [0.1, 0.2, 0.3, 0.4, 0.5])
    b = write_run(tmp_path / "b" / "run", [0.5, 0.5, 0.5, 0.5, 0.9], strategy="recompute")
    runs = load_runs([a, b])
    assert list(runs) == ["a/run", "b/run"] and runs["a/run"].path == a.resolve()
    out = tmp_path / "c.png"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["b/run", "a/run"]  # best final reward first
    assert f"a/run: {a.resolve()}" in printed and f"b/run: {b.resolve()}" in printed
    assert out.stat().st_size > 10_000
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 2  # exists: refused ...
    assert "--overwrite" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--out", str(out), "--overwrite"]) == 0  # ... unless asked
    assert main(["compare", str(a), str(tmp_path / "a" / "." / "run")]) == 2  # the same run twice
    assert "given twice" in capsys.readouterr().err


def test_report_and_compare_read_a_run_written_with_the_old_metric_keys(tmp_path, capsys):
    """A run written before the metric keys took one style reads under today's names: its
    summary, report and plot give the numbers a run written today gives. Its held-out metric was
    the mean reward whatever the reward, so that is what it reads as."""
    import polars as pl

    rewards, heldout = [0.1, 0.2, 0.3, 0.4, 0.5], {4: 0.36}
    old = write_run(tmp_path / "old" / "run", rewards, [0.0, 1.0, 2.0, 3.0, 4.0], heldout=heldout, old_keys=True)
    new = write_run(tmp_path / "new" / "run", rewards, [0.0, 1.0, 2.0, 3.0, 4.0], heldout=heldout)
    on_disk = pl.read_parquet(RunPaths(old).metrics_file(0)).columns
    assert "reward_mean" in on_disk and "reward/mean" not in on_disk
    runs = load_runs([old, new])
    assert "reward/mean" in runs["old/run"].metrics.columns and "heldout/mean_reward" in runs["old/run"].metrics.columns
    assert set(runs["old/run"].metrics.columns) == set(runs["new/run"].metrics.columns) - {"heldout/accuracy"} | {
        "heldout/mean_reward"}  # every timing under its name now (seconds/train, seconds/stage/..., step_end)
    was, now = summarize("old/run", runs["old/run"]), summarize("new/run", runs["new/run"])
    for key in ("final_reward", "final_reward_steps", "final_heldout", "best_heldout", "seconds_per_step", "mask_kept"):
        assert was[key] == now[key], key
    assert was["final_reward"] == 0.5 and was["final_heldout"] == 0.36 and was["seconds_per_step"] == 1.0
    assert was["heldout"] == "mean reward" and now["heldout"] == "accuracy"
    capsys.readouterr()
    assert main(["report", str(old), "--out", str(tmp_path / "old.png")]) == 0
    printed = capsys.readouterr().out
    assert "0.500" in printed and "0.360" in printed and "mean reward" in printed
    assert main(["compare", str(old), str(new), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").stat().st_size > 10_000


def test_default_compare_output_is_a_new_file_in_the_current_directory(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "run", [0.1, 0.2])
    monkeypatch.chdir(tmp_path)
    said = []
    for _ in range(2):
        assert main(["compare", str(run)]) == 0
        said.append(re.search(r"plots written to (\S+)", capsys.readouterr().out).group(1))
    assert said[0] != said[1]  # the second did not overwrite the first
    assert sorted(p.name for p in tmp_path.glob("compare-*.png")) == sorted(said)


def test_final_reward_and_wall_time_per_step(tmp_path):
    # 10 steps; a resume at step 6 (a 100 s gap that is not a step's time); steps 1 s apart before,
    # 3 s apart after; the first step ends 20 s after the first session started
    ends = [100.0 + s for s in range(6)] + [300.0 + 3 * (s - 6) for s in range(6, 10)]
    sessions = [{"started": 80.0, "first_step": 0}, {"started": 290.0, "first_step": 6}]
    run = write_run(tmp_path / "run", [0.0] * 8 + [0.5, 1.0], ends, sessions=sessions)
    (loaded,) = load_runs([run]).values()
    assert step_seconds(loaded)["seconds_per_step"].to_list() == [1.0] * 5 + [3.0] * 3
    row = summarize("run", loaded)
    assert row["final_reward"] == 0.75 and row["final_reward_steps"] == 2  # the last fifth of 10 steps
    assert row["seconds_per_step"] == round((5 * 1.0 + 3 * 3.0) / 8, 3)
    assert row["seconds_to_first_step"] == 20.0
    assert row["steps"] == 10 and row["strategy"] == "snapshot" and row["config"] == "quickstart"


def test_plot_draws_raw_values_and_says_when_evaluation_is_off(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rewards = [0.0, 1.0] * 10  # a smoothed-only curve would hide this oscillation
    with_eval = write_run(tmp_path / "e" / "run", rewards, [float(s) for s in range(20)], heldout={9: 0.4, 19: 0.6})
    without = write_run(tmp_path / "n" / "run", rewards)
    captured = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        captured["fig"] = fig
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = keep
    try:
        plot_runs(load_runs([without]), tmp_path / "off.png", smooth=4)
        off = captured["fig"]
        plot_runs(load_runs([with_eval, without]), tmp_path / "both.png")
        both = captured["fig"]
    finally:
        plt.Figure.savefig = real_savefig
    axes = {ax.get_title(): ax for ax in off.axes}
    reward = axes["mean reward of the train batch"]
    raw, smoothed = reward.get_lines()
    assert list(raw.get_ydata()) == rewards and smoothed.get_linestyle() == "--"
    assert reward.get_ylabel() == "reward" and axes["wall time per step"].get_ylabel() == "seconds"
    texts = [t.get_text() for t in axes["held-out greedy mean reward"].texts]
    assert texts == ["evaluation off (eval_every: 0)"]
    assert "config quickstart | strategy snapshot" in off._suptitle.get_text()
    assert "dashed: rolling mean over 4 steps" in off._suptitle.get_text()
    assert [t.get_text() for t in both.legends[0].get_texts()] == ["e/run", "n/run"]  # one legend, both runs
    accuracy = {ax.get_title(): ax for ax in both.axes}["held-out greedy mean reward\nnone for: n/run"]
    assert [list(line.get_ydata()) for line in accuracy.get_lines()] == [[0.4, 0.6]]


def test_notebook_dataframes_still_compare(tmp_path):
    import polars as pl

    runs = {"snapshot": pl.DataFrame({"step": [0, 1], "reward/mean": [0.1, 0.3], "strategy": ["snapshot"] * 2}),
            "behavior": pl.DataFrame({"step": [0, 1], "reward/mean": [0.2, 0.2], "strategy": ["behavior"] * 2})}
    table = comparison_table(runs)
    assert table["run"].to_list() == ["snapshot", "behavior"] and table["seconds_per_step"].null_count() == 2
    assert plot_runs(runs, tmp_path / "nb.png").stat().st_size > 10_000


@pytest.mark.parametrize("steps", [1, 20, 1_000_000])
def test_status_lines_fit_100_columns_and_number_steps_from_0(steps):
    row = {"step": steps - 1, "reward/mean": -12345.678, "rows": 65536, "rows_trained": 65536,
           "mask/token_kept_frac": 0.99999, "clip/frac": 0.5, "mismatch/k3": 1.23e-7, "staleness/mean": 123.45,
           "loss": -1234.5678, "checkpoint": 10}
    line = status_line(row, steps, 12345.6)
    assert len(line) <= WIDTH, line
    assert line.startswith(f"step {steps - 1} (100%) | reward -12345.678 | rows 65536/65536 | 12345.6s")
    small = status_line({"step": 4, "reward/mean": 0.219, "rows": 32, "rows_trained": 16}, 20, 1.25)
    assert small == "step  4 ( 25%) | reward 0.219 | rows 16/32 | 1.2s"


def test_summary_table_fits_100_columns():
    rows = [{"step": s, "reward/mean": 0.5, "rows_trained": 4096, "mask/token_kept_frac": 0.5, "clip/frac": 0.5,
             "mismatch/k3": 1e-3, "staleness/mean": 12.5, "staleness/max": 100, "loss": -123.4567,
             "seconds/train": 1234.5} for s in (0, 999_999)]
    table = format_table(rows, list(SUMMARY_COLUMNS))
    assert all(len(line) <= WIDTH for line in table.splitlines()), table
    assert table.splitlines()[-1].split()[0] == "999999"
