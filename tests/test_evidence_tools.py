"""The evidence benchmark's statistics (benchmarks/evidence.py) on hand-built cases."""

import polars as pl
import pytest

from benchmarks.evidence import bootstrap_interval, outcome_rows, regime_summary, sign_flip_p


def test_sign_flip_p_by_hand():
    # 3 positive differences: of the 8 sign patterns only all-plus and all-minus reach |mean| 1
    assert sign_flip_p([1.0, 1.0, 1.0]) == pytest.approx(2 / 8)
    assert sign_flip_p([1.0, -1.0]) == 1.0  # observed mean 0: every pattern is as extreme
    # [3, 1]: |mean| >= 2 for (+,+) and (-,-) only
    assert sign_flip_p([3.0, 1.0]) == pytest.approx(2 / 4)


def test_bootstrap_interval():
    assert bootstrap_interval([0.1] * 5) == pytest.approx((0.1, 0.1))
    d = [0.05, -0.01, 0.03, 0.02, 0.04, 0.0, 0.06, 0.01]
    lo, hi = bootstrap_interval(d)
    lo99, hi99 = bootstrap_interval(d, level=0.99)
    assert min(d) <= lo < sum(d) / len(d) < hi <= max(d)
    assert lo99 <= lo and hi <= hi99


def test_outcome_rows_pair_by_seed():
    curves = pl.DataFrame({
        "strategy": ["snapshot"] * 4 + ["behavior"] * 4,
        "seed": [0, 0, 1, 1] * 2,
        "version": [10, 20] * 4,
        "heldout_accuracy": [0.30, 0.40, 0.32, 0.50, 0.31, 0.35, 0.35, 0.46],
        "seconds_from_enter": [10.0, 20.0, 11.0, 21.0, 9.0, 19.0, 12.0, 22.0],
    })
    rows = {r["strategy"]: r for r in outcome_rows(curves, target=0.45)}
    # finals: snapshot 0.40, 0.50; behavior 0.35, 0.46 -> paired differences -0.05, -0.04
    assert rows["behavior"]["vs snapshot (paired)"].startswith("-0.045 [")
    assert rows["behavior"]["reached 0.45"] == "1/2" and rows["snapshot"]["reached 0.45"] == "1/2"
    assert rows["snapshot"]["seconds to target"] == "21" and rows["behavior"]["versions to target"] == "20.0"


def test_regime_summary_counts_steps_without_gradient_apart():
    nan = float("nan")
    rows = pl.DataFrame({
        "setting": ["s"] * 4, "staleness": ["2"] * 4, "strategy": ["recompute"] * 4, "delay": [2] * 4,
        "spread": [False] * 4,
        "grad/cos_vs_exact": [0.5, nan, 0.7, nan],  # steps 2 and 4: every token masked
        "grad/rel_err_vs_exact": [0.1, 1.0, 0.3, 100.0],
        "mask/token_kept_frac": [0.5, 0.0, 0.7, 0.0], "clip/frac": [0.0] * 4, "active_frac": [0.5, 0, 0.7, 0],
        "split/var_log_rd": [None] * 4, "split/var_log_rs": [None] * 4, "staleness/mean": [2.0] * 4,
    })
    (row,) = regime_summary(rows).to_dicts()
    assert row["cos"] == pytest.approx(0.6) and row["cos_min"] == pytest.approx(0.5)  # NaN steps left out
    assert row["no_grad"] == 0.5
    assert row["rel_err"] == pytest.approx(0.65)  # the median, not the mean the outlier owns


@pytest.mark.parametrize("keys", ["today", "before the names pass"])
def test_real_model_learning_result_reads_a_run_dir(tmp_path, keys):
    """benchmarks/real_model.py's reader on a hand-written run dir, under today's metric keys and
    under the keys runs were written with before (read back through jobs/recorder.py)."""
    import yaml

    from benchmarks.real_model import learning_result

    old = keys != "today"
    heldout, reward = ("heldout_accuracy", "reward_mean") if old else ("heldout/accuracy", "reward/mean")
    (tmp_path / "metrics").mkdir()
    for step, (acc, r) in enumerate([(None, 0.1), (0.20, 0.3)]):
        row = {"step": step, "version": step + 1, heldout: acc, f"{heldout}_start": 0.08 if step == 0 else None,
               reward: r, "seconds/step_end": 100.0 + 10.0 * step}
        pl.DataFrame([row], schema_overrides={heldout: pl.Float64, f"{heldout}_start": pl.Float64}).write_parquet(
            tmp_path / "metrics" / f"step={step:06d}.parquet")
    config = {"eval_prompts": 100, "steps": 2, "prompts_per_step": 8, "group_size": 4, "max_staleness": 0,
              "inference_dtype": "float32", "optimizer": {"lr": 3e-5}, "sampling": {"max_new_tokens": 96, "temperature": 1.0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = learning_result(tmp_path, "trajflow run smollm2", 60.0, "held-out accuracy 0.080 -> 0.200\n")
    assert result["curve"] == [{"version": 0, "accuracy": 0.08}, {"version": 2, "accuracy": 0.20}]
    assert result["reward"] == [0.1, 0.3] and result["seconds_per_step"] == 10.0
    assert result["settings"]["lr"] == 3e-5 and result["summary"] == ["held-out accuracy 0.080 -> 0.200"]


def test_distillation_study_pairs_the_rollout_time_arm_with_the_current_one_by_seed():
    from benchmarks.distillation_held import paired_rows, per_run

    def run(arm, seed, accuracies, kls):  # 4 steps, staleness 2, sampled accuracy after steps 1 and 3
        return pl.DataFrame({"arm": arm, "seed": seed, "staleness": 2, "step": [0, 1, 2, 3],
                             "heldout/sampled_accuracy": [None, accuracies[0], None, accuracies[1]],
                             "heldout/accuracy": [None, None, None, accuracies[1] + 0.1],
                             "distill/reverse_kl": kls, "staleness/mean": [0.0, 1.0, 2.0, 2.0],
                             "clip/frac": [0.5, 0.5, 0.1, 0.3], "split/var_log_rs": [0.0, 0.1, 0.2, 0.4],
                             "seconds/elapsed": [1.0, 2.0, 3.0, 4.0]})

    rows = pl.concat([run("current", 0, [0.6, 0.8], [0.4, 0.3, 0.2, 0.1]),
                      run("old", 0, [0.6, 0.7], [0.4, 0.3, 0.3, 0.3]),
                      run("current", 1, [0.5, 0.6], [0.5, 0.4, 0.3, 0.2]),
                      run("old", 1, [0.5, 0.4], [0.5, 0.5, 0.5, 0.5])])
    runs = per_run(rows)
    first = runs.filter((pl.col("arm") == "current") & (pl.col("seed") == 0)).row(0, named=True)
    assert first["accuracy"] == 0.8 and first["greedy"] == pytest.approx(0.9)
    assert first["kl_first"] == pytest.approx(0.3) and first["kl_last"] == pytest.approx(0.2)
    assert first["staleness_min"] == first["staleness_max"] == 2.0  # from step S on
    assert first["clip"] == pytest.approx(0.2) and first["var_log_rs"] == pytest.approx(0.3)
    table = {r["student in the advantage"]: r for r in paired_rows(runs, "accuracy")}
    # finals: current 0.8, 0.6; old 0.7, 0.4 -> paired differences -0.1, -0.2; 2 pairs, both negative
    old = table["rollout-time student"]
    paired = old["minus current (paired, 95 % bootstrap, sign-flip p)"]
    assert old["mean"] == "0.550" and paired.startswith("-0.150 [") and paired.endswith("p 0.500")
    assert table["current student (AsyncOPD)"]["per seed"] == "0.800, 0.600"


def test_outcome_study_cell_config_holds_the_study_settings_and_its_prompts_per_step():
    from benchmarks.evidence_held import BASE, config_for

    config = config_for("fp8", "loglinear", 3, staleness=2, steps=12, lr=3e-5)
    wider = config_for("fp8", "loglinear", 3, staleness=2, steps=12, lr=3e-5, prompts=8)
    assert config.prompts_per_step == BASE["prompts_per_step"] == 4 and wider.prompts_per_step == 8
    for c in (config, wider):
        assert (c.strategy, c.seed, c.max_staleness, c.steps, c.group_size) == ("loglinear", 3, 2, 12, 8)


def test_outcome_study_work_dir_keeps_one_design(tmp_path, capsys):
    from argparse import Namespace

    from benchmarks.evidence_held import check_design

    args = Namespace(staleness=2, steps=12, lr=3e-5, prompts=8, eval_every=6)
    check_design(tmp_path, args)
    check_design(tmp_path, args)  # the same design resumes
    with pytest.raises(SystemExit) as stop:
        check_design(tmp_path, Namespace(**{**vars(args), "prompts": 4}))
    assert stop.value.code == 2
    assert "study.json holds another design (prompts 8 -> 4): use a new --work" in capsys.readouterr().err
