"""Recovery time per kind of fault: seconds from a SIGKILL to the next trained step (issue #24).

    python -m benchmarks.recovery [--kinds store scorer ...] [--step 3]

Each kind is one `scripts/chaos.py` run (a `trajflow run` in a subprocess, its own Ray): the
process is killed while step `--step` trains, and the seconds run from the kill to that step's
metrics file. Prints a markdown table with the load average before each run (the machine is
shared: read the seconds against it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every kind's run: 16 rows a step, max_staleness 2, every version kept (a rebuilt store needs them)
BASE = ["quickstart", "--set", "checkpoint_every=3", "--set", "save_all_versions=true", "--set", "report_to=[]",
        "--set", "prompts_per_step=4", "--set", "group_size=4", "--set", "eval_every=0",
        "--set", "max_staleness=2", "--set", "inference_dtype=float32", "--set", "seed=0", "--no-progress"]
KINDS = {  # kind -> what its run adds
    "trainer_worker": ["--set", "trainer.num_workers=2", "--set", "strategy=snapshot"],
    "train_step": ["--set", "strategy=snapshot"],
    "store": ["--set", "strategy=snapshot"],
    "scorer": ["--set", "strategy=dedicated"],
}


def measure(kind: str, step: int, steps: int, work: Path) -> dict:
    """One chaos run: its JSON line, the load before it and the recoveries' inner seconds."""
    load = os.getloadavg()
    args = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--kind", kind, "--step", str(step),
            "--steps", str(steps), "--run-dir", str(work / kind), "--", *BASE, *KINDS[kind]]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if not proc.stdout.strip():
        raise RuntimeError(f"{kind}: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    state = json.loads((work / kind / "run.json").read_text())
    out.update(load=load, inside=[r["seconds"] for r in state["sessions"][-1].get("recoveries", [])])
    return out


def table(results: list[dict], steps: int) -> str:
    lines = ["| kind killed | step | ends | seconds (kill to the step's metrics) | recovery/seconds | load 1/5/15 |",
             "|---|---|---|---|---|---|"]
    for r in results:
        ends = (f"{len(r['steps'])}/{steps} steps, {r['rows']} rows, {r['duplicate_ids']} duplicates"
                if r["status"] == 0 else f"exit {r['status']}: {r['last_line'][:60]}")
        seconds = f"{r['recovery_seconds']:.1f}" if r["recovery_seconds"] is not None else "-"
        inside = ", ".join(f"{s:.1f}" for s in r["inside"]) or "-"
        load = " / ".join(f"{x:.1f}" for x in r["load"])
        lines.append(f"| {r['kind']} | {r['step']} | {ends} | {seconds} | {inside} | {load} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trajflow_recovery_") as work:
        results = [measure(kind, a.step, a.steps, Path(work)) for kind in a.kinds]
    print(table(results, a.steps))


if __name__ == "__main__":
    main()
