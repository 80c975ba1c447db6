"""Which stages share an actor process, and the actor that runs several stages in order.

Every operator boundary costs a Ray Data hop (a block put, a scheduling turn, a deserialisation)
and every process costs its own torch + transformers runtime (about 0.5 GB and seconds of imports
each). Consecutive stages can therefore run in one actor — `StageGroup` constructs its class
stages once per actor and passes each batch through all stages in order — as long as that does not
serialise work that would otherwise overlap. The stage list stays what it is: grouping changes
which process runs a stage, never the order of stages or what a stage computes.

`plan_groups` is the default policy, chosen from measurement (benchmarks/results/orchestration.md):

- synchronous (`max_staleness: 0`): every stage waits for the previous one anyway, so all
  stages that can share a process do (on CPU: generator, light stages, scorer and trainer in one);
- asynchronous, from SPLIT_FROM_CPUS CPUs on (`colocate: split` anywhere): three processes — the
  generator alone (rewards and scoring stay off its critical path, so a slow reward function
  never stalls sampling), every stage between it and the train step together (reward,
  advantage, filter, a scorer, your stages), and the train step alone;
- asynchronous on fewer CPUs (`colocate: rollout` anywhere): two processes — the generator with
  every stage up to the train step, and the train step alone. On 2 cores three compute-bound
  torch processes only time-slice, and the third costs its start-up and its runtime (the first
  step, the process tree's memory and the step time on the quickstart, two processes against
  three: benchmarks/results/startup.md). A slow reward function then delays the next rollout;
- two stages never share a process if their pool sizes differ, if either asks for a GPU or for
  custom resources the other does not have (placement on a cluster is the user's decision), or if
  either is marked `own_process` (`dedicated`'s scorer: its own CPU/GPU share by definition).

Each group also times its stages and hands the times on in the batch's schema metadata; the
last group adds them to the metrics row as `seconds/stage/<stage>` (and, in the first row, where
start-up went: `seconds/startup/...`, and which node each stage's process runs on:
`node/<stage class>`), so a step's wall time can be read against the compute inside it, and the
placement recorded, without any extra call (Ray's state API needs the dashboard, and without one
it spins ~40 s before failing).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa

from trajflow.operators.contracts.stage import loaded
from trajflow.operators.trainer.recovery import RESTARTED_PREFIX

if TYPE_CHECKING:
    from trajflow.pipelines.rl_loop import Stage

MEASURED_KEY = b"trajflow.measured"
NODE_AREA = "node"  # `node/<stage class>`: the node id of the stage's process (read for placement.json)
SPLIT_FROM_CPUS = 4  # `colocate: auto`: the fewest CPUs on which an async pipeline takes three processes


def rollout_colocated(colocate: str, cpus: float) -> bool:
    """Whether an asynchronous pipeline runs its generator with the stages up to the train step in
    one process (`colocate`: the setting; `cpus`: the CPUs its actors run on)."""
    return colocate == "rollout" or (colocate == "auto" and cpus < SPLIT_FROM_CPUS)


def _can_share(a: "Stage", b: "Stage") -> bool:
    """Whether two class stages may run in one process."""
    ra, rb = a.resources, b.resources
    gpu = (ra is not None and ra.num_gpus > 0) or (rb is not None and rb.num_gpus > 0)
    custom_a = ra.resources if ra is not None else {}
    custom_b = rb.resources if rb is not None else {}
    return a.pool_size == b.pool_size and not gpu and custom_a == custom_b and not (a.own_process or b.own_process)


def plan_groups(stages: list["Stage"], synchronous: bool, colocate: bool = True,
                rollout: bool = False) -> list[list["Stage"]]:
    """Consecutive runs of `stages` that share one actor process each.

    Asynchronous, the first stage (the generator) and the last class stage (the train step) each
    start a process of their own and nothing joins them; the stages between share (`rollout`: the
    generator shares with them, the train step stays alone). With `colocate=False`, every class
    stage has its own process and consecutive function stages share one.
    """
    actors = [i for i, s in enumerate(stages) if s.is_actor]
    if synchronous or not actors:
        boundaries = set()
    else:
        boundaries = {actors[-1]} if rollout else {actors[0], actors[0] + 1, actors[-1]}
    groups: list[list[Stage]] = []
    for i, stage in enumerate(stages):
        if groups and i not in boundaries and _joins(groups[-1], stage, colocate):
            groups[-1].append(stage)
        else:
            groups.append([stage])
    return groups


def _joins(group: list["Stage"], stage: "Stage", colocate: bool) -> bool:
    anchors = [s for s in group if s.is_actor]
    if not colocate:
        return not anchors and not stage.is_actor
    if not stage.is_actor:
        return True
    return all(_can_share(a, stage) for a in anchors)


def stage_class(stage: "Stage") -> str:
    """The class name of a stage: its class (a class stage) or its callable's type."""
    return stage.fn.__name__ if stage.is_actor else type(stage.fn).__name__


def group_name(group: list["Stage"]) -> str:
    """The class name of a group's actor: its stages' class names joined by '+'. Process titles
    read it (`MapWorker(MapBatches(Generate+Reward+...))`)."""
    return "+".join(stage_class(s) for s in group)


class StageGroup:
    """Consecutive stages in one actor: class stages are constructed here (with `store=` and their
    kwargs), function stages called as given; a batch goes through them in order.

    `timings`: "off"; "carry" (add this group's measurements to those the batch brought and hand
    them on in the schema metadata); "emit" (the last group: add them to the output rows as
    columns). Measured: `seconds/stage/<stage>`, the seconds each stage took on this batch; and,
    on a group's first batch only, `seconds/startup/<stage>` (constructing the stage: model loads),
    `seconds/startup/<first stage>.process` (from the actor process's creation to the group's
    constructor: worker start and imports) and `node/<stage class>` (the Ray node id of this
    process, "" outside Ray). The stages never see the metadata.

    Restarts: Ray Data restarts a pool's actor whose process died and retries its batch. A group
    built in such a restarted process counts it in the store (`recovery/restarted/<group>`,
    operators/trainer/recovery.py), which the next step's metrics row carries and the job prints
    and records in run.json; a group with the train step leaves it to the trainer's own recovery.
    """

    def __init__(self, stages: list["Stage"], store: Any = None,
                 timings: str = "off") -> None:
        self.startup: dict[str, float] = {}
        self.node: dict[str, str] = {}
        if stages and timings != "off":
            import psutil
            import ray

            self.startup[f"{stages[0].name}.process"] = time.time() - psutil.Process().create_time()
            # get_runtime_context() outside Ray would start one: check first
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
            self.node = {stage_class(s): node for s in stages}
        if store is not None and restarted_process() and not any(getattr(loaded(s.fn), "recovers_itself", False)
                                                                 for s in stages):
            store.add_counters({f"{RESTARTED_PREFIX}{group_name(stages)}": 1.0})
        self.stages: list[tuple[str, Callable[[pa.Table], pa.Table]]] = []
        for s in stages:
            started = time.perf_counter()
            fn = s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn
            self.stages.append((s.name, fn))
            if s.is_actor and timings != "off":
                self.startup[s.name] = time.perf_counter() - started
        self.timings = timings

    def __del__(self) -> None:
        # Ray Data ends a pool's actors gracefully by dropping this object: stages that own
        # processes or resources (the train step's data-parallel workers) release them here.
        for _, fn in getattr(self, "stages", []):
            close = getattr(fn, "close", None)
            if callable(close):
                close()

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.timings == "off":
            for _, fn in self.stages:
                batch = fn(batch)
            return batch
        measured, batch = pop_measurements(batch)
        seconds = measured.setdefault("seconds/stage", {})
        if self.startup:
            measured.setdefault("seconds/startup", {}).update(self.startup)
            measured.setdefault(NODE_AREA, {}).update(self.node)
            self.startup = {}
        for name, fn in self.stages:
            started = time.perf_counter()
            batch = fn(batch)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
        if self.timings == "emit":
            for area, values in measured.items():
                for name, value in values.items():
                    kind = pa.string() if isinstance(value, str) else pa.float64()
                    batch = batch.append_column(f"{area}/{name}", pa.array([value] * batch.num_rows, kind))
            return batch
        return batch.replace_schema_metadata({**(batch.schema.metadata or {}), MEASURED_KEY: json.dumps(measured)})


def restarted_process() -> bool:
    """Whether this process is a Ray actor restarted after its process died (outside Ray: no)."""
    import sys

    ray = sys.modules.get("ray")  # an operator run in one process never starts a Ray
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def pop_measurements(batch: pa.Table) -> tuple[dict[str, dict[str, float | str]], pa.Table]:
    """(what the groups before measured on this batch, the batch without that metadata)."""
    metadata = dict(batch.schema.metadata or {})
    raw = metadata.pop(MEASURED_KEY, None)
    if raw is None:
        return {}, batch
    return json.loads(raw), batch.replace_schema_metadata(metadata or None)


def group_resources(group: list["Stage"], light_cpus: float) -> tuple[float, float, dict[str, float]]:
    """(num_cpus, num_gpus, custom resources) of a group's actor: its stages run one at a time,
    so the largest request of any stage; a group of light stages only asks `light_cpus`."""
    configs = [s.resources for s in group if s.is_actor]
    if not configs:
        return light_cpus, 0.0, {}
    from trajflow.pipelines.config import ResourceConfig

    configs = [c or ResourceConfig() for c in configs]
    custom: dict[str, float] = {}
    for c in configs:
        for key, value in c.resources.items():
            custom[key] = max(custom.get(key, 0.0), value)
    return max(c.num_cpus for c in configs), max(c.num_gpus for c in configs), custom
