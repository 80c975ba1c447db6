"""A logged run with distributions, end to end on real Ray and real files: `trajflow run` with
top_k_logprobs and a teacher writes the top-k and teacher columns to the trajectory log, and
`trajflow replay --diagnose` reads them back under snapshot (reproducing the run's own
distribution-level and distillation diagnostics), behavior and score_centering."""

from __future__ import annotations

import polars as pl
import pyarrow.compute as pc
import pytest

from trajflow.schemas import TopKSemantics, read_parquet, top_k_semantics

from support import cli_in_process, explain, run_cli

pytestmark = pytest.mark.slow
STEPS, K = 3, 8


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dist") / "run"
    proc = run_cli(["run", "quickstart", "--run-dir", run_dir, "--set", f"steps={STEPS}", "--set", "prompts_per_step=4",
                    "--set", "group_size=4", "--set", "eval_every=0", "--set", f"top_k_logprobs={K}",
                    "--set", "teacher=artifacts/warm_start/addition", "--set", "distill.forward_kl_coef=0.5",
                    "--set", "drop_zero_variance_groups=false", "--set", "max_staleness=0"], timeout=900)
    assert proc.returncode == 0, explain(proc)
    return run_dir


@pytest.mark.timeout(1200)
def test_the_log_holds_the_distributions_and_replay_reads_them(distilled_run, tmp_path, ray_session, capfd):
    log = sorted((distilled_run / "trajectories").glob("step=*/part-*.parquet"))
    assert len(log) == STEPS
    table = read_parquet(log[0])  # validated: K per token, ids in the vocabulary, -inf rules
    assert top_k_semantics(table) == TopKSemantics(K, 64)
    for column in ("top_k_ids", "top_k_inference_logprobs", "top_k_old_logprobs", "top_k_teacher_logprobs",
                   "teacher_logprobs"):
        assert column in table.column_names and table[column].null_count == 0, column
    assert pc.all(pc.equal(pc.list_value_length(table["top_k_ids"]),
                           pc.list_value_length(table["response_tokens"]))).as_py()

    out = tmp_path / "replay"
    proc = cli_in_process(["replay", distilled_run / "trajectories", "--checkpoints", distilled_run / "versions",
                           "--strategy", "snapshot,behavior,score_centering", "--diagnose", "--out", out], capfd)
    assert proc.returncode == 0, explain(proc)
    replayed = pl.read_parquet(out / "metrics.parquet")
    logged = pl.read_parquet(distilled_run / "metrics.parquet").sort("step")
    snap = replayed.filter(pl.col("strategy") == "snapshot").sort("step")
    keys = [k for k in logged.columns if k.startswith(("mismatch/", "distill/"))]
    assert {"mismatch/tv", "mismatch/kl_support", "distill/reverse_kl", "distill/forward_kl"} <= set(keys)
    for live, again in zip(logged.iter_rows(named=True), snap.iter_rows(named=True)):
        for key in keys:  # the logged run is snapshot's: its diagnostics come back
            assert again[key] == pytest.approx(live[key], rel=1e-5, abs=1e-7), (live["step"], key)
    assert (snap["mismatch/tv"] > 0).all()  # bf16 inference (quickstart): a real mismatch
    behavior = replayed.filter(pl.col("strategy") == "behavior")
    assert (behavior["mismatch/tv"] == 0).all()  # its pi_old is mu
    sc = replayed.filter(pl.col("strategy") == "score_centering")
    assert sc["mismatch/tv"].to_list() == pytest.approx(snap["mismatch/tv"].to_list())  # the same exact pi_old
    assert (sc["clip/frac"] == 0).all() and (sc["sc/center_norm"] > 0).all()
