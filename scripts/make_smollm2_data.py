"""Make the real-model workload's data: GSM8K-shaped word problems for SmolLM2-135M-Instruct.

    python scripts/make_smollm2_data.py        # writes artifacts/smollm2/{train,test}.jsonl
    trajflow run smollm2                       # RL on them (jobs/configs/smollm2.yaml)

One- and two-step arithmetic stories (half each; the generators of scripts/make_byo_example.py),
as chat messages with a system prompt that asks for the answer in a form `reward: math` reads
(math-verify takes a completion's \\boxed{} first, else its last number); no problem text is in
both files. Deterministic: the script regenerates the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from make_byo_example import make_word_problems, write_jsonl  # noqa: E402 (the sibling script: the generators)

OUT = REPO_ROOT / "artifacts" / "smollm2"
SYSTEM = "Solve the problem. Think step by step in short sentences, then end with: The answer is N."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    train, test = make_word_problems(args.seed, args.train, args.test, SYSTEM)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)
    print(f"wrote {args.out}: {len(train)} train / {len(test)} test problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
