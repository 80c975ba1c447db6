"""Offline replay's input checks, without Ray: reading and grouping a logged trajectory dataset,
which version weights a replay needs, and the errors for bad logs and missing versions.
(The end-to-end replays of a real logged run are in test_jobs_run.py.)"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trajflow.engines import checkpoint as ckpt
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.replay import (
    Replay,
    ReplayError,
    format_versions,
    load_trajectories,
    locate_versions,
    required_versions,
    resolve_strategies,
)
from trajflow.schemas import SchemaError, from_rows, write_parquet


def _rows(step: int, n: int, versions: list[int]) -> pa.Table:
    rows = []
    for i in range(n):
        rows.append({
            "trajectory_id": f"s{step:06d}-p{i // 2:03d}-n{i % 2:03d}",
            "group_id": f"s{step:06d}-p{i // 2:03d}",
            "prompt_id": f"addition/train/{i // 2}",
            "prompt_tokens": [1, 5, 6],
            "response_tokens": [7, 8, 2],
            "loss_mask": [True, True, True],
            "inference_logprobs": [-0.5, -0.25, -0.1],
            "versions": versions,
            "old_logprobs": [-0.5, -0.25, -0.1],
            "finish_reason": "stop",
            "reward": float(i % 2),
            "advantage": 0.0,
            "answer": "1",
            "rollout_step": step,
            "filter_reason": None,
            "trainer_version": step,
        })
    table = from_rows(rows)
    return table.set_column(table.schema.get_field_index("rollout_step"), "rollout_step",
                            table["rollout_step"].cast(pa.int32()))


def _log(tmp_path, steps=(0, 1, 2), n=4):
    root = tmp_path / "run" / "trajectories"
    for s in steps:
        write_parquet(_rows(s, n, [max(0, s - 1), s, s]), root / f"step={s:06d}" / "part-0.parquet")
    return root


def _config(n=4):
    return PipelineConfig(prompts_per_step=n // 2, group_size=2, max_staleness=1)


def test_load_groups_by_step_and_checks_ids(tmp_path):
    root = _log(tmp_path)
    steps = load_trajectories(root)
    assert sorted(steps) == [0, 1, 2] and all(t.num_rows == 4 for t in steps.values())
    assert load_trajectories(root.parent).keys() == steps.keys()  # a run dir works too
    hidden = _log(tmp_path / ".work")  # a dot above the log is the user's; one inside it is skipped
    write_parquet(_rows(9, 4, [8, 9, 9]), hidden / ".tmp" / "part-0.parquet")
    assert sorted(load_trajectories(hidden)) == [0, 1, 2]
    # the same partition twice: duplicate trajectory ids are refused
    write_parquet(_rows(1, 4, [0, 1, 1]), root / "step=000001" / "part-1.parquet")
    with pytest.raises(ReplayError, match="step 1: duplicate trajectory_id"):
        load_trajectories(root)


def test_required_and_located_versions(tmp_path):
    steps = load_trajectories(_log(tmp_path))

    def needed(names, mode):
        return required_versions(steps, resolve_strategies(_config(), names), mode)

    assert needed(["snapshot"], "diagnose") == {0, 1, 2}
    assert needed(["behavior"], "diagnose") == {0, 1, 2}
    assert needed(["ewma"], "diagnose") == {0, 1, 2, 3}
    assert needed(["behavior"], "train") == {0}
    assert needed(["snapshot"], "train") == {0, 1, 2}
    assert needed(["m2po", "interrupt"], "train") == {0, 1, 2}

    run = tmp_path / "run"
    ckpt.save_weights({"w": torch.zeros(1)}, ckpt.version_file(run / "versions", 0))
    ckpt.save_checkpoint(run / "checkpoints", 2, {"w": torch.ones(1)})
    found, missing = locate_versions(run, [0, 1, 2, 3])
    assert sorted(found) == [0, 2] and missing == [1, 3]
    assert found[2].parent.name == "step-000002"
    assert format_versions([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_missing_versions_are_reported_by_number_before_any_work(tmp_path):
    root = _log(tmp_path, steps=(0, 1, 2, 3, 4))
    run = tmp_path / "run"
    for v in (0, 1, 4):
        ckpt.save_weights({"w": torch.zeros(1)}, ckpt.version_file(run / "versions", v))
    with pytest.raises(ReplayError) as info:
        Replay(_config(), root, run, ["snapshot"], "diagnose")
    assert "weights of 2 version(s) missing" in str(info.value) and ": 2-3 " in str(info.value)
    with pytest.raises(ReplayError, match="one strategy at a time"):
        Replay(_config(), root, run, ["snapshot", "behavior"], "train")
    with pytest.raises(ReplayError, match="--strategy: unknown strategy 'exactish'"):
        Replay(_config(), root, run, ["exactish"], "diagnose")
    with pytest.raises(ReplayError, match="each strategy once"):
        Replay(_config(), root, run, ["behavior", "behavior"], "diagnose")
    with pytest.raises(ReplayError, match="step 0 holds 4 rows, the config's rows_per_step is 8"):
        Replay(_config(8), root, run, ["behavior"], "diagnose")
    with pytest.raises(ReplayError, match="--gradients compares against an exact strategy"):
        Replay(_config(), root, run, ["behavior", "recompute"], "diagnose", gradients=True)


def test_bad_parquet_is_a_schema_error_naming_file_and_column(tmp_path):
    root = _log(tmp_path, steps=(0,))
    file = root / "step=000000" / "part-0.parquet"
    table = pq.read_table(file)
    bad = table.set_column(table.schema.get_field_index("reward"), "reward", table["reward"].cast(pa.string()))
    pq.write_table(bad, file)
    with pytest.raises(SchemaError, match=r"part-0.parquet: column 'reward'"):
        load_trajectories(root)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(SchemaError, match="not a readable Parquet file"):
        load_trajectories(root)


def test_the_progress_bar_counts_logged_steps_not_rows(tmp_path, capsys, monkeypatch):
    """Diagnose yields one row per step and strategy; `run()`'s bar advances once per logged step.
    (The rows themselves need Ray: here a list stands in for `iter_rows()`, which the pipeline and
    job tests run for real.)"""
    root = _log(tmp_path)
    run = tmp_path / "run"
    for v in range(3):
        ckpt.save_weights({"w": torch.zeros(1)}, ckpt.version_file(run / "versions", v))
    replay = Replay(_config(), root, run, ["snapshot", "behavior"], "diagnose")
    rows = [{"step": step, "strategy": name} for step in sorted(replay.steps) for name in ("snapshot", "behavior")]
    monkeypatch.setattr(replay, "iter_rows", lambda: iter(rows))
    metrics = replay.run(progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert metrics.height == 6 and bar.startswith("replay (diagnose): 100%") and " 3/3 " in bar, bar


class EditsReward:
    """A user stage inserted live: it edits the reward and marks rows (a light stage)."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        import numpy as np

        from trajflow.schemas.columns import mark_filtered, replace_column

        batch = replace_column(batch, "reward", pa.array(np.full(batch.num_rows, 7.0, np.float32)))
        return mark_filtered(batch, np.arange(batch.num_rows) == 0, "mine")


def test_replay_stages_come_from_the_live_stage_list(tmp_path):
    """generate and reward come from the log, the live strategy's stages are dropped, the replayed
    strategies bring theirs, a stage the user inserted runs again but cannot change the reward."""
    from trajflow.pipelines.rl_loop import RLPipeline, Stage

    root = _log(tmp_path)
    run = tmp_path / "run"
    for v in range(4):
        ckpt.save_weights({"w": torch.zeros(1)}, ckpt.version_file(run / "versions", v))
    live = RLPipeline(PipelineConfig(prompts_per_step=2, group_size=2, max_staleness=1, strategy="dedicated"))
    live.insert_after("reward", Stage("mine", EditsReward()))
    assert [s.name for s in live.stages] == ["generate", "old_logprobs", "reward", "mine", "advantage", "filter", "train"]

    def names(strategies, mode="diagnose"):
        replay = Replay(live.config, root, run, strategies, mode, pipeline=live)
        return replay, [s.name for s in replay.stages({"logged": None, "trainer": "trainer-store"})]

    assert names(["behavior"])[1] == ["mine", "advantage", "filter", "diagnose"]
    assert names(["snapshot", "ewma"])[1] == ["mine", "advantage", "filter", "old_logprobs", "diagnose"]
    assert names(["dedicated"])[1] == ["old_logprobs", "mine", "advantage", "filter", "diagnose"]
    assert names(["interrupt"])[1] == ["mine", "advantage", "filter", "old_logprobs", "diagnose"]  # scored in replay
    replay, stages = names(["m2po"], "train")
    assert stages == ["mine", "advantage", "filter", "train"]
    train = replay.stages({"logged": None, "trainer": "trainer-store"})[-1]
    assert train.kwargs["spec"].strategy.name == "m2po" and train.kwargs["store"] == "trainer-store"
    # the replayed user stage: its row filter takes effect again, its reward edit is already logged
    mine = replay.stages({"logged": None, "trainer": None})[0]
    logged = load_trajectories(root)[1]
    out = mine.fn(logged)
    assert out["reward"].to_pylist() == logged["reward"].to_pylist()
    assert out["filter_reason"].to_pylist()[:2] == ["mine", None]


def test_strategy_options_belong_to_the_configured_strategy():
    config = PipelineConfig(strategy="ewma", strategy_options={"window": 3, "reset_threshold": 0.5}, max_staleness=2)
    snapshot, ewma, loglinear = resolve_strategies(config, ["snapshot", "ewma", "loglinear"])
    assert (ewma.window, ewma.reset_threshold) == (3, 0.5)
    assert loglinear.name == "loglinear"  # its own defaults, not EWMA's options (which it would refuse)
    assert resolve_strategies(PipelineConfig(strategy="behavior", max_staleness=2), ["ewma"])[0].window == 2
