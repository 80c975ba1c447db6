"""Issue 45: does exact pi_old beat bypass and the proxies in outcome on the real model?

    python -m benchmarks.evidence_held run --work DIR          # the study (hours; resumable)
    python -m benchmarks.evidence_held run --work DIR --strategies snapshot --seeds 1 --first-seed 3
                                                              # one cell, from scratch
    python -m benchmarks.evidence_held report --work DIR [--name N]  # tables; results/N.png, .parquet

The outcome study of benchmarks/evidence.py could not decide on SmolLM2 (few rows trained,
staleness not held, too short: results/evidence.md). This one is set up so that it can:

- **staleness held**: every run is the in-process loop (pipelines/local.py) with `lag = S`: the
  rollout of step k is sampled by version max(0, k - S), so from step S on every token is exactly
  S versions stale, whatever the machine's load (each step's realized staleness is recorded);
- **most rows train**: the one-digit sums and differences of scripts/make_smollm2_arith.py, on
  which the model's sampled reward starts in 0.3-0.6 (measured before the study, and by the runs'
  own first steps), in groups of 8 samples;
- **the regime where the gap should show**: simulated fp8 inference at S = 2;
- **held-out accuracy that can move**: greedy, the model answers most held-out problems from the
  start (a ceiling; results/evidence.md has the numbers), while a sample at the training
  temperature is right much less often; the study's outcome is that sampled accuracy (2 seeded
  samples per problem at temperature 1, in the training numerics, 200 problems), with the greedy
  one beside it;
- **deterministic**: one process, fixed threads, seeded sampling: a cell rerun from scratch gives
  the same accuracy (the study's last check);
- **resumable**: each run's rows are written as it ends (`DIR/<setting>/<strategy>-seed<k>.parquet`)
  and a rerun skips them; `DIR/study.json` keeps the design (staleness, steps, lr, prompts per
  step, evaluation period) and a rerun with another design stops rather than mix the two.

The mechanism comes from the same runs (each step's r_d mask kept fraction and the variance split
of the log-ratio, `split/var_log_rd` / `split/var_log_rs`); in the snapshot runs of the first
`--gradient-seeds` seeds the train step first differentiates every strategy's loss on the batch
it is about to train and compares each gradient with the exact one (operators/diagnose.py,
`grad/cos_vs_exact`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from benchmarks.evidence import bootstrap_interval, sign_flip_p

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STRATEGIES = ["snapshot", "behavior", "recompute", "loglinear"]
SETTINGS = {"fp8": {"inference_dtype": "fp8"}, "bf16": {"inference_dtype": "bfloat16"}}
# the smollm2 config (jobs/configs/smollm2.yaml) on the one-digit slice; every setting of the
# study is here, so a cell's command line needs only its strategy, seed and setting
BASE = {
    "data.train_files": "[artifacts/smollm2/arith_train.jsonl]",
    "data.test_files": "[artifacts/smollm2/arith_test.jsonl]",
    "sampling.max_new_tokens": 48,
    "prompts_per_step": 4,
    "group_size": 8,
    "eval_prompts": 200,
    "eval_every": 0,  # the study's own evaluations (StudyEvaluation)
    "checkpoint_every": 0,
    # what smollm2.yaml set when the study began (it now leaves them `auto`, which in the study's
    # one process at max_staleness 2 would choose other threads): the same float order, the same runs
    "generator.torch_threads": 2,
    "scorer.torch_threads": 2,
    "trainer.torch_threads": 2,
    "trainer.max_tokens_per_microbatch": 1024,
    "report_to": "[]",
}


SAMPLED = {"samples": 2, "temperature": 1.0, "seed": 1234}  # the sampled held-out evaluation


def config_for(setting: str, strategy: str, seed: int, staleness: int, steps: int, lr: float,
               prompts: int = BASE["prompts_per_step"]):
    """The job config of one run of the study."""
    from trajflow.jobs.config import load_job_config

    overrides = {**BASE, **SETTINGS[setting], "strategy": strategy, "seed": seed, "max_staleness": staleness,
                 "steps": steps, "optimizer.lr": lr, "prompts_per_step": prompts}
    return load_job_config("smollm2", [f"{k}={v}" for k, v in overrides.items()])


def study_evaluations(pipe, every: int, steps: int, cache: Path) -> list:
    """The run's held-out evaluations, after each train step: sampled accuracy every `every`
    versions, greedy at the end; version 0's (the same model for every run) computed once and
    kept in `cache`."""
    import json

    from trajflow.operators.trainer.services import HeldoutEvaluation
    from trajflow.tasks.rollout import SampledEvaluation

    class StudyEvaluation(HeldoutEvaluation):
        def __call__(self, trainstep, batch, metrics):
            kept = cache / f"start-{'sampled' if self.sampled else 'greedy'}.json"
            if trainstep.version == 1 and kept.exists():
                metrics.update(json.loads(kept.read_text()))
                from trajflow.engines.models import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_path)  # the start is done
            super().__call__(trainstep, batch, metrics)
            start = {k: v for k, v in metrics.items() if k.endswith("_start")
                     and ("sampled" in k) == (self.sampled is not None)}
            if start and not kept.exists():
                cache.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(start))

    c = pipe.config
    return [StudyEvaluation(pipe.model_path, pipe.workload, every, c.eval_prompts, c.sampling.max_new_tokens,
                            c.sampling.stop, sampled=SampledEvaluation(**SAMPLED)),
            StudyEvaluation(pipe.model_path, pipe.workload, steps, c.eval_prompts, c.sampling.max_new_tokens,
                            c.sampling.stop)]


def probed_train_step(config, model_path: str, out: list):
    """The train step's class with a probe before each step (snapshot runs only: its store keeps
    the window's versions): every strategy's correction and gradient on the batch about to be
    trained, at the trainer's weights, against the exact one (operators/diagnose.py); the rows go
    to `out` (a list)."""
    from trajflow.operators.diagnose import Diagnose
    from trajflow.operators.strategies.registry import resolve_strategy
    from trajflow.operators.train_step import TrainStep

    s = config.settings
    strategies = [resolve_strategy(name).from_config(config, {}) for name in STRATEGIES]

    class ProbedTrainStep(TrainStep):
        def __call__(self, batch: pa.Table) -> pa.Table:
            if not hasattr(self, "probe"):
                self.probe = Diagnose(self.store, model_path, strategies, s.correction, s.kl, s.sampling,
                                      config.max_staleness, s.numerics, s.trainer.torch_threads, gradients=True,
                                      max_tokens_per_microbatch=s.trainer.max_tokens_per_microbatch)
            out.extend(self.probe(batch).to_pylist())
            return super().__call__(batch)

    return ProbedTrainStep


def run_one(setting: str, strategy: str, seed: int, args, path: Path) -> None:
    """One run of the study in this process; its per-step rows written to `path` at the end."""
    config = config_for(setting, strategy, seed, args.staleness, args.steps, args.lr, args.prompts)
    run_cell(config, {"setting": setting, "strategy": strategy, "seed": seed}, path, args.eval_every,
             probe=strategy == "snapshot" and seed < args.gradient_seeds)


def run_cell(config, columns: dict, path: Path, eval_every: int, probe: bool = False) -> None:
    """One run of a held-staleness study (this one, benchmarks/distillation_held.py) in this
    process: the in-process loop with lag = `max_staleness`, the study's evaluations, one line per
    step; its per-step rows, with `columns` added, written to `path` at the end. `probe`: the
    gradient probe before each step (snapshot's runs: `probed_train_step`)."""
    from transformers.utils import logging as hf_logging

    from trajflow.engines.models import load_model
    from trajflow.operators.contracts.stage import Stage
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    hf_logging.disable_progress_bar()  # a bar per model load (the probe loads one per version)
    pipe = RLPipeline(config.pipeline_config(), model_path=config.model_path)
    store = InProcessStore(config.max_staleness, pipe.strategy.keep_history)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    probes: list[dict] = []
    if probe:
        train = pipe.stage("train")
        pipe.replace("train", Stage("train", probed_train_step(config.pipeline_config(), pipe.model_path, probes),
                                    train.kwargs, train.resources))
    train = pipe.stage("train")
    train.kwargs["after_step"] = [*train.kwargs["after_step"],
                                  *study_evaluations(pipe, eval_every, config.steps, path.parent)]
    label = " ".join(str(v) if k != "seed" else f"seed {v}" for k, v in columns.items())
    rows, started = [], time.time()
    for _, row in iter_in_process(pipe, store, range(config.steps), lag=config.max_staleness):
        row["seconds/elapsed"] = time.time() - started  # since the run started
        rows.append(row)
        print(f"  [{label}] step {row['step']:2d}: reward {row['reward/mean']:.3f}, "
              f"rows {row['rows_trained']}/{row['rows']}, staleness {row.get('staleness/mean', 0):.2f}"
              + (f", reverse KL {row['distill/reverse_kl']:.3f}" if "distill/reverse_kl" in row else "")
              + (f", held-out sampled {row['heldout/sampled_accuracy']:.3f}"
                 if row.get("heldout/sampled_accuracy") is not None else "")
              + f", {row['seconds/elapsed']:.0f} s", flush=True)
    frame = pl.from_dicts(rows, infer_schema_length=None).with_columns(
        *(pl.lit(v).alias(k) for k, v in columns.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    frame.write_parquet(tmp)
    os.replace(tmp, path)
    if probes:
        probed = pl.from_dicts(probes, infer_schema_length=None).with_columns(pl.lit(columns["seed"]).alias("seed"))
        probed.write_parquet(path.with_name(f"{path.stem}.gradients.parquet"))


STUDY_KEYS = ("staleness", "steps", "lr", "prompts", "eval_every")  # one work dir holds one design


def check_design(work: Path, args) -> None:
    """Write the study's design into `work/study.json` on its first run, and stop (exit 2, one
    line) a later run whose design differs, so that one work dir never mixes two designs."""
    import json

    design = {key: getattr(args, key) for key in STUDY_KEYS}
    kept = work / "study.json"
    if kept.exists():
        before = json.loads(kept.read_text())
        if before != design:
            changed = ", ".join(f"{k} {before.get(k)} -> {design[k]}" for k in STUDY_KEYS if before.get(k) != design[k])
            print(f"error: {kept} holds another design ({changed}): use a new --work", file=sys.stderr)
            raise SystemExit(2)
    else:
        work.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(design, indent=1) + "\n")


def run(args) -> None:
    work = Path(args.work)
    check_design(work, args)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    cells = [(setting, strategy, seed) for setting in args.settings.split(",") for seed in seeds
             for strategy in args.strategies.split(",")]
    started = time.time()
    for n, (setting, strategy, seed) in enumerate(cells, start=1):
        path = work / setting / f"{strategy}-seed{seed}.parquet"
        if path.exists():
            continue
        print(f"[evidence_held {n}/{len(cells)}, {time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f}] "
              f"{setting} {strategy} seed {seed}", flush=True)
        run_one(setting, strategy, seed, args, path)


def load(work: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Every finished run's per-step rows, and the gradient probes', of a work dir."""
    files = sorted(work.glob("*/*.parquet"))
    # runs written before the metric keys took one shape said time/step_end for seconds/elapsed
    rows = [pl.read_parquet(p).rename(lambda c: "seconds/elapsed" if c == "time/step_end" else c)
            for p in files if not p.name.endswith(".gradients.parquet")]
    probes = [pl.read_parquet(p) for p in files if p.name.endswith(".gradients.parquet")]
    return (pl.concat(rows, how="diagonal_relaxed"),
            pl.concat(probes, how="diagonal_relaxed") if probes else pl.DataFrame())


ACCURACY, GREEDY = "heldout/sampled_accuracy", "heldout/accuracy"


def per_run(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per run: its final sampled and greedy accuracy, trained-row share, staleness from
    step S on, and the mechanism's means over its steps."""
    trained = pl.col("rows_trained").sum() / pl.col("rows").sum()
    last = pl.col("step") == pl.col("step").max()
    return rows.group_by("setting", "strategy", "seed", maintain_order=True).agg(
        pl.col(ACCURACY).filter(last).first().alias("accuracy"),
        pl.col(GREEDY).filter(last).first().alias("greedy"),
        trained.alias("trained_rows"),
        pl.col("staleness/mean").filter(pl.col("step") >= 2).min().alias("staleness_min"),
        pl.col("staleness/mean").filter(pl.col("step") >= 2).max().alias("staleness_max"),
        pl.col("mask/token_kept_frac").mean().alias("kept"),
        pl.col("clip/frac").mean().alias("clip"),
        pl.col("split/var_log_rd").mean().alias("var_log_rd"),
        pl.col("split/var_log_rs").mean().alias("var_log_rs"),
        pl.col("seconds/elapsed").max().alias("seconds"))


def outcome_rows(runs: pl.DataFrame, column: str) -> list[dict]:
    """Per strategy: `column` (a final accuracy) per seed, its mean, the paired difference with
    snapshot's with a 95 % bootstrap interval, and the exact sign-flip p."""
    base = {r["seed"]: r[column] for r in runs.filter(pl.col("strategy") == "snapshot").iter_rows(named=True)}
    out = []
    for strategy in dict.fromkeys(runs["strategy"].to_list()):
        mine = {r["seed"]: r[column] for r in runs.filter(pl.col("strategy") == strategy).iter_rows(named=True)}
        seeds = sorted(set(mine) & set(base))
        diff = [mine[k] - base[k] for k in seeds]
        interval = (" [{:+.3f}, {:+.3f}]".format(*bootstrap_interval(diff)) if len(diff) > 1
                    else " (one pair: no interval)")
        out.append({"strategy": strategy, "seeds": len(mine),
                    "per seed": ", ".join(f"{mine[k]:.3f}" for k in sorted(mine)),
                    "mean": f"{np.mean(list(mine.values())):.3f}",
                    "vs snapshot (paired, 95 % bootstrap)": "-" if strategy == "snapshot"
                    else f"{np.mean(diff):+.3f}{interval}",
                    "sign-flip p": "-" if strategy == "snapshot" else f"{sign_flip_p(diff):.3f}"})
    return out


def mechanism_rows(runs: pl.DataFrame, probes: pl.DataFrame) -> list[dict]:
    """Per strategy, means over its runs: the share of loss tokens its r_d mask kept, the clip
    fraction, trained rows, and (snapshot's batches) its gradient's cosine with the exact one."""
    cos = (probes.group_by("strategy").agg(pl.col("grad/cos_vs_exact").fill_nan(None).mean().alias("cos"),
                                           pl.col("mask/token_kept_frac").mean().alias("probe_kept"))
           if probes.height else pl.DataFrame({"strategy": [], "cos": [], "probe_kept": []}))
    cosines = {r["strategy"]: r for r in cos.iter_rows(named=True)}
    out = []
    for strategy in dict.fromkeys(runs["strategy"].to_list() + list(cosines)):  # probed, not yet run: "-"
        mine = runs.filter(pl.col("strategy") == strategy)
        probe = cosines.get(strategy, {})
        own = (lambda column: f"{mine[column].mean():.3f}") if mine.height else (lambda column: "-")
        out.append({"strategy": strategy, "mask kept (own runs)": own("kept"),
                    "clip frac": own("clip"), "rows trained": own("trained_rows"),
                    "grad cos vs exact (snapshot's batches)": f"{probe['cos']:.3f}" if probe else "-",
                    "mask kept (snapshot's batches)": f"{probe['probe_kept']:.3f}" if probe else "-"})
    return out


def plot_accuracy(ax, runs: pl.DataFrame, color: str, label: str) -> None:
    """Held-out sampled accuracy per version of one arm's runs (one per seed) on `ax`: each seed
    thin, from its start, and the mean thick."""
    points = []
    for seed in sorted(set(runs["seed"].to_list())):
        run = runs.filter(pl.col("seed") == seed).sort("step")
        start = run[f"{ACCURACY}_start"].drop_nulls()
        later = run.filter(pl.col(ACCURACY).is_not_null())
        xs = [0, *(later["step"] + 1).to_list()]
        ys = [start[0] if len(start) else None, *later[ACCURACY].to_list()]
        ax.plot(xs, ys, color=color, lw=0.6, alpha=0.35)
        points += list(zip(xs, ys))
    by_version = {}
    for x, y in points:
        by_version.setdefault(x, []).append(y)
    xs = sorted(by_version)
    ax.plot(xs, [np.mean(by_version[x]) for x in xs], color=color, lw=2.2, marker="o", label=label)
    ax.set(xlabel="version (optimizer steps)", ylabel="held-out accuracy (2 samples per problem, T = 1)",
           title="held-out sampled accuracy: each seed thin, mean thick")


def plot(rows: pl.DataFrame, path: Path) -> None:
    """Sampled held-out accuracy per version (each seed thin, the mean thick) and the train
    reward per step (mean over seeds), per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, strategy in enumerate(dict.fromkeys(rows["strategy"].to_list())):
        mine = rows.filter(pl.col("strategy") == strategy)
        plot_accuracy(left, mine, f"C{i}", strategy)
        reward = mine.group_by("step").agg(pl.col("reward/mean").mean()).sort("step")
        right.plot(reward["step"], reward["reward/mean"], color=f"C{i}", lw=1.6, marker=".", label=strategy)
    right.set(xlabel="train step", ylabel="mean reward of the step's samples (fp8 sampler)",
              title="train reward, mean over seeds")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, one-digit sums and differences, simulated fp8 inference, staleness held at 2",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(work: Path, name: str = "evidence_held") -> str:
    """The study's tables (markdown) from a work dir, and its plot and rows into
    results/`name`.png and .parquet."""
    from benchmarks.common import table

    rows, probes = load(work)
    order = {strategy: i for i, strategy in enumerate(STRATEGIES)}  # snapshot first, as in the study
    runs = per_run(rows).sort(pl.col("strategy").replace_strict(order, default=len(order)), "seed")
    RESULTS.mkdir(exist_ok=True)
    rows.write_parquet(RESULTS / f"{name}.parquet")
    plot(rows, RESULTS / f"{name}.png")
    staleness = rows.group_by("step").agg(pl.col("staleness/mean").min().alias("min"),
                                          pl.col("staleness/mean").max().alias("max"),
                                          pl.col("staleness/max").max().alias("max per token")).sort("step")
    trained = rows.group_by("step").agg((pl.col("rows_trained").sum() / pl.col("rows").sum()).alias("share"))
    trained = trained.sort("step")
    split = runs.filter(pl.col("strategy") == "snapshot")
    share = split["var_log_rd"] / (split["var_log_rd"] + split["var_log_rs"])
    counts = ", ".join(f"{k} {v}" for k, v in runs.group_by("strategy", maintain_order=True).len().iter_rows())
    probed = (pl.col("strategy") == "snapshot") & pl.col("seed").is_in(
        probes["seed"].unique().to_list() if probes.height else [])
    walls = "; ".join(f"{label} {len(s)}: {s.median():.0f} s median ({s.min():.0f}-{s.max():.0f})"
                      for label, s in (("unprobed", runs.filter(~probed)["seconds"]),
                                       ("probed", runs.filter(probed)["seconds"])) if len(s))
    design = work / "study.json"  # absent in work dirs begun before it was written
    return "\n\n".join([
        (f"Design ({design}): {design.read_text().strip()}" if design.exists() else f"Design: not kept in {work}"),
        f"Runs: {runs.height} ({counts}), {runs['seconds'].sum() / 3600:.1f} h in all.\nWall per run: {walls}.",
        "Realized staleness per step (mean per token over the step's trained tokens; min and max over runs):\n\n"
        + table([{"step": r["step"], "min": f"{r['min']:.2f}" if r["min"] is not None else "-",
                  "max": f"{r['max']:.2f}" if r["max"] is not None else "-",
                  "max per token": r["max per token"]} for r in staleness.iter_rows(named=True)]),
        "Trained rows per step (share of sampled rows, all runs):\n\n"
        + table([{"step": r["step"], "share": f"{r['share']:.3f}"} for r in trained.iter_rows(named=True)]),
        f"Held-out sampled accuracy at the end (version {int(rows['step'].max()) + 1}; 200 problems x 2 samples; "
        f"at version 0: {rows[f'{ACCURACY}_start'].drop_nulls()[0]:.3f}):\n\n" + table(outcome_rows(runs, "accuracy")),
        f"Held-out greedy accuracy at the end (at version 0: {rows[f'{GREEDY}_start'].drop_nulls()[0]:.3f}):\n\n"
        + table(outcome_rows(runs, "greedy")),
        "The mechanism, from the same runs:\n\n" + table(mechanism_rows(runs, probes)),
        f"The split of the log-ratio under exact old log-probs (snapshot's runs, mean over steps): var(log r_d) "
        f"{split['var_log_rd'].mean():.3g} (engine mismatch), var(log r_s) {split['var_log_rs'].mean():.3g} "
        f"(staleness): the mismatch is {share.mean():.2f} of the variance.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--settings", default="fp8")
    r.add_argument("--strategies", default=",".join(STRATEGIES))
    r.add_argument("--seeds", type=int, default=6)
    r.add_argument("--first-seed", type=int, default=0)
    r.add_argument("--staleness", type=int, default=2)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--lr", type=float, default=3e-5)
    r.add_argument("--prompts", type=int, default=BASE["prompts_per_step"], help="prompts per step")
    r.add_argument("--eval-every", type=int, default=6)
    r.add_argument("--gradient-seeds", type=int, default=2)
    rep = sub.add_parser("report")
    rep.add_argument("--work", required=True)
    rep.add_argument("--name", default="evidence_held", help="results/NAME.png and .parquet")
    a = parser.parse_args()
    if a.command == "run":
        run(a)
    else:
        print(report(Path(a.work), a.name))


if __name__ == "__main__":
    main()
