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
        from trajflow.operators.after_step import publish_weights

        def per_call(fn) -> float:
            fn()  # warm
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return 1000 * (time.perf_counter() - started) / calls

        store = self.store
        publish_weights(store, self.model)  # version 0: admission for step 0 passes at once
        return {
            "admit (generator)": per_call(lambda: ray.get(store.admit.remote(0))),
            "get newest + pin (generator)": per_call(lambda: ray.get(store.get.remote(None, True))),
            "fetch weights object (generator)": per_call(lambda: ray.get(ray.get(store.get.remote(None))[1][0])),
            "latest_version (per decode step, partial rollouts)": per_call(
                lambda: ray.get(store.latest_version.remote())),
            "stats (train step)": per_call(lambda: ray.get(store.stats.remote(True))),
            "publish 66 k params (train step)": per_call(lambda: publish_weights(store, self.model)),
            "add_counters, fire-and-forget (send only)": per_call(lambda: store.add_counters.remote({"x": 1.0})),
        }


def run(calls: int = 200) -> list[dict]:
    from trajflow.pipelines.policy_store import PolicyStore

    ensure_ray()
    store = PolicyStore.remote(0, False, final_version=10**9)
    caller = Caller.remote(store)
    ray.get(caller.time.remote(2))
    times = ray.get(caller.time.remote(calls))
    for actor in (caller, store):
        ray.kill(actor)
    return [{"call": name, "ms per call": ms} for name, ms in times.items()]


if __name__ == "__main__":
    for r in run():
        print(r)
