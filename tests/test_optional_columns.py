"""Optional dataset columns: a pass-through column (a note, a source URL) may be null in some rows;
the prompt and the columns the reward requires may not, and the error names those. Checked on
the config's own validation (before Ray), on JSON lines and Parquet, and through the operators in
one process: the null reaches the trajectory and the reward function as None."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.jobs.config import JobConfigError, build_job_config

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "artifacts" / "byo" / "model"


def rows(n: int = 8, **nulls) -> list[dict]:
    """n chat rows with an answer and a note; `nulls` = {column: indices where it is null}."""
    out = [{"prompt": [{"role": "user", "content": f"Ann has {i} pens and gets 2 more. How many?"}],
            "answer": str(i + 2), "note": f"source {i}"} for i in range(n)]
    for column, where in nulls.items():
        for i in where:
            out[i][column] = None
    return out


def write(path: Path, records: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(train: Path, reward: str = "exact", **keys):
    return build_job_config({"model": str(MODEL), "data": {"train_files": [str(train)]}, "reward": reward,
                             "steps": 1, "prompts_per_step": 4, "group_size": 2, **keys})


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_pass_through_column_may_be_null(tmp_path, suffix):
    path = write(tmp_path / f"train{suffix}", rows(note=[1, 4, 5]))
    cfg = config(path)
    from trajflow.tasks.dataset import checked_dataset

    workload = cfg.workload()
    assert workload.required_columns() == ["answer"]  # exact compares with it
    from trajflow.pipelines.config import checked_tokenizer

    table = checked_dataset(cfg.data, workload.train_files(), checked_tokenizer(cfg.model_path),
                            required=["answer"]).table
    assert table["note"].to_pylist() == [None if i in (1, 4, 5) else f"source {i}" for i in range(8)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_null_in_the_rewards_column_names_the_required_columns(tmp_path, suffix):
    path = write(tmp_path / f"train{suffix}", rows(answer=[6]))
    with pytest.raises(JobConfigError) as error:
        config(path)
    where = "line 7" if suffix == ".jsonl" else "row 6"
    message = str(error.value)
    assert f"train{suffix}: {where}: column 'answer' is null" in message
    assert "required in every row: 'prompt' (the prompt) and 'answer' (the reward's)" in message
    assert "other columns may be null" in message and "\n" not in message


def test_a_null_prompt_is_refused(tmp_path):
    path = write(tmp_path / "train.jsonl", rows(prompt=[2]))
    with pytest.raises(JobConfigError, match=r"line 3: column 'prompt' is null; required in every row: 'prompt'"):
        config(path)


def test_a_user_rewards_required_columns_are_its_parameters_without_default(tmp_path):
    path = write(tmp_path / "train.jsonl", rows(answer=[0], note=[1]))
    (tmp_path / "rewards.py").write_text(
        "def lenient(prompts, completions, **columns):\n    return [0.0] * len(prompts)\n"
        "def strict(prompts, completions, note, answer=None, **columns):\n    return [0.0] * len(prompts)\n")
    # **columns only: every column optional, answer's null included
    assert config(path, reward=f"{tmp_path / 'rewards.py'}:lenient").workload().required_columns() == []
    # `note` required by name (its null at line 2 refused); `answer=None` is optional
    with pytest.raises(JobConfigError, match=r"line 2: column 'note' is null; required in every row: 'prompt' "
                                             r"\(the prompt\) and 'note' \(the reward's\)"):
        config(path, reward=f"{tmp_path / 'rewards.py'}:strict")


@pytest.mark.timeout(300)
def test_a_null_travels_to_the_trajectory_and_the_reward(tmp_path, one_torch_thread):
    """The operators in one process (as tests/test_operators_in_process.py): the step's rows keep
    the null, generate copies it onto the trajectories, the user's reward receives None for it."""
    from trajflow.engines.models import load_model
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    path = write(tmp_path / "train.jsonl", rows(4, note=[0, 2]))
    (tmp_path / "rewards.py").write_text(
        "def seen(prompts, completions, answer, note=None, **columns):\n"
        "    return [0.0 if n is None else 1.0 for n in note]\n")
    cfg = config(path, reward=f"{tmp_path / 'rewards.py'}:seen", inference_dtype="float32",
                 sampling={"max_new_tokens": 3}, data={"train_files": [str(path)], "shuffle": False})
    pipe = RLPipeline(cfg.pipeline_config(), model_path=cfg.model_path)
    store = InProcessStore(0, False)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    stages = {s.name: s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn for s in pipe.stages}
    from trajflow.engines.models import load_tokenizer

    batch = pipe.workload.prompt_source(load_tokenizer(pipe.model_path), cfg.seed, cfg.prompts_per_step).step_rows(0)
    for name in ("generate", "reward"):
        batch = stages[name](batch)
    notes = batch["note"].to_pylist()
    assert notes == [None, None, "source 1", "source 1", None, None, "source 3", "source 3"]
    assert batch["reward"].to_pylist() == [0.0 if n is None else 1.0 for n in notes]


def _mapping_keys(model, prefix: str = "") -> list[str]:
    """Every key of the job config that takes a mapping: the sections and the dict-typed keys."""
    import typing

    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        for kind in (field.annotation, *typing.get_args(field.annotation)):
            if typing.get_origin(kind) is dict:
                keys.append(prefix + (field.alias or name))
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                keys.append(prefix + (field.alias or name))
                keys += _mapping_keys(kind, f"{prefix}{field.alias or name}.")
    return sorted(set(keys))


def test_every_mapping_key_says_it_needs_a_mapping(tmp_path, capsys, monkeypatch):
    """`--set strategy_options=[1, 2]` / `=abc` (and the same for every section and dict-typed
    key): one line naming the key and saying a mapping is needed, exit 2 (the entry point's main)."""
    from trajflow.jobs.cli import main
    from trajflow.jobs.config import JobConfig

    keys = _mapping_keys(JobConfig)
    assert {"strategy_options", "sampling", "generator.resources", "trainer.resources", "data"} <= set(keys)
    monkeypatch.chdir(tmp_path)
    shorthand = {"advantage"}  # `advantage: grpo` names the estimator: a string is a value there
    for key in keys:
        for value, shown in (("[1, 2]", "a list [1, 2]"), ("abc", "the string 'abc'"))[:1 if key in shorthand else 2]:
            code = main(["run", "quickstart", "--run-dir", "out", "--set", f"{key}={value}"])
            err = capsys.readouterr().err.strip()
            assert code == 2, (key, value, err)
            assert err == (f"trajflow: config error: {key}: expected a mapping of keys to values (e.g. {{key: value}}),"
                           f" got {shown}"), err
    assert not any(tmp_path.iterdir())
