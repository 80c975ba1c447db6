"""Benchmark: what one Ray Data operator hop costs while a long task is active — the diagnosis
behind pipelines/ray/patches.py (patch 4), isolated from trajflow's operators.

Four one-actor stages, each sleeping 20 ms per item, in a synchronous chain like trajflow's sync
mode: the first stage of item i blocks (inside its task, as the generator blocks on its
admission permit) until item i-1 has left the last stage. So there is always an active task, and
every hand-over between stages waits for the executor's next wake-up. Per set-up: wall ms per
item (the compute is 4 x 20 = 80 ms) and the driver's CPU ms per item.
"""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import ray
from ray.data import DataContext

from benchmarks.common import ensure_ray
from trajflow.pipelines.ray.patches import executor
from trajflow.pipelines.rl_loop import in_order_pool

SLEEP_S, STAGES = 0.02, 4


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self) -> None:
        self.done, self.cond = -1, asyncio.Condition()

    async def wait(self, i: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.done >= i - 1)

    async def finish(self, i: int) -> None:
        async with self.cond:
            self.done = i
            self.cond.notify_all()


class Sleep:
    def __init__(self, gate, position: str) -> None:
        self.gate, self.position = gate, position

    def __call__(self, batch: pa.Table) -> pa.Table:
        item = int(batch["id"][0].as_py())
        if self.position == "first":
            ray.get(self.gate.wait.remote(item))
        time.sleep(SLEEP_S)
        if self.position == "last":
            ray.get(self.gate.finish.remote(item))
        return batch


def chain(items: int) -> tuple[float, float]:
    """(wall s per item, driver CPU s per item), steady state."""
    gate = Gate.remote()
    DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.from_arrow([pa.table({"id": [i]}) for i in range(items)])
    for k in range(STAGES):
        position = "first" if k == 0 else "last" if k == STAGES - 1 else "middle"
        ds = ds.map_batches(Sleep, fn_constructor_kwargs=dict(gate=gate, position=position), batch_size=1,
                            batch_format="pyarrow", compute=in_order_pool(1), num_cpus=0.1)
    wall, cpu = [], []
    for _ in ds.iter_batches(batch_size=None, prefetch_batches=0):
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
    ray.kill(gate)
    skip = 4
    return (wall[-1] - wall[skip]) / (items - 1 - skip), (cpu[-1] - cpu[skip]) / (items - 1 - skip)


def run(items: int = 40) -> list[dict]:
    from ray.data._internal.execution import metadata_fetcher

    ensure_ray()
    rows = []
    setups = [("Ray Data as shipped", False, None), ("block metadata read inline only", False, False),
              ("wake on the first task event only", True, True), ("both (patches.executor)", True, False)]
    for name, patched, metadata_on_thread in setups:
        executor.revert()
        saved = metadata_fetcher._PREFETCH_ON_THREAD
        if patched:
            executor.apply()
        if metadata_on_thread is not None:
            metadata_fetcher._PREFETCH_ON_THREAD = metadata_on_thread
        try:
            wall, cpu = chain(items)
        finally:
            executor.revert()
            metadata_fetcher._PREFETCH_ON_THREAD = saved
        rows.append({"set-up": name, "wall ms/item": 1000 * wall, "compute ms/item": 1000 * SLEEP_S * STAGES,
                     "wall / compute": wall / (SLEEP_S * STAGES), "driver CPU ms/item": 1000 * cpu})
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
