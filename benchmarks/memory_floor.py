"""Benchmark: what the quickstart's process tree cannot go below, and what its stages add.

Issue 36 asks for a tree peak of at most 1.5 GB PSS. Two numbers bound that from below, measured
in cold processes (nothing imported before):

- The import floor: two interpreters importing what each torch actor of the asynchronous
  quickstart imports (torch, transformers' modeling and Llama, Ray, Ray Data, polars, pyarrow,
  trajflow's generate and train modules), and one importing what a driver without torch would
  (Ray, Ray Data, polars, pyarrow, pydantic, a fast tokenizer), all three alive at once; PSS of
  each (shared pages split among the processes that map them, so the sum is the tree's).
- The working memory: the quickstart's stages built in one process as their actors build them
  (policy store in-process, model loaded from the warm start) and run for a few steps; the
  process's USS after each stage and its peak RSS so far.

Ray's own processes (GCS, raylet, agents, log monitor, the policy store's worker) come from a
real run's tree: `python -m benchmarks.startup`.

    python -m benchmarks.memory_floor [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil

from benchmarks.common import machine, run_script

ACTOR_IMPORTS = ("import torch, transformers.modeling_utils; from transformers import LlamaForCausalLM; "
                 "import ray, ray.data, polars, pyarrow; "
                 "import trajflow.operators.generate, trajflow.operators.train_step")
DRIVER_IMPORTS = ("import ray, ray.data, polars, pyarrow, pydantic, tokenizers, transformers; "
                  "from transformers import PreTrainedTokenizerFast; import sys; "
                  "assert 'torch' not in sys.modules, 'the torch-free driver imported torch'")
HOLD = "; import sys; print('ready', flush=True); sys.stdin.read()"

# the quickstart's stages in one process, USS after each (MiB) and peak RSS so far (MiB)
STAGES = r'''
import json, resource, sys
import psutil
import torch
torch.set_num_threads(1)  # as in an actor
from trajflow.engines.models import load_model
from trajflow.jobs.config import load_job_config, resolve_config_path
from trajflow.pipelines.local import build
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline

me = psutil.Process()
def point(label):
    return {"at": label, "uss_mib": me.memory_full_info().uss / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
points = [point("imports")]
pipe = RLPipeline(load_job_config(resolve_config_path("quickstart")).pipeline_config())
store = InProcessStore(pipe.config.max_staleness, pipe.strategy.keep_history)
store.publish(load_model(pipe.model_path).state_dict(), 0)
operators = [(stage.name, build(stage, store)) for stage in pipe.stages]
points.append(point("stages built"))
for step in range(int(sys.argv[1])):
    batch = pipe.prompts.step_rows(step)
    for name, operator in operators:
        batch = operator(batch)
        points.append(point(f"step {step} {name}"))
print("RESULT " + json.dumps(points))
'''


def import_floor() -> dict[str, float]:
    """PSS (MiB) of two torch-actor interpreters and one torch-free driver, alive together."""
    procs = {name: subprocess.Popen([sys.executable, "-c", code + HOLD], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
             for name, code in (("torch actor 1", ACTOR_IMPORTS), ("torch actor 2", ACTOR_IMPORTS),
                                ("driver without torch", DRIVER_IMPORTS))}
    try:
        for name, proc in procs.items():
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{name}: its imports failed (exit {proc.wait()})")
        time.sleep(1.0)
        return {name: psutil.Process(proc.pid).memory_full_info().pss / 2**20 for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def report(steps: int) -> str:
    floor = import_floor()
    stages = run_script(STAGES, str(steps))
    lines = [f"Machine: {machine()}",
             "", "| process (imports only, the three alive together) | PSS MiB |", "|---|---|"]
    lines += [f"| {name} | {pss:.0f} |" for name, pss in floor.items()]
    lines += [f"| sum | {sum(floor.values()):.0f} |",
              "", "| after (one process, the quickstart's stages) | USS MiB | peak RSS so far MiB |", "|---|---|---|"]
    lines += [f"| {p['at']} | {p['uss_mib']:.0f} | {p['peak_rss_mib']:.0f} |" for p in stages]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="quickstart steps through the stages (default 4)")
    args = parser.parse_args()
    print(report(args.steps))
    print(json.dumps({"load_1min": psutil.getloadavg()[0]}))


if __name__ == "__main__":
    main()
