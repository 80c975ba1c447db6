"""Make the distillation teacher of the addition task: the warm start, trained longer.

Continues supervised fine-tuning of ``artifacts/warm_start/addition`` (the student every RL run
starts from) with the warm start's own recipe (make_warm_start.py: teacher-forced prompt -> answer
+ eos, AdamW, the same batch size and learning rate, a fresh 50-step warm-up), evaluating greedy
accuracy on held-out prompts every ``--eval-every`` steps, until it first reaches ``--band``
(default 60-100%): a teacher well above the student (26.3%), with the same tokenizer and
architecture, so it scores the student's token ids on the same vocabulary.

Writes safetensors + config + tokenizer and ``warm_start.json`` (how it was made, its held-out
report) to ``artifacts/teacher/addition/``. CPU, deterministic given ``--seed``.

    python scripts/make_teacher.py
    python scripts/make_teacher.py --eval-only    # the saved teacher's held-out report
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trajflow.engines.models import REPO_ROOT, WARM_START_DIR, load_model, load_tokenizer, save_model
from trajflow.tasks import get_task

from make_warm_start import evaluate, greedy_accuracy, make_batch, sft_until_band, write_record  # noqa: E402 (sibling script)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1, help="the data stream's seed (the warm start used 0)")
    parser.add_argument("--band", type=float, nargs=2, default=(0.60, 1.0), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-n", type=int, default=500, help="held-out prompts per evaluation while training")
    parser.add_argument("--report-n", type=int, default=1000, help="held-out prompts of the final report")
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 when other work shares the cores)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "artifacts" / "teacher" / "addition")
    parser.add_argument("--eval-only", action="store_true", help="report on the saved teacher and exit")
    args = parser.parse_args(argv)
    task = get_task("addition")

    if args.eval_only:
        report = evaluate(load_model(args.out), load_tokenizer(args.out), task, args.report_n, args.seed)
        print(json.dumps(report, indent=2))
        return 0

    heldout = task.heldout(args.eval_n)
    stream = task.prompts("train", args.seed)
    start = time.perf_counter()
    model, tokenizer, info = sft_until_band(
        lambda tok: make_batch(tok, [next(stream) for _ in range(args.batch_size)]),
        lambda model, tok: greedy_accuracy(model, tok, heldout, task.reward),
        metric="heldout_accuracy", seed=args.seed, band=tuple(args.band), lr=args.lr, warmup=50,
        eval_every=args.eval_every, max_steps=args.max_steps, threads=args.threads,
        build=lambda seed: (load_model(WARM_START_DIR), load_tokenizer(WARM_START_DIR)))
    train_seconds = time.perf_counter() - start
    report = evaluate(model, tokenizer, task, args.report_n, args.seed)
    save_model(model, tokenizer, args.out)
    write_record(args.out, "make_teacher.py", argv, args, info, report, train_seconds, task="addition",
                 task_repr=repr(task), initialised_from=str(Path(WARM_START_DIR).relative_to(REPO_ROOT)),
                 torch_threads=torch.get_num_threads())
    print(f"saved {args.out}: held-out greedy accuracy {report['heldout_accuracy']:.3f} on {args.report_n} prompts "
          f"after {info['steps']} more steps ({train_seconds:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
