"""Built-in tasks (determinism, held-out split, verifiers, vocab) and the committed warm start."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from collections.abc import Iterator

import pytest
import torch

from trajflow.engines.models import REPO_ROOT, WARM_START_DIR, load_model, load_tokenizer
from trajflow.engines.tokenizer import CHARACTERS, build_char_tokenizer, encode_prompt
from trajflow.tasks import AdditionTask, Prompt, Task, get_task, register_task, registered_tasks

TASKS = ["addition", "reverse"]


def _load_script():
    path = REPO_ROOT / "scripts" / "make_warm_start.py"
    spec = importlib.util.spec_from_file_location("make_warm_start", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _load_script()


def take(stream: Iterator[Prompt], n: int) -> list[Prompt]:
    return list(itertools.islice(stream, n))


# --- interface and registry ---------------------------------------------------------------------

@pytest.mark.parametrize("name", TASKS)
def test_builtin_tasks_implement_the_protocol(name):
    task = get_task(name)
    assert isinstance(task, Task)
    assert task.name == name
    assert set(TASKS) <= set(registered_tasks())


def test_get_task_passes_kwargs_and_rejects_unknown_names():
    task = get_task("addition", max_digits=2)
    assert isinstance(task, AdditionTask) and task.max_digits == 2
    assert all(len(p.text.split("+")[0]) <= 2 for p in take(task.prompts("train", 0), 200))
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(ValueError):
        get_task("addition", min_digits=3, max_digits=2)


def test_an_external_task_can_be_registered():
    class Echo:  # implements the Protocol without inheriting anything
        name = "echo"

        def prompts(self, split, seed):
            for i in itertools.count():
                yield Prompt(f"echo/{split}/{seed}/{i:06d}", f"say {i}=", str(i))

        def heldout(self, n):
            return take(self.prompts("test", 0), n)

        def reward(self, prompt_text, answer, response_text):
            return float(response_text == answer)

    from trajflow.tasks import registry

    try:
        register_task("echo", Echo)
        task = get_task("echo")
        assert isinstance(task, Task)
        assert task.heldout(2)[1].answer == "1"
        register_task("not_a_task", lambda: object())
        with pytest.raises(TypeError, match="not a Task"):
            get_task("not_a_task")
    finally:  # leave the global registry as it was
        registry._REGISTRY.pop("echo", None)
        registry._REGISTRY.pop("not_a_task", None)


# --- prompt streams -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("split", ["train", "test"])
def test_streams_are_deterministic_given_the_seed(name, split):
    a = take(get_task(name).prompts(split, 7), 300)
    b = take(get_task(name).prompts(split, 7), 300)
    c = take(get_task(name).prompts(split, 8), 300)
    assert a == b
    assert [p.text for p in a] != [p.text for p in c]


@pytest.mark.parametrize("name", TASKS)
def test_train_and_test_are_disjoint(name):
    task = get_task(name)
    test_texts = {p.text for p in task.heldout(1000)}
    for seed in (0, 1, 2):
        test_texts |= {p.text for p in take(task.prompts("test", seed), 500)}
    train_texts = set()
    for seed in (0, 1, 2):
        train_texts |= {p.text for p in take(task.prompts("train", seed), 5000)}
    assert not test_texts & train_texts
    assert all(task.split_of(t) == "test" for t in test_texts)
    assert all(task.split_of(t) == "train" for t in train_texts)
    # the hash partition holds out about the documented 10% of problems
    fraction = sum(task.split_of(f"{i}+{j}=") == "test" for i in range(100) for j in range(100)) / 1e4
    assert 0.08 < fraction < 0.12


@pytest.mark.parametrize("name", TASKS)
def test_heldout_is_a_fixed_prefix_of_test_without_repeats(name):
    task = get_task(name)
    heldout = task.heldout(1000)
    assert heldout == take(task.prompts("test", 0), 1000)
    assert task.heldout(10) == heldout[:10]
    assert len({p.text for p in heldout}) == 1000


@pytest.mark.parametrize("name", TASKS)
def test_prompt_ids_are_unique_and_stable(name):
    task = get_task(name)
    ids = []
    for split, seed in [("train", 0), ("train", 1), ("test", 0), ("test", 1)]:
        prompts = take(task.prompts(split, seed), 2000)
        assert prompts[5].prompt_id == f"{name}/{split}/{seed}/000005"
        ids += [p.prompt_id for p in prompts]
    assert len(ids) == len(set(ids))


def test_answers_are_correct():
    for p in take(get_task("addition").prompts("train", 3), 500):
        a, b = p.text.removesuffix("=").split("+")
        assert p.text.endswith("=") and int(p.answer) == int(a) + int(b) and p.answer == str(int(p.answer))
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3
    lengths = set()
    for p in take(get_task("reverse").prompts("train", 3), 500):
        word = p.text.removeprefix("rev:").removesuffix("=")
        assert p.answer == word[::-1]
        lengths.add(len(p.answer))
    assert lengths == {2, 3, 4, 5, 6}  # variable-length answers


@pytest.mark.parametrize("name", TASKS)
def test_every_character_is_in_the_tokenizer_vocab(name):
    task = get_task(name)
    prompts = take(task.prompts("train", 0), 3000) + task.heldout(1000)
    used = set("".join(p.text + p.answer for p in prompts))
    assert used <= set(CHARACTERS)
    tokenizer = build_char_tokenizer()
    for p in prompts[:50]:
        ids = encode_prompt(tokenizer, p.text + p.answer)
        assert tokenizer.unk_token_id not in ids and len(ids) == 1 + len(p.text + p.answer)


def test_a_tiny_problem_space_ends_the_test_stream():
    task = AdditionTask(max_digits=1)  # 100 problems, about 10 held out
    test = list(task.prompts("test", 0))
    assert 0 < len(test) < 30 and len({p.text for p in test}) == len(test)


# --- verifiers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("357", 1.0), (" 357\n", 1.0),                       # right (surrounding whitespace ignored)
    ("358", 0.0), ("35", 0.0), ("3570", 0.0), ("0357", 0.0), ("357 357", 0.0),  # wrong
    ("", 0.0), ("   ", 0.0),                             # empty
    ("<unk><eos>##\x00é", 0.0), ("12+345=357", 0.0),     # garbage
    (None, 0.0), (357, 0.0), (b"357", 0.0),              # not even a string
])
def test_addition_reward(response, expected):
    task = get_task("addition")
    assert task.reward("12+345=", "357", response) == expected


@pytest.mark.parametrize("response, expected", [
    ("dcba", 1.0), ("abcd", 0.0), ("dcb", 0.0), ("dcbaa", 0.0), ("", 0.0), ("?:=|", 0.0), (None, 0.0),
])
def test_reverse_reward(response, expected):
    assert get_task("reverse").reward("rev:abcd=", "dcba", response) == expected


@pytest.mark.parametrize("name", TASKS)
def test_rewards_are_binary_floats_in_unit_interval(name):
    task = get_task(name)
    for p in take(task.prompts("train", 0), 50):
        for response in (p.answer, p.answer[::-1] + "x", "", p.text, "\n" * 40):
            r = task.reward(p.text, p.answer, response)
            assert isinstance(r, float) and r in (0.0, 1.0)
        assert task.reward(p.text, p.answer, p.answer) == 1.0


# --- the warm-start script ----------------------------------------------------------------------

def test_make_batch_puts_loss_on_the_response_only(script):
    tokenizer = build_char_tokenizer()
    batch = script.make_batch(tokenizer, [Prompt("x", "1+2=", "3"), Prompt("y", "10+20=", "30")])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    labels = batch["labels"][0].tolist()
    assert labels[:5] == [-100] * 5  # bos 1 + 2 =
    assert labels[5:7] == [tokenizer.convert_tokens_to_ids("3"), tokenizer.eos_token_id]
    assert labels[7:] == [-100] * (len(labels) - 7)  # padding
    assert batch["attention_mask"][0].sum() == 7 and batch["attention_mask"][1].sum() == 10


def test_training_is_deterministic_given_the_seed(script):
    task = get_task("addition")
    runs = []
    for _ in range(2):
        model, _, info = script.train_until_band(task, seed=3, band=(0.0, 1.0), eval_every=3,
                                                 eval_n=20, log=lambda line: None)
        runs.append((model.state_dict(), info))
    assert runs[0][1]["steps"] == 3 and runs[0][1]["history"] == runs[1][1]["history"]
    for key, value in runs[0][0].items():
        assert torch.equal(value, runs[1][0][key]), key


# --- the committed warm start -------------------------------------------------------------------

@pytest.fixture(scope="module")
def warm_start():
    torch.set_num_threads(2)
    record = json.loads((WARM_START_DIR / "warm_start.json").read_text())
    return load_model(WARM_START_DIR), load_tokenizer(WARM_START_DIR), record


def test_warm_start_record_is_within_the_band(warm_start):
    _, _, record = warm_start
    low, high = record["band"]
    assert record["task"] == "addition" and record["heldout_n"] == 1000
    assert 0.2 <= low <= record["heldout_accuracy"] <= high <= 0.5
    assert record["command"].startswith("python scripts/make_warm_start.py")
    assert {"seed", "steps"} <= set(record)
    size = sum(f.stat().st_size for f in WARM_START_DIR.iterdir())
    assert size < 5_000_000


def test_warm_start_tokenizer_matches_the_builtin_one(warm_start):
    _, tokenizer, _ = warm_start
    builtin = build_char_tokenizer()
    text = "12+345=357"
    assert encode_prompt(tokenizer, text) == encode_prompt(builtin, text)
    assert tokenizer.eos_token_id == builtin.eos_token_id and tokenizer.pad_token_id == builtin.pad_token_id


def test_warm_start_greedy_accuracy_matches_the_record(warm_start, script):
    model, tokenizer, record = warm_start
    task = get_task("addition")
    prompts = task.heldout(100)
    acc = script.greedy_accuracy(model, tokenizer, prompts, task.reward)
    # 100 of the recorded 1000 prompts: allow ~3 standard errors
    margin = 3 * math.sqrt(record["heldout_accuracy"] * (1 - record["heldout_accuracy"]) / 100)
    assert abs(acc - record["heldout_accuracy"]) <= margin, (acc, record["heldout_accuracy"])
    assert 0.0 < acc < 1.0


def test_cached_greedy_decode_matches_full_recompute(warm_start, script):
    model, tokenizer, _ = warm_start
    prompts = get_task("addition").heldout(40)
    responses = script._decode(model, tokenizer, prompts, max_new_tokens=6)
    with torch.no_grad():
        for p, response in zip(prompts, responses):
            ids = encode_prompt(tokenizer, p.text)
            out = []
            for _ in range(6):
                token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(token)
                if token == tokenizer.eos_token_id:
                    break
            expected = tokenizer.decode([t for t in out if t != tokenizer.eos_token_id])
            if tokenizer.eos_token_id not in out:
                expected += "<length>"
            assert response == expected, p
