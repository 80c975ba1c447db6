"""Benchmark: start-up of a BYO run with a real 131k-token tokenizer — the seconds of validation
before Ray starts, and the wall time to the end of the first step — for two installs of trajflow
side by side (e.g. main's and this branch's: `--python` of each one's virtualenv).

The tokenizer is Mistral's Tekken (131,072 tokens, `tekken_240911.json` as shipped inside the
`mistral_common` wheel; nothing is downloaded), converted to a Hugging Face tokenizer by
transformers' own `MistralConverter`, with a chat template that refuses roles it does not know.
The model is a randomly initialised Qwen2 with that vocabulary (hidden size 64, 2 layers, tied
embeddings: 8.5 M parameters, nearly all of them the embedding). The data: GSM8K-shaped word
problems as chat messages, 7,473 train rows (GSM8K's train split size) and 300 test rows, JSON lines.

Validation is `load_job_config` of the run's config in a fresh process, timed (wall and CPU) after
the imports it needs (torch, transformers: the run imports them anyway). On a shared 2-core
machine the CPU seconds are the steadier number. Time to the first step
is benchmarks/startup.py's cold `trajflow run` (the real command line, phases timestamped).

    python -m benchmarks.startup_vocab --python /work/main/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TRAIN_ROWS, TEST_ROWS = 7473, 300
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}<s>[{{ m['role'] }}]"
                   "{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>[assistant]{% endif %}")

# timed in a fresh process: imports, then the config's validation (a dataset's rows included)
VALIDATE = r'''
import json, sys, time
t0 = time.perf_counter()
import torch, transformers  # what validation of a dataset imports; the run needs them anyway
from trajflow.jobs.config import load_job_config
t1, c1 = time.perf_counter(), time.process_time()
load_job_config(sys.argv[1])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"imports s": t1 - t0, "validation s": t2 - t1, "validation CPU s": c2 - c1}))
'''


def build_assets(root: Path) -> Path:
    """The tokenizer, model, data and config under `root`; returns the config's path."""
    import mistral_common
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.integrations.mistral.tokenizer import MistralConverter

    tekken = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    backend = MistralConverter(vocab_file=str(tekken)).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = STRICT_TEMPLATE
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    model_dir = root / "model"
    Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    rng = np.random.default_rng(0)
    for name, n in (("train", TRAIN_ROWS), ("test", TEST_ROWS)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                a, b, c = (int(x) for x in rng.integers(2, 60, 3))
                text = (f"Natalia sold clips to {a} of her friends in April, and then she sold {b} more clips "
                        f"in May than {c} friends. How many clips did Natalia sell altogether in April and May?")
                messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": text}]
                f.write(json.dumps({"prompt": messages, "answer": str(a + b + c)}) + "\n")
    path = root / "job.yaml"
    path.write_text(json.dumps({
        "name": "vocab128k", "model": str(model_dir), "reward": "math", "strategy": "snapshot",
        "data": {"train_files": [str(root / "train.jsonl")], "test_files": [str(root / "test.jsonl")],
                 "prompt_key": "prompt", "max_prompt_tokens": 128},
        "prompts_per_step": 16, "group_size": 8, "max_staleness": 1, "eval_every": 0,
        "sampling": {"max_new_tokens": 6}, "checkpoint_every": 0, "report_to": [],
    }))
    return path


# timed in a fresh process: what each Ray actor that loads the tokenizer pays (the generator no
# longer does: it takes eos, pad and stop ids from the driver, engines/tokenizer.py TokenIds)
TOKENIZER_LOAD = r'''
import json, sys, time
import transformers  # an actor has it imported already
from trajflow.engines.models import load_tokenizer
t1, c1 = time.perf_counter(), time.process_time()
tokenizer = load_tokenizer(sys.argv[1])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"tokenizer load s": t2 - t1, "tokenizer load CPU s": c2 - c1, "vocab": len(tokenizer)}))
'''


def tokenizer_load_seconds(python: str, model_dir: Path, runs: int = 3) -> dict:
    """Median over `runs` fresh processes of loading the run's tokenizer (wall and CPU)."""
    import statistics

    samples = [json.loads(subprocess.run([python, "-c", TOKENIZER_LOAD, str(model_dir)], capture_output=True,
                                         text=True, check=True).stdout.strip().splitlines()[-1]) for _ in range(runs)]
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def validation_seconds(python: str, config: Path) -> dict:
    out = subprocess.run([python, "-c", VALIDATE, str(config)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(pythons: list[str], steps: int = 2) -> str:
    from benchmarks.common import table
    from benchmarks.startup import measure

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = build_assets(Path(tmp))
        for python in pythons:
            checked = validation_seconds(python, config)
            loads = tokenizer_load_seconds(python, config.parent / "model")
            result = measure(steps, config=str(config), python=python)
            generator = next((p for p in result["processes"] if p["process"].startswith("Generate")), {})
            phases = {p["phase"]: p["wall s"] for p in result["phases"]}
            rows.append({
                "trajflow of": python,
                "imports s": checked["imports s"],
                "validation s": checked["validation s"],
                "validation CPU s": checked["validation CPU s"],
                "run: config checks before Ray s": phases["config checks, run dir"],
                "run: Ray start to first step s": sum(v for k, v in phases.items() if k not in (
                    "interpreter start", "CLI + jobs.run imports", "config checks, run dir")),
                "run: wall to end of step 1 s": result["wall to end of step 1 s"],
                "run: CPU s, all processes, to end of step 1": result["CPU s, all processes, to end of step 1"],
                "tokenizer load CPU s (each process that loads it)": loads["tokenizer load CPU s"],
                "run: generator process CPU s to end of step 1": generator.get("CPU s to step 1"),
                "load before / after": result["load before / after"],
            })
    return table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", default=[], help="a Python with trajflow installed (repeat)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print(run(args.python or [sys.executable], args.steps))
