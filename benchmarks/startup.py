"""Benchmark: where the time to the end of the first step goes, and the whole process tree, for
the quickstart settings (`jobs/configs/quickstart.yaml`), each measured in a fresh Python process
(cold: nothing imported, no Ray running), with stages colocated (default) and one process per
stage.

The driver's phases are timed from outside; inside each actor process the first metrics row
reports `startup_seconds/<stage>.process` (process creation to the stage group's constructor:
worker start, unpickling, imports of torch and transformers) and `startup_seconds/<stage>`
(constructing the stage: model and tokenizer loads); what remains to the first row is Ray Data's
first execution (planning, actor scheduling) and the first step's compute.
"""

from __future__ import annotations

import time

from benchmarks.common import run_script

PHASES = """
import json, os, sys, time
t0 = time.perf_counter()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from benchmarks.common import ProcessTree
from trajflow.jobs.config import load_job_config
from trajflow.pipelines.rl_loop import RLPipeline
import ray
from ray.data import DataContext
out = {"driver imports": time.perf_counter() - t0}
config = load_job_config("quickstart").pipeline_config().model_copy(update={"steps": 4, "colocate": sys.argv[1]})
t = time.perf_counter()
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
DataContext.get_current().enable_progress_bars = False
out["ray.init"] = time.perf_counter() - t
pipe = RLPipeline(config)
t = time.perf_counter()
pipe.start_store()
out["policy store + initial publish (driver loads the model)"] = time.perf_counter() - t
t = time.perf_counter()
rows = []
with ProcessTree(interval=0.5) as tree:
    for row in pipe.iter_metrics():
        rows.append((time.perf_counter() - t, row))
out["pipeline start to end of step 1"] = rows[0][0]
out["steps 2-4, s/step"] = (rows[-1][0] - rows[0][0]) / (len(rows) - 1)
out["total to end of step 1"] = time.perf_counter() - t0 - (rows[-1][0] - rows[0][0])
out["inside actors"] = {k.removeprefix("startup_seconds/"): v for k, v in rows[0][1].items()
                        if k.startswith("startup_seconds/")}
out["step 1 stages"] = {k.removeprefix("stage_seconds/"): v for k, v in rows[0][1].items()
                        if k.startswith("stage_seconds/")}
out["processes"] = pipe.layout()
out["tree"] = {"processes": tree.peak_processes, "threads": tree.peak_threads, "PSS GiB": tree.peak_pss_bytes / 2**30}
ray.shutdown()
print("RESULT " + json.dumps(out))
"""


def measure(colocate: str) -> dict:
    started = time.perf_counter()
    out = run_script(PHASES, colocate, timeout=900)
    out["process wall (incl. interpreter start, shutdown)"] = time.perf_counter() - started
    return out


def run() -> list[dict]:
    rows = []
    for colocate in ("auto", "off"):
        m = measure(colocate)
        inside = m.pop("inside actors")
        step = m.pop("step 1 stages")
        tree = m.pop("tree")
        rows.append({
            "colocate": colocate,
            **{k: v for k, v in m.items() if isinstance(v, float)},
            "actor process start + imports (per group)": " ".join(f"{k} {v:.1f}" for k, v in inside.items()
                                                                   if k.endswith(".process")),
            "stage construction s": " ".join(f"{k} {v:.1f}" for k, v in inside.items() if not k.endswith(".process")),
            "step 1 compute s": sum(step.values()),
            "layout": m["processes"],
            "tree processes": tree["processes"],
            "tree threads": tree["threads"],
            "tree peak PSS GiB": tree["PSS GiB"],
        })
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
