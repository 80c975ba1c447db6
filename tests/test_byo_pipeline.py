"""Bring-your-own workload on real Ray: a JSONL of chat messages, a locally trained BPE tokenizer
with a chat template, a tiny Qwen2, and reward functions from a file in tmp_path (not importable
by the Ray workers: they receive the code by value).

- a run's logged prompt_tokens equal `apply_chat_template(messages, add_generation_prompt=True)`
  of the dataset rows, and its logged rewards equal the user's function recomputed on the decoded
  responses; each epoch trains every prompt once;
- a reward that raises on a quarter of the items and sleeps past the timeout on others: the run
  completes, those rows are marked `reward_error` and kept in the log with why (the exception,
  the timeout), the count is in the metrics;
- SIGKILL after checkpoint 2 and `--resume`: the steps trained over the two sessions hold exactly
  the prompts of an uninterrupted run, each once per epoch; a changed dataset refuses to resume;
- `env: file.py:Class`: a user's environment class reaches the Ray workers and plays the episodes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import yaml

from support import cli_in_process, explain, logged, run_until_checkpoint_then_kill
from trajflow.engines.models import load_tokenizer
from trajflow.engines.tokenizer import decode_responses, stop_token_ids

pytestmark = pytest.mark.slow

PROMPTS, PER_STEP, STEPS = 12, 4, 6  # two epochs
REWARDS = textwrap.dedent("""
    import time

    def reward(prompts, completions, answer, **columns):
        # uses every argument: the chat messages, the decoded completion, a dataset column
        return [len(c) / 10 + (c.strip() == a) + 0.01 * len(p[-1]["content"])
                for p, c, a in zip(prompts, completions, answer)]

    def flaky(prompts, completions, answer, idx, **columns):
        out = []
        for i in idx:
            if i % 4 == 0:
                raise ValueError("this reward fails on a quarter of the items")
            if i == 5:
                time.sleep(4.0)  # past reward_timeout_seconds
            out.append(1.0 + i)
        return out
""")


@pytest.fixture(scope="module")
def workload_dir(bpe, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("byo")
    rows = [{**r, "idx": i} for i, r in enumerate(bpe[1][:PROMPTS])]
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "rewards.py").write_text(REWARDS)
    return path


def job(workload_dir: Path, model_dir: Path, **overrides) -> dict:
    return {
        "name": "byo", "model": str(model_dir), "strategy": "snapshot", "max_staleness": 1,
        "data": {"train_files": [str(workload_dir / "train.jsonl")], "shuffle": True},
        "reward": f"{workload_dir / 'rewards.py'}:reward", "steps": STEPS, "prompts_per_step": PER_STEP,
        "group_size": 2, "sampling": {"max_new_tokens": 5}, "seed": 3, "checkpoint_every": 2,
        "keep_checkpoints": 5, "report_to": [], "save_all_versions": False, **overrides,
    }


def prompt_ids_by_step(run_dir: Path) -> dict[int, list[str]]:
    table = logged(run_dir)
    out: dict[int, list[str]] = {}
    for step, pid in zip(table["rollout_step"].to_pylist(), table["prompt_id"].to_pylist()):
        out.setdefault(step, []).append(pid)
    return out


@pytest.fixture(scope="module")
def reference_run(workload_dir, bpe_model_dir, ray_session, tmp_path_factory) -> Path:
    """An uninterrupted run (in-process, on the session's Ray)."""
    from trajflow.jobs.config import build_job_config
    from trajflow.jobs.run import run_job

    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    config = build_job_config(job(workload_dir, bpe_model_dir, run_dir=str(run_dir)))
    return run_job(config, progress=False)


def test_logged_prompt_tokens_and_rewards_are_the_users(reference_run, workload_dir, bpe_model_dir):
    from trajflow.user_code import load_object

    rows = [json.loads(line) for line in (workload_dir / "train.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(bpe_model_dir)
    table = logged(reference_run)
    assert table.num_rows == STEPS * PER_STEP * 2
    for row in table.select(["prompt_id", "prompt", "prompt_tokens", "answer", "idx"]).to_pylist():
        source = rows[int(row["prompt_id"].split(":")[1])]
        assert row["prompt_tokens"] == tokenizer.apply_chat_template(source["prompt"], add_generation_prompt=True)[
            "input_ids"]
        assert row["prompt"] == source["prompt"] and row["answer"] == source["answer"]
        assert row["idx"] == source["idx"]
    completions = decode_responses(tokenizer, table["response_tokens"], stop_token_ids(tokenizer, bpe_model_dir))
    user_reward = load_object(f"{workload_dir / 'rewards.py'}:reward", "reward")
    expected = user_reward(table["prompt"].to_pylist(), completions, table["answer"].to_pylist())
    np.testing.assert_allclose(table["reward"].to_numpy(), expected, rtol=1e-6)
    assert len(set(completions)) > 3, "responses should differ"
    # every epoch (3 steps of 4 prompts) trains each of the 12 prompts once
    by_step = prompt_ids_by_step(reference_run)
    for epoch in range(2):
        ids = [pid for s in range(3 * epoch, 3 * epoch + 3) for pid in sorted(set(by_step[s]))]
        assert sorted(ids) == [f"train.jsonl:{i:06d}" for i in range(PROMPTS)]
    meta = json.loads((reference_run / "checkpoints" / "step-000006" / "meta.json").read_text())
    assert meta["data"]["epoch_size"] == PROMPTS and meta["data"]["epoch"] == 2 and meta["data"]["index_in_epoch"] == 0
    metrics = pl.read_parquet(reference_run / "metrics.parquet")
    assert metrics["data/epoch"].to_list() == [0, 0, 0, 1, 1, 1]
    assert (metrics["reward/errors"] == 0).all() and (metrics["data/prompts_too_long"] == 0).all()


def test_failing_rewards_mark_rows_and_the_run_goes_on(workload_dir, bpe_model_dir, ray_session, tmp_path):
    from trajflow.jobs.config import build_job_config
    from trajflow.jobs.run import run_job

    config = build_job_config(job(workload_dir, bpe_model_dir, steps=3, run_dir=str(tmp_path / "run"),
                                  reward=f"{workload_dir / 'rewards.py'}:flaky", reward_timeout_seconds=1.0))
    run_dir = run_job(config, progress=False)
    table = logged(run_dir)
    assert table.num_rows == 3 * PER_STEP * 2  # nothing lost: failed rows stay in the log
    idx = np.array(table["idx"].to_pylist())
    failed = (idx % 4 == 0) | (idx == 5)
    reasons = np.array(table["filter_reason"].to_pylist(), dtype=object)
    assert (reasons[failed] == "reward_error").all()
    errors = np.array(table["reward_error"].to_pylist(), dtype=object)  # why, per row
    assert set(errors[idx % 4 == 0]) == {"ValueError: this reward fails on a quarter of the items"}
    assert set(errors[idx == 5]) == {"TimeoutError: the reward took longer than reward_timeout_seconds (1 s)"}
    assert set(errors[~failed]) == {None}
    assert table.filter(pa.array(failed))["reward"].null_count == failed.sum()
    ok = table.filter(pa.array(~failed))
    np.testing.assert_allclose(ok["reward"].to_numpy(), 1.0 + np.array(ok["idx"].to_pylist()))
    assert (reasons[~failed] != "reward_error").all()
    metrics = pl.read_parquet(run_dir / "metrics.parquet").sort("step")
    per_step = [int(failed[np.array(table["rollout_step"].to_pylist()) == s].sum()) for s in range(3)]
    assert metrics["reward/errors"].to_list() == per_step and sum(per_step) > 0
    assert metrics["filtered/reward_error"].fill_null(0).to_list() == per_step


def test_killed_run_resumes_with_exactly_the_prompts_of_an_uninterrupted_run(reference_run, workload_dir,
                                                                             bpe_model_dir, tmp_path, capfd):
    """The run SIGKILLed is a subprocess; the refusal and the resume are the entry point's `main`
    in this process (on the session's Ray, as the reference run)."""
    run_dir = tmp_path / "killed"
    config = tmp_path / "job.yaml"
    # slower decoding so the run is still going when it is killed (prompts do not depend on it)
    config.write_text(yaml.safe_dump(job(workload_dir, bpe_model_dir, simulate_decode_seconds=0.15)))
    run_until_checkpoint_then_kill(["run", config, "--run-dir", run_dir, "--no-progress"], run_dir, 2,
                                   tmp_path / "first.log")
    assert len(list((run_dir / "metrics").glob("step=*.parquet"))) < STEPS, "finished before it was killed"
    meta = json.loads((run_dir / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["data"]["next_step"] == 2 and meta["data"]["index_in_epoch"] == 8

    # a changed dataset is refused (one line, exit 2), and nothing is touched
    train = workload_dir / "train.jsonl"
    original = train.read_text()
    train.write_text(original.replace('"answer": "', '"answer": "1', 1))
    try:
        proc = cli_in_process(["run", "--resume", run_dir], capfd)
    finally:
        train.write_text(original)
    assert proc.returncode == 2, explain(proc)
    assert "changed since checkpoint step-000002" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    proc = cli_in_process(["run", "--resume", run_dir, "--no-progress"], capfd)
    assert proc.returncode == 0, explain(proc)
    assert prompt_ids_by_step(run_dir) == prompt_ids_by_step(reference_run)
    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == list(range(STEPS))


def test_an_environment_by_import_path_from_a_file(ray_session, tmp_path):
    """`env: file.py:Class`: a user's Environment (not importable by the workers) plays episodes."""
    from trajflow.engines.models import REPO_ROOT
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    (tmp_path / "my_env.py").write_text(textwrap.dedent("""
        from trajflow.tasks.environments import CalculatorEnv

        class ShortCalc(CalculatorEnv):
            name = "short_calc"

            def __init__(self):
                super().__init__(max_digits=1, max_turns=3, max_response_tokens=24)
    """))
    config = PipelineConfig(env=f"{tmp_path / 'my_env.py'}:ShortCalc", model=REPO_ROOT / "artifacts/warm_start/calc",
                            steps=2, prompts_per_step=2, group_size=2, sampling={"max_new_tokens": 8})
    assert config.task is None and config.workload().environment().max_turns == 3
    def check_episodes(train_step, batch, metrics) -> None:
        """ShortCalc's episodes: multi-turn, within its 24-token budget. (A closure: shipped to the
        trainer actor by value; a failure there fails the run.)"""
        assert (np.array(batch["turns"].to_pylist()) >= 1).all()
        assert max(len(r) for r in batch["response_tokens"].to_pylist()) <= 24

    pipe = RLPipeline(config)
    pipe.hooks.on_step = check_episodes
    metrics = pipe.run(progress=False)
    assert metrics.height == 2 and (metrics["rows"] == 4).all()
    rows = pa.concat_tables([pipe.prompts.step_rows(s) for s in range(2)])
    assert all(pid.startswith("short_calc/train/") for pid in rows["prompt_id"].to_pylist())
