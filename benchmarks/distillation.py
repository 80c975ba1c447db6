"""Distributions on the toy task: on-policy distillation (fresh and stale rollouts, reverse KL with
and without AsyncOPD's correction, forward KL on the top-k support), and Score Centering beside
snapshot and behavior with the distribution-level mismatch logged.

Every run is the synchronous in-process loop over the real operators (pipelines/local.py). A stale
arm generates each rollout `lag` steps ahead (`run_in_process(lag=S)`, max_staleness S): after the
first S steps every token is exactly S versions old, the steady state of the asynchronous pipeline
when generation outpaces training, but fixed by construction, so the outcome does not depend on the
machine's load (the Ray pipeline's staleness does: see --ray for that run).

Distillation: the student is the warm start (artifacts/warm_start/addition), the teacher the warm
start trained longer (artifacts/teacher/addition, scripts/make_teacher.py); pure distillation
(task_advantage_coef 0: the reward is only measured), snapshot's exact pi_old, float32 inference (r_d
= 1: staleness is the only off-policy factor). Score Centering: the task's reward, bf16 inference
(a real training-inference mismatch), K = 8.

    python -m benchmarks.distillation --part distill      # results/distributions.md (+ parquet, png)
    python -m benchmarks.distillation --part sc
    python -m benchmarks.distillation --part distill --ray   # the same arms on the Ray pipeline (async)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results"
TEACHER = REPO / "artifacts" / "teacher" / "addition"
COMMON = dict(task="addition", prompts_per_step=32, group_size=8, drop_zero_variance_groups=False,
              sampling={"temperature": 1.0, "max_new_tokens": 6}, optimizer={"lr": 3e-4}, eval_every=10,
              eval_prompts=500, seed=0)
STEPS = 40

# name -> (config overrides, lag)
DISTILL = {
    "reverse KL, current student (AsyncOPD), fresh": ({"distill": {"reverse_kl_student": "current"}}, 0),
    "reverse KL, rollout-time student, fresh": ({"distill": {"reverse_kl_student": "old"}}, 0),
    "reverse KL, current student (AsyncOPD), stale 4": ({"distill": {"reverse_kl_student": "current"}}, 4),
    "reverse KL, rollout-time student, stale 4": ({"distill": {"reverse_kl_student": "old"}}, 4),
    "forward KL (top-8), fresh": ({"distill": {"reverse_kl_coef": 0.0, "forward_kl_coef": 1.0}}, 0),
    "forward KL (top-8), stale 4": ({"distill": {"reverse_kl_coef": 0.0, "forward_kl_coef": 1.0}}, 4),
}
SC = {
    "snapshot": ({"strategy": "snapshot"}, 0),
    "behavior": ({"strategy": "behavior"}, 0),
    "score_centering": ({"strategy": "score_centering"}, 0),
    "snapshot, stale 2": ({"strategy": "snapshot"}, 2),
    "behavior, stale 2": ({"strategy": "behavior"}, 2),
    "score_centering, stale 2": ({"strategy": "score_centering"}, 2),
}


def config(part: str, overrides: dict, lag: int, steps: int):
    from trajflow.pipelines.config import PipelineConfig

    if part == "distill":
        base = dict(COMMON, strategy="snapshot", inference_dtype="float32", teacher=str(TEACHER), top_k_logprobs=8)
    else:
        base = dict(COMMON, inference_dtype="bfloat16", top_k_logprobs=8)
    return PipelineConfig(**{**base, **overrides, "max_staleness": lag, "steps": steps})


def run_arm(part: str, name: str, steps: int, ray: bool) -> pl.DataFrame:
    import torch

    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.rl_loop import RLPipeline

    overrides, lag = (DISTILL if part == "distill" else SC)[name]
    torch.set_num_threads(1)
    pipe = RLPipeline(config(part, overrides, lag, steps))
    metrics = pipe.run(progress=False) if ray else run_in_process(pipe, lag=lag)
    return metrics.with_columns(pl.lit(name).alias("arm"), pl.lit(lag).alias("lag"))


def heldout(m: pl.DataFrame) -> dict[int, float]:
    """Held-out greedy accuracy by version: the start (version 0) and every eval_every versions."""
    out = {0: m["heldout/accuracy_start"].drop_nulls()[0]}
    for row in m.filter(pl.col("heldout/accuracy").is_not_null()).iter_rows(named=True):
        out[row["version"]] = row["heldout/accuracy"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("distill", "sc"), required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--arms", nargs="*", help="a subset of the part's arms (default: all)")
    p.add_argument("--ray", action="store_true", help="the Ray pipeline (asynchronous, staleness from the load)")
    a = p.parse_args(argv)
    arms = a.arms or list(DISTILL if a.part == "distill" else SC)
    suffix = "_ray" if a.ray else ""
    frames, started = [], time.time()
    for i, name in enumerate(arms):
        frames.append(run_arm(a.part, name, a.steps, a.ray))
        acc = heldout(frames[-1])
        print(f"[{i + 1}/{len(arms)} {time.time() - started:.0f}s] {name}: held-out {json.dumps(acc)}", flush=True)
    metrics = pl.concat(frames, how="diagonal_relaxed")
    OUT.mkdir(parents=True, exist_ok=True)
    metrics.write_parquet(OUT / f"distributions_{a.part}{suffix}.parquet")
    print(f"wrote {OUT / f'distributions_{a.part}{suffix}.parquet'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
