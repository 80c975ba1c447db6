"""`trajflow eval --config JOB.yaml --model ...` on a byo-style config (the tiny Qwen2 and BPE
tokenizer of test_byo_pipeline.py, chat-message prompts in JSONL, a reward from a file):

- on a run's checkpoint that is not a Hugging Face directory (weights only, as every checkpoint
  but a run's last), with a continuous reward: the printed mean reward equals the reward
  computed by hand on greedy completions generated here with Hugging Face's own `generate`, over
  every row of data.test_files, and no accuracy is claimed;
- with a 0/1 reward on a model directory: the accuracy is the count of exact answers;
- a run dir stands for its latest checkpoint, and a kept version's file for that version; a
  directory that is neither, or a config without data.test_files, is one line, exit 2.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from support import cli_in_process, explain, run_cli
from trajflow.engines import checkpoint as ckpt
from trajflow.engines.models import load_model, load_tokenizer
from trajflow.engines.tokenizer import stop_token_ids

MAX_NEW_TOKENS = 5
REWARDS = textwrap.dedent("""
    def graded(prompts, completions, answer, **columns):
        return [len(c) / 10 + (c.strip() == a) + 0.01 * len(p[-1]["content"])
                for p, c, a in zip(prompts, completions, answer)]

    def exact(prompts, completions, answer, **columns):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
""")


@pytest.fixture(scope="module")
def workload(bpe, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval")
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bpe[1][:8]))
    (path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bpe[2]))
    (path / "rewards.py").write_text(REWARDS)
    return path


def job(workload: Path, model_dir: Path, reward: str) -> dict:
    return {"name": "byo", "model": str(model_dir), "reward": f"{workload / 'rewards.py'}:{reward}",
            "data": {"train_files": [str(workload / "train.jsonl")], "test_files": [str(workload / "test.jsonl")]},
            "sampling": {"max_new_tokens": MAX_NEW_TOKENS}, "steps": 4}


@pytest.fixture(scope="module")
def run_dir(workload, bpe_model_dir, tmp_path_factory) -> Path:
    """A run dir with the config it was run with and checkpoint 3 of a changed model: weights and
    optimizer only (no config.json), as the recorder writes every checkpoint but the last."""
    root = tmp_path_factory.mktemp("run")
    (root / "config.yaml").write_text(yaml.safe_dump(job(workload, bpe_model_dir, "graded")))
    generator = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
             for k, v in load_model(bpe_model_dir).state_dict().items()}
    ckpt.save_checkpoint(root / "checkpoints", 3, state, meta={"step": 3})
    return root


def by_hand(model, tokenizer, model_dir: Path, rows: list[dict]) -> list[str]:
    """Greedy completions with Hugging Face's generate, one prompt at a time, cut at the first stop token."""
    stops = stop_token_ids(tokenizer, model_dir)
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=stops, pad_token_id=stops[0])[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(new) if t in stops), len(new))
        out.append(tokenizer.decode(new[:cut], skip_special_tokens=True))
    return out


def mean_reward(line: str) -> tuple[float, int]:
    found = re.search(r"mean reward (\d+\.\d+) on (\d+) held-out prompts", line)
    assert found, line
    return float(found[1]), int(found[2])


def test_eval_of_a_checkpoint_is_the_mean_reward_computed_by_hand(workload, bpe, bpe_model_dir, run_dir, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job(workload, bpe_model_dir, "graded")))
    checkpoint = run_dir / "checkpoints" / "step-000003"
    assert not (checkpoint / "config.json").exists()
    proc = run_cli(["eval", "--config", config, "--model", checkpoint], timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", explain(proc)
    assert len(proc.stdout.splitlines()) == 1 and "accuracy" not in proc.stdout  # a continuous reward
    mean, count = mean_reward(proc.stdout)

    model = load_model(bpe_model_dir)
    model.load_state_dict(ckpt.load_weights(checkpoint / "model.safetensors"))
    tokenizer = load_tokenizer(bpe_model_dir)
    rows = bpe[2]
    completions = by_hand(model, tokenizer, bpe_model_dir, rows)
    namespace: dict = {}
    exec(REWARDS, namespace)  # the reward file's own functions
    rewards = namespace["graded"]([r["prompt"] for r in rows], completions, [r["answer"] for r in rows])
    assert count == len(rows) == 8  # every row of data.test_files
    assert mean == pytest.approx(sum(rewards) / len(rewards), abs=5e-5)
    base = by_hand(load_model(bpe_model_dir), tokenizer, bpe_model_dir, rows)
    assert base != completions, "the checkpoint's weights should change the completions"

    # a run dir stands for its latest checkpoint, on the model the run started from
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.evaluate import evaluate, resolve_model

    model = resolve_model(run_dir, load_job_config(config))
    assert model.weights.path == checkpoint and model.base == bpe_model_dir.resolve()
    # a version kept with save_all_versions: its weights, on the run's model
    version = run_dir / "versions" / "v000003.safetensors"
    ckpt.save_weights(ckpt.load_weights(checkpoint / "model.safetensors"), version)
    model = resolve_model(version, load_job_config(config))
    assert model.weights == version and model.base == bpe_model_dir.resolve()
    assert evaluate(load_job_config(config).workload(), model, None, MAX_NEW_TOKENS).mean == pytest.approx(mean,
                                                                                                           abs=5e-5)


def test_eval_with_a_binary_reward_reports_the_accuracy(workload, bpe, bpe_model_dir, tmp_path):
    from trajflow.jobs.config import build_job_config
    from trajflow.jobs.evaluate import evaluate, resolve_model

    config = build_job_config(job(workload, bpe_model_dir, "exact"))
    model = resolve_model(bpe_model_dir, config)
    result = evaluate(config.workload(), model, None, MAX_NEW_TOKENS)
    rows = bpe[2]
    completions = by_hand(load_model(bpe_model_dir), load_tokenizer(bpe_model_dir), bpe_model_dir, rows)
    exact = sum(c.strip() == r["answer"] for c, r in zip(completions, rows))
    assert result.rewards == [float(c.strip() == r["answer"]) for c, r in zip(completions, rows)]
    assert f"(accuracy {exact}/8 = {exact / 8:.1%})" in result.line("data.test_files", model.label)


def test_eval_without_a_model_or_held_out_data_is_one_line(workload, bpe_model_dir, tmp_path, capfd):
    """Both are found before a model is loaded (the entry point in this process)."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job(workload, bpe_model_dir, "graded")))
    (tmp_path / "empty").mkdir()
    proc = cli_in_process(["eval", "--config", config, "--model", tmp_path / "empty"], capfd)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.splitlines() == [f"trajflow: eval: --model {tmp_path / 'empty'}: neither a model directory "
                                        "(no config.json) nor a run's checkpoint (checkpoints/step-N with "
                                        "meta.json) or run dir with one"]

    no_test = job(workload, bpe_model_dir, "graded")
    no_test["data"].pop("test_files")
    config.write_text(yaml.safe_dump(no_test))
    proc = cli_in_process(["eval", "--config", config], capfd)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.splitlines() == [f"trajflow: eval: --config {config}: data.test_files is empty (nothing "
                                        "held out to evaluate on)"]
