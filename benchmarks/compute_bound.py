"""Benchmark: the compute-bound point — a ~25 M-parameter Llama from a config (random init: the
numbers are throughput, not learning) generating 64-token responses, where generation and
training each take a real share of a core, so the pipeline's own cost is small next to them.

Reports sync and async (`max_staleness` 2) s/step for `behavior`, the async/sync ratio, the train
stage's busy fraction, and every strategy's async s/step against `behavior`'s. Each row also
gives wall s/step against the compute on the critical path (see benchmarks/orchestration.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import RunResult, ensure_ray, run_pipeline, top_k_for
from benchmarks.models import model_dir
from trajflow.operators.strategies import strategy_names

STRATEGIES = ["behavior", *(name for name in strategy_names() if name != "behavior")]  # behavior: the base


def settings(model: Path, steps: int) -> dict:
    # every row trains: a random model earns no reward, so zero-variance groups are kept
    return dict(model=model, prompts_per_step=2, group_size=8, sampling={"max_new_tokens": 64}, steps=steps,
                drop_zero_variance_groups=False)


def row(label: str, strategy: str, staleness: int, r: RunResult, base: RunResult | None) -> dict:
    wall = r.seconds_per_step()
    compute = r.critical_path(staleness == 0)
    return {
        "run": label,
        "strategy": strategy,
        "max_staleness": staleness,
        "wall s/step": wall,
        "critical-path compute s/step": compute,
        "wall / compute": wall / compute,
        "trainer busy": r.trainer_busy(),
        "vs behavior (async)": wall / base.seconds_per_step() if base is not None else None,
        "stages s/step": " ".join(f"{k} {v:.2f}" for k, v in r.stage_seconds().items() if v >= 0.005),
    }


def run(steps: int = 10, strategies: list[str] = STRATEGIES) -> list[dict]:
    ensure_ray()
    with tempfile.TemporaryDirectory() as root:
        model = model_dir("25M", Path(root))
        sync = run_pipeline(strategy="behavior", max_staleness=0, **settings(model, steps))
        results = {s: run_pipeline(strategy=s, max_staleness=2, **settings(model, steps), **top_k_for(s))
                   for s in strategies}
    base = results["behavior"]
    rows = [row("sync", "behavior", 0, sync, None)]
    rows += [row("async", s, 2, r, base) for s, r in results.items()]
    rows.append({"run": "async / sync (behavior)", "strategy": "behavior", "max_staleness": 2,
                 "wall s/step": sync.seconds_per_step() / base.seconds_per_step()})
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
