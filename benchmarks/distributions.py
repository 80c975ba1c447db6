"""What the distributions cost: bytes per response token in the trajectory log and the time of a
train step, at top_k_logprobs K = 0, 8, 64, beside today's record (the code before them).

Each configuration runs the same synchronous snapshot pipeline in a process of its own
(pipelines/local.py: every stage in one process, so the step time is the step's compute: generate,
reward, the old log-prob scorer, the train step) and logs every trained step's rows as the job's
trajectory log does (schemas.write_parquet of the conformed batch). "today" is the same run on the
base commit's code (a `git archive` of `--base`, imported instead of this tree), so K = 0 is
compared with the record as it was. Runs are interleaved by round (today, K=0, K=8, K=64, then
again), the step times of all rounds pooled per configuration after the first `--skip` steps of
each run; the table gives medians and their ratio to today, never asserts.

Bytes are deterministic (same seed, same rows): they do not depend on the machine's load. Step
times do: run the timed part on a quiet machine.

    python -m benchmarks.distributions                 # both parts, results/distributions_cost.md
    python -m benchmarks.distributions --part bytes    # bytes only (any machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "distributions_cost.md"
CONFIGS = ("today", 0, 8, 64)
SETTINGS = dict(strategy="snapshot", prompts_per_step=64, group_size=8, max_staleness=0, inference_dtype="bfloat16",
                drop_zero_variance_groups=False, seed=0)


def worker(k: int | None, steps: int, out: Path) -> dict:
    """One run in this process (this tree's trajflow, or the base tree's on PYTHONPATH): per-step
    wall seconds and the trajectory log's bytes and response tokens. k None: no top_k_logprobs key
    (today's code has none)."""
    import pyarrow.compute as pc
    import torch

    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.rl_loop import RLPipeline
    from trajflow.schemas import conform, write_parquet

    torch.set_num_threads(1)
    config = PipelineConfig(**SETTINGS, steps=steps, **({} if k is None else {"top_k_logprobs": k}))
    pipe = RLPipeline(config)
    marks, logged = [time.perf_counter()], {"bytes": 0, "tokens": 0}

    def on_rows(trainstep, batch, step):  # the job's trajectory log (jobs/recorder.py): one file per step
        path = write_parquet(conform(batch), out / f"step={step:06d}.parquet")
        logged["bytes"] += path.stat().st_size
        logged["tokens"] += int(pc.sum(pc.list_value_length(batch["response_tokens"])).as_py())

    def on_step(trainstep, batch, metrics):
        marks.append(time.perf_counter())

    pipe.hooks.on_rows, pipe.hooks.on_step = on_rows, on_step
    run_in_process(pipe)
    columns = sorted(c for c in batch_columns(out) if c.startswith("top_k_"))
    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])], **logged, "top_k_columns": columns}


def batch_columns(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_schema(next(out.glob("*.parquet"))).names


def base_tree(ref: str, root: Path) -> Path:
    """The base commit's code laid out as the installed package `trajflow` (its folders are the
    package's subpackages, pyproject's package-dir), under root/pkg; returns that PYTHONPATH."""
    archive = root / "base.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", ref], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")
    src, pkg = root / "src", root / "pkg" / "trajflow"
    pkg.mkdir(parents=True)
    for item in (src / "trajflow").iterdir():
        (pkg / item.name).symlink_to(item)
    for folder in ("schemas", "operators", "algorithms", "engines", "tasks", "pipelines", "jobs"):
        (pkg / folder).symlink_to(src / folder)
    return root / "pkg"


def run_one(config, steps: int, pythonpath: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if pythonpath is not None:  # the base tree before the editable install of this one
            env["PYTHONPATH"] = str(pythonpath)
        k = "none" if config == "today" else str(config)
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", k, "--steps", str(steps),
                               "--out", out], capture_output=True, text=True, env=env, cwd=out)
        if proc.returncode:
            raise RuntimeError(f"{config}: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("bytes", "time", "all"), default="all")
    p.add_argument("--base", default="0b427e5", help="the commit whose code is 'today'")
    p.add_argument("--steps", type=int, default=8, help="train steps per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the timed part")
    p.add_argument("--skip", type=int, default=2, help="first steps of each run left out of the times")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        print(json.dumps(worker(None if a.worker == "none" else int(a.worker), a.steps, a.out)))
        return 0

    rounds = 1 if a.part == "bytes" else a.rounds
    steps = 2 if a.part == "bytes" else a.steps
    runs: dict = {c: [] for c in CONFIGS}
    started = time.time()
    with tempfile.TemporaryDirectory() as root:
        today = base_tree(a.base, Path(root))
        for r in range(rounds):
            for config in CONFIGS:
                runs[config].append(run_one(config, steps, today if config == "today" else None))
                print(f"round {r + 1}/{rounds} {config}: {time.time() - started:.0f}s", flush=True)
    write_results(runs, a, steps)
    return 0


def write_results(runs: dict, a, steps: int) -> None:
    from benchmarks.common import machine

    base = runs["today"][0]
    lines = [f"# The distributions' cost: top_k_logprobs K = 0, 8, 64 against today ({a.base})", "",
             f"{machine()}; snapshot, {SETTINGS['prompts_per_step']} x {SETTINGS['group_size']} rows per step, "
             f"bf16 inference, max_new_tokens 6, synchronous in one process (pipelines/local.py); "
             f"`python -m benchmarks.distributions --part {a.part}"
             + (f" --rounds {a.rounds}`." if a.part != "bytes" else "`."), "",
             "| record | top-k columns | log bytes / response token | vs today |"
             + (" step seconds (median) | vs today |" if a.part != "bytes" else ""),
             "|---|---|---|---|" + ("---|---|" if a.part != "bytes" else "")]
    times = {c: [t for run in rs for t in run["step_seconds"][a.skip:]] for c, rs in runs.items()}
    for config, rs in runs.items():
        per_token = rs[0]["bytes"] / rs[0]["tokens"]
        row = (f"| {'today' if config == 'today' else f'K = {config}'} | {', '.join(rs[0]['top_k_columns']) or '-'} "
               f"| {per_token:.2f} | {per_token / (base['bytes'] / base['tokens']):.3f} |")
        if a.part != "bytes":
            median = statistics.median(times[config])
            row += f" {median:.3f} | {median / statistics.median(times['today']):.3f} |"
        lines.append(row)
    if a.part != "bytes":
        lines += ["", f"Step times: {a.rounds} interleaved rounds x {steps} steps per configuration, the first "
                  f"{a.skip} of each run left out ({len(times['today'])} steps per configuration). Median step "
                  "seconds of each run, by round (the spread is the machine's load, which others share):", ""]
        lines += [f"- {'today' if c == 'today' else f'K = {c}'}: "
                  + ", ".join(f"{statistics.median(run['step_seconds'][a.skip:]):.3f}" for run in rs)
                  for c, rs in runs.items()]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
