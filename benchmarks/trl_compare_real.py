"""Benchmark: TRL's GRPOTrainer and trajflow side by side on the real model (issue 32).

Both train SmolLM2-135M-Instruct (4-bit-quantized Q4_1 weights, dequantized to float32: the
directory `trajflow prepare smollm2` makes) on the same data (artifacts/smollm2/train.jsonl, chat
messages through SmolLM2's chat template), with the same prompts x group, max_new_tokens, lr,
sampling (temperature 1, no top-k / top-p), float32 on the CPU, one optimizer step per rollout at
a constant lr (TRL's default schedule decays it linearly; trajflow's is constant), no KL term, and
the same reward (trajflow's `reward: math`, math-verify). TRL is the `bench` extra.

Each system runs as one fresh process, launched and awaited by this one: wall is enter to exit
(imports, model loading, Ray's start for trajflow, every step, the final checkpoint trajflow always
writes), the whole process tree's peak PSS is sampled from outside (`ProcessTree(pid=...)`), and
the systems are interleaved over `repeats` so a slow spell of the machine hits each. Rates, like
for like: completions per second (every sampled response, trained or not) and trained tokens per
second (response tokens that entered a backward pass: TRL trains every row, trajflow by default
only groups with reward variance). The steady s/step is the mean step time from the second step on.

    python -m benchmarks.trl_compare_real --steps 6 --repeats 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ProcessTree

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "artifacts" / "smollm2" / "train.jsonl"

TRL = r"""
import json, os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
spec = json.loads(sys.argv[1])
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trajflow.engines.models import load_model, load_tokenizer
from trajflow.tasks.rewards import MathVerify

torch.set_num_threads(spec["threads"])
rows = [json.loads(line) for line in open(spec["data"])]
data = Dataset.from_list(rows[: spec["prompts"] * (spec["steps"] + 1)])
verify = MathVerify()

def reward(prompts, completions, answer, **_):
    return verify(prompts, [c[-1]["content"] for c in completions], answer)

ends = []
class Clock(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        ends.append(time.time())

args = GRPOConfig(output_dir=spec["out"], per_device_train_batch_size=spec["prompts"] * spec["group"],
                  num_generations=spec["group"], max_completion_length=spec["max_new_tokens"],
                  learning_rate=spec["lr"], lr_scheduler_type="constant", max_steps=spec["steps"], beta=0.0,
                  temperature=1.0, top_k=0, top_p=1.0, use_cpu=True, bf16=False, report_to="none",
                  save_strategy="no", logging_steps=1, disable_tqdm=True, seed=spec["seed"], disable_dropout=True)
tokenizer = load_tokenizer(spec["model"])
trainer = GRPOTrainer(model=load_model(spec["model"]), reward_funcs=reward, args=args, train_dataset=data,
                      processing_class=tokenizer, callbacks=[Clock()])
trainer.train()
logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
rows_per_step = spec["prompts"] * spec["group"]
print("RESULT " + json.dumps({
    "step_ends": ends, "completions": rows_per_step * len(logs),
    "trained_tokens": sum(h["completions/mean_length"] * rows_per_step for h in logs),
    "clipped_ratio": [h.get("completions/clipped_ratio") for h in logs],
    "reward": [h.get("reward") for h in logs]}))
"""


TRL_NAME = "TRL GRPOTrainer (sync, every row)"
DEFAULTS = "defaults"  # a system's overrides with this key set no thread counts: trajflow chooses them


def _systems(all_rows_async: int, threads: int) -> dict[str, tuple[str, dict | None]]:
    """name -> (short name, trajflow overrides; None: TRL)."""
    every_row_async = {"max_staleness": all_rows_async, "drop_zero_variance_groups": False}
    return {
        TRL_NAME: ("trl", None),
        # what a user's config gets: `auto` threads and micro-batches, `old_logprob_forward: auto`
        "trajflow sync, every row, defaults": ("sync_default", {"max_staleness": 0, "drop_zero_variance_groups": False,
                                                               DEFAULTS: True}),
        f"trajflow async (max_staleness {all_rows_async}), every row, defaults": (
            "async_default", {**every_row_async, DEFAULTS: True}),
        "trajflow sync, every row": ("sync_all", {"max_staleness": 0, "drop_zero_variance_groups": False}),
        f"trajflow async (max_staleness {all_rows_async}), every row": ("async_all", every_row_async),
        # the trainer is async's bottleneck (a train step at 1 thread takes 1.9x its 2-thread time):
        # it gets every thread, the generator and scorer 1 each, oversubscribing the cores
        f"trajflow async (max_staleness {all_rows_async}), every row, trainer {threads} threads": (
            "async_all_trainer", {**every_row_async, "trainer.torch_threads": threads}),
        "trajflow default filter (sync)": ("sync_filter", {"max_staleness": 0}),
        # bypass: the inference log-probs as old ones, no second forward (TRL's on-policy choice);
        # in float32 the snapshot's forward moves them by < 3e-5 here (benchmarks/results/real_model.md)
        f"trajflow async (max_staleness {all_rows_async}), every row, trainer {threads} threads, behavior": (
            "async_behavior", {**every_row_async, "trainer.torch_threads": threads, "strategy": "behavior"}),
    }


def _launch(command: list[str], log: Path) -> tuple[float, ProcessTree, int]:
    """Run `command` to its end: (wall seconds, its tree's peaks, exit status)."""
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        with ProcessTree(interval=0.5, pid=proc.pid) as tree:
            code = proc.wait()
    return time.time() - started, tree, code


def run_trl(spec: dict, work: Path) -> dict:
    log = work / "trl.log"
    wall, tree, code = _launch([sys.executable, "-c", TRL, json.dumps({**spec, "out": str(work / "trl")})], log)
    line = next((x for x in log.read_text().splitlines() if x.startswith("RESULT ")), None)
    if code or line is None:
        raise RuntimeError(f"TRL failed ({code}); see {log}")
    result = json.loads(line.removeprefix("RESULT "))
    shutil.rmtree(work / "trl", ignore_errors=True)  # its final model: GBs per run, nothing read from it
    ends = result.pop("step_ends")
    return {**result, "wall": wall, "pss": tree.peak_pss_bytes, "processes": tree.peak_processes,
            "s_per_step": (ends[-1] - ends[0]) / max(1, len(ends) - 1), "steps": len(ends)}


def run_trajflow(spec: dict, overrides: dict, work: Path, name: str) -> dict:
    import pyarrow.compute as pc

    from trajflow.jobs.recorder import RunPaths, read_metrics
    from trajflow.pipelines.replay import load_trajectories

    run_dir = work / name
    overrides = dict(overrides)
    # hand-set threads (unless the system takes the defaults): sync, one process runs every stage
    # in turn and gets all threads; async, a process per side
    threads = spec["threads"] if overrides.get("max_staleness", 0) == 0 else 1
    hand_set = {} if overrides.pop(DEFAULTS, False) else {
        "trainer.torch_threads": threads, "generator.torch_threads": threads, "scorer.torch_threads": threads}
    sets = {"model": spec["model"], "steps": spec["steps"], "prompts_per_step": spec["prompts"],
            "group_size": spec["group"], "sampling.max_new_tokens": spec["max_new_tokens"], "optimizer.lr": spec["lr"],
            "seed": spec["seed"], "inference_dtype": "float32", "eval_every": 0, "report_to": [],
            "checkpoint_every": 0, **hand_set, **overrides}
    command = [sys.executable, "-m", "trajflow.jobs.cli", "run", "smollm2", "--run-dir", str(run_dir), "--no-progress"]
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(value) if isinstance(value, bool) else value}"]
    wall, tree, code = _launch(command, work / f"{name}.log")
    if code:
        raise RuntimeError(f"trajflow failed ({code}); see {work / f'{name}.log'}")
    metrics = read_metrics(RunPaths(run_dir))
    trained_tokens = completions = cut = 0
    gap_max = gap_sum = gap_tokens = 0.0  # |old - inference log-prob| where the strategy scored old ones
    for table in load_trajectories(run_dir / "trajectories").values():
        completions += table.num_rows
        scored = table.filter(pc.is_valid(table["old_logprobs"]))
        if scored.num_rows:
            gap = pc.abs(pc.subtract(pc.list_flatten(scored["old_logprobs"]),
                                     pc.list_flatten(scored["inference_logprobs"])))
            gap_max = max(gap_max, pc.max(gap).as_py() or 0.0)
            gap_sum += pc.sum(gap).as_py() or 0.0
            gap_tokens += len(gap) - gap.null_count
        cut += int(pc.sum(pc.equal(table["finish_reason"], "length")).as_py() or 0)
        trained = table.filter(pc.is_null(table["filter_reason"]))
        trained_tokens += int(pc.sum(pc.list_value_length(trained["response_tokens"])).as_py() or 0)
    ends = metrics.sort("step")["seconds/step_end"].to_list()
    for weights in ("checkpoints", "versions"):  # GBs per run; the logs, metrics and trajectories stay
        shutil.rmtree(run_dir / weights, ignore_errors=True)
    return {"wall": wall, "pss": tree.peak_pss_bytes, "processes": tree.peak_processes, "completions": completions,
            "trained_tokens": trained_tokens, "s_per_step": (ends[-1] - ends[0]) / max(1, len(ends) - 1),
            "steps": metrics.height, "reward": metrics["reward/mean"].to_list(),
            "rows_trained": int(metrics["rows_trained"].sum()), "clipped_ratio": cut / max(1, completions),
            "old_vs_inference_max": gap_max if gap_tokens else None,
            "old_vs_inference_mean": gap_sum / gap_tokens if gap_tokens else None}


def run(steps: int, repeats: int, prompts: int = 8, group: int = 4, max_new_tokens: int = 96, lr: float = 1e-5,
        threads: int = 2, async_staleness: int = 1, work: Path | None = None,
        only: list[str] | None = None) -> dict:
    """Every system (or TRL and the ones whose short names are in `only`), interleaved."""
    from trajflow.engines.prepared import SMOLLM2, prepare

    spec = {"model": str(prepare(SMOLLM2.name)), "data": str(DATA), "steps": steps, "prompts": prompts,
            "group": group, "max_new_tokens": max_new_tokens, "lr": lr, "seed": 0, "threads": threads}
    work = work or Path(tempfile.mkdtemp(prefix="trajflow-trl-real-"))
    systems = {name: system for name, system in _systems(async_staleness, threads).items()
               if only is None or system[1] is None or system[0] in only}
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(repeats):  # interleaved
        for name, (short, overrides) in systems.items():
            where = work / f"r{r}"
            where.mkdir(parents=True, exist_ok=True)
            result = run_trl(spec, where) if overrides is None else run_trajflow(spec, overrides, where, short)
            results[name].append(result)
            print(f"[trl_compare_real r{r}] {name}: wall {result['wall']:.0f} s, {result['s_per_step']:.1f} s/step, "
                  f"PSS {result['pss'] / 2**30:.2f} GiB", flush=True)
    return {"spec": spec, "repeats": repeats, "load_1min_end": os.getloadavg()[0], "results": results}


def table_rows(data: dict) -> list[dict]:
    """Per system: min..max over repeats, and ratios to TRL from the best of each (side by side)."""
    results = data["results"]
    trl = results[TRL_NAME]

    def best(runs, key, fn=min):
        return fn(r[key] for r in runs)

    rows = []
    for name, runs in results.items():
        wall = [r["wall"] for r in runs]
        rate = [r["completions"] / r["wall"] for r in runs]
        tokens = [r["trained_tokens"] / r["wall"] for r in runs]
        rows.append({
            "system": name,
            "wall s (enter to exit)": f"{min(wall):.0f}..{max(wall):.0f}",
            "wall vs TRL": f"{min(wall) / best(trl, 'wall'):.2f}",
            "s/step (steady)": f"{best(runs, 's_per_step'):.1f}",
            "s/step vs TRL": f"{best(runs, 's_per_step') / best(trl, 's_per_step'):.2f}",
            "completions/s": f"{max(rate):.2f}",
            "trained tokens/s": f"{max(tokens):.0f}",
            "trained tokens/s vs TRL": f"{max(tokens) / max(r['trained_tokens'] / r['wall'] for r in trl):.2f}",
            "peak PSS GiB (tree)": f"{best(runs, 'pss', max) / 2**30:.2f}",
            "PSS vs TRL": f"{best(runs, 'pss', max) / best(trl, 'pss', max):.2f}",
        })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path)
    p.add_argument("--out", type=Path, help="write the raw results (JSON) here")
    p.add_argument("--only", nargs="+", metavar="SHORT", help="TRL and these trajflow systems (e.g. async_all)")
    a = p.parse_args()
    from benchmarks.common import table

    data = run(a.steps, a.repeats, a.prompts, a.group, a.max_new_tokens, a.lr, a.threads, work=a.work, only=a.only)
    if a.out:
        a.out.write_text(json.dumps(data, indent=1))
    print(table(table_rows(data)))


if __name__ == "__main__":
    main()
