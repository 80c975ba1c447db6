"""Benchmark: `trajflow run quickstart` from enter to exit, its parts, and beside it what the run
cannot go below: its start-up plus its steps' compute (issue 20's target: within 5 s of that).

The run is the real command line (`trajflow.jobs.cli.main(["run", "quickstart", ...])`, what the
installed `trajflow` calls) in a fresh Python process, the quickstart as shipped. Enter is when this
process starts it, exit when it has ended. Inside, a wrapper (DRIVER) only timestamps: Ray's start
(the driver's `start_ray`), each status line (the driver's `status_line`, called as each metrics
row arrives; the row is kept for its `seconds/stage/*`), the summary, and the end of Python's
exit handlers (Ray's own shutdown among them). The parts:

    interpreter + imports + validation   enter -> Ray starts (the config and run dir are checked)
    Ray start                            the embedded Ray (torch and transformers import alongside)
    to the end of the first step         actors start and load their models; step 0
    the other steps                      step 0's status line -> the last step's
    pipeline shut down, metrics gathered Ray Data ends its actors; metrics.parquet is written
    summary table; printed, recorded     the summary; run.json's session ends
    atexit: Ray shut down                Ray's processes are ended (Ray's own exit handler)
    interpreter exit                     the rest of the way out

Start-up is enter -> step 0's line. The steps' compute is, per step from 1 on, its critical path
(benchmarks/common.py, RunResult.critical_path: the busiest process, or all compute over the
cores), summed. Enter-to-exit minus start-up minus that is the run's own cost: hand-offs between
stages, the driver, and the way out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 5.0

DRIVER = r'''
import atexit, json, os, sys, time

EVENTS = open(os.environ["TRAJFLOW_BENCH_EVENTS"], "a", buffering=1)


def mark(event, **extra):
    EVENTS.write(json.dumps({"event": event, "t": time.time(), **extra}, default=str) + "\n")


atexit.register(mark, "atexit done")  # registered first, so it runs last: after Ray's own shutdown
from trajflow.jobs import cli, run

start_ray, status_line, summary_table = run.start_ray, run.status_line, run.summary_table
started = []


def timed_start_ray(*args, **kwargs):
    if started:  # _execute's call: Ray is up already
        return start_ray(*args, **kwargs)
    started.append(True)
    mark("ray start")
    start_ray(*args, **kwargs)
    mark("ray ready")


def timed_status_line(row, *args, **kwargs):
    mark("row", row=row)
    return status_line(row, *args, **kwargs)


def timed_summary_table(*args, **kwargs):
    mark("summary")
    out = summary_table(*args, **kwargs)
    mark("summary made")
    return out


run.start_ray, run.status_line, run.summary_table = timed_start_ray, timed_status_line, timed_summary_table
code = cli.main(sys.argv[1:])
mark("main returned")
sys.exit(code)
'''


def measure(extra: tuple[str, ...] = ()) -> dict:
    """One cold `trajflow run quickstart` (plus `extra` arguments), from this process."""
    from benchmarks.common import RunResult
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.summary import heldout_line
    from trajflow.pipelines.rl_loop import RLPipeline

    overrides = [a for flag, a in zip(extra, extra[1:]) if flag == "--set"]
    config = load_job_config("quickstart", overrides)
    layout = [[s.name for s in group] for group in RLPipeline(config.pipeline_config()).process_groups()]
    with tempfile.TemporaryDirectory() as tmp:
        events_path = Path(tmp) / "events.jsonl"
        env = {**os.environ, "TRAJFLOW_BENCH_EVENTS": str(events_path), "PYTHONUNBUFFERED": "1"}
        load_before = os.getloadavg()
        enter = time.time()
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, "run", "quickstart", "--run-dir",
                                 str(Path(tmp) / "run"), *extra], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
        reader.start()
        proc.wait()
        exit_ = time.time()
        load_after = os.getloadavg()
        reader.join(timeout=10)
        if proc.returncode != 0:
            raise RuntimeError("trajflow run failed:\n" + "".join(output)[-4000:])
        events = [json.loads(line) for line in events_path.read_text().splitlines()]
    rows = [e for e in events if e["event"] == "row"]
    at = {e["event"]: e["t"] for e in events if e["event"] != "row"}
    first, last = rows[0]["t"], rows[-1]["t"]
    metrics = pl.DataFrame([e["row"] for e in rows], infer_schema_length=None)
    critical, serial = RunResult(metrics, exit_ - enter, layout=layout).compute_seconds(config.max_staleness == 0)
    parts = [
        ("interpreter + imports + validation", at["ray start"] - enter),
        ("Ray start", at["ray ready"] - at["ray start"]),
        ("to the end of the first step", first - at["ray ready"]),
        (f"the other {len(rows) - 1} steps", last - first),
        ("pipeline shut down, metrics gathered", at["summary"] - last),
        ("summary table", at["summary made"] - at["summary"]),
        ("summary printed, session recorded", at["main returned"] - at["summary made"]),
        ("atexit: Ray shut down", at["atexit done"] - at["main returned"]),
        ("interpreter exit", exit_ - at["atexit done"]),
    ]
    start_up = first - enter
    return {
        "parts": [{"part": name, "wall s": seconds, "share of enter to exit": seconds / (exit_ - enter)}
                  for name, seconds in parts],
        "side by side": {
            "steps": len(rows),
            "rows per step": config.rows_per_step,
            "enter to exit s": exit_ - enter,
            "start-up (enter to step 0's line) s": start_up,
            "steps 1.. wall s": last - first,
            "steps 1.. compute, critical path s": critical,
            "steps 1.. compute, all stages s": serial,
            "start-up + compute s": start_up + critical,
            "enter to exit - (start-up + compute) s": exit_ - enter - start_up - critical,
            f"within {TARGET_SECONDS:.0f} s": "yes" if exit_ - enter - start_up - critical <= TARGET_SECONDS else "no",
            "load before / after (1 min)": f"{load_before[0]:.1f} / {load_after[0]:.1f}",
        },
        "heldout": heldout_line(metrics, config.eval_prompts) if config.eval_every else None,
    }


def run(steps: int | None = None) -> str:
    """Markdown: the side-by-side row, then the parts of enter to exit."""
    from benchmarks.common import table

    result = measure(("--set", f"steps={steps}") if steps else ())
    return "\n\n".join([
        table([result["side by side"]]),
        "Where enter to exit went (wall seconds, measured by the driver's timestamps and from outside):\n\n"
        + table(result["parts"]),
        f"The run's summary says: {result['heldout'] or 'no held-out evaluation'}.",
    ])


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else None))
