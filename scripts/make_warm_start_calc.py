"""Make the warm start of the calculator environment ("calc"): supervised on expert episodes.

Trains ``build_tiny_model(seed)`` teacher-forced on expert episodes (prompt, then policy turns and
the calculator's observations; loss on the policy tokens only, as in RL), evaluates the greedy
multi-turn success rate on held-out prompts every ``--eval-every`` steps, and stops as soon as it
first falls inside the target band (default 45-55%): RL then starts from a policy that solves a
fair share of the problems but far from all. If one interval jumps over the band, training rolls
back to the last evaluated state and redoes that stretch with evaluations twice as frequent.

Why 45-55% (the single-turn tasks use 25-40%): supervised learning first masters problems with a
one-digit addend c (about half of them) and only later copies a two-digit c into the second tool
call. Checkpoints at 30-43% solve no two-digit-c problem at all, not even when sampling, so RL has
nothing to reinforce there; the committed one solves ~99% of one-digit-c and ~6% (greedy) / ~8%
(sampled) of two-digit-c problems, which RL can then improve.

Writes safetensors + config + tokenizer and ``warm_start.json`` to ``artifacts/warm_start/calc/``.
CPU, 2 threads, deterministic given ``--seed``.

    python scripts/make_warm_start_calc.py
    python scripts/make_warm_start_calc.py --eval-only    # the saved checkpoint's success rate
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from make_warm_start import sft_tensors, sft_until_band, write_record  # noqa: E402 (the sibling script, on sys.path when run)

from trajflow.engines.models import REPO_ROOT, load_model, load_tokenizer, save_model
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.tokenizer import encode_prompt, encode_response
from trajflow.engines.torch_engine import TorchEngine
from trajflow.tasks import Prompt, get_task
from trajflow.tasks.environments import CalculatorEnv
from trajflow.tasks.rollout import heldout_success_rate, run_episodes

TURN_TOKENS = 8  # per-turn limit (sampling.max_new_tokens) used in evaluation and in jobs/configs/calc.yaml


def expert_episode(env: CalculatorEnv, tokenizer, prompt: Prompt) -> tuple[list[int], list[bool]]:
    """(response tokens, loss mask) of the expert episode: policy turns + eos, observations."""
    episode = env.reset(prompt)
    tokens: list[int] = []
    mask: list[bool] = []
    for turn in env.expert_turns(prompt):
        policy = encode_response(tokenizer, turn)
        tokens += policy
        mask += [True] * len(policy)
        step = episode.step(turn)
        obs = tokenizer.encode(step.observation, add_special_tokens=False) if step.observation else []
        tokens += obs
        mask += [False] * len(obs)
    assert step.done and step.reward == 1.0, "the expert must solve its episode"
    return tokens, mask


def make_batch(env, tokenizer, prompts: list[Prompt]) -> dict[str, torch.Tensor]:
    rows, labels = [], []
    for p in prompts:
        prompt_ids = encode_prompt(tokenizer, p.text)
        response, mask = expert_episode(env, tokenizer, p)
        rows.append(prompt_ids + response)
        labels.append([-100] * len(prompt_ids) + [t if m else -100 for t, m in zip(response, mask)])
    return sft_tensors(rows, labels, tokenizer.pad_token_id)


def sampled_report(model, tokenizer, env, prompts: list[Prompt], k: int, seed: int) -> dict:
    """Temperature-1 episodes: mean success of single samples, pass@k, finish reasons, turns."""
    engine = TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                         sampling=SamplingConfig(temperature=1.0, max_new_tokens=TURN_TOKENS), seed=seed)
    with torch.no_grad():
        episodes = run_episodes(engine, env, tokenizer, prompts, n=k)
    hits = [e.reward == 1.0 for e in episodes]
    per_prompt = [any(hits[i * k:(i + 1) * k]) for i in range(len(prompts))]
    return {
        "sample_success_t1": sum(hits) / len(hits),
        f"pass_at_{k}_t1": sum(per_prompt) / len(prompts),
        "finish_reasons_t1": dict(Counter(e.finish_reason for e in episodes)),
        "mean_turns_t1": sum(e.turns for e in episodes) / len(episodes),
        "mean_response_tokens_t1": sum(len(e.response_tokens) for e in episodes) / len(episodes),
    }


def evaluate(model, tokenizer, env, n: int, seed: int) -> dict:
    report = {"heldout_n": n,
              "heldout_success_rate": heldout_success_rate(model, tokenizer, env, n, TURN_TOKENS)}
    report.update(sampled_report(model, tokenizer, env, env.heldout(200), k=8, seed=seed))
    return report


def train_until_band(env, *, seed: int, band: tuple[float, float], batch_size: int, lr: float,
                     warmup: int, eval_every: int, eval_n: int, max_steps: int, log=print):
    stream = env.prompts("train", seed)
    return sft_until_band(
        lambda tokenizer: make_batch(env, tokenizer, [next(stream) for _ in range(batch_size)]),
        lambda model, tokenizer: heldout_success_rate(model, tokenizer, env, eval_n, TURN_TOKENS),
        metric="heldout_success_rate", seed=seed, band=band, lr=lr, warmup=warmup, eval_every=eval_every,
        max_steps=max_steps, log=log)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--band", type=float, nargs=2, default=(0.45, 0.55), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-n", type=int, default=300)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "artifacts" / "warm_start" / "calc")
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args(argv)
    env = get_task("calc")
    torch.set_num_threads(2)
    if args.eval_only:
        model = load_model(args.out)
        print(json.dumps(evaluate(model, load_tokenizer(args.out), env, args.eval_n, args.seed), indent=2))
        return 0
    start = time.perf_counter()
    model, tokenizer, info = train_until_band(
        env, seed=args.seed, band=tuple(args.band), batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
        eval_every=args.eval_every, eval_n=args.eval_n, max_steps=args.max_steps)
    train_seconds = time.perf_counter() - start
    model.eval()
    report = evaluate(model, tokenizer, env, args.eval_n, args.seed)
    save_model(model, tokenizer, args.out)
    write_record(args.out, "make_warm_start_calc.py", argv, args, info, report, train_seconds, task="calc",
                 task_repr=repr(env), turn_tokens=TURN_TOKENS)
    print(f"saved {args.out}: heldout greedy success {report['heldout_success_rate']:.3f} on {args.eval_n} "
          f"prompts after {info['steps']} steps ({train_seconds:.0f}s); sampled (T=1) "
          f"{report['sample_success_t1']:.3f}, pass@8 {report['pass_at_8_t1']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
