"""A reward that fails, and what a run's output holds, end to end (`trajflow run` as a subprocess
on real Ray; the tiny Qwen2 and BPE tokenizer of test_byo_pipeline.py). One run serves both
end-to-end tests (each run pays Ray's and the actors' start-up; the two cases do not interact):

- a reward that raises on some items of step 0, then returns the wrong number of values for the
  whole of steps 1 and 2: every failed row keeps its error text in the trajectory log (the
  exception, or the wrong length); the status lines show the errors; the run stops after
  `reward_max_failed_steps` (2) such steps with one line naming the function and the first
  error, and exit status 1;
- the same reward also warns, writes to stderr and calls math-verify in the Ray worker: the run
  prints trajflow's own lines only (stdout: its status and `trajflow:` lines; stderr: the one
  line), and the worker's lines are in RUN/workers.log (that a finished run prints its summary:
  test_jobs_run.py's quickstart run);
- (no Ray) a step's metrics count the rows the reward failed on from the `reward_error` column,
  whatever else filtered them; the count of failed steps resets on a step that scored.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from support import explain, logged, run_cli

PER_STEP, GROUP = 4, 2
REWARDS = textwrap.dedent("""
    import sys
    import warnings

    from trajflow.tasks.rewards import MathVerify

    _math = MathVerify()

    def broken(prompts, completions, answer, idx, phase, **columns):
        warnings.warn("broken: a warning from the reward")
        print("broken: a line on stderr", file=sys.stderr)
        _math(prompts, completions, answer)  # math-verify's own timeouts are off: no warning of its own
        if all(p == "short" for p in phase):
            return []  # no score at all: the wrong number of values
        out = []
        for i in idx:
            if i % 4 == 0:
                raise ValueError(f"cannot score item {i}")
            out.append(float(i))
        return out
""")


@pytest.fixture(scope="module")
def workload_dir(bpe, tmp_path_factory) -> Path:
    """12 prompts in file order (shuffle off): step 0 gets idx 0-3 ("flaky"), steps 1-2 idx 4-11 ("short")."""
    path = tmp_path_factory.mktemp("rewards")
    rows = [{**r, "idx": i, "phase": "flaky" if i < PER_STEP else "short"} for i, r in enumerate(bpe[1][:12])]
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "rewards.py").write_text(REWARDS)
    return path


def job(workload_dir: Path, model_dir: Path, reward: str, **overrides) -> dict:
    return {
        "name": "rewards", "model": str(model_dir), "strategy": "snapshot",
        "data": {"train_files": [str(workload_dir / "train.jsonl")], "shuffle": False},
        "reward": f"{workload_dir / 'rewards.py'}:{reward}", "steps": 6, "prompts_per_step": PER_STEP,
        "group_size": GROUP, "sampling": {"max_new_tokens": 4}, "seed": 1, "checkpoint_every": 0,
        "report_to": [], **overrides,
    }


@pytest.fixture(scope="module")
def broken_run(workload_dir, bpe_model_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("broken")
    config = root / "job.yaml"
    config.write_text(yaml.safe_dump(job(workload_dir, bpe_model_dir, "broken", reward_max_failed_steps=2)))
    run_dir = root / "run"
    return run_dir, run_cli(["run", config, "--run-dir", run_dir, "--no-progress"], timeout=600)


@pytest.mark.slow
def test_failed_rewards_are_logged_per_row_and_the_run_stops_with_one_line(workload_dir, broken_run):
    run_dir, proc = broken_run
    assert proc.returncode == 1, explain(proc)
    wrong = f"the reward returned 0 values for {PER_STEP * GROUP} completions (one score per completion)"
    assert proc.stderr.splitlines() == [
        f"trajflow: reward {workload_dir / 'rewards.py'}:broken failed on every row of steps 1-2 "
        f"(reward_max_failed_steps: 2); first error: {wrong}"], explain(proc)

    table = logged(run_dir)
    steps, idx = np.array(table["rollout_step"].to_pylist()), np.array(table["idx"].to_pylist())
    assert sorted(set(steps)) == [0, 1, 2]  # stopped after the second failed step: 3-5 never ran
    errors, rewards = table["reward_error"].to_pylist(), table["reward"].to_pylist()
    reasons = table["filter_reason"].to_pylist()
    for step, i, error, reward, reason in zip(steps, idx, errors, rewards, reasons):
        if step == 0 and i % 4:
            assert error is None and reward == float(i) and reason != "reward_error"
        else:
            assert reward is None and reason == "reward_error"
            assert error == (f"ValueError: cannot score item {i}" if step == 0 else wrong)

    lines = {int(m[1]): line for line in proc.stdout.splitlines() if (m := re.match(r"step (\d+) \(", line))}
    assert sorted(lines) == [0, 1, 2]
    assert f"reward errors {GROUP}" in lines[0] and f"reward errors {PER_STEP * GROUP}" in lines[2]
    metrics = pl.concat([pl.read_parquet(f) for f in sorted((run_dir / "metrics").glob("*.parquet"))],
                        how="diagonal_relaxed").sort("step")
    assert metrics["reward/errors"].to_list() == [GROUP, PER_STEP * GROUP, PER_STEP * GROUP]
    assert metrics["reward/first_error"].to_list() == ["ValueError: cannot score item 0", wrong, wrong]
    assert json.loads((run_dir / "run.json").read_text())["state"] == "failed"


@pytest.mark.slow
def test_a_run_prints_trajflow_lines_only_and_the_workers_lines_go_to_its_log(broken_run):
    run_dir, proc = broken_run
    assert proc.returncode == 1, explain(proc)
    # stderr: the one stop line (above), not the worker's line on stderr nor its warning
    assert [line for line in proc.stderr.splitlines() if not line.startswith("trajflow: ")] == [], explain(proc)
    own = re.compile(r"^(trajflow: |step +\d+ \( *\d+%\) \| |strategy |stages: |training numerics: |max_staleness |"
                     r"auto: |old log-probs: |"
                     r"  \S)")  # the description's wrapped lines are indented
    assert re.search(r"^step +2 \(", proc.stdout, re.M), explain(proc)  # the lines of every step that ran
    others = [line for line in proc.stdout.splitlines() if line and not own.match(line)]
    assert others == [], explain(proc)
    workers = (run_dir / "workers.log").read_text()
    assert "broken: a warning from the reward" in workers and "broken: a line on stderr" in workers
    assert "Timeout is disabled" not in workers  # math-verify's own timeouts are off for a reason: not a warning


def test_step_metrics_count_reward_errors_and_failed_steps_reset():
    import pyarrow as pa

    from trajflow.operators.reward import FailedRewardSteps, RewardFailed
    from trajflow.operators.trainer.accounting import step_metrics

    batch = pa.table({"reward": pa.array([None, 1.0, None, None], pa.float32()),
                      "filter_reason": ["over_stale", None, "reward_error", "reward_error"],
                      "reward_error": [None, None, "ValueError: a", "ValueError: b"]})
    metrics = step_metrics(batch, 0, 0, np.array([1]), 0)
    assert metrics["reward/errors"] == 2 and metrics["reward/first_error"] == "ValueError: a"
    assert metrics["reward/mean"] == 1.0
    earlier = batch.set_column(1, "filter_reason", pa.array(["over_stale"] * 4))  # filtered before the reward
    none_scored = earlier.set_column(0, "reward", pa.nulls(4, pa.float32())).set_column(
        2, "reward_error", pa.array(["E: x"] * 4))
    metrics = step_metrics(none_scored, 0, 0, np.array([], int), 0)
    assert metrics["reward/errors"] == 4 and np.isnan(metrics["reward/mean"])

    failed = FailedRewardSteps("reward f.py:r", 2)
    all_failed = {"rows": 4, "reward/errors": 4}
    failed.check({**all_failed, "step": 0, "reward/first_error": "E: first"})
    failed.check({"step": 1, "rows": 4, "reward/errors": 3})  # one row scored: the count starts over
    failed.check({**all_failed, "step": 2, "reward/first_error": "E: third"})
    assert failed.stop_line() is None
    with pytest.raises(RewardFailed) as raised:
        failed.check({**all_failed, "step": 3, "reward/first_error": "E: fourth"})
    assert str(raised.value) == ("reward f.py:r failed on every row of steps 2-3 (reward_max_failed_steps: 2); "
                                 "first error: E: third")
    never = FailedRewardSteps("r", 0)
    for step in range(5):
        never.check({**all_failed, "step": step})
