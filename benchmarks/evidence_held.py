"""Issue 45: does exact pi_old beat bypass and the proxies in outcome on the real model?

    python -m benchmarks.evidence_held run --work DIR          # the study (hours; resumable)
    python -m benchmarks.evidence_held run --work DIR --strategies snapshot --seeds 1 --first-seed 3
                                                              # one cell, from scratch
    python -m benchmarks.evidence_held report --work DIR       # tables + plot into results/

The outcome study of benchmarks/evidence.py could not decide on SmolLM2 (few rows trained,
staleness not held, too short: results/evidence.md). This one is set up so that it can:

- **staleness held**: every run is the in-process loop (pipelines/local.py) with `lag = S`: the
  rollout of step k is sampled by version max(0, k - S), so from step S on every token is exactly
  S versions stale, whatever the machine's load (each step's realized staleness is recorded);
- **most rows train**: the one-digit sums and differences of scripts/make_smollm2_arith.py, on
  which the model's sampled reward starts near 0.4 (measured before the study, and by the runs'
  own first steps), in groups of 8 samples;
- **the regime where the gap should show**: simulated fp8 inference at S = 2;
- **held-out accuracy that can move**: greedy, the model answers 86.5 % of the held-out problems
  from the start (a ceiling), while a sample at the training temperature is right 66 % of the
  time; the study's outcome is that sampled accuracy (2 seeded samples per problem at temperature
  1, in the training numerics, 200 problems), with the greedy one beside it;
- **deterministic**: one process, fixed threads, seeded sampling: a cell rerun from scratch gives
  the same accuracy (the study's last check);
- **resumable**: each run's rows are written as it ends (`DIR/<setting>/<strategy>-seed<k>.parquet`)
  and a rerun skips them.

The mechanism comes from the same runs (each step's r_d mask kept fraction and the variance split
of the log-ratio, `split/var_log_rd` / `split/var_log_rs`); in the snapshot runs of the first
`--gradient-seeds` seeds the train step first differentiates every strategy's loss on the batch
it is about to train and compares each gradient with the exact one (operators/diagnose.py,
`grad/cos_vs_exact`).
"""

from __future__ import annotations

import argparse
import os
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
    "report_to": "[]",
}


SAMPLED = {"samples": 2, "temperature": 1.0, "seed": 1234}  # the sampled held-out evaluation


def config_for(setting: str, strategy: str, seed: int, staleness: int, steps: int, lr: float):
    """The job config of one run of the study."""
    from trajflow.jobs.config import load_job_config

    overrides = {**BASE, **SETTINGS[setting], "strategy": strategy, "seed": seed, "max_staleness": staleness,
                 "steps": steps, "optimizer.lr": lr}
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
                                      config.max_staleness, s.numerics, s.trainer.torch_threads, gradients=True)
            out.extend(self.probe(batch).to_pylist())
            return super().__call__(batch)

    return ProbedTrainStep


def run_one(setting: str, strategy: str, seed: int, args, path: Path) -> None:
    """One run of the study in this process; its per-step rows written to `path` at the end."""
    from trajflow.engines.models import load_model
    from trajflow.operators.contracts.stage import Stage
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    config = config_for(setting, strategy, seed, args.staleness, args.steps, args.lr)
    pipe = RLPipeline(config.pipeline_config(), model_path=config.model_path)
    store = InProcessStore(config.max_staleness, pipe.strategy.keep_history)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    probes: list[dict] = []
    if strategy == "snapshot" and seed < args.gradient_seeds:
        train = pipe.stage("train")
        pipe.replace("train", Stage("train", probed_train_step(config.pipeline_config(), pipe.model_path, probes),
                                    train.kwargs, train.resources))
    train = pipe.stage("train")
    train.kwargs["after_step"] = [*train.kwargs["after_step"],
                                  *study_evaluations(pipe, args.eval_every, config.steps, path.parent)]
    rows, started = [], time.time()
    for _, row in iter_in_process(pipe, store, range(config.steps), lag=config.max_staleness):
        row["time/step_end"] = time.time() - started
        rows.append(row)
        print(f"  [{setting} {strategy} seed {seed}] step {row['step']:2d}: reward {row['reward/mean']:.3f}, "
              f"rows {row['rows_trained']}/{row['rows']}, staleness {row.get('staleness/mean', 0):.2f}"
              + (f", held-out sampled {row['heldout/sampled_accuracy']:.3f}"
                 if row.get("heldout/sampled_accuracy") is not None else "")
              + f", {row['time/step_end']:.0f} s", flush=True)
    frame = pl.from_dicts(rows, infer_schema_length=None).with_columns(
        pl.lit(setting).alias("setting"), pl.lit(strategy).alias("strategy"), pl.lit(seed).alias("seed"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    frame.write_parquet(tmp)
    os.replace(tmp, path)
    if probes:
        pl.from_dicts(probes, infer_schema_length=None).with_columns(pl.lit(seed).alias("seed")).write_parquet(
            path.with_name(f"{path.stem}.gradients.parquet"))


def run(args) -> None:
    work = Path(args.work)
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


def load(work: Path) -> pl.DataFrame:
    files = sorted(p for p in work.glob("*/*.parquet") if not p.name.endswith(".gradients.parquet"))
    return pl.concat([pl.read_parquet(p) for p in files], how="diagonal_relaxed")


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
    r.add_argument("--eval-every", type=int, default=6)
    r.add_argument("--gradient-seeds", type=int, default=2)
    a = parser.parse_args()
    if a.command == "run":
        run(a)


if __name__ == "__main__":
    main()
