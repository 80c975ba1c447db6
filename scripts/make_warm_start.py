"""Make the warm-start checkpoint: supervised fine-tuning of the tiny model on a built-in task.

Trains ``build_tiny_model(seed)`` with teacher forcing on prompt -> answer + eos (loss on the
response tokens only), evaluates greedy accuracy on the task's held-out prompts every
``--eval-every`` steps, and stops as soon as that accuracy first falls inside the target band
(default 25-40%), so RL starts from a model that solves a fair share but far from all. If one
interval jumps over the band, training rolls back to the last evaluated state and redoes that
stretch with evaluations twice as frequent (deterministic: the data stream just moves on).

Writes ``save_model`` output (safetensors + config + tokenizer) and ``warm_start.json`` to
``artifacts/warm_start/<task>/``. CPU, 2 threads, deterministic given ``--seed``.

    python scripts/make_warm_start.py                  # addition (the default warm start)
    python scripts/make_warm_start.py --task reverse   # the variable-length task
    python scripts/make_warm_start.py --eval-only      # print the saved checkpoint's accuracy
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from trajflow.engines.models import REPO_ROOT, build_tiny_model, load_model, save_model
from trajflow.engines.tokenizer import decode_response, encode_prompt, encode_response
from trajflow.tasks import Prompt, Task, exact_match_reward, get_task

Reward = Callable[[str, str, str], float]


@torch.no_grad()
def _decode(model, tokenizer, prompts: Sequence[Prompt], max_new_tokens: int, *,
            temperature: float = 0.0, generator: torch.Generator | None = None,
            batch_size: int = 512) -> list[str]:
    """Decode responses with a KV cache: greedy if temperature == 0, else plain sampling.

    Prompts are batched by token length so no padding (and no position-id bookkeeping) is needed.
    Returns response texts in the order of ``prompts``.
    """
    model.eval()
    eos = tokenizer.eos_token_id
    encoded = [encode_prompt(tokenizer, p.text) for p in prompts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    for length in sorted(by_len):
        indices = by_len[length]
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
            result = model(input_ids=input_ids, use_cache=True)
            past, logits = result.past_key_values, result.logits[:, -1, :]
            generated = torch.empty(len(chunk), 0, dtype=torch.long)
            done = torch.zeros(len(chunk), dtype=torch.bool)
            for _ in range(max_new_tokens):
                if temperature > 0:
                    probs = torch.softmax(logits.float() / temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                else:
                    token = logits.argmax(dim=-1)
                token = torch.where(done, torch.full_like(token, eos), token)
                generated = torch.cat([generated, token[:, None]], dim=1)
                done |= token == eos
                if bool(done.all()):
                    break
                result = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
                past, logits = result.past_key_values, result.logits[:, -1, :]
            for row, i in enumerate(chunk):
                ids = generated[row].tolist()
                out[i] = decode_response(tokenizer, ids) if eos in ids else _no_eos(tokenizer, ids)
    return out


def _no_eos(tokenizer, ids: list[int]) -> str:
    """A response cut at max_new_tokens (finish "length"): its text plus a marker so it never matches."""
    return decode_response(tokenizer, ids) + "<length>"


def _max_new_tokens(prompts: Sequence[Prompt]) -> int:
    return max(len(p.answer) for p in prompts) + 2  # the answer, eos, and one token of slack


def greedy_accuracy(model, tokenizer, prompts: Sequence[Prompt], reward: Reward | None = None,
                    max_new_tokens: int | None = None) -> float:
    """Fraction of prompts whose greedy response (ended by eos) earns reward 1 (default: exact match)."""
    if not prompts:
        return 0.0
    reward = reward or (lambda text, answer, response: exact_match_reward(answer, response))
    responses = _decode(model, tokenizer, prompts, max_new_tokens or _max_new_tokens(prompts))
    return sum(reward(p.text, p.answer, r) == 1.0 for p, r in zip(prompts, responses)) / len(prompts)


def greedy_correct(model, tokenizer, prompts: Sequence[Prompt], reward: Reward) -> list[bool]:
    """Per-prompt greedy correctness."""
    responses = _decode(model, tokenizer, prompts, _max_new_tokens(prompts))
    return [reward(p.text, p.answer, r) == 1.0 for p, r in zip(prompts, responses)]


def sampled_stats(model, tokenizer, prompts: Sequence[Prompt], reward: Reward, k: int,
                  seed: int) -> dict[str, float]:
    """Temperature-1 sampling: mean reward of single samples and pass@k (a headroom signal for RL)."""
    generator = torch.Generator().manual_seed(seed)
    repeated = [p for p in prompts for _ in range(k)]
    responses = _decode(model, tokenizer, repeated, _max_new_tokens(prompts),
                        temperature=1.0, generator=generator)
    hits = [reward(p.text, p.answer, r) == 1.0 for p, r in zip(repeated, responses)]
    per_prompt = [any(hits[i * k:(i + 1) * k]) for i in range(len(prompts))]
    return {"sample_accuracy_t1": sum(hits) / len(hits), f"pass_at_{k}_t1": sum(per_prompt) / len(prompts)}


def make_batch(tokenizer, prompts: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    """Right-padded teacher-forcing batch; labels are -100 except on the answer tokens and eos."""
    rows, labels = [], []
    for p in prompts:
        prompt_ids = encode_prompt(tokenizer, p.text)
        response_ids = encode_response(tokenizer, p.answer)
        rows.append(prompt_ids + response_ids)
        labels.append([-100] * len(prompt_ids) + response_ids)
    return sft_tensors(rows, labels, tokenizer.pad_token_id)


def sft_tensors(rows: Sequence[list[int]], labels: Sequence[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """Right-pad token rows (with `pad`) and their labels (with -100) into a teacher-forcing batch."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
    label_t = torch.tensor([l + [-100] * (width - len(l)) for l in labels], dtype=torch.long)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_t}


def _take(stream: Iterator[Prompt], n: int) -> list[Prompt]:
    return [next(stream) for _ in range(n)]


def sft_until_band(next_batch: Callable[[object], dict[str, torch.Tensor]],
                   score: Callable[[torch.nn.Module, object], float], *, metric: str, seed: int,
                   band: tuple[float, float], lr: float, warmup: int, eval_every: int, max_steps: int,
                   log: Callable[[str], None] = print,
                   build: Callable[[int], tuple[torch.nn.Module, object]] = build_tiny_model,
                   threads: int = 2) -> tuple[torch.nn.Module, object, dict]:
    """SFT ``build(seed)`` (default: the built-in tiny model) on ``next_batch(tokenizer)`` until ``score(model, tokenizer)``
    (named ``metric``) first enters ``band``; on overshooting, roll back to the last evaluated state
    and evaluate twice as often. Shared by every warm-start script.

    Returns (model, tokenizer, info) where info has steps, examples, the metric and the history.
    Raises RuntimeError if the band is not reached within ``max_steps``.
    """
    torch.set_num_threads(threads)  # 1 on a loaded machine: 2 threads' barriers stall on oversubscribed cores
    torch.use_deterministic_algorithms(True)
    low, high = band
    model, tokenizer = build(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    history: list[dict] = []
    step, interval, examples = 0, eval_every, 0
    saved = None  # (step, model state, optimizer state, scheduler state) at the last eval below the band
    start = time.perf_counter()
    while step < max_steps:
        model.train()
        target = step + interval
        while step < target:
            batch = next_batch(tokenizer)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            examples += len(batch["input_ids"])
        model.eval()
        value = score(model, tokenizer)
        history.append({"step": step, "loss": round(loss.item(), 4), metric: value})
        log(f"step {step:5d}  loss {loss.item():.4f}  {metric} {value:.3f}  {time.perf_counter() - start:6.1f}s")
        if low <= value <= high:
            return model, tokenizer, {"steps": step, "examples": examples, metric: value, "history": history}
        if value > high:
            if saved is None or interval == 1:
                raise RuntimeError(f"overshot the band {band} at step {step} ({metric} {value:.3f}); "
                                   "lower --lr or --eval-every")
            step, model_state, opt_state, sched_state = saved
            model.load_state_dict(model_state)
            optimizer.load_state_dict(opt_state)
            schedule.load_state_dict(sched_state)
            interval = max(1, interval // 2)
            log(f"  above the band: back to step {step}, evaluating every {interval} steps")
            continue
        saved = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                 copy.deepcopy(schedule.state_dict()))
    raise RuntimeError(f"band {band} not reached in {max_steps} steps")


def train_until_band(task: Task, *, seed: int = 0, band: tuple[float, float] = (0.25, 0.40),
                     batch_size: int = 64, lr: float = 1e-3, warmup: int = 50,
                     eval_every: int = 50, eval_n: int = 1000, max_steps: int = 20000,
                     log: Callable[[str], None] = print) -> tuple[torch.nn.Module, object, dict]:
    """SFT the tiny model on ``task`` until held-out greedy accuracy first enters ``band``."""
    heldout = task.heldout(eval_n)
    stream = task.prompts("train", seed)
    return sft_until_band(
        lambda tokenizer: make_batch(tokenizer, _take(stream, batch_size)),
        lambda model, tokenizer: greedy_accuracy(model, tokenizer, heldout, task.reward),
        metric="heldout_accuracy", seed=seed, band=band, lr=lr, warmup=warmup, eval_every=eval_every,
        max_steps=max_steps, log=log)


def _accuracy_by_answer_len(prompts: Sequence[Prompt], correct: Sequence[bool]) -> dict[str, float]:
    groups: dict[int, list[bool]] = defaultdict(list)
    for p, c in zip(prompts, correct):
        groups[len(p.answer)].append(c)
    return {str(k): round(sum(v) / len(v), 4) for k, v in sorted(groups.items())}


def evaluate(model, tokenizer, task: Task, n: int, seed: int) -> dict:
    """Held-out report: greedy accuracy on the first n held-out prompts, by answer length, sampling."""
    prompts = task.heldout(n)
    correct = greedy_correct(model, tokenizer, prompts, task.reward)
    report = {"heldout_n": n, "heldout_accuracy": sum(correct) / n,
              "heldout_accuracy_by_answer_len": _accuracy_by_answer_len(prompts, correct)}
    report.update(sampled_stats(model, tokenizer, prompts[:200], task.reward, k=8, seed=seed))
    return report


def write_record(out: Path, script: str, argv: list[str], args: argparse.Namespace, info: dict, report: dict,
                 train_seconds: float, *, task: str, task_repr: str, **settings) -> None:
    """`out/warm_start.json`: how the checkpoint was made (command, settings, history) and its report."""
    record = {
        "task": task,
        "task_repr": task_repr,
        "seed": args.seed,
        "steps": info["steps"],
        "train_examples": info["examples"],
        "band": list(args.band),
        "batch_size": args.batch_size,
        "lr": args.lr,
        **settings,
        **report,
        "train_seconds": round(train_seconds, 1),
        "torch_version": torch.__version__,
        "command": " ".join(["python", f"scripts/{script}", *map(shlex.quote, argv)]),
        "history": info["history"],
    }
    (out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="addition", choices=["addition", "reverse"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--band", type=float, nargs=2, default=(0.25, 0.40), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-n", type=int, default=1000)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None, help="default: artifacts/warm_start/<task>")
    parser.add_argument("--eval-only", action="store_true", help="evaluate the saved checkpoint and exit")
    args = parser.parse_args(argv)
    out = args.out or REPO_ROOT / "artifacts" / "warm_start" / args.task
    task = get_task(args.task)
    torch.set_num_threads(2)

    if args.eval_only:
        model = load_model(out)
        from trajflow.engines.models import load_tokenizer
        report = evaluate(model, load_tokenizer(out), task, args.eval_n, args.seed)
        print(json.dumps(report, indent=2))
        return 0

    start = time.perf_counter()
    model, tokenizer, info = train_until_band(
        task, seed=args.seed, band=tuple(args.band), batch_size=args.batch_size, lr=args.lr,
        eval_every=args.eval_every, eval_n=args.eval_n, max_steps=args.max_steps)
    train_seconds = time.perf_counter() - start
    report = evaluate(model, tokenizer, task, args.eval_n, args.seed)
    save_model(model, tokenizer, out)
    write_record(out, "make_warm_start.py", argv, args, info, report, train_seconds, task=args.task,
                 task_repr=repr(task))
    print(f"saved {out}: heldout greedy accuracy {report['heldout_accuracy']:.3f} on {args.eval_n} prompts "
          f"after {info['steps']} steps ({train_seconds:.0f}s); "
          f"pass@8 (T=1) {report['pass_at_8_t1']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
