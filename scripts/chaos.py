"""Chaos: kill a random actor of a chosen kind at a random step of a `trajflow run`, by seed.

    python scripts/chaos.py --kind trainer_worker --seed 3 -- quickstart --set steps=8 ...

The run is `trajflow run ARGS` in a subprocess (its own embedded Ray). The seed picks the step
(1 .. steps-2) and, among the run's processes of that kind, the one to SIGKILL; the kill lands
while that step trains (once the previous step's metrics are written). The same seed and
arguments give the same step and the same choice (processes ordered by their start). Prints one
JSON line: the kind, seed, step, exit status, the steps with metrics, duplicate trajectory ids,
and the seconds from the kill to the step's metrics (the recovery time seen from outside).

Kinds (the process command lines they match): trainer_worker `TrainerRank` (needs
trainer.num_workers >= 2), train_step `TrainStep` (its fused stages too, in sync mode),
generator `Generate`, scorer `OldLogprobs` (a dedicated or snapshot scorer stage), store
`PolicyStoreActor`, learner `LearnerActor` (an agent's learner of a team on Ray).

`chaos_run` (what the tests use, through conftest's `chaos` fixture) takes several kills, each
(kind, step), in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = {"trainer_worker": "TrainerRank", "train_step": "TrainStep", "generator": "Generate",
         "scorer": "OldLogprobs", "store": "PolicyStoreActor", "learner": "LearnerActor"}
CLI = [sys.executable, "-m", "trajflow.jobs.cli"]


@dataclass
class Kill:
    kind: str
    step: int  # the step it lands in: once step - 1's metrics are written
    seconds: float | None = None  # from the kill to the step's metrics; None: never written


@dataclass
class ChaosResult:
    status: int
    output: str
    kills: list[Kill]  # the kills done, in order

    @property
    def killed(self) -> int:
        return len(self.kills)


def run_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # each run on its own embedded Ray
    return env


def chaos_run(run_args: list[str], run_dir: Path, kills: list[tuple[str, int]], log_path: Path, seed: int = 0,
              timeout: float = 300.0) -> ChaosResult:
    """`trajflow run RUN_ARGS --run-dir RUN_DIR`; for each (kind, step) of `kills` (steps
    increasing), one of the run's processes of that kind (drawn from `seed`) is SIGKILLed while
    that step trains, after the previous kill's step has its metrics. No kills: no kill."""
    import psutil

    rng = random.Random(seed)
    args = CLI + ["run", *run_args, "--run-dir", str(run_dir)]
    done: list[Kill] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=run_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            for kind, step in kills:
                before = run_dir / "metrics" / f"step={step - 1:06d}.parquet"
                while not before.is_file():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"chaos: the run ended or stalled before step {step - 1} (see {log_path})")
                    time.sleep(0.05)
                title = KINDS[kind]
                found = sorted((p for p in psutil.Process(proc.pid).children(recursive=True)
                                if title in " ".join(p.cmdline())), key=lambda p: (p.create_time(), p.pid))
                if not found:
                    raise RuntimeError(f"chaos: no {kind} process ({title!r}) in the run")
                victim = found[rng.randrange(len(found))]
                killed_at = time.monotonic()
                victim.kill()
                after = run_dir / "metrics" / f"step={step:06d}.parquet"
                while not after.is_file() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                done.append(Kill(kind, step, time.monotonic() - killed_at if after.is_file() else None))
            status = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return ChaosResult(status, log_path.read_text(), done)


def check_log(run_dir: Path) -> dict:
    """The steps with metrics and the number of trajectory ids logged more than once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from trajflow.schemas import read_parquet

    steps = sorted(int(p.stem.split("=")[1]) for p in (run_dir / "metrics").glob("step=*.parquet"))
    parts = sorted((run_dir / "trajectories").glob("step=*/part-*.parquet"))
    table = pa.concat_tables([read_parquet(p) for p in parts], promote_options="permissive") if parts else None
    duplicates = table.num_rows - pc.count_distinct(table["trajectory_id"]).as_py() if table is not None else 0
    return {"steps": steps, "rows": table.num_rows if table is not None else 0, "duplicate_ids": duplicates}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8, help="the run's steps (also passed as --set steps=N)")
    parser.add_argument("--step", type=int, default=None, help="the step to kill in (default: drawn from the seed)")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("run_args", nargs="+", help="after --: trajflow run's config and --set options")
    a = parser.parse_args(argv)
    if a.steps < 3:
        parser.error("--steps must be at least 3 (the kill lands on a step after the first)")
    a.run_dir.parent.mkdir(parents=True, exist_ok=True)
    step = random.Random(a.seed).randint(1, a.steps - 2) if a.step is None else a.step
    result = chaos_run([*a.run_args, "--set", f"steps={a.steps}"], a.run_dir, [(a.kind, step)],
                       a.run_dir.parent / f"{a.run_dir.name}.log", seed=a.seed)
    (kill,) = result.kills
    out = {"kind": a.kind, "seed": a.seed, "step": step, "status": result.status, "recovery_seconds": kill.seconds,
           "killed": result.killed}
    out.update(check_log(a.run_dir), last_line=result.output.strip().splitlines()[-1] if result.output.strip() else "")
    print(json.dumps(out))
    return 0 if result.status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
