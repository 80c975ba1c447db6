"""Benchmark: the pipeline's own cost per step, at quickstart size (16 prompts x 8 samples, 6 new
tokens, `snapshot`), sync (`max_staleness` 0) and async (2), three set-ups side by side:

1. Ray Data's executor as shipped, one actor process per operator stage (the layout before #15);
2. the event-driven executor wake-ups (pipelines/ray/patches.py, patch 4), same layout;
3. plus stages sharing processes (pipelines/colocation.py): the default.

Per row: wall s/step measured by the driver as metrics rows arrive (outside the stages); the
compute on the critical path (sync: the sum of the stages' compute; async: the busiest process,
or all compute spread over the 2 cores if that is more); their ratio, i.e. the orchestration
overhead; the train stage's busy fraction; the driver's CPU per step; and the whole process
tree (processes, peak PSS).
"""

from __future__ import annotations

from benchmarks.common import RunResult, ensure_ray, run_pipeline

QUICKSTART = dict(strategy="snapshot", prompts_per_step=16, group_size=8)
SETUPS = [
    ("Ray Data as shipped, a process per stage", dict(executor_patch=False, colocate="off")),
    ("event-driven executor, a process per stage", dict(executor_patch=True, colocate="off")),
    ("event-driven executor, colocated stages (default)", dict(executor_patch=True, colocate="auto")),
]


def summary(mode: str, setup: str, r: RunResult, synchronous: bool) -> dict:
    wall = r.seconds_per_step()
    compute = r.critical_path(synchronous)
    stages = r.stage_seconds()
    return {
        "mode": mode,
        "set-up": setup,
        "wall s/step": wall,
        "critical-path compute s/step": compute,
        "wall / compute": wall / compute,
        "stages s/step": " ".join(f"{k} {v:.3f}" for k, v in stages.items() if v >= 0.0005),
        "trainer busy": r.trainer_busy(),
        "driver CPU s/step": r.driver_cpu_per_step(),
        "processes": "".join(f"[{' '.join(g)}]" for g in r.layout),
        "tree processes": r.tree.peak_processes,
        "tree PSS GiB": r.tree.peak_pss_bytes / 2**30,
    }


def run(steps: int = 40) -> list[dict]:
    ensure_ray()
    rows = []
    for mode, staleness in (("sync", 0), ("async", 2)):
        for setup, options in SETUPS:
            r = run_pipeline(**QUICKSTART, **options, steps=steps, max_staleness=staleness)
            rows.append(summary(mode, setup, r, synchronous=staleness == 0))
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
