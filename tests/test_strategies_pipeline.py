"""Strategies in the running pipeline: every strategy under top-k / top-p sampling, exact old
log-probs under bf16 mixed precision and with a dropout checkpoint, and a strategy defined outside
the package, live and in `trajflow replay --diagnose`.

Runs either on Ray Data (`RLPipeline.run`) or with the same stage list executed in this process
(`run_in_process`, pipelines/local.py: the same operator objects in one process, without Ray), which keeps the sixteen top-k/top-p runs affordable.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow.compute as pc
import pytest
import torch

from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer, save_model
from trajflow.operators.strategies import strategy_names
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.local import run_in_process
from trajflow.pipelines.rl_loop import RLPipeline

SMALL = dict(prompts_per_step=8, group_size=4, drop_zero_variance_groups=False, seed=1)


def record_weights_and_old(trainstep, batch, metrics) -> None:
    """A job-style hook: are the new weights finite, and how many trained loss tokens had a pi_old
    of -inf (outside the support under training numerics) in the loss (`loss_old_logprobs`)."""
    metrics["test/weights_finite"] = all(bool(torch.isfinite(v).all()) for v in trainstep.policy.policy_state_dict().values())
    trained = pc.is_null(batch["filter_reason"])
    old = batch.filter(trained)
    flat_old = pc.list_flatten(old["loss_old_logprobs"]).to_numpy(zero_copy_only=False)
    flat_mask = pc.list_flatten(old["loss_mask"]).to_numpy(zero_copy_only=False)
    metrics["test/old_neg_inf"] = int((np.isneginf(flat_old) & flat_mask).sum())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sampling, correction", [
    ({"top_k": 2}, {"mask_level": "none", "clip_level": "sequence"}),  # the levels that turned -inf into NaN
    ({"top_p": 0.9}, {}),
])
def test_every_strategy_trains_under_top_k_and_top_p(sampling, correction):
    # bf16-sampled tokens outside the float32 support: ~7e-4 of tokens on the warm start at top_k 2
    # and at top_p 0.9 (measured on 5,400 tokens each), so each strategy samples its own data (seed)
    # and the runs together meet a few
    outside = {}
    for i, strategy in enumerate(strategy_names()):
        # with the record's top-k (past the filter's support: -inf entries), which score_centering needs
        config = PipelineConfig(**{**SMALL, "seed": 10 + i}, strategy=strategy, steps=6, inference_dtype="bfloat16",
                                sampling={"max_new_tokens": 6, **sampling}, correction=correction, top_k_logprobs=8)
        pipe = RLPipeline(config)
        pipe.hooks.on_step = record_weights_and_old
        m = run_in_process(pipe)
        assert m.height == 6, strategy
        trained = m.filter(pl.col("rows_trained") > 0)
        assert trained.height == 6, strategy
        assert all(math.isfinite(v) for v in trained["loss"].to_list()), strategy
        assert m["test/weights_finite"].all(), strategy
        assert (trained["grad/nonfinite_skipped"] == 0).all(), strategy  # no update was ever skipped
        # every -inf old log-prob on a trained token was taken out (and counted), plus tokens whose
        # current log-prob was -inf
        assert (trained["support/outside_tokens"] >= m["test/old_neg_inf"]).all(), strategy
        outside[strategy] = int(trained["support/outside_tokens"].sum())
    print(f"\n{sampling}: tokens outside the support removed per strategy (6 steps x 32 rows): {outside}")
    assert sum(outside.values()) > 0  # the runs did meet -inf tokens, and counted them


@pytest.mark.timeout(600)
def test_bf16_mixed_precision_gives_exact_old_logprobs_on_policy(ray_session):
    """pi_old in the trainer's numerics: at max_staleness 0 with one minibatch, r_s = 1 exactly."""
    common = dict(**SMALL, steps=3, max_staleness=0, optimizer={"mixed_precision": "bf16"})
    snapshot = RLPipeline(PipelineConfig(**common, strategy="snapshot")).run(progress=False)  # on Ray Data
    worst = {"snapshot": snapshot["staleness/max_abs_log_ratio"].max()}
    for strategy in ("dedicated", "interrupt", "recompute", "ewma"):
        m = run_in_process(RLPipeline(PipelineConfig(**common, strategy=strategy)))
        # the EWMA equals the trainer's weights only before the first update (step 0)
        worst[strategy] = m["staleness/max_abs_log_ratio"][0] if strategy == "ewma" else m["staleness/max_abs_log_ratio"].max()
    print(f"\nbf16 autocast, S=0: max |log r_s| per strategy {worst}")
    assert all(v <= 1e-6 for v in worst.values()), worst
    assert snapshot["mismatch/k3"].max() > 0  # r_d: bf16-autocast training vs float32 inference


@pytest.mark.timeout(600)
def test_a_dropout_checkpoint_keeps_old_logprobs_exact(tmp_path):
    model, tokenizer = load_model(WARM_START_DIR), load_tokenizer(WARM_START_DIR)
    model.config.attention_dropout = 0.1
    save_model(model, tokenizer, tmp_path / "dropout")
    pipe = RLPipeline(PipelineConfig(**SMALL, steps=3, max_staleness=0, model=tmp_path / "dropout",
                                     old_logprob_forward="always"))  # the forward under test
    assert "the checkpoint's attention_dropout 0.1 is off" in pipe.describe()
    m = run_in_process(pipe)  # synchronous (S=0): the pipeline's own stages, in this process
    print(f"\ndropout 0.1 checkpoint: max|log r_s| {m['staleness/max_abs_log_ratio'].max():.2e}, "
          f"max|log r_d| {m['mismatch/max_abs_log_rd'].max():.2e}")
    assert m["staleness/max_abs_log_ratio"].max() <= 1e-6
    assert m["mismatch/max_abs_log_rd"].max() < 1e-5  # float32 inference: old == inference


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_user_strategy_runs_live_and_in_replay_diagnose(ray_session, user_strategy_module, monkeypatch, capsys):
    from trajflow.jobs.cli import main
    from trajflow.jobs.config import JobConfig
    from trajflow.jobs.recorder import RunPaths, RunRecorder, read_metrics

    tmp_path, _ = user_strategy_module("my_corrections")
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver imports it; Ray workers get it by value
    from my_corrections import HalfwayOld

    run_dir = tmp_path / "run"
    config = PipelineConfig(**SMALL, steps=3, max_staleness=1, inference_dtype="bfloat16")
    pipe = RLPipeline(config, strategy=HalfwayOld())  # live, from a Python object
    recorder = RunRecorder(run_dir=str(run_dir), steps=3, checkpoint_every=0, keep_checkpoints=1,
                           save_all_versions=True, trajectory_log=True)
    recorder.install(pipe.hooks)
    live = pipe.run(progress=False)
    assert live.height == 3 and set(live["strategy"]) == {"halfway"}
    # the run's config names the strategy by import path, as a job config would
    job = JobConfig(**{**config.model_dump(), "strategy": "my_corrections:HalfwayOld", "run_dir": run_dir})
    (run_dir / "config.yaml").write_text(job.to_yaml())

    out = tmp_path / "replay"
    # the CLI's entry point in this process, on the session's Ray (the module is on sys.path above)
    code = main(["replay", str(run_dir / "trajectories"), "--checkpoints", str(run_dir / "versions"),
                 "--strategy", "my_corrections:HalfwayOld", "--strategy", "m2po", "--diagnose", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    assert "halfway replay vs the logged run: 3 steps" in printed.out
    replayed = pl.read_parquet(out / "metrics.parquet")
    assert sorted(set(replayed["strategy"])) == ["halfway", "m2po"]
    mine = replayed.filter(pl.col("strategy") == "halfway").sort("step")
    logged = read_metrics(RunPaths(run_dir)).sort("step")
    for key in ("loss", "active_frac", "clip/frac", "mismatch/k3", "staleness/mean", "loss_tokens"):
        assert mine[key].to_list() == pytest.approx(logged[key].to_list(), rel=1e-6, abs=1e-6), key
    m2po = replayed.filter(pl.col("strategy") == "m2po")
    assert (m2po["clip/frac"] == 0).all() and (m2po["m2po/m2_before"] >= m2po["m2po/m2_after"]).all()
