"""Benchmark: one weight version from the trainer to a reader, object store vs collective
(`weight_sync.method`), float32 vs bf16 transfer, by model size (25 M, ~100 M, ~400 M
parameters, random init from a config).

The trainer and the reader are Ray actors on this node, each with one torch thread, like the
pipeline's. Per version:

- object_store: the trainer publishes its state dict (`RayStore.publish`: one float32 copy into
  the object store, blocking the trainer until the store registered it); the reader fetches the
  newest version and loads it into its model (all on the reader's critical path);
- collective: the trainer packs its weights into the weight server's buckets in the reader's
  dtype (`WeightServer.offer`: the only part that blocks the trainer) and its thread sends them
  over gloo while the trainer goes on; the reader's thread receives them in the background and
  the reader loads them when it next asks for the newest version.

Columns: `trainer s` the trainer's blocked time per version; `s per version` from the start of the
publish to the reader holding the version (not yet loaded); `idle s` the reader's (generator's)
own blocked time: it asks for the version after a simulated decode window of `busy` seconds
that started with the publish (the transfer overlaps it), then waits and loads; `MiB moved` the
bytes per version put into the object store or sent over the group, per reader.
"""

from __future__ import annotations

import time

import ray
import torch

from benchmarks.common import ensure_ray
from benchmarks.models import build_model

SIZES = ("25M", "100M", "400M")
BUSY_SECONDS = 1.0  # the reader's decode window per version (it generates meanwhile)


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, size: str, store, method: str, dtype: str) -> None:
        from trajflow.operators.trainer.weight_server import WeightServer
        from trajflow.operators.trainer.weight_sync import WeightSyncConfig

        torch.set_num_threads(1)
        self.model, self.store, self.server = build_model(size), store, None
        if method == "collective":
            config = WeightSyncConfig(method="collective", timeout_seconds=600)
            self.server = WeightServer(store, config, self.model.state_dict(), [dtype])

    def publish(self, version: int) -> tuple[float, float]:
        """(seconds the trainer is blocked, seconds until the version reached the reader)."""
        with torch.no_grad():  # a new version: different numbers, same tensors
            next(self.model.parameters()).add_(1.0)
        started = time.perf_counter()
        if self.server is None:
            self.store.publish(self.model.state_dict(), version)
            blocked = time.perf_counter() - started
            return blocked, blocked
        self.server.offer(version, self.model.state_dict().items())
        blocked = time.perf_counter() - started
        self.server.wait()
        return blocked, time.perf_counter() - started

    def readers(self) -> int:
        return len(self.server.readers) if self.server is not None else 1

    def moved_bytes(self) -> int:
        return self.server.moved_bytes if self.server is not None else self.store.stats().snapshot_bytes


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self, size: str, store, method: str, dtype: str) -> None:
        from trajflow.operators.trainer.weight_receiver import weight_source
        from trajflow.operators.trainer.weight_sync import WeightSyncConfig

        torch.set_num_threads(1)
        self.model = build_model(size).to(getattr(torch, dtype))
        self.store = store
        config = WeightSyncConfig(method=method, timeout_seconds=600)
        self.source = weight_source(store, config, dtype, history=False)
        self.source.newest()  # holding the starting version (the store's); collective: joining

    def take(self, version: int, busy: float) -> float:
        """Decode for `busy` seconds, then take `version` (waiting if it is not there yet) and load
        it; returns the seconds blocked after the decode window."""
        time.sleep(busy)
        started = time.perf_counter()
        self.store.wait_for_version(version)
        got, weights = self.source.newest()
        assert got == version, (got, version)
        self.model.load_state_dict(weights)
        return time.perf_counter() - started


def measure(size: str, method: str, dtype: str, versions: int) -> dict:
    from trajflow.pipelines.policy_store import RayStore

    store = RayStore.start(0, False, final_version=10**9)  # the trainer owns its versions
    store.publish(build_model(size).state_dict(), 0)
    trainer = Trainer.remote(size, store, method, dtype)
    reader = Reader.remote(size, store, method, dtype)
    ray.get(reader.take.remote(0, 0.0))
    while ray.get(trainer.readers.remote()) < 1:  # collective: the reader's thread joins
        time.sleep(0.05)
    blocked, latency, idle = [], [], []
    for version in range(1, versions + 1):
        taken = reader.take.remote(version, BUSY_SECONDS)
        b, s = ray.get(trainer.publish.remote(version))
        blocked.append(b)
        latency.append(s)
        idle.append(ray.get(taken))
    moved = ray.get(trainer.moved_bytes.remote())
    for actor in (trainer, reader):
        ray.kill(actor)
    store.kill()
    return {"trainer s": min(blocked), "s per version": min(latency), "idle s": min(idle), "MiB moved": moved / 2**20}


def run(sizes: tuple[str, ...] = SIZES, versions: int = 3) -> list[dict]:
    ensure_ray()
    rows = []
    for size in sizes:
        params = sum(p.numel() for p in build_model(size).parameters())
        runs = {"store": measure(size, "object_store", "float32", versions),
                "f32": measure(size, "collective", "float32", versions),
                "bf16": measure(size, "collective", "bfloat16", versions)}
        row: dict = {"model": f"{size} ({params / 1e6:.0f} M)"}
        for key in ("trainer s", "s per version", "idle s", "MiB moved"):
            row.update({f"{key} {name}": r[key] for name, r in runs.items()})
        row["s/version store / f32"] = runs["store"]["s per version"] / runs["f32"]["s per version"]
        row["s/version f32 / bf16"] = runs["f32"]["s per version"] / runs["bf16"]["s per version"]
        row["idle store / f32"] = runs["store"]["idle s"] / max(runs["f32"]["idle s"], 1e-6)
        rows.append(row)
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
