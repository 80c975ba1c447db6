"""A learning curve: one pipeline run from Python, printing held-out accuracy as it goes.

    python -m benchmarks.learning '{"strategy": "snapshot", "max_staleness": 0, "prompts_per_step": 128,
                                    "steps": 400, "eval_every": 50, "eval_prompts": 500}'

The argument is a PipelineConfig as JSON (validated before Ray starts). Prints one status line
every 10 steps and at every evaluation, then the curve as a table with wall times.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.common import ensure_ray


def run(config: dict) -> list[dict]:
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(**config))  # validated here, before Ray starts
    ensure_ray()
    started, curve = time.perf_counter(), []
    for row in pipe.iter_metrics():
        wall = time.perf_counter() - started
        accuracy = row.get("heldout/accuracy")
        if accuracy is not None:
            curve.append({"steps": row["version"], "heldout/accuracy": accuracy, "wall_s": round(wall)})
        if accuracy is not None or row["step"] % 10 == 0:
            print(f"step {row['step']:4d}  {wall:6.0f}s  reward {row['reward/mean']:.3f}  acc {accuracy}  "
                  f"mask kept {row.get('mask/token_kept_frac', float('nan')):.3f}  "
                  f"lag {row.get('staleness/max')}  trainer busy {row['trainer/busy_frac']:.2f}", flush=True)
    return curve


if __name__ == "__main__":
    curve = run(json.loads(sys.argv[1]))
    print("| steps | held-out accuracy | wall s |\n|---|---|---|")
    for point in curve:
        print(f"| {point['steps']} | {point['heldout/accuracy']:.3f} | {point['wall_s']} |")
