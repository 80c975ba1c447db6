"""Benchmark 1: every strategy at max_staleness in {0, 2, 4} with bfloat16 inference, several seeds.

Reports final held-out greedy accuracy and steps to reach a target accuracy (mean ± std over
seeds). Runs are short on a 2-core CPU; the table says how many steps and prompts.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import ensure_ray, mean_std, run_pipeline

STRATEGIES = ["snapshot", "dedicated", "interrupt", "ewma", "recompute", "behavior", "loglinear"]


def run(steps: int, seeds: int, staleness: list[int], eval_every: int, eval_prompts: int, target: float,
        strategies: list[str] = STRATEGIES) -> list[dict]:
    ensure_ray()
    rows = []
    for s in staleness:
        for strategy in strategies:
            finals, to_target, masks, clips = [], [], [], []
            for seed in range(seeds):
                result = run_pipeline(strategy=strategy, max_staleness=s, inference_dtype="bfloat16", steps=steps,
                                      prompts_per_step=16, group_size=8, eval_every=eval_every,
                                      eval_prompts=eval_prompts, seed=seed)
                m = result.metrics
                evals = m.filter(m["heldout_accuracy"].is_not_null()) if "heldout_accuracy" in m.columns else m[:0]
                finals.append(evals["heldout_accuracy"][-1] if evals.height else None)
                hit = evals.filter(evals["heldout_accuracy"] >= target)
                to_target.append(int(hit["version"][0]) if hit.height else None)
                masks.append(float(m["mask/token_kept_frac"].mean()))
                clips.append(float(m["clip/frac"].mean()))
                print(f"  {strategy:<10} S={s} seed={seed}: final acc {finals[-1]}, steps to {target:.2f}: "
                      f"{to_target[-1]}, wall {result.wall_seconds:.0f}s", flush=True)
            reached = [t for t in to_target if t is not None]
            rows.append({
                "max_staleness": s, "strategy": strategy,
                "final_accuracy": mean_std(finals),
                "steps_to_target": (mean_std(reached) if reached else "never") + f" ({len(reached)}/{seeds} reached)",
                "mask_kept": f"{np.mean(masks):.3f}", "clip_frac": f"{np.mean(clips):.3f}",
            })
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--target", type=float, default=0.32)
    a = p.parse_args()
    for row in run(a.steps, a.seeds, [0, 2, 4], a.eval_every, a.eval_prompts, a.target):
        print(row)
