"""Make the real-model distillation teacher: SmolLM2-135M-Instruct fine-tuned on the evidence
study's one-digit sums and differences (artifacts/smollm2/arith_train.jsonl).

The student of benchmarks/distillation_held.py is the model itself (the smollm2 config's model);
its teacher must be clearly better on the same problems, with the same tokenizer and
architecture. This continues supervised fine-tuning of that model on the train file's problems,
each answered in the worked examples' own form ("6 + 7 = 13. The answer is 13."), with the
warm-start scripts' recipe (make_warm_start.py `sft_until_band`: teacher-forced prompt -> answer +
eos, AdamW, warm-up), evaluating greedy accuracy on the first `--eval-prompts` held-out problems
every `--eval-every` steps until it first reaches `--band`. Then the whole held-out report, greedy
and sampled as the study measures them, beside the model's own.

Writes safetensors + config + tokenizer and ``warm_start.json`` (how it was made, its held-out
report) to OUT (not committed: 538 MB in float32). CPU, deterministic given ``--seed``.

    python scripts/make_smollm2_teacher.py OUT
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT))
from make_smollm2_arith import PHRASINGS  # noqa: E402 (sibling scripts)
from make_warm_start import sft_tensors, sft_until_band, write_record  # noqa: E402

TRAIN = REPO_ROOT / "artifacts" / "smollm2" / "arith_train.jsonl"


def worked_answer(question: str, answer: str) -> str:
    """The worked examples' form of the answer to one of the slice's questions."""
    for op, phrasings in PHRASINGS.items():
        for phrasing in phrasings:
            pattern = re.escape(phrasing).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
            match = re.fullmatch(pattern, question)
            if match:
                a, b = int(match["a"]), int(match["b"])
                result = a + b if op == "+" else a - b
                if str(result) != answer:
                    raise ValueError(f"{TRAIN}: {question!r} has answer {answer!r}, not {result}")
                return f"{a} {op} {b} = {result}. The answer is {result}."
    raise ValueError(f"{TRAIN}: {question!r} is none of make_smollm2_arith.py's phrasings")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--band", type=float, nargs=2, default=(0.95, 1.0), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=40)
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args(argv)

    from benchmarks.evidence_held import SAMPLED, config_for
    from trajflow.engines.models import load_model, load_tokenizer, save_model
    from trajflow.engines.tokenizer import encode_prompts
    from trajflow.pipelines.rl_loop import RLPipeline
    from trajflow.tasks.rollout import SampledEvaluation, heldout_rewards

    config = config_for("fp8", "snapshot", args.seed, 0, 1, args.lr)  # the study's model and data
    pipe = RLPipeline(config.pipeline_config(), model_path=config.model_path)
    max_new_tokens = pipe.config.sampling.max_new_tokens
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    tokenizer = load_tokenizer(pipe.model_path)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows])
    answers = [tokenizer.encode(worked_answer(r["prompt"][-1]["content"], r["answer"]), add_special_tokens=False)
               + [tokenizer.eos_token_id] for r in rows]
    order = np.random.default_rng(args.seed)
    queue: list[int] = []

    def next_batch(_tokenizer) -> dict[str, torch.Tensor]:  # epochs of the train file, each shuffled
        while len(queue) < args.batch_size:
            queue.extend(order.permutation(len(rows)).tolist())
        chosen = [queue.pop(0) for _ in range(args.batch_size)]
        return sft_tensors([prompts[i] + answers[i] for i in chosen],
                           [[-100] * len(prompts[i]) + answers[i] for i in chosen], tokenizer.pad_token_id)

    def accuracy(model, n: int | None = None, sampled: SampledEvaluation | None = None) -> float:
        rewards = heldout_rewards(model, tokenizer, pipe.workload, n, max_new_tokens, sampled=sampled)
        return float(np.mean([r or 0.0 for r in rewards]))

    started = time.perf_counter()
    model, _, info = sft_until_band(next_batch, lambda m, _t: accuracy(m, args.eval_prompts),
                                    metric="heldout_greedy", seed=args.seed, band=tuple(args.band), lr=args.lr,
                                    warmup=args.warmup, eval_every=args.eval_every, max_steps=args.max_steps,
                                    build=lambda _seed: (load_model(pipe.model_path), tokenizer))
    train_seconds = time.perf_counter() - started
    n = pipe.config.eval_prompts
    report = {"heldout_prompts": n}
    for name, candidate in (("teacher", model), ("student", load_model(pipe.model_path))):
        report[f"{name}_greedy_accuracy"] = accuracy(candidate, n)
        report[f"{name}_sampled_accuracy"] = accuracy(candidate, n, SampledEvaluation(**SAMPLED))
    print(json.dumps(report))
    save_model(model, tokenizer, args.out)
    write_record(args.out, Path(__file__).name, argv, args, info, report, train_seconds,
                 task="smollm2 one-digit sums and differences", task_repr=str(TRAIN.relative_to(REPO_ROOT)),
                 student=str(pipe.model_path), warmup=args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
