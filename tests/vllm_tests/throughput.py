"""Generation throughput, torch engine vs vLLM engine, on this machine (not a test: prints only).

    .venv-vllm/bin/python tests/vllm_tests/throughput.py [--model warm|tiny] [--prompts 16] [--n 8] [--tokens 16]

Same model (the committed warm start, whose answers end after a few tokens, or the untrained tiny
model of the tests, which rarely emits eos and so runs the full length), float32, same prompts, same batch, same sampling
(temperature 1, no filters), one torch thread for both; a warm-up call each, then `reps` timed calls
alternating between the engines; the median tokens/s is reported. Timings are noisy on a shared
machine: compare the ratio, and never assert on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from trajflow.engines.factory import make_engine  # noqa: E402
from trajflow.engines.models import WARM_START_DIR, build_tiny_model, load_model, load_tokenizer, save_model  # noqa: E402
from trajflow.engines.sampling import SamplingConfig  # noqa: E402
from trajflow.engines.tokenizer import encode_prompt  # noqa: E402
from trajflow.tasks import get_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=["warm", "tiny"], default="warm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = WARM_START_DIR
    if args.model == "tiny":
        model_dir = Path(tempfile.mkdtemp(prefix="trajflow-tiny-"))
        save_model(*build_tiny_model(seed=0), model_dir)
    tok = load_tokenizer(model_dir)
    stream = get_task("addition").prompts("train", seed=0)
    prompts = [encode_prompt(tok, next(stream).text) for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.tokens)
    common = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, sampling=sampling, inference_dtype="float32", seed=0)
    t0 = time.perf_counter()
    engines = {
        "torch": make_engine("torch", load_model(model_dir), **common),
        "vllm": make_engine("vllm", model_dir, **common, kv_cache_memory_bytes=256 << 20),
    }
    print(f"engines built in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():  # warm-up
        engine.generate(prompts, n=args.n)
    for _ in range(args.reps):
        for name, engine in engines.items():
            start = time.perf_counter()
            gens = engine.generate(prompts, n=args.n)
            seconds = time.perf_counter() - start
            tokens = sum(len(g.response_tokens) for g in gens)
            rates[name].append(tokens / seconds)
    batch = (f"{args.model} model, {args.prompts} prompts x {args.n} samples, <= {args.tokens} new tokens, "
             f"{tokens / len(gens):.1f} per sequence")
    for name, r in rates.items():
        print(f"{name:5s}: median {statistics.median(r):8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in r)})  [{batch}]")
    print(f"vllm / torch = {statistics.median(rates['vllm']) / statistics.median(rates['torch']):.2f}")


if __name__ == "__main__":
    main()
