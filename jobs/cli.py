"""The `trajflow` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_generate(args: argparse.Namespace) -> int:
    """Generate a batch with a model, score it teacher-forced, print a table (no Ray needed)."""
    import numpy as np
    import polars as pl
    import torch

    from trajflow.engines import SamplingParams, TorchEngine, score
    from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
    from trajflow.engines.tokenizer import decode_response, encode_prompt
    from trajflow.tasks import get_task

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = Path(args.model or WARM_START_DIR)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    task = get_task(args.task)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    engine = TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, sampling=sampling,
                         inference_dtype=args.inference_dtype, seed=args.seed)
    stream = task.prompts("train", seed=args.seed)
    prompts = [next(stream) for _ in range(args.prompts)]
    prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    gens = engine.generate(prompt_tokens, n=args.n)
    scored = score(model, [prompt_tokens[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)
    rows = []
    for g, train_lp in zip(gens, scored):
        p = prompts[g.prompt_index]
        response = decode_response(tokenizer, g.response_tokens)
        inference_lp = np.asarray(g.logprobs)
        rows.append({
            "prompt": p.text,
            "answer": p.answer,
            "response": response,
            "reward": task.reward(p.text, p.answer, response),
            "tokens": len(g.response_tokens),
            "finish": g.finish_reason,
            "sum_logprob": float(inference_lp.sum()),
            "max_abs_old_minus_inf": float(np.abs(train_lp - inference_lp).max()),
        })
    df = pl.DataFrame(rows)
    with pl.Config(tbl_rows=len(rows), tbl_cols=-1, tbl_width_chars=160):
        print(df)
    print(f"model {model_dir} | inference_dtype {args.inference_dtype} | temperature {args.temperature} | "
          f"mean reward {df['reward'].mean():.3f} | mean |training - inference log-prob| "
          f"{float(np.mean(np.concatenate([np.abs(s - np.asarray(g.logprobs)) for g, s in zip(gens, scored)]))):.2e}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Greedy accuracy of a model on the task's held-out prompts."""
    import torch

    from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
    from trajflow.operators.evaluate import heldout_accuracy
    from trajflow.tasks import get_task

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = Path(args.model or WARM_START_DIR)
    accuracy = heldout_accuracy(load_model(model_dir), load_tokenizer(model_dir), get_task(args.task), args.n,
                                args.max_new_tokens)
    print(f"{args.task}: greedy accuracy {accuracy:.1%} on {args.n} held-out prompts ({model_dir})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate and score a batch with a model; print a table")
    gen.add_argument("--model", help="local model dir (default: the built-in warm start)")
    gen.add_argument("--task", default="addition")
    gen.add_argument("--prompts", type=int, default=4)
    gen.add_argument("--n", type=int, default=4, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--max-new-tokens", type=int, default=6)
    gen.add_argument("--inference-dtype", default="bfloat16", choices=["float32", "bfloat16", "fp8"])
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    ev = sub.add_parser("eval", help="greedy accuracy on held-out prompts")
    ev.add_argument("--model", help="local model dir (default: the built-in warm start)")
    ev.add_argument("--task", default="addition")
    ev.add_argument("--n", type=int, default=1000)
    ev.add_argument("--max-new-tokens", type=int, default=6)
    ev.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
