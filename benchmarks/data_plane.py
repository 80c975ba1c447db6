"""Benchmark 4: tokens per second through reward + advantage + filter on one core (no Ray).

The light stages run fused in one Ray task in the pipeline; here they run in-process on a
synthetic step of realistic shape, so the number is the operators' own cost.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from trajflow.algorithms.config import AdvantageConfig
from trajflow.engines.models import WARM_START_DIR
from trajflow.operators.advantage import Advantage
from trajflow.operators.filter import Filter
from trajflow.operators.reward import Reward
from trajflow.pipelines.rl_loop import Fused
from trajflow.schemas import SamplingSemantics, conform
from trajflow.tasks.workload import Workload


def synthetic_step(rows: int, group_size: int, response_len: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, response_len + 1, rows)
    responses = [rng.integers(4, 14, n).astype(np.int32).tolist() for n in lengths]
    int_list, float_list = pa.list_(pa.int32()), pa.list_(pa.float32())
    table = pa.table({
        "trajectory_id": [f"t{i}" for i in range(rows)],
        "group_id": [f"g{i // group_size}" for i in range(rows)],
        "prompt_id": [f"p{i // group_size}" for i in range(rows)],
        "prompt_tokens": pa.array([[1, 5, 6, 41, 7, 44]] * rows, int_list),
        "response_tokens": pa.array(responses, int_list),
        "loss_mask": pa.array([[True] * n for n in lengths], pa.list_(pa.bool_())),
        "inference_logprobs": pa.array([(-rng.random(n)).astype(np.float32).tolist() for n in lengths], float_list),
        "versions": pa.array([[0] * n for n in lengths], int_list),
        "old_logprobs": pa.nulls(rows, float_list),
        "finish_reason": ["stop"] * rows,
        "reward": pa.nulls(rows, pa.float32()),
        "advantage": pa.nulls(rows, pa.float32()),
        "prompt": [f"{i // group_size}+1=" for i in range(rows)],
        "answer": [str(rng.integers(0, 1000)) for _ in range(rows)],
        "rollout_step": pa.array(np.zeros(rows, np.int32)),
    })
    return conform(table, SamplingSemantics(1.0, 1.0, 0))


def run(rows: int = 4096, group_size: int = 8, response_len: int = 32, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    batch = synthetic_step(rows, group_size, response_len)
    tokens = int(np.sum([len(r) for r in batch["response_tokens"].to_pylist()]))
    stages = {"reward": Reward(WARM_START_DIR, Workload(task="addition"), ()), "advantage": Advantage(AdvantageConfig()),
              "filter": Filter(True)}
    stages["reward"](batch)  # load the tokenizer outside the timing
    results = {}
    out = batch
    for name, stage in stages.items():
        best = min(_timed(stage, out) for _ in range(repeats))
        results[f"{name} tokens/s"] = tokens / best
        out = stage(out)
    fused = Fused(list(stages.values()))
    results["reward+advantage+filter tokens/s"] = tokens / min(_timed(fused, batch) for _ in range(repeats))
    results["rows"], results["tokens"] = rows, tokens
    return results


def _timed(fn, batch) -> float:
    t0 = time.perf_counter()
    fn(batch)
    return time.perf_counter() - t0


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:>36}: {value:,.0f}")
