"""The critic (issue 44): what it costs, whether its values' version matters, whether PPO learns.

    python -m benchmarks.critic cost [--steps 8] [--repeats 2] [--before CHECKOUT]   # quiet machine
    python -m benchmarks.critic values --work DIR [--seeds 4] [--steps 30]   # rollout vs train values
    python -m benchmarks.critic values-report --work DIR                      # ... its tables
    python -m benchmarks.critic learn --work DIR    # runs of `trajflow run ppo` / quickstart, summed up

cost: the quickstart's task in one process, synchronous, every row trained (so the two compare
row for row), GRPO against PPO with its values scored at rollout time and recomputed at train
time; each arm a process of its own (its peak RSS is its own), arms interleaved per repeat. Per
step: wall time, the values stage, each learner's update. `--before CHECKOUT`: a GRPO arm run
by another checkout (its own .venv; an earlier commit, e.g. a `git worktree`), to show a GRPO
step costs what it did; its per-step reward and loss are compared with this checkout's GRPO arm.

values: PPO at max_staleness 2 held exactly (the in-process loop's lag), `critic.values_at:
rollout` against `train`, paired seeds; the held-out accuracy at the end (outcome) and, in the
rollout runs, on every batch about to be trained, how far the advantages and the policy
gradient move when the values come from the trainer's current critic instead of the rollout's
(gradient level: the cosine of the two policy gradients on the same batch and weights).

learn: run directories of `trajflow run ppo` and `trajflow run quickstart` (GRPO) under DIR,
named `{config}-seed{k}`: held-out accuracy at version 0 and at the end, and the critic's
explained variance over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ARMS = {
    "grpo": [],
    "ppo rollout": ["advantage={estimator: gae, lam: 0.95}", "critic={optimizer: {lr: 1.0e-3}}"],
    "ppo train": ["advantage={estimator: gae, lam: 0.95}", "critic={values_at: train, optimizer: {lr: 1.0e-3}}"],
}


# -- cost -----------------------------------------------------------------------------------------
def cost_child(arm: str, steps: int) -> dict:
    """One arm in this process: per-step seconds, reward and loss, and the process's peak RSS.
    Only what an earlier checkout also has (the `--before` arm runs this file there)."""
    from trajflow.jobs.config import load_job_config
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    overrides = [f"steps={steps}", "eval_every=0", "max_staleness=0", "drop_zero_variance_groups=false",
                 *ARMS[arm.removesuffix(BEFORE)]]
    pipe = RLPipeline(load_job_config("quickstart", overrides).pipeline_config())
    store = InProcessStore(0, pipe.strategy.keep_history)
    if hasattr(pipe, "publish_start"):
        pipe.publish_start(store, 0)
    else:  # a checkout from before learners: one model to publish
        from trajflow.engines.models import load_model
        store.publish(load_model(pipe.model_path).state_dict(), 0)
    rows, last = [], time.perf_counter()
    for _, row in iter_in_process(pipe, store, range(steps)):
        now = time.perf_counter()
        rows.append({"wall": now - last, "values": row.get("seconds/values") or 0.0,
                     "train": row["seconds/train"], "policy": row.get("seconds/policy_update") or 0.0,
                     "critic": row.get("seconds/critic_update") or 0.0,
                     "reward": float(row["reward/mean"]), "loss": float(row["loss"])})
        last = now
    return {"arm": arm, "steps": rows, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


BEFORE = " (before)"


def cost(steps: int, repeats: int, before: str | None = None) -> str:
    started, found = time.time(), []
    arms = [*ARMS, *([f"grpo{BEFORE}"] if before else [])]
    for repeat in range(repeats):
        for arm in arms:
            where, python = ((Path(before), str(Path(before) / ".venv" / "bin" / "python")) if arm.endswith(BEFORE)
                             else (HERE.parent, sys.executable))
            out = subprocess.run([python, str(Path(__file__).resolve()), "cost-child", arm, str(steps)],
                                 capture_output=True, text=True, cwd=where, check=True)
            found.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[critic cost] repeat {repeat}: {arm}", flush=True)
    from benchmarks.common import table

    rows, base = [], None
    for arm in arms:
        runs = [f for f in found if f["arm"] == arm]
        per = {k: np.median([s[k] for r in runs for s in r["steps"][1:]])  # the first step (warm-up) left out
               for k in ("wall", "values", "train", "policy", "critic")}
        base = base or per["wall"]
        rows.append({"arm": arm, "s/step": f"{per['wall']:.2f}", "vs grpo": f"{per['wall'] / base:.2f}x",
                     "values stage s": f"{per['values']:.2f}", "train step s": f"{per['train']:.2f}",
                     "policy update s": f"{per['policy']:.2f}", "critic update s": f"{per['critic']:.2f}",
                     "peak RSS GiB": f"{np.median([r['peak_rss_gib'] for r in runs]):.2f}"})
    text = (f"{repeats} interleaved repeats x {steps} steps per arm (the first step of each left out), medians "
            f"over steps; {time.time() - started:.0f} s at load {os.getloadavg()[0]:.1f}.\n\n" + table(rows))
    if before:
        now, then = ([(s["reward"], s["loss"]) for s in f["steps"]] for f in
                     (next(f for f in found if f["arm"] == a) for a in ("grpo", f"grpo{BEFORE}")))
        text += (f"\n\nGRPO's per-step (reward, loss) here and in {before}: "
                 f"{'identical' if now == then else 'DIFFERENT'} over {steps} steps.")
    return text


# -- values at rollout vs at train time -------------------------------------------------------------
def probed_train_step(out: list):
    """The train step's class that, before each step of a `values_at: rollout` run, recomputes the
    batch's values with its current critic and compares GAE and the policy gradient under both."""
    import torch

    from trajflow.algorithms.gae import explained_variance
    from trajflow.operators.advantage import gae_columns
    from trajflow.operators.train_step import TrainStep
    from trajflow.operators.trainer.correction import StepBatch, correct
    from trajflow.schemas.columns import TOKEN_ADVANTAGE_COLUMN, VALUES_COLUMN, filter_reasons, padded

    class ProbedTrainStep(TrainStep):
        def __call__(self, batch):
            import pyarrow as pa

            trained = np.flatnonzero(filter_reasons(batch) == None)  # noqa: E711
            if len(trained) and self.version > 0:
                rows = batch.take(pa.array(trained))
                width = max(len(r) for r in rows["response_tokens"].to_pylist())
                now = self.critic_values(rows["prompt_tokens"].to_pylist(), rows["response_tokens"].to_pylist(),
                                         width).numpy()
                train = gae_columns(rows, now, self.spec.advantage, self.spec.kl)
                mask = torch.from_numpy(padded(rows["loss_mask"], width, False, bool))
                a = torch.from_numpy(padded(rows[TOKEN_ADVANTAGE_COLUMN], width, 0.0))[mask].double()
                b = torch.from_numpy(padded(train[TOKEN_ADVANTAGE_COLUMN], width, 0.0))[mask].double()
                grads = [self._gradient(StepBatch.from_table(t, self.version)) for t in (rows, train)]
                recorded = torch.from_numpy(padded(rows[VALUES_COLUMN], width, 0.0))
                out.append({"step": self.version, "advantage_cos": float(a @ b / (a.norm() * b.norm())),
                            "advantage_mean_abs_diff": float((a - b).abs().mean()),
                            "value_mean_abs_diff": float((recorded - torch.from_numpy(now))[mask].abs().mean()),
                            "grad_cos": float(grads[0] @ grads[1] / (grads[0].norm() * grads[1].norm())),
                            "ev_rollout_values": explained_variance(recorded, torch.from_numpy(
                                padded(rows["returns"], width, 0.0)), mask)})
            return super().__call__(batch)

        def _gradient(self, batch):
            policy = self.policy
            policy.model.zero_grad(set_to_none=True)
            current = policy.current(batch, grad=True)
            correct(policy.strategy, batch, current, policy, policy.correction).loss.loss.backward()
            grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]).double()
            policy.model.zero_grad(set_to_none=True)
            return grad

    return ProbedTrainStep


def values_run(values_at: str, seed: int, steps: int, path: Path) -> None:
    """One PPO run at max_staleness 2 (lag 2), in this process; its rows (and probes) to `path`."""
    import polars as pl

    from trajflow.jobs.config import load_job_config
    from trajflow.operators.contracts.stage import Stage
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    overrides = [f"steps={steps}", f"seed={seed}", "max_staleness=2", "eval_every=" + str(steps),
                 f"critic.values_at={values_at}"]
    config = load_job_config("ppo", overrides).pipeline_config()
    pipe = RLPipeline(config)
    probes: list[dict] = []
    if values_at == "rollout":
        train = pipe.stage("train")
        pipe.replace("train", Stage("train", probed_train_step(probes), train.kwargs, train.resources))
    store = InProcessStore(2, pipe.strategy.keep_history)
    pipe.publish_start(store, 0)
    rows = [row for _, row in iter_in_process(pipe, store, range(steps), lag=2)]
    frame = pl.from_dicts(rows, infer_schema_length=None).with_columns(pl.lit(values_at).alias("values_at"),
                                                                       pl.lit(seed).alias("seed"))
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(path)
    if probes:
        pl.from_dicts(probes).with_columns(pl.lit(seed).alias("seed")).write_parquet(
            path.with_name(path.stem + ".probe.parquet"))


def values_report(work: Path) -> str:
    """The paired comparison of a `values` work dir: held-out accuracy at the end per seed (and
    the paired difference train - rollout with a 95 % bootstrap interval and the sign-flip p),
    the critic's explained variance over the last 10 steps, and the probes' advantage and policy
    gradient cosines (rollout runs: the rollout's values against the trainer's current critic's
    on the same batch and weights)."""
    import polars as pl

    from benchmarks.common import table
    from benchmarks.evidence import bootstrap_interval, sign_flip_p

    runs: dict[str, dict[int, dict]] = {"rollout": {}, "train": {}}
    for path in sorted(work.glob("*-seed*.parquet")):
        if path.name.endswith(".probe.parquet"):
            continue
        frame = pl.read_parquet(path)
        values_at, seed = frame["values_at"][0], int(frame["seed"][0])
        last = frame.filter(pl.col("heldout/accuracy").is_not_null())["heldout/accuracy"]
        runs[values_at][seed] = {"start": frame["heldout/accuracy_start"].drop_nulls()[0], "end": last[-1],
                                 "ev": frame["critic/explained_variance"].tail(10).mean(),
                                 "staleness": frame["critic/value_staleness_mean"].tail(10).mean()}
    seeds = sorted(set(runs["rollout"]) & set(runs["train"]))
    rows = [{"seed": k, "v0": f"{runs['rollout'][k]['start']:.3f}",
             **{f"{v} end": f"{runs[v][k]['end']:.3f}" for v in runs},
             "train - rollout": f"{runs['train'][k]['end'] - runs['rollout'][k]['end']:+.3f}",
             **{f"{v} EV (last 10)": f"{runs[v][k]['ev']:.3f}" for v in runs},
             "value staleness (rollout)": f"{runs['rollout'][k]['staleness']:.2f}"} for k in seeds]
    diff = [runs["train"][k]["end"] - runs["rollout"][k]["end"] for k in seeds]
    lo, hi = bootstrap_interval(diff) if len(diff) > 1 else (float("nan"), float("nan"))
    probes = pl.concat([pl.read_parquet(p) for p in sorted(work.glob("*.probe.parquet"))])
    probe_rows = [{"": name, "mean": f"{probes[column].mean():.3f}", "min": f"{probes[column].min():.3f}",
                   "max": f"{probes[column].max():.3f}"}
                  for name, column in (("advantage cosine", "advantage_cos"), ("policy gradient cosine", "grad_cos"),
                                       ("mean abs. value difference", "value_mean_abs_diff"),
                                       ("mean abs. advantage difference", "advantage_mean_abs_diff"))]
    return "\n\n".join([
        table(rows),
        f"Paired difference (train - rollout) over {len(seeds)} seeds: {np.mean(diff):+.3f} "
        f"[{lo:+.3f}, {hi:+.3f}] (95 % bootstrap), sign-flip p {sign_flip_p(diff):.3f}.",
        f"Gradient level, {probes.height} batches of the rollout runs (every step after the first, "
        f"{len(seeds)} seeds):\n\n" + table(probe_rows)])


def learn(work: Path) -> str:
    """Runs `{config}-seed{k}` under `work`: held-out accuracy at version 0 and at the end, and
    the critic's explained variance (mean of the last 10 steps, and its maximum)."""
    import polars as pl

    from benchmarks.common import table

    rows = []
    for run in sorted(work.glob("*-seed*")):
        metrics = run / "metrics.parquet"
        if not metrics.exists():
            continue
        frame = pl.read_parquet(metrics)
        accuracy = frame.filter(pl.col("heldout/accuracy").is_not_null())
        ev = frame["critic/explained_variance"] if "critic/explained_variance" in frame.columns else None
        start, end = frame["heldout/accuracy_start"].drop_nulls()[0], accuracy["heldout/accuracy"][-1]
        rows.append({"run": run.name, "steps": frame.height, "held-out v0": f"{start:.3f}",
                     "held-out end": f"{end:.3f}", "gain": f"{end - start:+.3f}",
                     "EV last 10": f"{ev.tail(10).mean():.3f}" if ev is not None else "-",
                     "EV max": f"{ev.max():.3f}" if ev is not None else "-"})
    return table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--steps", type=int, default=8)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--before", help="a checkout of an earlier commit with its own .venv: a GRPO arm run there")
    child = sub.add_parser("cost-child")
    child.add_argument("arm")
    child.add_argument("steps", type=int)
    v = sub.add_parser("values")
    v.add_argument("--work", required=True)
    v.add_argument("--seeds", type=int, default=4)
    v.add_argument("--steps", type=int, default=30)
    for name in ("values-report", "learn"):
        sub.add_parser(name).add_argument("--work", required=True)
    a = parser.parse_args()
    if a.command == "cost-child":
        print(json.dumps(cost_child(a.arm, a.steps)))
    elif a.command == "cost":
        print(cost(a.steps, a.repeats, a.before))
    elif a.command == "values-report":
        print(values_report(Path(a.work)))
    elif a.command == "learn":
        print(learn(Path(a.work)))
    elif a.command == "values":
        for seed in range(a.seeds):
            for values_at in ("rollout", "train"):
                path = Path(a.work) / f"{values_at}-seed{seed}.parquet"
                if not path.exists():
                    print(f"[critic values] {values_at} seed {seed}", flush=True)
                    values_run(values_at, seed, a.steps, path)


if __name__ == "__main__":
    main()
