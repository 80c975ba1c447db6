"""Benchmark: the policy store's per-step calls, each measured from an actor (as the generator and
the train step make them): milliseconds per blocking call, and per fire-and-forget call."""

from __future__ import annotations

import time

import ray
import torch

from benchmarks.common import ensure_ray


@ray.remote(num_cpus=0)
class Caller:
    def __init__(self, store) -> None:
        self.store = store
        self.model = torch.nn.Linear(128, 128)

    def time(self, calls: int) -> dict[str, float]:
        def per_call(fn) -> float:
            fn()  # warm
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return 1000 * (time.perf_counter() - started) / calls

        store = self.store  # a RayStore, the client every operator is handed
        store.publish(self.model.state_dict())  # version 0: admission for step 0 passes at once
        return {
            "admit (generator)": per_call(lambda: store.admit(0)),
            "newest weights + pin (generator)": per_call(lambda: store.weights(None, pin=True)),
            "latest_version (per decode step, partial rollouts)": per_call(store.latest_version),
            "stats (train step)": per_call(lambda: store.stats(reset_counters=True)),
            "publish 66 k params (train step)": per_call(lambda: store.publish(self.model.state_dict())),
            "add_counters, fire-and-forget (send only)": per_call(lambda: store.add_counters({"x": 1.0})),
        }


def run(calls: int = 200) -> list[dict]:
    from trajflow.pipelines.policy_store import RayStore

    ensure_ray()
    store = RayStore.start(0, False, final_version=10**9)
    caller = Caller.remote(store)
    ray.get(caller.time.remote(2))
    times = ray.get(caller.time.remote(calls))
    ray.kill(caller)
    store.kill()
    return [{"call": name, "ms per call": ms} for name, ms in times.items()]


if __name__ == "__main__":
    for r in run():
        print(r)
