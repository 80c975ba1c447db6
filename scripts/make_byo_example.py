"""Make the bring-your-own-workload example: word problems, a BPE tokenizer with a chat template,
and a tiny Qwen2 warm-started on them (no download; CPU, a few minutes; deterministic).

    python scripts/make_byo_example.py            # writes artifacts/byo/
    trajflow run byo                              # RL on it with reward: math (jobs/configs/byo.yaml)

What it writes (committed; the script regenerates the same bytes):

    artifacts/byo/train.jsonl     3,000 word problems: {"prompt": [chat messages], "answer": "19"}
    artifacts/byo/test.jsonl      300 held-out problems (no problem text in common with train)
    artifacts/byo/model/          a Qwen2 causal LM (0.6 M parameters) in Hugging Face format, with
                                  a byte-level BPE tokenizer trained here (`tokenizers`, 384 tokens,
                                  digits split one per token) and a ChatML-style chat template;
                                  eos is <|im_end|>, and the generation config also stops on
                                  <|endoftext|>; warm_start.json records how it was trained

The model is fine-tuned on train.jsonl (the chat-templated prompt, then the answer and
<|im_end|>) until its greedy accuracy on test.jsonl (math-verify equivalence, as `reward: math`)
first enters a band (default 15-40%), so RL has something to improve.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from make_warm_start import sft_tensors, sft_until_band  # noqa: E402 (the sibling script: the shared SFT loop)

OUT = REPO_ROOT / "artifacts" / "byo"
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "Answer with a number."
NAMES = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jill", "Kai", "Lena", "Max", "Nora"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]


def _cast(rng: np.random.Generator) -> tuple[str, str, str, int]:
    """A story's two people, its item and which of four stories it is."""
    name, other = rng.choice(NAMES, 2, replace=False)
    return str(name), str(other), str(rng.choice(ITEMS)), int(rng.integers(4))


def word_problem(rng: np.random.Generator) -> tuple[str, str]:
    """One problem and its integer answer: addition, subtraction, multiplication or division."""
    name, other, item, kind = _cast(rng)
    if kind == 0:
        a, b = (int(x) for x in rng.integers(1, 21, 2))
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", str(a + b)
    if kind == 1:
        a = int(rng.integers(2, 21))
        b = int(rng.integers(1, a))
        return f"{name} has {a} {item} and gives {b} to {other}. How many {item} are left?", str(a - b)
    if kind == 2:
        a, b = (int(x) for x in rng.integers(2, 10, 2))
        return f"Each box holds {a} {item}. How many {item} are in {b} boxes?", str(a * b)
    a, b = (int(x) for x in rng.integers(2, 10, 2))
    return f"{name} shares {a * b} {item} equally among {b} friends. How many does each friend get?", str(a)


def two_step_problem(rng: np.random.Generator) -> tuple[str, str]:
    """One GSM8K-shaped problem of two operations in one story, and its integer answer."""
    name, other, item, kind = _cast(rng)
    if kind == 0:
        a, b = (int(x) for x in rng.integers(2, 21, 2))
        c = int(rng.integers(1, a + b))
        return (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {other}. "
                f"How many {item} does {name} have now?", str(a + b - c))
    if kind == 1:
        a, b = (int(x) for x in rng.integers(2, 10, 2))
        c = int(rng.integers(1, 21))
        return (f"{name} already has {c} {item} and buys {b} boxes with {a} {item} in each box. "
                f"How many {item} does {name} have in all?", str(a * b + c))
    if kind == 2:
        each, friends = (int(x) for x in rng.integers(2, 10, 2))
        c = int(rng.integers(1, 11))
        return (f"{name} has {each * friends + c} {item}, keeps {c} and shares the rest equally among "
                f"{friends} friends. How many {item} does each friend get?", str(each))
    a, b, c = (int(x) for x in rng.integers(2, 10, 3))
    return (f"A bag holds {a} {item}. {name} fills {b} bags and {other} fills {c} bags. "
            f"How many {item} do they have together?", str(a * (b + c)))


def make_word_problems(seed: int, n_train: int, n_test: int, system: str) -> tuple[list[dict], list[dict]]:
    """GSM8K-shaped rows for a chat model: one- and two-step problems (half each), every prompt
    with `system` as its system message; train and test texts disjoint."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_test:
        text, answer = (two_step_problem if rng.random() < 0.5 else word_problem)(rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"prompt": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                     "answer": answer})
    return rows[:n_train], rows[n_train:]


def make_problems(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Train and test rows with disjoint problem texts; about half carry a system message."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_test:
        text, answer = word_problem(rng)
        if text in seen:
            continue
        seen.add(text)
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        rows.append({"prompt": messages, "answer": answer})
    return rows[:n_train], rows[n_train:]


def train_tokenizer(rows: list[dict], vocab_size: int):
    """A byte-level BPE (digits one per token) trained on the problems, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    roles = [m["role"] + "\n" for r in rows for m in r["prompt"]] + ["assistant\n"] * len(rows)
    corpus = [m["content"] for r in rows for m in r["prompt"]] + [r["answer"] for r in rows] + roles
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int):
    """A freshly initialised tiny Qwen2 for `tokenizer` (eos <|im_end|>, also <|endoftext|>)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=eos[0], pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def sft_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Teacher forcing on the chat-templated prompt -> answer + eos (loss on the answer tokens)."""
    from trajflow.engines.tokenizer import encode_prompts, encode_response

    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows])
    ids, labels = [], []
    for p, r in zip(prompts, rows):
        response = encode_response(tokenizer, r["answer"])
        ids.append(p + response)
        labels.append([-100] * len(p) + response)
    return sft_tensors(ids, labels, tokenizer.pad_token_id)


def greedy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Held-out greedy accuracy under `reward: math` (the same verifier RL uses)."""
    from trajflow.engines.tokenizer import decode_responses, encode_prompts
    from trajflow.engines.torch_engine import greedy_engine
    from trajflow.tasks.rewards import MathVerify

    engine = greedy_engine(model, tokenizer, max_new_tokens=6,
                           stop_token_ids=model.generation_config.eos_token_id)
    with torch.no_grad():
        gens = engine.generate(encode_prompts(tokenizer, [r["prompt"] for r in rows]))
    completions = decode_responses(tokenizer, [g.response_tokens for g in gens],
                                   model.generation_config.eos_token_id)
    scores = MathVerify()(None, completions, [r["answer"] for r in rows])
    return float(np.mean(scores))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--band", type=float, nargs=2, default=(0.15, 0.40), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=6000)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    from trajflow.engines.models import save_model

    train, test = make_problems(args.seed, args.train, args.test)
    tokenizer = train_tokenizer(train, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)

    order = np.random.default_rng(args.seed).permutation(len(train))
    cursor = [0]

    def next_batch(tok) -> dict[str, torch.Tensor]:
        start = cursor[0] % len(train)
        cursor[0] += args.batch_size
        return sft_batch(tok, [train[i] for i in order[np.arange(start, start + args.batch_size) % len(train)]])

    started = time.perf_counter()
    model, tokenizer, info = sft_until_band(
        next_batch, lambda m, tok: greedy_accuracy(m, tok, test), metric="heldout_accuracy", seed=args.seed,
        band=tuple(args.band), lr=args.lr, warmup=50, eval_every=args.eval_every, max_steps=args.max_steps,
        build=lambda seed: (build_model(tokenizer, seed), tokenizer))
    seconds = time.perf_counter() - started
    model_dir = args.out / "model"
    save_model(model, tokenizer, model_dir)
    record = {
        "seed": args.seed, "train_rows": len(train), "test_rows": len(test), "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()), "band": list(args.band),
        "batch_size": args.batch_size, "lr": args.lr, "steps": info["steps"],
        "heldout_accuracy": info["heldout_accuracy"], "train_seconds": round(seconds, 1),
        "torch_version": torch.__version__,
        "command": " ".join(["python", "scripts/make_byo_example.py", *map(shlex.quote, argv)]),
        "history": info["history"],
    }
    (model_dir / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}: {len(train)} train / {len(test)} test problems, vocab {len(tokenizer)}, "
          f"held-out greedy accuracy {info['heldout_accuracy']:.3f} after {info['steps']} steps ({seconds:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
