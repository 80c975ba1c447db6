"""Benchmark 2: async vs sync wall time for the same train steps and samples, and the trainer's
busy fraction (time in forward/backward/step over wall time) in async mode."""

from __future__ import annotations

from benchmarks.common import ensure_ray, run_pipeline


def run(steps: int = 40, max_staleness: int = 2, decode_seconds: float = 0.0) -> dict:
    ensure_ray()
    common = dict(strategy="snapshot", steps=steps, prompts_per_step=64, group_size=8,
                  simulate_decode_seconds=decode_seconds)
    sync = run_pipeline(max_staleness=0, **common)
    async_ = run_pipeline(max_staleness=max_staleness, **common)
    return {
        "steps": steps,
        "samples per step": 64 * 8,
        "sync s/step": sync.seconds_per_step(),
        "async s/step": async_.seconds_per_step(),
        "speedup (sync/async)": sync.seconds_per_step() / async_.seconds_per_step(),
        "sync wall s": sync.wall_seconds,
        "async wall s": async_.wall_seconds,
        "trainer busy frac sync": sync.trainer_busy(),
        "trainer busy frac async": async_.trainer_busy(),
        "async mean lag": float(async_.metrics["staleness/mean"].mean()),
        "sync critical-path compute s/step": sync.critical_path(True),
        "sync wall / compute": sync.seconds_per_step() / sync.critical_path(True),
        "async critical-path compute s/step": async_.critical_path(False),
        "async wall / compute": async_.seconds_per_step() / async_.critical_path(False),
    }


if __name__ == "__main__":
    for k, v in run().items():
        print(f"{k:>26}: {v}")
