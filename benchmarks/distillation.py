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

    python -m benchmarks.distillation --part distill      # results/distributions_distill.{parquet,png} + tables
    python -m benchmarks.distillation --part sc
    python -m benchmarks.distillation --part distill --ray   # the same arms on the Ray pipeline (async)
    python -m benchmarks.distillation --part distill --steps 120 --seeds 0 1 2 --tag _120
    python -m benchmarks.distillation --part sc --report     # the tables and the png from the parquet
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


def config(part: str, overrides: dict, lag: int, steps: int, seed: int = 0):
    from trajflow.pipelines.config import PipelineConfig

    if part == "distill":
        base = dict(COMMON, strategy="snapshot", inference_dtype="float32", teacher=str(TEACHER), top_k_logprobs=8)
    else:
        base = dict(COMMON, inference_dtype="bfloat16", top_k_logprobs=8)
    return PipelineConfig(**{**base, **overrides, "max_staleness": lag, "steps": steps, "seed": seed})


def run_arm(part: str, name: str, steps: int, ray: bool, seed: int = 0) -> pl.DataFrame:
    import torch

    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.rl_loop import RLPipeline

    overrides, lag = (DISTILL if part == "distill" else SC)[name]
    torch.set_num_threads(1)
    pipe = RLPipeline(config(part, overrides, lag, steps, seed))
    metrics = pipe.run(progress=False) if ray else run_in_process(pipe, lag=lag)
    return metrics.with_columns(pl.lit(name).alias("arm"), pl.lit(lag).alias("lag"), pl.lit(seed).alias("seed"))


def heldout(m: pl.DataFrame) -> dict[int, float]:
    """Held-out greedy accuracy by version: the start (version 0) and every eval_every versions."""
    out = {0: m["heldout/accuracy_start"].drop_nulls()[0]}
    if "heldout/accuracy" not in m.columns:  # a run shorter than eval_every
        return out
    for row in m.filter(pl.col("heldout/accuracy").is_not_null()).iter_rows(named=True):
        out[row["version"]] = row["heldout/accuracy"]
    return out


def se(p: float, n: int) -> float:
    """The binomial standard error of an accuracy p on n held-out prompts (the greedy responses are
    deterministic: this is the spread over the choice of prompts)."""
    return (p * (1 - p) / n) ** 0.5


def last_mean(m: pl.DataFrame, column: str, steps: int = 10, first: bool = False) -> float | None:
    """A per-step metric's mean over the arm's last (`first`: first) `steps` steps (None if the
    arm does not log it)."""
    if column not in m.columns or m[column].drop_nulls().is_empty():
        return None
    rows = m.sort("step")
    return float((rows.head(steps) if first else rows.tail(steps))[column].mean())


def report(part: str, suffix: str = "") -> str:
    """Markdown tables of a part's arms from its parquet (one row per arm and seed; with several
    seeds, a summary over them), and its plot (results/distributions_<part>.png)."""
    from benchmarks.common import table

    metrics = pl.read_parquet(OUT / f"distributions_{part}{suffix}.parquet")
    if "seed" not in metrics.columns:
        metrics = metrics.with_columns(pl.lit(0).alias("seed"))
    n = COMMON["eval_prompts"]
    rows, finals = [], {}
    for name, seed in dict.fromkeys(zip(metrics["arm"].to_list(), metrics["seed"].to_list())):
        m = metrics.filter((pl.col("arm") == name) & (pl.col("seed") == seed))
        acc = heldout(m)
        final = acc[max(acc)]
        key = "distill/reverse_kl" if part == "distill" else "mismatch/tv"  # the summary's per-step metric
        finals.setdefault(name, []).append((final, final - acc[0], last_mean(m, key)))
        row = {"arm": name, "seed": seed, "lag": m["lag"][0], "steps": int(m["version"].max())}
        row |= {f"acc@{v}": a for v, a in acc.items()}
        row |= {"final ± s.e.": f"{final:.3f} ± {se(final, n):.3f}", "Δ vs start": final - acc[0],
                "staleness/mean": last_mean(m, "staleness/mean")}
        if part == "distill":  # where the teacher-student gap started: the logged KLs' first steps
            row |= {f"{k} (first 5)": f"{last_mean(m, k, 5, first=True):.3f}"
                    for k in ("distill/reverse_kl", "distill/forward_kl")}
        keys = (("reward/mean", "distill/reverse_kl", "distill/forward_kl") if part == "distill" else
                ("reward/mean", "mismatch/tv", "mismatch/kl_support", "mismatch/k3", "sc/alpha", "sc/center_norm"))
        # the mismatch metrics are small: scientific notation, not the table's three decimals
        row |= {f"{k} (last 10)": v if k.startswith(("reward/", "sc/alpha", "distill/")) or v is None
                else f"{v:.2e}" for k in keys for v in [last_mean(m, k)]}
        rows.append(row)
    teacher = teacher_accuracy() if part == "distill" else None
    plot(metrics, part, OUT / f"distributions_{part}{suffix}.png", teacher)
    if teacher is not None:
        rows.append({"arm": "teacher (artifacts/teacher/addition)",
                     "final ± s.e.": f"{teacher:.3f} ± {se(teacher, n):.3f}"})
    out = table(rows)
    if max(len(v) for v in finals.values()) > 1:
        summary = []
        for name, runs in finals.items():
            acc, delta = [r[0] for r in runs], [r[1] for r in runs]
            mean = sum(acc) / len(acc)
            spread = f" ± {(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1) / len(acc)) ** 0.5:.3f}" \
                if len(acc) > 1 else ""
            summary.append({"arm": name, "seeds": len(runs),
                            "final accuracy by seed": ", ".join(f"{a:.3f}" for a in acc),
                            "mean ± s.e. over seeds": f"{mean:.3f}{spread}", "mean Δ vs start": sum(delta) / len(delta)})
            value = sum(r[2] for r in runs) / len(runs)
            summary[-1][f"{key} last 10, mean over seeds"] = value if part == "distill" else f"{value:.2e}"
        out += "\n\nOver the seeds:\n\n" + table(summary)
    return out


def teacher_accuracy() -> float:
    """The teacher's held-out greedy accuracy on the arms' own eval prompts (the first eval_prompts
    held-out prompts, the arms' max_new_tokens), scored as the runs score the student."""
    import torch

    from trajflow.engines.models import load_model, load_tokenizer
    from trajflow.tasks.rollout import heldout_rewards

    torch.set_num_threads(1)
    c = config("distill", {}, 0, 1)
    rewards = heldout_rewards(load_model(TEACHER), load_tokenizer(TEACHER), c.workload(), c.eval_prompts,
                              c.sampling.max_new_tokens, stop=c.sampling.stop)
    return sum(r or 0.0 for r in rewards) / len(rewards)


def plot(metrics: pl.DataFrame, part: str, path: Path, teacher: float | None = None) -> None:
    """Held-out accuracy by version and the part's per-step metric, each the mean over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    right = "distill/reverse_kl" if part == "distill" else "mismatch/tv"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, name in enumerate(dict.fromkeys(metrics["arm"].to_list())):
        m = metrics.filter(pl.col("arm") == name).sort("step")
        runs = [heldout(m.filter(pl.col("seed") == seed)) for seed in m["seed"].unique().sort()]
        acc = {v: sum(r[v] for r in runs) / len(runs) for v in runs[0]}
        per_step = m.group_by("version").agg(pl.col(right).mean()).sort("version")
        style = "--" if m["lag"][0] else "-"
        label = name + (f" (mean of {len(runs)} seeds)" if metrics["seed"].n_unique() > 1 else "")
        axes[0].plot(list(acc), list(acc.values()), style + "o", color=f"C{i}", label=label, markersize=4)
        axes[1].plot(per_step["version"], per_step[right], style, color=f"C{i}", label=name)
    if teacher is not None:
        axes[0].axhline(teacher, color="k", linestyle=":", label=f"teacher ({teacher:.3f})")
    axes[0].set_xlabel("policy version (optimizer steps)")
    axes[0].set_ylabel(f"held-out greedy accuracy ({COMMON['eval_prompts']} prompts)")
    axes[1].set_xlabel("policy version (optimizer steps)")
    axes[1].set_ylabel({"distill/reverse_kl": "reverse KL to teacher (nats/token)",
                        "mismatch/tv": "TV(μ, π_old), top-8 + tail (per token)"}[right])
    if part == "sc":
        axes[1].set_title("behavior takes μ as π_old: 0 by definition", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(("On-policy distillation" if part == "distill" else "Score Centering beside snapshot and behavior")
                 + " on the toy addition task; dashed: stale rollouts (lag > 0)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("distill", "sc"), required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--arms", nargs="*", help="a subset of the part's arms (default: all)")
    p.add_argument("--ray", action="store_true", help="the Ray pipeline (asynchronous, staleness from the load)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="each arm once per seed")
    p.add_argument("--tag", default="", help="appended to the results' names (e.g. _120 for a 120-step run)")
    p.add_argument("--report", action="store_true", help="only the tables and the png, from the saved parquet")
    a = p.parse_args(argv)
    suffix = ("_ray" if a.ray else "") + a.tag
    if a.report:
        print(report(a.part, suffix))
        return 0
    arms = a.arms or list(DISTILL if a.part == "distill" else SC)
    frames, started = [], time.time()
    runs = [(seed, name) for seed in a.seeds for name in arms]
    for i, (seed, name) in enumerate(runs):
        frames.append(run_arm(a.part, name, a.steps, a.ray, seed))
        acc = heldout(frames[-1])
        print(f"[{i + 1}/{len(runs)} {time.time() - started:.0f}s] {name}, seed {seed}: held-out {json.dumps(acc)}",
              flush=True)
    metrics = pl.concat(frames, how="diagonal_relaxed")
    OUT.mkdir(parents=True, exist_ok=True)
    metrics.write_parquet(OUT / f"distributions_{a.part}{suffix}.parquet")
    print(f"wrote {OUT / f'distributions_{a.part}{suffix}.parquet'}")
    print(report(a.part, suffix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
