"""Issue 45's second study: on-policy distillation on the real model under held staleness.

AsyncOPD's claim: with stale rollouts, the reverse-KL advantage -(log pi_student - log pi_teacher)
should use the *current* student (recomputed in the update), not the rollout-time one (a score
cached when the rollout was generated). On the toy (results/distributions.md) the two arms did
not separate: the student moved too little in 4 stale steps for the two to differ. Here the
student is SmolLM2-135M-Instruct on the evidence study's one-digit sums and differences
(benchmarks/evidence_held.py: the same data, model, evaluations and in-process loop with
`lag = S`, so from step S on every token is exactly S versions stale), the teacher the same model
fine-tuned on the train problems until it answers nearly all held-out ones
(scripts/make_smollm2_teacher.py), and the distillation pure (`distill.task_advantage_coef: 0`:
the reward is measured, not trained on; every group trains, none is dropped for equal rewards).
Float32 inference, so exact old log-probs equal the inference ones (r_d = 1) and staleness is
the only off-policy factor; the exact strategy (snapshot) in both arms.

    python scripts/make_smollm2_teacher.py TEACHER                  # the teacher (minutes)
    python -m benchmarks.distillation_held run --work DIR --teacher TEACHER   # hours; resumable
    python -m benchmarks.distillation_held report --work DIR        # tables + plot into results/

Per run, the outcome is the held-out sampled accuracy at the end (the study's: 200 problems x 2
seeded samples at T = 1), greedy beside it, and the reverse KL to the teacher on the step's own
samples (`distill/reverse_kl`, per token) as the student moves; arms paired by seed (the same seed:
the same prompts and the same first batches).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import polars as pl

from benchmarks.evidence import bootstrap_interval, sign_flip_p
from benchmarks.evidence_held import ACCURACY, BASE, GREEDY, RESULTS, plot_accuracy, run_cell

ARMS = {"current": "current student (AsyncOPD)", "old": "rollout-time student"}


def config_for(arm: str, seed: int, teacher: Path, staleness: int, steps: int, lr: float):
    """The job config of one run: the evidence study's, pure distillation from `teacher`."""
    from trajflow.jobs.config import load_job_config

    overrides = {**BASE, "inference_dtype": "float32", "strategy": "snapshot", "teacher": teacher,
                 "distill.reverse_kl_student": arm, "distill.task_advantage_coef": 0.0,
                 "drop_zero_variance_groups": False, "seed": seed, "max_staleness": staleness, "steps": steps,
                 "optimizer.lr": lr}
    return load_job_config("smollm2", [f"{k}={v}" for k, v in overrides.items()])


def run(args) -> None:
    work, teacher = Path(args.work), Path(args.teacher).resolve()
    cells = [(arm, seed) for seed in range(args.first_seed, args.first_seed + args.seeds)
             for arm in args.arms.split(",")]
    started = time.time()
    for n, (arm, seed) in enumerate(cells, start=1):
        path = work / f"s{args.staleness}" / f"{arm}-seed{seed}.parquet"
        if path.exists():
            continue
        print(f"[distillation_held {n}/{len(cells)}, {time.time() - started:.0f} s] {arm} student, seed {seed}, "
              f"staleness {args.staleness}", flush=True)
        config = config_for(arm, seed, teacher, args.staleness, args.steps, args.lr)
        run_cell(config, {"arm": arm, "staleness": args.staleness, "seed": seed}, path, args.eval_every)


def per_run(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per run: final sampled and greedy accuracy, the reverse KL to the teacher over its
    first and last three steps, from step S on the clip fraction and the variance of log r_s (how
    far pi_theta moved from the rollout's student), and its wall time."""
    last = pl.col("step") == pl.col("step").max()
    kl = pl.col("distill/reverse_kl")
    stale = pl.col("step") >= pl.col("staleness")  # every token exactly S versions old
    return rows.group_by("staleness", "arm", "seed", maintain_order=True).agg(
        pl.col(ACCURACY).filter(last).first().alias("accuracy"),
        pl.col(GREEDY).filter(last).first().alias("greedy"),
        kl.sort_by("step").head(3).mean().alias("kl_first"),
        kl.sort_by("step").tail(3).mean().alias("kl_last"),
        pl.col("staleness/mean").filter(stale).min().alias("staleness_min"),
        pl.col("staleness/mean").filter(stale).max().alias("staleness_max"),
        pl.col("clip/frac").filter(stale).mean().alias("clip"),
        pl.col("split/var_log_rs").filter(stale).mean().alias("var_log_rs"),
        pl.col("seconds/elapsed").max().alias("seconds"))


def paired_rows(runs: pl.DataFrame, column: str, fmt: str = "{:.3f}") -> list[dict]:
    """Per arm: `column` per seed and its mean; for the rollout-time arm, the paired difference
    from the current one (95 % bootstrap interval, exact sign-flip p)."""
    base = {r["seed"]: r[column] for r in runs.filter(pl.col("arm") == "current").iter_rows(named=True)}
    out = []
    for arm in ARMS:
        mine = {r["seed"]: r[column] for r in runs.filter(pl.col("arm") == arm).iter_rows(named=True)}
        if not mine:
            continue
        diff = [mine[k] - base[k] for k in sorted(set(mine) & set(base))]
        paired = "-"
        if arm != "current" and diff:
            interval = (" [{:+.3f}, {:+.3f}]".format(*bootstrap_interval(diff)) if len(diff) > 1 else "")
            paired = f"{np.mean(diff):+.3f}{interval}, p {sign_flip_p(diff):.3f}"
        out.append({"student in the advantage": ARMS[arm], "seeds": len(mine),
                    "per seed": ", ".join(fmt.format(mine[k]) for k in sorted(mine)),
                    "mean": fmt.format(np.mean(list(mine.values()))),
                    "minus current (paired, 95 % bootstrap, sign-flip p)": paired})
    return out


def plot(rows: pl.DataFrame, teacher: dict, path: Path) -> None:
    """Held-out sampled accuracy per version and the reverse KL to the teacher per step, per arm
    (each seed thin, the mean thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, arm in enumerate(ARMS):
        mine = rows.filter(pl.col("arm") == arm)
        if not mine.height:
            continue
        plot_accuracy(left, mine, f"C{i}", ARMS[arm])
        for seed in sorted(set(mine["seed"].to_list())):
            run = mine.filter(pl.col("seed") == seed).sort("step")
            right.plot(run["step"], run["distill/reverse_kl"], color=f"C{i}", lw=0.6, alpha=0.35)
        kl = mine.group_by("step").agg(pl.col("distill/reverse_kl").mean()).sort("step")
        right.plot(kl["step"], kl["distill/reverse_kl"], color=f"C{i}", lw=2.2, marker=".", label=ARMS[arm])
    if teacher.get("teacher_sampled_accuracy") is not None:
        left.axhline(teacher["teacher_sampled_accuracy"], color="grey", ls="--", lw=1, label="teacher")
    right.set(xlabel="train step", ylabel="reverse KL to the teacher, nats per token (own samples)",
              title="reverse KL(student || teacher) on the step's samples")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    stale = sorted(set(rows["staleness"].to_list()))
    fig.suptitle(f"SmolLM2-135M distilled from a fine-tuned teacher, float32 inference, staleness held at "
                 f"{', '.join(map(str, stale))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(work: Path, teacher: Path | None) -> str:
    """The study's tables (markdown) from a work dir; its rows and plot into results/."""
    import json

    from benchmarks.common import table

    files = sorted(p for p in work.glob("s*/*.parquet") if not p.name.endswith(".gradients.parquet"))
    rows = pl.concat([pl.read_parquet(p) for p in files], how="diagonal_relaxed")
    runs = per_run(rows).sort("arm", "seed")
    record = json.loads((teacher / "warm_start.json").read_text()) if teacher is not None else {}
    RESULTS.mkdir(exist_ok=True)
    rows.write_parquet(RESULTS / "distillation_held.parquet")
    plot(rows, record, RESULTS / "distillation_held.png")
    seconds = runs["seconds"]
    lines = [f"Runs: {runs.height}; staleness from step S on: {runs['staleness_min'].min():.2f}-"
             f"{runs['staleness_max'].max():.2f}; wall per run {seconds.median():.0f} s median "
             f"({seconds.min():.0f}-{seconds.max():.0f}), {seconds.sum() / 3600:.1f} h in all."]
    if record:
        lines.append(f"Teacher ({record['steps']} SFT steps): held-out greedy {record['teacher_greedy_accuracy']:.3f}, "
                     f"sampled {record['teacher_sampled_accuracy']:.3f}; the student at the start: greedy "
                     f"{record['student_greedy_accuracy']:.3f}, sampled {record['student_sampled_accuracy']:.3f}.")
    lines += [
        f"Held-out sampled accuracy at the end (version {int(rows['step'].max()) + 1}):\n\n"
        + table(paired_rows(runs, "accuracy")),
        "Held-out greedy accuracy at the end:\n\n" + table(paired_rows(runs, "greedy")),
        "Reverse KL to the teacher, nats per token on the run's own samples, mean of the last 3 steps "
        "(first 3 steps: " + ", ".join(f"{ARMS[a]} {runs.filter(pl.col('arm') == a)['kl_first'].mean():.3f}"
                                       for a in ARMS if runs.filter(pl.col("arm") == a).height) + "):\n\n"
        + table(paired_rows(runs, "kl_last")),
        "The mechanism, from step S on (every token S versions old): the PPO clip's fraction of tokens\n\n"
        + table(paired_rows(runs, "clip")),
        "and var(log r_s), r_s = pi_theta / pi_old: how far the updated policy is from the student that "
        "sampled\n\n" + table(paired_rows(runs, "var_log_rs")),
    ]
    return "\n\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--teacher", required=True, help="scripts/make_smollm2_teacher.py's output")
    r.add_argument("--arms", default=",".join(ARMS))
    r.add_argument("--seeds", type=int, default=4)
    r.add_argument("--first-seed", type=int, default=0)
    r.add_argument("--staleness", type=int, default=4)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--lr", type=float, default=3e-5)
    r.add_argument("--eval-every", type=int, default=6)
    rep = sub.add_parser("report")
    rep.add_argument("--work", required=True)
    rep.add_argument("--teacher", help="the teacher's directory (its warm_start.json: its accuracies)")
    a = parser.parse_args()
    if a.command == "run":
        run(a)
    else:
        print(report(Path(a.work), Path(a.teacher) if a.teacher else None))


if __name__ == "__main__":
    main()
