"""A trainer process that dies never lets a run go on with a fresh optimizer (issue #13).

With `recovery.max_restarts: 0` (the default heals: tests/test_recovery.py), `trajflow run` as a
subprocess on its own embedded Ray; once checkpoint 2 is written, a data-parallel worker
(`TrainerRank`, 2 workers) is SIGKILLed: worker 0 sees the all-reduce fail, names the worker and
its node, and the job exits 1 with that one line saying `--resume`; the resumed run then
completes with every step logged once and no trajectory_id twice. The train step's
own process restarted by Ray Data stops the run the same way instead of training on with reset
Adam moments: tests/test_recovery.py checks that in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from trajflow.schemas import read_parquet

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "trajflow.jobs.cli"]
STEPS = 8


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _args(run_dir: Path, workers: int) -> list[str]:
    return ["run", "quickstart", "--run-dir", str(run_dir), "--set", f"steps={STEPS}", "--set", "checkpoint_every=2",
            "--set", "save_all_versions=false", "--set", "tensorboard=false", "--set", f"trainer.num_workers={workers}",
            # the quickstart's pre-learning-demo size: these tests are about the trainer group
            "--set", "prompts_per_step=8", "--set", "group_size=4", "--set", "eval_every=0", "--no-progress",
            "--set", "recovery.max_restarts=0"]  # today's behaviour: stop with one line (tests/test_recovery.py heals)


def run_and_kill(args: list[str], run_dir: Path, process_title: str, log_path: Path) -> tuple[int, str]:
    """Start `trajflow ARGS`; once checkpoint 2 is complete, SIGKILL the run's processes whose
    title contains `process_title`; returns (exit status, output)."""
    import psutil

    with open(log_path, "w") as log:
        proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (run_dir / "checkpoints" / "step-000002" / "meta.json").is_file():
                assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before checkpoint 2"
                assert time.monotonic() < deadline, "no checkpoint 2 within 240 s"
                time.sleep(0.2)
            victims = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if process_title in " ".join(p.cmdline())]
            assert victims, f"no process titled {process_title!r} in the run"
            for p in victims:
                p.kill()
            status = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return status, log_path.read_text()


def assert_stopped_with_resume_line(status: int, out: str, run_dir: Path, starts: str, says: str) -> None:
    """Exit status 1, and the output ends with one line naming the worker and the resume command."""
    last = out.strip().splitlines()[-1]
    assert status == 1, out[-3000:]
    assert last.startswith(starts) and says in last, last
    assert last.endswith(f"`trajflow run --resume {run_dir}`"), last


@pytest.mark.timeout(600)
def test_killed_worker_stops_the_run_with_one_line_and_resume_completes_it(tmp_path):
    run_dir = tmp_path / "run"
    status, out = run_and_kill(_args(run_dir, workers=2), run_dir, "TrainerRank", tmp_path / "first.log")
    assert_stopped_with_resume_line(status, out, run_dir, "trajflow: trainer worker 1 of 2 (node ", " died; ")
    assert len(list((run_dir / "metrics").glob("step=*.parquet"))) < STEPS, "the run finished before the kill"

    proc = subprocess.run(CLI + ["run", "--resume", str(run_dir), "--no-progress"], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == list(range(STEPS))  # each step once: none repeated or skipped
    assert metrics["version"].to_list() == list(range(1, STEPS + 1))
    assert (metrics["trainer/num_workers"] == 2).all()
    trained_steps = (metrics["rows_trained"] > 0).cast(pl.Int64).cum_sum()
    assert metrics["optimizer_steps"].to_list() == trained_steps.to_list()  # Adam's state carried over
    parts = sorted((run_dir / "trajectories").glob("step=*/part-*.parquet"))
    table = pa.concat_tables([read_parquet(p) for p in parts], promote_options="permissive")
    assert table.num_rows == STEPS * 32
    assert pc.count_distinct(table["trajectory_id"]).as_py() == table.num_rows
