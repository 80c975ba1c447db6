"""A trainer process that dies never lets a run go on with a fresh optimizer (issue #13).

With `recovery.max_restarts: 0` (the default heals: tests/test_recovery.py), `trajflow run` as a
subprocess on its own embedded Ray (driven by scripts/chaos.py); once checkpoint 2 is written, a
data-parallel worker (`TrainerRank`, 2 workers) is SIGKILLed: worker 0 sees the all-reduce fail,
names the worker and its node, and the job exits 1 with that one line saying `--resume`; the
resumed run then completes with every step logged once and no trajectory_id twice. The train
step's own process restarted by Ray Data stops the run the same way instead of training on with
reset Adam moments: tests/test_recovery.py checks that in one process.

The run is `strategy: dedicated`, and its scorer is SIGKILLed first (issue #24): Ray Data
restarts it and retries the batch it held whole, which the run survives (it goes on to the
worker's kill) and which leaves no row trained half-scored (every trained row has old log-probs).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support import cli_in_process, explain

from trajflow.schemas import read_parquet

pytestmark = pytest.mark.slow

STEPS = 6


def _args(workers: int) -> list[str]:
    return ["quickstart", "--set", f"steps={STEPS}", "--set", "checkpoint_every=2",
            "--set", "save_all_versions=false", "--set", "report_to=[]", "--set", f"trainer.num_workers={workers}",
            # the quickstart's pre-learning-demo size: these tests are about the trainer group
            "--set", "prompts_per_step=8", "--set", "group_size=4", "--set", "eval_every=0", "--no-progress",
            "--set", "strategy=dedicated",
            "--set", "recovery.max_restarts=0"]  # today's behavior: stop with one line (tests/test_recovery.py heals)


def assert_stopped_with_resume_line(status: int, out: str, run_dir: Path, starts: str, says: str) -> None:
    """Exit status 1, and the output ends with one line naming the worker and the resume command."""
    last = out.strip().splitlines()[-1]
    assert status == 1, out[-3000:]
    assert last.startswith(starts) and says in last, last
    assert last.endswith(f"`trajflow run --resume {run_dir}`"), last


@pytest.mark.timeout(600)
def test_killed_scorer_is_replaced_then_a_killed_worker_stops_the_run_with_one_line_and_resume_completes_it(
        tmp_path, chaos, ray_session, capfd):
    """The killed run is a subprocess (chaos.py); the resume is the entry point's `main` in this
    process, on the session's Ray."""
    run_dir = tmp_path / "run"
    # the scorer while step 2 trains; a worker while step 3 trains (checkpoint 2 written by then)
    result = chaos.chaos_run(_args(workers=2), run_dir, [("scorer", 2), ("trainer_worker", 3)], tmp_path / "first.log")
    assert result.killed == 2, result.output[-3000:]
    assert result.kills[0].seconds is not None, "no metrics of step 2 after the scorer's kill"
    assert_stopped_with_resume_line(result.status, result.output, run_dir, "trajflow: trainer worker 1 of 2 (node ",
                                    " died; ")
    assert len(list((run_dir / "metrics").glob("step=*.parquet"))) < STEPS, "the run finished before the kill"

    proc = cli_in_process(["run", "--resume", run_dir, "--no-progress"], capfd)
    assert proc.returncode == 0, explain(proc)
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
    trained = pl.from_arrow(table).filter(pl.col("filter_reason").is_null())
    assert trained.height > 0 and trained["old_logprobs"].null_count() == 0  # every trained row scored
