"""Benchmark: what publishing a weight version costs per train step, by model size (0.6 M, 25 M,
~100 M parameters, random init from a config), before and after #15.

- before: the trainer cloned its weights, put them as a pickled torch state dict, and the policy
  store re-put every version to own it (one more full copy per publish);
- after: `RayStore.publish` puts a `SharedStateDict` (one copy, straight from the parameters into
  shared memory) and the store keeps the trainer's object (it copies only a run's final version).

Per size: the trainer's seconds per publish (until the store has registered the version), a
reader's seconds to fetch the newest version and load it into its model (what a generator or
scorer does once per version), and the bytes per version (and copies) in the object store.
"""

from __future__ import annotations

import time

import ray
import torch

from benchmarks.common import ensure_ray
from benchmarks.models import SIZES, build_model


@ray.remote(num_cpus=0)
class Publisher:
    def __init__(self, size: str, store) -> None:
        torch.set_num_threads(1)
        self.model, self.store = build_model(size), store

    def publish(self, before: bool) -> float:
        started = time.perf_counter()
        if before:  # a cloned state dict, put as it is (the store actor's raw method)
            state = {k: v.detach().to(torch.float32).clone() for k, v in self.model.state_dict().items()}
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            ray.get(self.store.actor.put.remote([ray.put(state)], nbytes))
        else:
            self.store.publish(self.model.state_dict())
        return time.perf_counter() - started


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self, size: str, store) -> None:
        torch.set_num_threads(1)
        self.model, self.store = build_model(size), store

    def fetch(self) -> float:
        started = time.perf_counter()
        self.model.load_state_dict(self.store.weights()[1])
        return time.perf_counter() - started


def measure(size: str, before: bool, repeats: int) -> dict:
    from trajflow.pipelines.policy_store import RayStore

    # before: the store owned (re-put) every version; after: only the final one, never reached here
    store = RayStore.start(0, False, final_version=None if before else 10**9)
    publisher, reader = Publisher.remote(size, store), Reader.remote(size, store)
    publish_s, fetch_s = [], []
    for _ in range(repeats):
        publish_s.append(ray.get(publisher.publish.remote(before)))
        fetch_s.append(ray.get(reader.fetch.remote()))
    nbytes = store.stats().snapshot_bytes
    for actor in (publisher, reader):
        ray.kill(actor)
    store.kill()
    return {"publish s": min(publish_s), "fetch + load s": min(fetch_s), "bytes": nbytes}


def run(sizes: tuple[str, ...] = tuple(SIZES), repeats: int = 3) -> list[dict]:
    ensure_ray()
    rows = []
    for size in sizes:
        params = sum(p.numel() for p in build_model(size).parameters())
        before, after = measure(size, True, repeats), measure(size, False, repeats)
        rows.append({
            "model": f"{size} ({params / 1e6:.1f} M params)",
            "MiB per version": after["bytes"] / 2**20,
            "publish s before": before["publish s"],
            "publish s after": after["publish s"],
            "publish speed-up": before["publish s"] / after["publish s"],
            "fetch + load s before": before["fetch + load s"],
            "fetch + load s after": after["fetch + load s"],
        })
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
