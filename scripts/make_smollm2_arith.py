"""Make the evidence study's slice of the real-model workload: one-digit sums and differences.

    python scripts/make_smollm2_arith.py       # writes artifacts/smollm2/arith_{train,test}.jsonl

SmolLM2-135M-Instruct samples the right answer to 3-7 % of the bundled word problems
(artifacts/smollm2/), so most groups of 4 samples have no reward variance and most rows are not
trained. Asked additions and subtractions of one-digit numbers after two worked examples (a
prior exchange in the chat), it samples the right answer about 40 % of the time under simulated
fp8 inference (measured before the study: benchmarks/results/evidence.md, "Deciding it on the
real model"), so most groups train, and it learns it within a dozen steps (with operands up to
20, `--largest 20`, it did not learn in 16 steps). Every problem is one of 155 operand pairs
(a + b, and a - b with a >= b, operands 0-9) in one of four phrasings, with the smollm2
workload's system prompt; the test file's pairs are never in the train file in any phrasing, nor
in the worked examples. Deterministic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from make_byo_example import write_jsonl  # noqa: E402 (the sibling script)
from make_smollm2_data import SYSTEM  # noqa: E402

OUT = REPO_ROOT / "artifacts" / "smollm2"
PHRASINGS = {
    "+": ("What is {a} + {b}?", "Compute {a} + {b}.", "What is the sum of {a} and {b}?", "Add {a} and {b}."),
    "-": ("What is {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?", "Subtract {b} from {a}."),
}


# the worked examples every prompt starts with (a prior exchange: user, assistant, user, assistant)
SHOTS = (("+", 6, 7), ("-", 9, 4))


def shots() -> list[dict]:
    messages = []
    for op, a, b in SHOTS:
        answer = a + b if op == "+" else a - b
        messages += [{"role": "user", "content": f"What is {a} {op} {b}?"},
                     {"role": "assistant", "content": f"{a} {op} {b} = {answer}. The answer is {answer}."}]
    return messages


def pairs(largest: int) -> list[tuple[str, int, int]]:
    """Every (operator, a, b) with operands 0..largest: a + b, and a - b for a >= b."""
    return ([("+", a, b) for a in range(largest + 1) for b in range(largest + 1)]
            + [("-", a, b) for a in range(largest + 1) for b in range(a + 1)])


def rows_of(chosen: list[tuple[str, int, int]]) -> list[dict]:
    rows = []
    for op, a, b in chosen:
        for text in PHRASINGS[op]:
            rows.append({"prompt": [{"role": "system", "content": SYSTEM}, *shots(),
                                    {"role": "user", "content": text.format(a=a, b=b)}],
                         "answer": str(a + b if op == "+" else a - b)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-pairs", type=int, default=50, help="operand pairs held out (x4 phrasings)")
    parser.add_argument("--largest", type=int, default=9, help="the largest operand")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    everything = pairs(args.largest)
    order = np.random.default_rng(args.seed).permutation(len(everything))
    test = [p for p in (everything[i] for i in order) if p not in SHOTS][: args.test_pairs]
    train = [p for p in everything if p not in test]
    rng = np.random.default_rng(args.seed + 1)
    train_rows, test_rows = rows_of(train), rows_of(test)
    train_rows = [train_rows[i] for i in rng.permutation(len(train_rows))]
    test_rows = [test_rows[i] for i in rng.permutation(len(test_rows))]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "arith_train.jsonl", train_rows)
    write_jsonl(args.out / "arith_test.jsonl", test_rows)
    print(f"wrote {args.out}: {len(train_rows)} train / {len(test_rows)} test problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
