"""Bring-your-own workload, without Ray: prompt encoding, completions, the dataset's step mapping,
reward functions (TRL convention, failures isolated per item), the built-in verifiers, and every
name checked in PipelineConfig validation with one line naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.engines.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    build_char_tokenizer,
    decode_response,
    decode_responses,
    encode_prompts,
    stop_token_ids,
)
from trajflow.pipelines.config import PipelineConfig
from trajflow.tasks.dataset import DataConfig, DataError, PromptDataset, epoch_order
from trajflow.tasks.rewards import ERROR_CHARS, MathVerify, RewardRunner, RewardSpecError, exact_match
from trajflow.tasks.workload import TaskPrompts, Workload
from trajflow.user_code import UserCodeError, load_object


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- prompts and completions ---------------------------------------------------------------------
def test_chat_messages_go_through_the_chat_template(bpe):
    tokenizer, rows, _ = bpe
    messages = [r["prompt"] for r in rows[:6]]
    encoded = encode_prompts(tokenizer, messages)
    for m, ids in zip(messages, encoded):
        assert ids == tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"]
    text = rows[0]["prompt"][-1]["content"]
    # a string is raw text unless apply_chat_template wraps it as one user message
    assert encode_prompts(tokenizer, [text]) == [tokenizer.encode(text, add_special_tokens=False)]
    wrapped = encode_prompts(tokenizer, [text], apply_chat_template=True)[0]
    assert wrapped == tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True)["input_ids"]
    # the built-in tasks' rule is unchanged: bos + one token per character
    char = build_char_tokenizer()
    assert encode_prompts(char, ["12+3="]) == [[BOS_ID] + [char.convert_tokens_to_ids(c) for c in "12+3="]]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(char, [[{"role": "user", "content": "1+1="}]])


def test_completions_stop_at_any_stop_token_and_skip_special_tokens():
    tok = build_char_tokenizer()
    ids = lambda s: [tok.convert_tokens_to_ids(c) for c in s]  # noqa: E731
    q = tok.convert_tokens_to_ids("q")
    responses = [ids("12") + [EOS_ID] + ids("34"), [], ids("5") + [PAD_ID] + ids("6"), ids("7") + [q] + ids("8"),
                 [EOS_ID], ids("ab;cd")]
    assert decode_responses(tok, responses) == ["12", "", "56", "7q8", "", "ab;cd"]
    assert decode_responses(tok, responses, stop_ids=[EOS_ID, q]) == ["12", "", "56", "7", "", "ab;cd"]
    # a stop string ends the completion before it
    assert decode_responses(tok, responses, stop=[";", "8"]) == ["12", "", "56", "7q", "", "ab"]
    assert decode_response(tok, responses[0]) == "12"
    # vectorised == row by row, on random responses
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 20, rng.integers(0, 9)).tolist() for _ in range(300)]
    expected = []
    for r in rows:
        cut = r.index(EOS_ID) if EOS_ID in r else len(r)
        expected.append(tok.decode(r[:cut], skip_special_tokens=True))
    assert decode_responses(tok, pa.array(rows, pa.list_(pa.int32()))) == expected


def test_stop_token_ids_add_the_generation_config_eos(bpe, bpe_model_dir):
    tokenizer = bpe[0]
    im_end, endoftext = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert stop_token_ids(tokenizer) == [im_end]
    assert stop_token_ids(tokenizer, bpe_model_dir) == [im_end, endoftext]


# -- the dataset ---------------------------------------------------------------------------------
def test_step_rows_visit_every_prompt_once_per_epoch_in_a_seeded_order(bpe, tmp_path):
    tokenizer, rows, _ = bpe
    path = write_jsonl(tmp_path / "train.jsonl", rows[:10])
    config = DataConfig(train_files=[str(path)])
    dataset = PromptDataset.load(config, [path], tokenizer)
    assert dataset.epoch_size == 10 and dataset.columns == ["answer"]
    assert dataset.table["prompt_id"].to_pylist() == [f"train.jsonl:{i:06d}" for i in range(10)]
    pps = 4  # steps straddle epochs: 10 prompts, 4 per step
    steps = [dataset.step_rows(s, pps, seed=7, shuffle=True) for s in range(10)]
    ids = [i for t in steps for i in t["prompt_id"].to_pylist()]
    for epoch in range(4):
        assert sorted(ids[epoch * 10:(epoch + 1) * 10]) == sorted(dataset.table["prompt_id"].to_pylist())
    assert ids[:10] != ids[10:20], "each epoch has its own permutation"
    assert all(t["rollout_step"].to_pylist() == [s] * pps for s, t in enumerate(steps))
    # a pure function of (seed, step): a second instance (a resumed run) rebuilds step 7 exactly
    again = PromptDataset.load(config, [path], tokenizer)
    assert again.step_rows(7, pps, 7, True).equals(steps[7])
    assert not dataset.step_rows(7, pps, 8, True).equals(steps[7])
    assert dataset.step_rows(0, pps, 7, shuffle=False)["prompt_id"].to_pylist() == [
        f"train.jsonl:{i:06d}" for i in range(4)]
    assert np.array_equal(np.sort(epoch_order(10, 7, 3, True)), np.arange(10))
    # the rows carry the dataset's prompt, its tokens (chat template) and the passthrough columns
    row = steps[0].to_pylist()[0]
    source = rows[int(row["prompt_id"].split(":")[1])]
    assert row["prompt"] == source["prompt"] and row["answer"] == source["answer"]
    assert row["prompt_tokens"] == tokenizer.apply_chat_template(source["prompt"], add_generation_prompt=True)[
        "input_ids"]
    assert dataset.position(3, pps) == {"epoch": 1, "index": 2}


def test_parquet_and_jsonl_give_the_same_rows_and_long_prompts_are_dropped_and_counted(bpe, tmp_path):
    tokenizer, rows, _ = bpe
    texts = [{"question": r["prompt"][-1]["content"], "answer": int(r["answer"])} for r in rows[:12]]
    jsonl = write_jsonl(tmp_path / "a.jsonl", texts)
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(texts), parquet)
    config = DataConfig(train_files=["x"], prompt_key="question", apply_chat_template=True)
    a = PromptDataset.load(config, [jsonl], tokenizer).table
    b = PromptDataset.load(config, [parquet], tokenizer).table
    assert a.drop_columns(["prompt_id"]).equals(b.drop_columns(["prompt_id"]))
    lengths = sorted(len(t) for t in a["prompt_tokens"].to_pylist())
    limit = lengths[6]
    short = PromptDataset.load(dataclasses.replace(config, max_prompt_tokens=limit), [jsonl], tokenizer)
    assert short.dropped == sum(n > limit for n in lengths) > 0
    assert short.epoch_size + short.dropped == 12
    assert max(len(t) for t in short.table["prompt_tokens"].to_pylist()) <= limit  # dropped, never cut
    # two files: ids name the file relative to their common folder, rows in file order
    (tmp_path / "sub").mkdir()
    second = write_jsonl(tmp_path / "sub" / "a.jsonl", texts[:2])
    both = PromptDataset.load(config, [jsonl, second], tokenizer).table["prompt_id"].to_pylist()
    assert both[-3:] == ["a.jsonl:000011", "sub/a.jsonl:000000", "sub/a.jsonl:000001"]


def test_one_pass_tokenizes_every_row_once_keeps_the_tokens_and_reports_progress(bpe_model_dir, bpe, tmp_path,
                                                                                    monkeypatch, capsys):
    """Rows past the first batch are checked and tokenized like the first (the same tokens as
    tokenizing each prompt alone); a long check says how far it got; a second look at unchanged
    files and tokenizer in the same process is the first one's rows (nothing read again), and a
    changed file is read again."""
    from trajflow.engines.models import load_tokenizer
    from trajflow.engines.tokenizer import encode_prompt
    from trajflow.tasks import dataset

    tokenizer = load_tokenizer(bpe_model_dir)
    rows = (bpe[1] * 100)[:dataset.BATCH_ROWS * 2 + 5]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    config = DataConfig(train_files=[str(path)])
    monkeypatch.setattr(dataset, "PROGRESS_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(dataset, "PROGRESS_EVERY_SECONDS", 0.0)
    first = dataset.checked_dataset(config, [path], tokenizer)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trajflow: checking")]
    assert [line.split(": ")[2].split(" rows")[0] for line in progress] == ["2048", "4096", "4101"], progress
    assert first.epoch_size == len(rows)
    for i in (0, dataset.BATCH_ROWS, len(rows) - 1):  # a row of each batch
        assert first.table["prompt_tokens"][i].as_py() == encode_prompt(tokenizer, rows[i]["prompt"])
    assert dataset.checked_dataset(config, [path], load_tokenizer(bpe_model_dir)) is first
    write_jsonl(path, rows[:10])
    assert dataset.checked_dataset(config, [path], tokenizer).epoch_size == 10


def test_built_in_tasks_give_the_same_rows():
    from trajflow.tasks import get_task

    source = TaskPrompts(get_task("addition"), build_char_tokenizer(), seed=3, prompts_per_step=5)
    rows = source.step_rows(4)
    stream = get_task("addition").prompts("train", seed=3 * 1_000_003 + 4)
    expected = [next(stream) for _ in range(5)]
    assert rows.column_names == ["rollout_step", "prompt_id", "prompt", "prompt_tokens", "answer"]
    assert rows["prompt"].to_pylist() == [p.text for p in expected]
    assert rows["answer"].to_pylist() == [p.answer for p in expected]
    assert rows["rollout_step"].type == pa.int32() and set(rows["rollout_step"].to_pylist()) == {4}


# -- reward functions ----------------------------------------------------------------------------
def trl_reward(prompts, completions, answer, **kwargs):
    return [float(c == a) + 0.5 * len(p) for p, c, a in zip(prompts, completions, answer)]


def test_rewards_follow_trl_convention_and_a_failing_item_fails_only_itself():
    prompts, completions, answers = ["ab", "c", "de", "f"], ["1", "2", "3", "4"], ["1", "0", "3", "0"]
    runner = RewardRunner(trl_reward, timeout=5)
    assert runner(prompts, completions, {"answer": answers}) == ([2.0, 0.5, 2.0, 0.5], [None] * 4)

    def raises_on_a_quarter(prompts, completions, answer):
        return [1.0 if int(c) % 4 else 1 / 0 for c in completions]  # raises for "4" and "8"

    runner = RewardRunner(raises_on_a_quarter, timeout=5)
    scores, errors = runner([""] * 8, [str(i) for i in range(1, 9)], {"answer": [""] * 8})
    assert scores == [1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, None]
    assert errors == [None] * 3 + ["ZeroDivisionError: division by zero"] + [None] * 3 + [
        "ZeroDivisionError: division by zero"]

    def bad_values(prompts, completions, answer):
        return [{"1": 1.0, "2": None, "3": math.nan, "4": math.inf, "5": "high", "6": True}[c] for c in completions]

    assert RewardRunner(bad_values, 5)([""] * 6, list("123456"), {"answer": [""] * 6}) == (
        [1.0, None, None, None, None, 1.0],
        [None, "the reward returned None", "the reward returned nan", "the reward returned inf",
         "the reward returned 'high' (str), not a number", None])


def test_a_result_of_the_wrong_length_is_every_items_error_and_not_retried_per_item():
    calls = []

    def one_score(prompts, completions, **kwargs):
        calls.append(len(completions))
        return [1.0]

    wrong = "the reward returned 1 value for 3 completions (one score per completion)"
    assert RewardRunner(one_score, 5)([""] * 3, ["1", "2", "3"], {}) == ([None] * 3, [wrong] * 3)
    assert calls == [3]  # a length bug is the function's, not one item's: no per-item retry
    scores, errors = RewardRunner(lambda p, c, **k: 1.0, 5)(["", ""], ["1", "2"], {})
    assert scores == [None, None] and errors == ["the reward returned a float for 2 completions (one score per "
                                                 "completion)"] * 2


def test_a_long_error_is_one_line_of_at_most_200_characters():
    def raises_long(prompts, completions, **kwargs):
        raise RuntimeError("line one\n" + "x" * 500)

    scores, errors = RewardRunner(raises_long, 5)([""] * 2, ["1", "2"], {})
    assert scores == [None, None]
    assert all(len(e) == ERROR_CHARS and "\n" not in e and e.startswith("RuntimeError: line one xxx") and
               e.endswith("...") for e in errors)


def test_an_item_past_the_timeout_is_an_error_and_the_batch_finishes_in_bounded_time():
    def sleeps_on_seven(prompts, completions, **kwargs):
        if "7" in completions:
            time.sleep(10.0)
        return [1.0] * len(completions)

    over = "TimeoutError: the reward took longer than reward_timeout_seconds (0.5 s)"
    started = time.monotonic()
    scores, errors = RewardRunner(sleeps_on_seven, timeout=0.5)([""] * 8, [str(i) for i in range(8)], {})
    assert scores == [1.0] * 7 + [None] and errors == [None] * 7 + [over]
    assert time.monotonic() - started < 5.0  # batch 0.5 s + one round of items 0.5 s, not the 10 s hang

    async def async_reward(prompts, completions, **kwargs):
        import asyncio

        await asyncio.sleep(10.0 if "7" in completions else 0.0)
        if "3" in completions:
            raise RuntimeError("no")
        return [float(c) for c in completions]

    started = time.monotonic()
    scores, errors = RewardRunner(async_reward, timeout=0.5)([""] * 8, [str(i) for i in range(8)], {})
    assert scores == [0.0, 1.0, 2.0, None, 4.0, 5.0, 6.0, None]
    assert errors == [None] * 3 + ["RuntimeError: no"] + [None] * 3 + [over]
    assert time.monotonic() - started < 5.0


def test_a_built_in_reward_runs_under_the_per_item_timeout(monkeypatch):
    """`reward: math` (like every reward) is called under RewardRunner's timeout: a parse that
    hangs makes that item an error within the timeout, and math-verify's own timeouts (SIGALRM,
    main thread only) are off in the runner's thread without their notice."""
    import logging

    import math_verify

    runner = Workload(data=DataConfig(train_files=["unused.jsonl"]), reward="math",
                      reward_timeout_seconds=0.5).reward_runner()
    real_parse = math_verify.parse
    timeouts = []

    def parse(text, parsing_timeout=5, **kwargs):
        timeouts.append(parsing_timeout)
        if text == "hang":
            time.sleep(10.0)
        return real_parse(text, parsing_timeout=parsing_timeout, **kwargs)

    monkeypatch.setattr(math_verify, "parse", parse)
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addHandler(handler)
    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    try:
        started = time.monotonic()
        scores, errors = runner([""] * 3, ["0.5", "hang", "4"], {"answer": ["\\frac{1}{2}", "1", "3"]})
        elapsed = time.monotonic() - started
    finally:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).removeHandler(handler)
    assert scores == [1.0, None, 0.0]
    assert errors[1].startswith("TimeoutError") and errors[0] is None and errors[2] is None
    assert elapsed < 5.0  # batch 0.5 s + one round of items 0.5 s, not the 10 s hang
    assert set(timeouts) == {None}  # math-verify's own timeouts off: not the main thread
    assert not [n for n in notices if n.startswith("Timeout is disabled")]


def test_exact_match_is_vectorised_and_strips_whitespace():
    assert exact_match(None, [" 12 ", "12", "3", "", "7"], ["12", "12\n", "4", "", 7]) == [1.0, 1.0, 0.0, 1.0, 1.0]
    from trajflow.tasks.base import exact_match_reward

    rng = np.random.default_rng(1)
    answers = [str(x) for x in rng.integers(0, 30, 500)]
    completions = [f" {x}" if i % 3 else str(x) for i, x in enumerate(rng.integers(0, 30, 500))]
    assert exact_match(None, completions, answers) == [exact_match_reward(a, c) for a, c in zip(answers, completions)]


def test_math_verifier():
    math_reward = MathVerify()
    assert math_reward(None, ["0.5"], ["\\frac{1}{2}"]) == [1.0]
    assert math_reward(None, ["4"], ["3"]) == [0.0]
    assert math_reward(None, ["\\frac{1}{2}", "The answer is 19.", "1/2", "nineteen", ""], ["0.5", "19", "0.5", "19",
                                                                                              "19"]) == [
        1.0, 1.0, 1.0, 0.0, 0.0]


def test_a_reward_in_a_file_is_pickled_by_value(tmp_path):
    import ray.cloudpickle

    (tmp_path / "my_reward_mod.py").write_text("def score(prompts, completions, **kw):\n    return [2.0] * len(completions)\n")
    fn = load_object(f"{tmp_path / 'my_reward_mod.py'}:score", "reward")
    payload = ray.cloudpickle.dumps(fn)
    del sys.modules[fn.__module__]
    (tmp_path / "my_reward_mod.py").unlink()  # a worker cannot import it: the code travels by value
    assert ray.cloudpickle.loads(payload)([""], ["x"]) == [2.0]


# -- validation before Ray -----------------------------------------------------------------------
@pytest.fixture()
def dataset_config(bpe, bpe_model_dir, tmp_path):
    rows = bpe[1][:8]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "rewards.py").write_text(textwrap.dedent("""
        def good(prompts, completions, answer, **kwargs):
            return [1.0] * len(completions)
        def wants_other(prompts, completions, level):
            return [1.0] * len(completions)
        def too_few(completions):
            return [1.0]
        NOT_CALLABLE = 3
    """))
    return dict(model=str(bpe_model_dir), data={"train_files": [str(path)]}, reward=f"{tmp_path}/rewards.py:good",
                prompts_per_step=4, group_size=2)


@pytest.mark.parametrize("change, message", [
    ({"data": {"train_files": ["/nope/train.jsonl"]}}, "data.train_files: /nope/train.jsonl: no such file"),
    ({"data": {"train_files": ["{tmp}/train.jsonl"], "prompt_key": "question"}}, "no column 'question'"),
    ({"reward": "no_such_module_xyz:fn"}, "reward: cannot import no_such_module_xyz"),
    ({"reward": "{tmp}/rewards.py:missing"}, "has no 'missing'"),
    ({"reward": "{tmp}/rewards.py:NOT_CALLABLE"}, "is not callable"),
    ({"reward": "{tmp}/rewards.py:too_few"}, "must take (prompts, completions, **columns)"),
    ({"reward": "{tmp}/rewards.py:wants_other"}, "does not accept the dataset column(s) answer"),
    ({"reward": "/nope/r.py:fn"}, "reward: /nope/r.py: no such file"),
    ({"reward": None}, "reward: a dataset needs a reward"),
    ({"task": "addition"}, "task: give either task, or data"),
    ({"model": None}, "has no chat template"),
    ({"env": "trajflow.tasks:AdditionTask", "reward": None, "data": None}, "env: trajflow.tasks:AdditionTask is not "
                                                                           "an Environment"),
    ({"data": {"train_files": ["{tmp}/train.jsonl"], "epochs": 1}, "steps": 5}, "need more than data.epochs=1"),
])
def test_bad_workload_inputs_fail_before_ray_with_one_line(dataset_config, tmp_path, change, message):
    """In validation (names, combinations) or in the preflight that reads the disk (files,
    columns, the reward's module and signature, the chat template): one line either way."""
    from trajflow.jobs.config import JobConfigError, build_job_config

    config = {**dataset_config, **json.loads(json.dumps(change).replace("{tmp}", str(tmp_path)))}
    with pytest.raises(JobConfigError) as info:
        build_job_config(config)
    line = str(info.value)
    assert message in line and "\n" not in line, line


def test_epochs_set_the_number_of_steps(dataset_config, tmp_path):
    from trajflow.pipelines.config import preflight

    config = {**dataset_config, "data": {"train_files": [str(tmp_path / "train.jsonl")], "epochs": 3}}
    assert PipelineConfig(**config).steps == 100  # validation reads no file: the default until the preflight
    assert preflight(PipelineConfig(**config)).steps == 3 * 8 // 4
    assert preflight(PipelineConfig(**config, steps=4)).steps == 4


def test_bad_inputs_exit_2_with_one_line_from_the_cli(dataset_config, tmp_path, capsys):
    import yaml

    from trajflow.jobs.cli import main

    for change, fragment in [({"data": {"train_files": [str(tmp_path / "missing.jsonl")]}}, "missing.jsonl: no such file"),
                             ({"data": {"train_files": [str(tmp_path / "train.jsonl")], "prompt_key": "q"}},
                              "no column 'q'"),
                             ({"reward": "nowhere.mod:fn"}, "reward: cannot import nowhere"),
                             ({"reward": f"{tmp_path}/rewards.py:NOT_CALLABLE"}, "is not callable")]:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump({**dataset_config, **change, "run_dir": str(tmp_path / "run")}))
        assert main(["run", str(path)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("trajflow: config error: ") and fragment in err[0], err
        assert not (tmp_path / "run").exists()


def test_workload_of_a_config(dataset_config):
    workload = PipelineConfig(**dataset_config).workload()
    assert isinstance(workload, Workload) and workload.task is None and workload.columns() == ["answer"]
    assert PipelineConfig().workload().task == "addition"
    with pytest.raises(DataError, match="needs data.test_files"):
        workload.heldout_rows(None, 3)
    with pytest.raises(UserCodeError, match="reward: 'not a path' is not module:name"):
        load_object("not a path", "reward")


def test_dataset_errors_found_while_reading_are_one_line_bad_input(bpe, tmp_path):
    """A problem only reading the whole file can find (a null prompt in row 2) is a DataError naming
    the row, which the CLI reports as bad input (one line, exit 2)."""
    from trajflow.jobs.cli import _BAD_INPUT, _is_one_of

    rows = [dict(r) for r in bpe[1][:3]]
    rows[2]["prompt"] = None
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match="data.train_files: train.jsonl: line 3: column 'prompt' is null") as info:
        PromptDataset.load(DataConfig(train_files=[str(path)]), [path], bpe[0])
    assert _is_one_of(info.value, _BAD_INPUT) and _is_one_of(RewardSpecError("reward: x"), _BAD_INPUT)
