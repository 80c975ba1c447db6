"""Benchmark 3: extra seconds per step and extra memory of snapshot, dedicated, interrupt and ewma
relative to behavior (same async setting, measured side by side in one Ray session)."""

from __future__ import annotations

from benchmarks.common import ensure_ray, run_pipeline


def run(steps: int = 30, max_staleness: int = 2) -> list[dict]:
    ensure_ray()
    results = {}
    for strategy in ["behavior", "snapshot", "dedicated", "interrupt", "ewma"]:
        results[strategy] = run_pipeline(strategy=strategy, max_staleness=max_staleness, steps=steps,
                                         prompts_per_step=16, group_size=8, inference_dtype="bfloat16")
    base = results["behavior"]
    base_mem = sum(base.memory_mb.values())
    rows = []
    for strategy, r in results.items():
        m = r.metrics
        rows.append({
            "strategy": strategy,
            "s/step": round(r.seconds_per_step(), 3),
            "extra s/step vs behavior": round(r.seconds_per_step() - base.seconds_per_step(), 3),
            "ratio vs behavior": round(r.seconds_per_step() / base.seconds_per_step(), 2),
            "critical-path compute s/step": round(r.critical_path(synchronous=max_staleness == 0), 3),
            "wall / compute": round(r.seconds_per_step() / r.critical_path(synchronous=max_staleness == 0), 2),
            "actors peak RSS MiB": round(sum(r.memory_mb.values())),
            "extra RSS MiB vs behavior": round(sum(r.memory_mb.values()) - base_mem),
            # only the strategies whose store keeps history report snapshots
            "max snapshot MiB (store)": round(float(m["snapshot/bytes"].max()) / 2**20, 2)
            if "snapshot/bytes" in m.columns else 0.0,
            "max versions held": int(m["snapshot/max_versions_held"].max())
            if "snapshot/max_versions_held" in m.columns else 1,
            "old log-prob s/step": round(float(m["seconds/old_logprobs"].mean()), 3)
            if "seconds/old_logprobs" in m.columns else 0.0,
        })
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
