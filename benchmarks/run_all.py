"""Run the four benchmarks side by side and write benchmarks/RESULTS.md.

    python -m benchmarks.run_all            # full settings (about an hour on 2 cores)
    python -m benchmarks.run_all --quick    # a smoke pass with tiny settings
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import async_vs_sync, data_plane, strategy_overhead, strategy_quality  # noqa: E402
from benchmarks.common import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[k]) for k in keys) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:,.3f}" if isinstance(v, float) else str(v)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", default=["data_plane", "async_vs_sync", "overhead", "quality"])
    a = p.parse_args()
    q = a.quick
    started = time.time()
    sections = [f"# Benchmarks\n\nCommand: `python -m benchmarks.run_all{' --quick' if q else ''}`  \n"
                f"Machine: {machine()}  \nDate: {datetime.date.today()}\n"]
    if "data_plane" in a.only:
        r = data_plane.run(rows=512 if q else 4096)
        sections.append("## 4. Data plane: reward + advantage + filter on one core\n\n"
                        + table([{k: v for k, v in r.items()}]))
        print(sections[-1], flush=True)
    if "async_vs_sync" in a.only:
        r = async_vs_sync.run(steps=12 if q else 40)
        sections.append("## 2. Async vs sync (snapshot, same steps and samples)\n\n" + table([r]))
        print(sections[-1], flush=True)
    if "overhead" in a.only:
        rows = strategy_overhead.run(steps=12 if q else 30)
        sections.append("## 3. Strategy overhead relative to `behavior` (max_staleness 2, bf16)\n\n" + table(rows))
        print(sections[-1], flush=True)
    if "quality" in a.only:
        steps, seeds = (6, 1) if q else (60, 3)
        rows = strategy_quality.run(steps=steps, seeds=seeds, staleness=[0, 2, 4], eval_every=20 if not q else 3,
                                    eval_prompts=200 if not q else 50, target=0.32)
        sections.append(f"## 1. Strategy quality (bf16 inference, {steps} steps x 128 samples, {seeds} seeds; "
                        "held-out greedy accuracy on 200 prompts; warm start 0.263 on 1000)\n\n" + table(rows))
        print(sections[-1], flush=True)
    sections.append(f"Total benchmark wall time: {time.time() - started:.0f} s")
    RESULTS.write_text("\n\n".join(sections) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
