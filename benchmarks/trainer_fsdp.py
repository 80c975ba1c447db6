"""Benchmark: what each trainer worker holds under `trainer.sharding: fsdp`, by model size and
number of workers (25 M and ~100 M parameters, random init from a config).

Per size, side by side in one run: the replicated trainer (`sharding: none`, 1 worker: the
replica) and FSDP with 1, 2 and 4 workers. Each train step is built as the pipeline builds it
(worker 0 in this process, workers 1..N-1 as Ray actors in one gloo group on this node) and
trains one step of 16 rows of 32 + 32 tokens (`behavior`, 2 optimizer updates), publishing its
version after. Reported, per worker (the largest over the workers): the bytes of parameters,
gradients and AdamW state after the step's last update (`trainer/*_bytes`: the distinct storages
a worker holds, FSDP's padding to equal shards included), their sum, its ratio to the replica's
next to 1/N, and the step's seconds (for scale only: the workers share this machine's cores).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ensure_ray
from benchmarks.models import model_dir

SIZES = ("25M", "100M")
LAYOUTS = (("none", 1), ("fsdp", 1), ("fsdp", 2), ("fsdp", 4))
ROWS, PROMPT, RESPONSE = 16, 32, 32
KINDS = ("parameter", "gradient", "optimizer")


def step_rows(seed: int = 0):
    """One step's trained rows: random tokens of the character vocabulary, rewards and advantages."""
    from trajflow.schemas import from_rows

    rng = np.random.default_rng(seed)
    return from_rows([{
        "trajectory_id": f"s000000-p{i // 8:03d}-n{i % 8:03d}", "group_id": f"s000000-p{i // 8:03d}",
        "prompt_id": f"p{i // 8}", "prompt_tokens": rng.integers(4, 40, PROMPT).tolist(),
        "response_tokens": rng.integers(4, 40, RESPONSE).tolist(), "loss_mask": [True] * RESPONSE,
        "inference_logprobs": (-rng.uniform(0.5, 4.0, RESPONSE)).tolist(), "versions": [0] * RESPONSE,
        "finish_reason": "length", "reward": float(i % 2), "advantage": float(rng.normal()), "rollout_step": 0,
        "filter_reason": None,
    } for i in range(ROWS)])


def measure(model: Path, sharding: str, workers: int) -> dict:
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    config = PipelineConfig(model=model, strategy="behavior", prompts_per_step=2, group_size=8,
                            optimizer={"minibatches_per_step": 2},
                            trainer={"sharding": sharding, "num_workers": workers, "num_cpus": 0.25})
    pipe = RLPipeline(config)
    store = pipe.start_store()
    stage = pipe.stage("train")
    trainstep = stage.fn(store=store, **stage.kwargs)
    try:
        started = time.perf_counter()
        metrics = trainstep(step_rows()).to_pylist()[0]
        seconds = time.perf_counter() - started
    finally:
        trainstep.close()
        pipe.shutdown()
    return {**{kind: metrics[f"trainer/{kind}_bytes"] for kind in KINDS}, "seconds": seconds}


def run(sizes: tuple[str, ...] = SIZES, layouts: tuple[tuple[str, int], ...] = LAYOUTS) -> list[dict]:
    ensure_ray()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            model = model_dir(size, Path(root))
            results = {layout: measure(model, *layout) for layout in layouts}
            replica = sum(results[("none", 1)][kind] for kind in KINDS)
            for (sharding, workers), r in results.items():
                total = sum(r[kind] for kind in KINDS)
                rows.append({
                    "model": size, "sharding": sharding, "workers": workers,
                    **{f"{kind} MiB": r[kind] / 2**20 for kind in KINDS},
                    "total MiB / worker": total / 2**20, "total / replica": total / replica,
                    "1 / N": 1 / workers, "step s": r["seconds"],
                })
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
