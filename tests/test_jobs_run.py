"""`trajflow run`, `--resume` and `replay` end to end, as subprocesses on real Ray and real files.

- the quickstart config runs to the end and leaves a complete run dir (schema-valid trajectory
  partitions, one metrics row per step, checkpoints with retention, every version's weights);
- a run SIGKILLed after its second checkpoint (a LoRA run: the adapter is what is checkpointed)
  resumes from its last complete checkpoint: every step is logged exactly once and no
  trajectory_id is duplicated;
- replaying the logged run under `snapshot` in --diagnose mode reproduces the run's own
  diagnostics; replaying it under another strategy gives that strategy's (different) numbers;
- bad input (wrong column type, truncated Parquet, missing version weights) ends with one line
  and exit status 2, and writes nothing (these, report and compare call the entry point's `main`
  in this process: they end before Ray starts);
- resumes and replays run the entry point's `main` in this process too, on the session's Ray
  (`trajflow run` itself, its own Ray and its console, is the quickstart run's and the timing
  test's subprocess; a SIGKILL's target stays a subprocess): each `trajflow` subprocess pays an
  interpreter, torch and Ray's start-up that is not what those tests show;
- each status line is printed when its step ends: after the step's end and before the next
  step's end (timestamps of the lines as they arrive, against the trainer's `seconds/step_end`).

The other runs are the quickstart at its old, small size (8 prompts x 4 samples per step, ROWS).

Each `trajflow run` subprocess starts its own embedded Ray; `main` in this process uses the
session's (conftest's `ray_session`: already initialised, so the command does not start another).

One module on purpose: the end-to-end CLI runs share its module fixtures (one quick run, one
logged run, read by many tests), which is what keeps them affordable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import load_job_config
from trajflow.schemas import read_parquet

from support import cli_env, cli_in_process, explain, run_cli, run_until_checkpoint_then_kill, sessions_of

pytestmark = pytest.mark.slow

QUICK_STEPS = 8
ROWS = 32
SMALL = ["--set", "prompts_per_step=8", "--set", "group_size=4"]  # ROWS per step
EVAL_PROMPTS = 64
# the diagnostics a train step reports that a --diagnose replay recomputes
DIAGNOSTIC_PREFIXES = ("mask/", "clip/", "mismatch/", "is/", "staleness/", "active_frac", "loss_tokens", "loss")


def _all_trajectories(run_dir: Path) -> pa.Table:
    parts = sorted((run_dir / "trajectories").glob("step=*/part-*.parquet"))
    return pa.concat_tables([read_parquet(p) for p in parts], promote_options="permissive")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("jobs") / "quick"
    proc = run_cli(["run", "quickstart", "--run-dir", run_dir, "--set", f"steps={QUICK_STEPS}", *SMALL,
                    "--set", "checkpoint_every=2", "--set", "keep_checkpoints=2", "--set", "eval_every=4",
                    "--set", f"eval_prompts={EVAL_PROMPTS}"], modules=run_dir.parent / "driver_modules.txt")
    assert proc.returncode == 0, explain(proc)
    return run_dir, proc


def test_the_driver_never_imports_torch_nor_transformers_modeling(quick_run):
    """Issue 46: the driver names its operators (each actor imports its own), publishes version 0
    from the model's files and tokenizes with the tokenizer alone; torch and transformers'
    modeling load only in the actors (benchmarks/results/startup.md has what that saves)."""
    run_dir, _ = quick_run
    modules = set((run_dir.parent / "driver_modules.txt").read_text().split())
    assert "trajflow.pipelines.rl_loop" in modules and "ray.data" in modules  # the whole run, this process
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert "transformers.modeling_utils" not in modules


def test_quickstart_run_writes_a_complete_run_dir(quick_run):
    run_dir, proc = quick_run
    # resolved config: run dir and model path (not `model: null`)
    config = load_job_config(run_dir / "config.yaml")
    assert config.steps == QUICK_STEPS and config.strategy == "snapshot" and config.run_dir == run_dir.resolve()
    assert config.model == (Path(__file__).resolve().parent.parent / "artifacts" / "warm_start" / "addition")
    # progress: a status line per step (0-based step index, as in the metrics), then the summary
    for step in range(QUICK_STEPS):
        assert re.search(rf"^step {step} \( *{100 * (step + 1) // QUICK_STEPS}%\) \| reward ", proc.stdout, re.M), step
    assert "save_all_versions: 9 versions x" in proc.stdout  # the size estimate
    assert "checkpoints kept: step-000006, step-000008" in proc.stdout
    assert "trajflow: checkpoint of version 2 (resumes at step 2)" in proc.stdout
    summary = (run_dir / "summary.txt").read_text()
    assert summary.strip() and summary in proc.stdout  # the summary printed is the one written
    # every line fits 100 columns, except the ones naming a path
    long = [line for line in proc.stdout.splitlines() if len(line) > 100 and str(run_dir) not in line]
    assert not long, long
    # quiet: none of Ray's own notices, no weight-loading bar (--verbose shows them)
    for noise in ("Token authentication", "core_worker", "Progress bars disabled", "Loading weights", "Traceback"):
        assert noise not in proc.stdout + proc.stderr, noise
    assert not proc.stderr.strip(), proc.stderr
    # run.json: the state and one session
    state = json.loads((run_dir / "run.json").read_text())
    assert state["state"] == "finished" and len(state["sessions"]) == 1
    assert state["sessions"][0]["steps_trained"] == QUICK_STEPS and state["sessions"][0]["first_step"] == 0

    # metrics: one row per step, durable per-step files and the gathered file agree
    per_step = sorted((run_dir / "metrics").glob("step=*.parquet"))
    assert [p.name for p in per_step] == [f"step={s:06d}.parquet" for s in range(QUICK_STEPS)]
    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == list(range(QUICK_STEPS))
    assert metrics["version"].to_list() == list(range(1, QUICK_STEPS + 1))
    assert metrics["trainer_node"].n_unique() == 1 and len(metrics["trainer_node"][0]) > 8
    assert (metrics["rows"] == ROWS).all()
    # one key shape: every timing in seconds under seconds/, no unit suffix (docs/design.md §4a)
    timings = [c for c in metrics.columns if "seconds" in c or c.startswith("time/")]
    assert {"seconds/generate", "seconds/train", "seconds/step_end"} <= set(timings), timings
    assert all(c.startswith("seconds/") and not c.endswith("_seconds") for c in timings), timings
    # placement.json, from the node each stage's process reported (no state API: no dashboard here)
    from trajflow.pipelines.colocation import stage_class
    from trajflow.pipelines.rl_loop import RLPipeline

    placement = json.loads((run_dir / "placement.json").read_text())
    stages = {stage_class(s) for s in RLPipeline(config.pipeline_config()).stages}
    assert {"Generate", "TrainStep"} < stages and set(placement["stages"]) == stages
    assert set(placement["nodes"]) == {metrics["trainer_node"][0]}
    assert all(nodes == [metrics["trainer_node"][0]] for nodes in placement["stages"].values())
    assert "trajflow: placement" not in proc.stdout  # said only when stages run on several nodes

    # held-out accuracy: version 0 (the warm start) in step 0's row, then versions 4 and 8; the summary
    # shows both ends with the standard error over the 64 prompts
    assert metrics["heldout/accuracy_start"].drop_nulls().len() == 1
    start = metrics["heldout/accuracy_start"][0]
    assert start == pytest.approx(_warm_start_accuracy(EVAL_PROMPTS), abs=1e-9)
    evaluated = metrics.filter(pl.col("heldout/accuracy").is_not_null())
    assert evaluated["version"].to_list() == [4, 8]
    end = evaluated["heldout/accuracy"][-1]
    error = np.hypot(np.sqrt(start * (1 - start) / EVAL_PROMPTS), np.sqrt(end * (1 - end) / EVAL_PROMPTS))
    assert (f"held-out accuracy on {EVAL_PROMPTS} prompts: {start:.3f} at version 0 -> {end:.3f} at version 8, "
            f"{end - start:+.3f} ± {error:.3f} (s.e.)") in proc.stdout

    # trajectories: schema-valid partitions of one train step each, unique ids
    table = _all_trajectories(run_dir)
    assert table.num_rows == QUICK_STEPS * ROWS
    assert pc.count_distinct(table["trajectory_id"]).as_py() == table.num_rows
    for step in range(QUICK_STEPS):
        part = read_parquet(run_dir / "trajectories" / f"step={step:06d}" / "part-0.parquet")
        assert set(part["trainer_version"].to_pylist()) == {step}
        assert set(part["rollout_step"].to_pylist()) == {step}
        trained = pc.is_null(part["filter_reason"])
        # the exact strategy filled old log-probs for every trained row; versions within the window
        assert part.filter(trained)["old_logprobs"].null_count == 0
        versions = pc.list_flatten(part["versions"]).to_numpy()
        assert versions.max() <= step and versions.min() >= step - config.max_staleness
    n_trained = int(pc.sum(pc.is_null(table["filter_reason"])).as_py())
    assert n_trained == int(metrics["rows_trained"].sum())

    # checkpoints: the newest two (retention), weights + optimizer state, no pickle anywhere
    kept = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [c.version for c in kept] == [6, 8]
    state_files = {"meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors"}
    for c in kept:
        names = {p.name for p in c.path.iterdir()}
        # the last one is also the run's exported Hugging Face directory (config, tokenizer files)
        expected = state_files | ({"config.json", "tokenizer.json"} if c is kept[-1] else set())
        assert expected <= names and (c is kept[-1] or names == state_files)
        optimizer = c.optimizer_state()
        assert optimizer["state"] and "exp_avg" in next(iter(optimizer["state"].values()))
    assert not [p for p in run_dir.rglob("*") if p.suffix in (".pt", ".pkl", ".pickle", ".bin", ".tmp")]
    # every version's weights (save_all_versions), the final one equal to the last checkpoint
    assert sorted(p.name for p in (run_dir / "versions").iterdir()) == [
        f"v{v:06d}.safetensors" for v in range(QUICK_STEPS + 1)]
    final = kept[-1].model_state()
    saved = ckpt.load_weights(run_dir / "versions" / f"v{QUICK_STEPS:06d}.safetensors")
    assert all(np.array_equal(final[k].numpy(), saved[k].numpy()) for k in final)
    # TensorBoard event files (tensorboard is a dependency): one scalar series per metric, steps 0..7
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("reward/mean")] == list(range(QUICK_STEPS))
    assert [e.value for e in accumulator.Scalars("reward/mean")] == pytest.approx(metrics["reward/mean"].to_list())


def _warm_start_accuracy(prompts: int) -> float:
    """Greedy held-out accuracy of the warm start, computed here as the trainer does (one thread)."""
    import torch

    from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
    from trajflow.tasks.rollout import heldout_mean_reward

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workload = load_job_config("quickstart").workload()
        return heldout_mean_reward(load_model(WARM_START_DIR), load_tokenizer(WARM_START_DIR), workload, prompts, 6)
    finally:
        torch.set_num_threads(threads)


def test_status_lines_are_printed_as_their_steps_end(tmp_path):
    """`trajflow` (the installed entry point) on a tiny synchronous config whose steps take at
    least 6 x 0.3 s of (simulated) decoding each: the line of step k arrives after step k ended
    (the trainer's wall-clock `seconds/step_end`) and before step k+1 ended. A driver that holds the
    lines back (e.g. a 40 s call after the first row) prints them in a burst after the last step."""
    steps, run_dir = 4, tmp_path / "timed"
    entry = Path(sys.executable).with_name("trajflow")
    args = ["run", "quickstart", "--run-dir", run_dir, "--no-progress", "--set", f"steps={steps}",
            "--set", "max_staleness=0", "--set", "prompts_per_step=4", "--set", "group_size=2",
            "--set", "simulate_decode_seconds=0.3", "--set", "eval_every=0", "--set", "checkpoint_every=0",
            "--set", "save_all_versions=false", "--set", "trajectory_log=false", "--set", "report_to=[]"]
    proc = subprocess.Popen([str(entry), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cli_env())
    arrived: dict[int, float] = {}
    lines = []
    try:
        for line in proc.stdout:  # unbuffered child (PYTHONUNBUFFERED): each line as it is printed
            lines.append(line)
            found = re.match(r"step +(\d+) \(", line)
            if found:
                arrived[int(found.group(1))] = time.time()
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # a finished run leaves no Ray session dir behind and keeps no Ray logs (tests/test_ray_sessions.py)
    assert sessions_of({proc.pid}) == [] and not (run_dir / "ray-logs").exists()
    ended = pl.read_parquet(run_dir / "metrics.parquet").sort("step")["seconds/step_end"].to_list()
    assert sorted(arrived) == list(range(steps)) and len(ended) == steps, "".join(lines)
    for k in range(steps):
        assert arrived[k] >= ended[k], (k, arrived[k] - ended[k])
        if k + 1 < steps:
            assert arrived[k] < ended[k + 1], f"the line of step {k} came {arrived[k] - ended[k + 1]:.1f}s after " \
                                              f"step {k + 1} ended"


def test_resuming_a_finished_run_says_so_and_touches_nothing(quick_run, capfd):
    run_dir, _ = quick_run
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = cli_in_process(["run", "--resume", run_dir], capfd)  # it ends before Ray starts
    assert proc.returncode == 0, explain(proc)
    assert f"already finished all {QUICK_STEPS} steps" in proc.stdout and "nothing to do" in proc.stdout
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_resume_passes_over_a_truncated_checkpoint_and_says_so(quick_run, tmp_path, ray_session, capfd):
    """The last checkpoint's weights cut short (a disk filled up, a copy interrupted): the resume
    finds it before writing anything, says so in one line, and continues from the checkpoint
    before it; the run ends complete, its last checkpoint whole again."""
    run_dir = tmp_path / "cut"
    shutil.copytree(quick_run[0], run_dir)
    weights = run_dir / "checkpoints" / f"step-{QUICK_STEPS:06d}" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert [c.version for c in ckpt.list_checkpoints(run_dir / "checkpoints")] == [6, 8]  # it looks complete
    before = (run_dir / "config.yaml").read_bytes()

    proc = cli_in_process(["run", "--resume", run_dir, "--no-progress"], capfd)
    assert proc.returncode == 0, explain(proc)
    damaged = [line for line in proc.stdout.splitlines() if "is damaged" in line]
    assert damaged == [f"trajflow: checkpoint step-{QUICK_STEPS:06d} is damaged (model.safetensors: truncated "
                       f"({size // 2} of {size} bytes)); falling back to step-000006"], proc.stdout
    assert "resuming from checkpoint step-000006: steps 6..7" in proc.stdout
    assert (run_dir / "config.yaml").read_bytes() == before
    assert pl.read_parquet(run_dir / "metrics.parquet")["step"].to_list() == list(range(QUICK_STEPS))
    last = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert last.version == QUICK_STEPS and ckpt.checkpoint_problem(last) is None


def test_report_and_compare_of_runs_with_the_same_directory_name(quick_run, tmp_path, capfd):
    """compare a/quick b/quick keeps both runs: they are paths, labelled by the path tails."""
    run_dir, _ = quick_run
    for parent in ("a", "b"):
        shutil.copytree(run_dir, tmp_path / parent / "quick", ignore=shutil.ignore_patterns("trajectories", "versions"))
    out = tmp_path / "both.png"
    proc = cli_in_process(["compare", tmp_path / "a" / "quick", tmp_path / "b" / "quick", "--out", out], capfd)
    assert proc.returncode == 0, explain(proc)
    header = proc.stdout.splitlines()[0].split()
    assert header == ["a/quick", "b/quick"] or header == ["b/quick", "a/quick"], proc.stdout
    assert f"a/quick: {tmp_path / 'a' / 'quick'}" in proc.stdout and f"b/quick: {tmp_path / 'b' / 'quick'}" in proc.stdout
    assert f"plots written to {out}" in proc.stdout and out.stat().st_size > 10_000
    assert re.search(r"^  = mean of last N steps, N +1 +1$", proc.stdout, re.M)  # 8 steps: the last fifth
    again = cli_in_process(["compare", tmp_path / "a" / "quick", tmp_path / "b" / "quick", "--out", out], capfd)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # never silently overwritten

    report = cli_in_process(["report", tmp_path / "a" / "quick"], capfd)
    assert report.returncode == 0, explain(report)
    assert (tmp_path / "a" / "quick" / "report.png").stat().st_size > 10_000
    wall = re.search(r"^wall time per step \(s\) +([0-9.]+)$", report.stdout, re.M)
    assert wall and float(wall.group(1)) > 0


def test_replay_snapshot_reproduces_the_logged_diagnostics(quick_run, tmp_path, ray_session, capfd):
    run_dir, _ = quick_run
    out = tmp_path / "replay"
    proc = cli_in_process(["replay", run_dir / "trajectories", "--checkpoints", run_dir / "versions",
                           "--strategy", "snapshot", "--strategy", "recompute", "--diagnose", "--out", out], capfd)
    assert proc.returncode == 0, explain(proc)
    replayed = pl.read_parquet(out / "metrics.parquet")
    logged = pl.read_parquet(run_dir / "metrics.parquet")
    assert sorted(replayed["strategy"].unique().to_list()) == ["recompute", "snapshot"]

    snap = replayed.filter(pl.col("strategy") == "snapshot").sort("step")
    assert snap["step"].to_list() == list(range(QUICK_STEPS))
    keys = [c for c in snap.columns if c.startswith(DIAGNOSTIC_PREFIXES)]
    logged_keys = [c for c in logged.columns if c.startswith(DIAGNOSTIC_PREFIXES)]
    assert {"mask/token_kept_frac", "clip/frac", "active_frac", "mismatch/k3", "is/ess", "loss"} <= set(keys)
    assert sorted(keys) == sorted(logged_keys)
    compared = 0
    for live, again in zip(logged.sort("step").iter_rows(named=True), snap.iter_rows(named=True)):
        assert live["rows_trained"] == again["rows_trained"]
        for key in keys:
            if live[key] is None:
                assert again[key] is None, key
                continue
            assert again[key] == pytest.approx(live[key], rel=1e-6, abs=1e-6), (live["step"], key)
            compared += 1
    assert compared > 50

    # a different strategy on the same data: recompute scores "old" with the trainer's current
    # weights, so r_s = 1 (nothing clipped) and policy drift shows up in r_d instead
    rec = replayed.filter(pl.col("strategy") == "recompute").sort("step")
    trained = rec.filter(pl.col("rows_trained") > 0)
    assert (trained["clip/frac"] == 0).all()
    assert trained["mismatch/k3"].sum() > snap.filter(pl.col("rows_trained") > 0)["mismatch/k3"].sum()


# -- bad input ---------------------------------------------------------------------------------------
def _one_line_failure(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, explain(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("trajflow: "), explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _copy_log(run_dir: Path, dest: Path, steps=(0, 1, 2)) -> Path:
    for s in steps:
        name = f"step={s:06d}"
        shutil.copytree(run_dir / "trajectories" / name, dest / "trajectories" / name)
    shutil.copy(run_dir / "config.yaml", dest / "config.yaml")
    return dest


def test_replay_rejects_a_wrong_column_type(quick_run, tmp_path, capfd):
    run_dir, _ = quick_run
    log = _copy_log(run_dir, tmp_path / "log")
    file = log / "trajectories" / "step=000001" / "part-0.parquet"
    table = pq.read_table(file)
    index = table.schema.get_field_index("versions")
    pq.write_table(table.set_column(index, "versions", table["versions"].cast(pa.list_(pa.string()))), file)
    out = tmp_path / "out"
    proc = cli_in_process(["replay", log, "--checkpoints", run_dir, "--strategy", "snapshot", "--out", out], capfd)
    _one_line_failure(proc, "step=000001/part-0.parquet", "column 'versions'")
    assert not out.exists() and not (log / "replay").exists()


def test_replay_rejects_a_truncated_parquet_file(quick_run, tmp_path, capfd):
    run_dir, _ = quick_run
    log = _copy_log(run_dir, tmp_path / "log")
    file = log / "trajectories" / "step=000002" / "part-0.parquet"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 2 // 3])
    out = tmp_path / "out"
    proc = cli_in_process(["replay", log, "--checkpoints", run_dir, "--strategy", "snapshot", "--out", out], capfd)
    _one_line_failure(proc, "step=000002/part-0.parquet", "not a readable Parquet file")
    assert not out.exists()


def test_replay_quarantines_nonfinite_rows_only_when_asked(quick_run, tmp_path, ray_session, capfd):
    run_dir, _ = quick_run
    log = _copy_log(run_dir, tmp_path / "log")
    file = log / "trajectories" / "step=000001" / "part-0.parquet"
    table = pq.read_table(file)
    values = table["inference_logprobs"].to_pylist()
    values[3] = [float("nan")] + values[3][1:]
    index = table.schema.get_field_index("inference_logprobs")
    pq.write_table(table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type)),
                   file)
    out = tmp_path / "out"
    args = ["replay", log, "--checkpoints", run_dir, "--strategy", "snapshot", "--out", out]
    refused = cli_in_process(args, capfd)
    _one_line_failure(refused, "step=000001/part-0.parquet", "inference_logprobs", "--quarantine-nonfinite")
    assert not out.exists()

    proc = cli_in_process([*args, "--quarantine-nonfinite"], capfd)
    assert proc.returncode == 0, explain(proc)
    assert "quarantined 1 rows with NaN/inf log-probs (steps 1)" in proc.stdout
    quarantined = pq.read_table(out / "quarantine.parquet")
    assert quarantined.num_rows == 1 and quarantined["trajectory_id"][0] == table["trajectory_id"][3]
    metrics = pl.read_parquet(out / "metrics.parquet").sort("step")
    assert metrics["filtered/nonfinite"].fill_null(0).to_list() == [0, 1, 0]
    assert (metrics["rows"] == ROWS).all()


def test_replay_reports_missing_versions_by_number(quick_run, tmp_path, capfd):
    run_dir, _ = quick_run
    versions = tmp_path / "versions"
    shutil.copytree(run_dir / "versions", versions)
    for v in (2, 3, 5):
        (versions / f"v{v:06d}.safetensors").unlink()
    out = tmp_path / "out"
    proc = cli_in_process(["replay", run_dir, "--checkpoints", versions, "--strategy", "snapshot", "--diagnose",
                    "--out", out], capfd)
    _one_line_failure(proc, "weights of 3 version(s) missing", ": 2-3, 5 ")
    assert not out.exists()


# -- kill and resume ---------------------------------------------------------------------------------
def test_sigkilled_lora_run_resumes_without_repeating_or_skipping_steps(tmp_path, ray_session, capfd):
    """A SIGKILLed job (a LoRA run, asynchronous snapshot at max_staleness 2, float32 inference,
    every version kept) resumes from its last complete checkpoint (the adapter and its optimizer
    state): `--resume` trains exactly the remaining steps, once each; the log has every row once;
    the last checkpoint is the merged model; old = inference on the adapter versions of both
    sessions. The versions on disk are PEFT adapters (each under 15 % of a full version) and the
    base once, across both sessions; a `--train` replay of the whole log reads them and retraces
    the run: the same losses (1e-6) and the same final adapter (1e-6)."""
    from support import max_abs_difference
    from transformers import AutoModelForCausalLM

    from trajflow.engines import lora
    from trajflow.pipelines.replay import Replay

    steps = 8
    run_dir = tmp_path / "killed"
    args = ["run", "quickstart", "--run-dir", run_dir, "--set", f"steps={steps}", *SMALL, "--set", "lora.r=8",
            "--set", "max_staleness=2", "--set", "inference_dtype=float32", "--set", "checkpoint_every=2",
            "--set", "keep_checkpoints=2", "--set", "save_all_versions=true", "--set", "report_to=[]",
            "--set", "eval_every=4", "--set", "eval_prompts=16"]
    run_until_checkpoint_then_kill(args, run_dir, 4, tmp_path / "first.log")
    logged_before = sorted((run_dir / "metrics").glob("step=*.parquet"))
    assert len(logged_before) < steps, "the run finished before it could be killed"
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.version >= 4
    assert (latest.path / ckpt.ADAPTER_FILE).is_file() and lora.is_adapter(latest.model_state())

    proc = cli_in_process(["run", "--resume", run_dir, "--no-progress"], capfd)  # the killed run was a subprocess
    assert proc.returncode == 0, explain(proc)
    assert f"from checkpoint step-{latest.version:06d}: steps {latest.version}..{steps - 1}" in proc.stdout
    # the resumed session trained exactly the steps from the checkpoint's version on
    assert not re.search(rf"^step {latest.version - 1} \(", proc.stdout, re.M)
    for step in range(latest.version, steps):
        assert re.search(rf"^step {step} \(", proc.stdout, re.M), step

    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == list(range(steps))  # each step exactly once, in order
    # version 0 is evaluated once, by the first session; the resumed trainer started later
    assert metrics.filter(pl.col("heldout/accuracy_start").is_not_null())["step"].to_list() == [0]
    assert metrics["version"].to_list() == list(range(1, steps + 1))
    # the optimizer state was restored: its step count runs on across the resume
    trained_steps = (metrics["rows_trained"] > 0).cast(pl.Int64).cum_sum()
    assert metrics["optimizer_steps"].to_list() == trained_steps.to_list()
    table = _all_trajectories(run_dir)
    assert table.num_rows == steps * ROWS
    assert pc.count_distinct(table["trajectory_id"]).as_py() == table.num_rows  # no duplicate rows
    assert sorted(set(table["trainer_version"].to_pylist())) == list(range(steps))
    assert [c.version for c in ckpt.list_checkpoints(run_dir / "checkpoints")] == [6, 8]
    final = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert (final.path / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(final.path)  # the merged model loads
    # exactness in the asynchronous run: old (the snapshot scorer) = inference on adapter versions
    diffs = [np.max(np.abs(np.subtract(o, i))) for o, i, v in zip(
        table["old_logprobs"].to_pylist(), table["inference_logprobs"].to_pylist(), table["versions"].to_pylist())
        if min(v) >= 1 and o is not None]
    assert len(diffs) > 0 and max(diffs) < 1e-5
    state = json.loads((run_dir / "run.json").read_text())
    assert state["state"] == "finished" and state["first_step"] == latest.version
    # run.json keeps both sessions: the killed one (its steps up to the checkpoint kept) and the resume
    first, second = state["sessions"]
    assert first["state"] == "killed" and first["first_step"] == 0 and first["steps_trained"] == latest.version
    assert second["state"] == "finished" and second["first_step"] == latest.version
    assert second["steps_trained"] == steps - latest.version and second["started"] > first["started"]

    # versions/: the base once and every version's adapter in PEFT's format, across both sessions
    versions = run_dir / "versions"
    assert sorted(p.name for p in versions.iterdir()) == ["base", *(f"v{v:06d}" for v in range(steps + 1))]
    full = ckpt.weights_nbytes(versions / "base")
    sizes = [sum(f.stat().st_size for f in (versions / f"v{v:06d}").iterdir()) for v in range(steps + 1)]
    assert max(sizes) <= 0.15 * full, (sizes, full)
    assert "save_all_versions: the base once (" in (tmp_path / "first.log").read_text()  # the estimate
    last = ckpt.load_version(versions / f"v{steps:06d}")
    assert max_abs_difference(last, final.model_state()) == 0.0  # the last version: the final checkpoint's adapter
    # a --train replay of the whole log from version 0 reads the adapters and retraces both sessions
    config = load_job_config(run_dir / "config.yaml").pipeline_config()
    replay = Replay(config, run_dir / "trajectories", versions, ["snapshot"], "train")
    replayed = replay.run(progress=False)
    print(f"\nLoRA versions on disk: {max(sizes)} B at most, a full version {full} B; replay --train loss gap "
          f"{max(abs(a - b) for a, b in zip(replayed['loss'], metrics['loss'])):.1e}")
    assert replayed["step"].to_list() == list(range(steps)) and replayed["version"].to_list() == list(range(1, steps + 1))
    assert replayed["loss"].to_list() == pytest.approx(metrics["loss"].to_list(), abs=1e-6)
    assert lora.is_adapter(replay.final_weights) and max_abs_difference(replay.final_weights, last) < 1e-6


# -- in-process on the session's Ray ---------------------------------------------------------------
def test_replay_train_on_the_logged_data_retraces_the_run(quick_run, tmp_path, ray_session):
    """--train under the run's own strategy, on the first 4 logged steps, from version 0: the same
    batches, old log-probs and optimizer steps, so it ends at the run's own version 4. (The Replay
    itself: the CLI path of replay is covered by the diagnose test above.)"""
    from trajflow.pipelines.replay import Replay

    run_dir, _ = quick_run
    log = _copy_log(run_dir, tmp_path / "log", steps=range(4))
    config = load_job_config(run_dir / "config.yaml").pipeline_config()
    replay = Replay(config, log, run_dir / "versions", ["snapshot"], "train")
    assert 0 in replay.weights and set(replay.weights) <= {0, 1, 2, 3}  # the start + the log's versions
    metrics = replay.run()
    assert metrics["step"].to_list() == [0, 1, 2, 3] and metrics["version"].to_list() == [1, 2, 3, 4]
    logged = pl.read_parquet(run_dir / "metrics.parquet").head(4)
    assert metrics["loss"].to_list() == pytest.approx(logged["loss"].to_list(), abs=1e-6)
    original = ckpt.load_weights(run_dir / "versions" / "v000004.safetensors")
    trained = replay.final_weights
    assert max(float((trained[k] - original[k]).abs().max()) for k in original) < 1e-5


LOUD_STRATEGY = """
import sys
import warnings

from trajflow.operators.strategies.snapshot import Snapshot


class Loud(Snapshot):
    name = "loud"

    def old_logprobs(self, batch, current, trainer):
        warnings.warn("loud: a warning from the strategy")
        print("loud: a line on stderr", file=sys.stderr, flush=True)
        return super().old_logprobs(batch, current, trainer)
"""


def test_replay_prints_trajflow_lines_only_and_the_workers_lines_go_to_its_log(quick_run, tmp_path):
    """`trajflow replay` (a subprocess: its own Ray forwards the workers' lines) is as quiet as
    `run`: a strategy that warns and writes to stderr in the Ray worker shows in OUT/workers.log,
    not in the output; with --verbose it is printed."""
    run_dir, _ = quick_run
    (tmp_path / "loud.py").write_text(LOUD_STRATEGY)
    log = _copy_log(run_dir, tmp_path / "log", steps=range(2))
    args = ["replay", log, "--checkpoints", run_dir / "versions", "--strategy", f"{tmp_path / 'loud.py'}:Loud",
            "--config", run_dir / "config.yaml", "--no-progress"]
    proc = run_cli([*args, "--out", tmp_path / "quiet"])
    assert proc.returncode == 0, explain(proc)
    assert proc.stderr == "", explain(proc)
    assert "loud:" not in proc.stdout and "pid=" not in proc.stdout, explain(proc)
    workers = (tmp_path / "quiet" / "workers.log").read_text()
    assert "loud: a warning from the strategy" in workers and "loud: a line on stderr" in workers
    proc = run_cli([*args, "--out", tmp_path / "loud", "--verbose"])
    assert proc.returncode == 0, explain(proc)
    assert "loud: a line on stderr" in proc.stdout + proc.stderr, explain(proc)
    assert not (tmp_path / "loud" / "workers.log").exists()


def test_the_session_ray_listens_on_loopback_only(ray_session):
    """The test session's own Ray is started like a run's (conftest: start_local_ray)."""
    from trajflow.pipelines.ray.embedded import SINGLE_NODE_ENV

    assert ray_session.util.get_node_ip_address() == "127.0.0.1"
    assert SINGLE_NODE_ENV not in os.environ  # restored after the start: a later cluster connection is unaffected
