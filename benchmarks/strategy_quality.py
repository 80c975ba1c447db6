"""Benchmark 1: every strategy at max_staleness in {0, 2, 4} with bfloat16 inference, several seeds.

Reports final held-out greedy accuracy and steps to reach a target accuracy (mean ± std over
seeds), plus the mean train-infer mask kept fraction and clip fraction. Runs are short on a
2-core CPU; the table title says how many steps and samples.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import ensure_ray, mean_std, run_pipeline, top_k_for
from trajflow.operators.strategies import strategy_names

STRATEGIES = strategy_names()  # every built-in (operators/strategies/registry.py)
STEPS, PROMPTS, GROUP, LR = 40, 32, 8, 1.5e-4
SAMPLES = PROMPTS * GROUP
EVAL_EVERY, EVAL_PROMPTS = 10, 200
WARM_START_ACCURACY = 0.275  # greedy, on the same first 200 held-out prompts (heldout/accuracy)
TARGET = 0.36  # warm start + 8.5 points
# At max_staleness 0 these four are one algorithm (old = pi_v^train of the trainer's own version v,
# scored exactly), so it runs once and its row stands for all four.
SAME_AT_SYNC = ("snapshot", "dedicated", "interrupt", "recompute")


def run(steps: int, seeds: int, staleness: list[int], strategies: list[str] = STRATEGIES) -> list[dict]:
    ensure_ray()
    rows, done, started, sync_exact = [], 0, time.time(), None
    repeats = max(0, len(set(SAME_AT_SYNC) & set(strategies)) - 1) if 0 in staleness else 0
    total = (len(staleness) * len(strategies) - repeats) * seeds
    for s in staleness:
        for strategy in strategies:
            if s == 0 and strategy in SAME_AT_SYNC and sync_exact is not None:
                rows.append({**sync_exact, "strategy": f"{strategy} (= {sync_exact['strategy']} at S=0)"})
                continue
            finals, to_target, masks, clips = [], [], [], []
            for seed in range(seeds):
                result = run_pipeline(strategy=strategy, max_staleness=s, inference_dtype="bfloat16", steps=steps,
                                      prompts_per_step=PROMPTS, group_size=GROUP, optimizer={"lr": LR},
                                      eval_every=min(EVAL_EVERY, steps), eval_prompts=EVAL_PROMPTS, seed=seed,
                                      **top_k_for(strategy))
                m = result.metrics
                evals = m.filter(m["heldout/accuracy"].is_not_null())
                finals.append(evals["heldout/accuracy"][-1])
                hit = evals.filter(evals["heldout/accuracy"] >= TARGET)
                to_target.append(int(hit["version"][0]) if hit.height else None)
                masks.append(float(m["mask/token_kept_frac"].mean()))
                clips.append(float(m["clip/frac"].mean()))
                done += 1
                eta = (time.time() - started) / done * (total - done)
                print(f"[{done}/{total}, ~{eta / 60:.0f} min left] {strategy:<10} S={s} seed={seed}: "
                      f"final acc {finals[-1]}, steps to {TARGET:.2f}: {to_target[-1]}, "
                      f"wall {result.wall_seconds:.0f}s", flush=True)
            reached = [t for t in to_target if t is not None]
            rows.append({
                "max_staleness": s, "strategy": strategy,
                "final_accuracy": mean_std(finals),
                "steps_to_target": (mean_std(reached, digits=0) if reached else "never")
                + f" ({len(reached)}/{seeds} reached)",
                "mask_kept": f"{np.mean(masks):.3f}", "clip_frac": f"{np.mean(clips):.3f}",
            })
            if s == 0 and strategy in SAME_AT_SYNC:
                sync_exact = rows[-1]
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    for row in run(a.steps, a.seeds, [0, 2, 4]):
        print(row)
