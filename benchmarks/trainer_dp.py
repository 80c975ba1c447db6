"""Benchmark: what data-parallel training adds per optimizer update, by model size (0.6 M, 25 M,
~100 M parameters, random init from a config), with 2 workers on this node (gloo over loopback).

Per size, measured side by side in the same two worker processes:
- the gradient all-reduce of one update: one flat float32 buffer of every parameter (plus the
  loss sum and count), as the train step does it (operators/trainer/plan.py `Collective`);
- the forward + backward of one micro-batch (8 rows x 64 tokens, 1 thread) for scale;
- publishing the new version from worker 0 (one `SharedStateDict` put + the store's registration,
  operators/trainer/services.py), and its bytes: only worker 0 publishes, so N workers add no copy.

The all-reduce's bus bandwidth (2 (N-1)/N x bytes / seconds, the ring algorithm's traffic per
worker) is the constant docs/scaling.md extrapolates from.
"""

from __future__ import annotations

import time

import ray
import torch

from benchmarks.common import ensure_ray
from benchmarks.models import SIZES, build_model

ROWS, TOKENS = 8, 64


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, size: str, rank: int, world_size: int) -> None:
        from trajflow.operators.trainer.collective import listening_socket

        torch.set_num_threads(1)
        self.model, self.rank, self.world_size = build_model(size), rank, world_size
        self.listen = listening_socket("127.0.0.1") if rank == 0 else None

    def port(self) -> int:
        return self.listen.getsockname()[1]

    def join(self, port: int) -> None:
        from trajflow.operators.trainer.collective import Collective

        self.collective = Collective(self.rank, self.world_size, host="127.0.0.1", port=port, listen=self.listen)

    def allreduce(self, repeats: int) -> float:
        numel = sum(p.numel() for p in self.model.parameters()) + 2
        flat = torch.ones(numel)
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.collective.all_reduce_sum(flat)
            seconds.append(time.perf_counter() - started)
        return min(seconds)

    def forward_backward(self, repeats: int) -> float:
        tokens = torch.randint(4, 60, (ROWS, TOKENS))
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.model(input_ids=tokens).logits.float().logsumexp(-1).mean().backward()
            seconds.append(time.perf_counter() - started)
        self.model.zero_grad(set_to_none=True)
        return min(seconds)

    def publish(self, store, repeats: int) -> float:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            store.publish(self.model.state_dict())
            seconds.append(time.perf_counter() - started)
        return min(seconds)


def measure(size: str, repeats: int) -> dict:
    from trajflow.pipelines.policy_store import RayStore

    workers = [Worker.remote(size, rank, 2) for rank in range(2)]
    port = ray.get(workers[0].port.remote())
    ray.get([w.join.remote(port) for w in workers])
    allreduce = max(ray.get([w.allreduce.remote(repeats) for w in workers]))
    compute = ray.get(workers[0].forward_backward.remote(repeats))
    store = RayStore.start(0, False, final_version=10**9)
    publish = ray.get(workers[0].publish.remote(store, repeats))
    nbytes = store.stats().snapshot_bytes
    for actor in workers:
        ray.kill(actor)
    store.kill()
    params = sum(p.numel() for p in build_model(size).parameters())
    return {
        "model": f"{size} ({params / 1e6:.1f} M params)",
        "all-reduce s / update": allreduce,
        "bus GB/s": 2 * (2 - 1) / 2 * params * 4 / allreduce / 1e9,
        f"fwd+bwd s ({ROWS}x{TOKENS} tokens)": compute,
        "all-reduce / fwd+bwd": allreduce / compute,
        "publish s (worker 0)": publish,
        "MiB per version": nbytes / 2**20,
    }


def run(sizes: tuple[str, ...] = tuple(SIZES), repeats: int = 3) -> list[dict]:
    ensure_ray()
    return [measure(size, repeats) for size in sizes]


if __name__ == "__main__":
    for row in run():
        print(row)
