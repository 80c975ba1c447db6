"""Which stages share a process (pipelines/colocation.py), without Ray: the default plan for sync
and async, what never shares, the explicit override, and the per-stage timings a group hands on.
(The pipeline tests run the plans on a real Ray.)"""

from __future__ import annotations

import pyarrow as pa
import pytest

from trajflow.pipelines.colocation import StageGroup, group_name, group_resources, plan_groups, pop_measurements
from trajflow.pipelines.config import PipelineConfig, ResourceConfig
from trajflow.pipelines.rl_loop import Fused, RLPipeline, Stage


def names(groups):
    return [[s.name for s in g] for g in groups]


def layout(**config):
    """Process groups of a config's stages, the exact strategies' old log-prob forward included."""
    return names(RLPipeline(PipelineConfig(**{"old_logprob_forward": "always", **config})).process_groups())


def test_sync_runs_every_stage_in_one_process():
    assert layout(max_staleness=0) == [["generate", "reward", "advantage", "filter", "old_logprobs", "train"]]
    # dedicated's scorer has its own process by definition; light stages may join it
    assert layout(max_staleness=0, strategy="dedicated") == [
        ["generate"], ["old_logprobs", "reward", "advantage", "filter"], ["train"]]


def test_colocate_split_keeps_generator_and_train_step_alone():
    # rewards and scoring off the generator's critical path, the trainer never waits behind them
    assert layout(max_staleness=2, colocate="split") == [
        ["generate"], ["reward", "advantage", "filter", "old_logprobs"], ["train"]]
    assert layout(max_staleness=1, colocate="split", strategy="behavior") == [
        ["generate"], ["reward", "advantage", "filter"], ["train"]]
    assert layout(max_staleness=1, colocate="split", strategy="dedicated") == [
        ["generate"], ["old_logprobs", "reward", "advantage", "filter"], ["train"]]
    assert layout(max_staleness=0, colocate="split") == layout(max_staleness=0)  # sync: one process anyway


def test_auto_splits_an_async_pipeline_from_four_cpus_on():
    """On fewer CPUs three compute-bound torch processes only time-slice: auto takes two."""
    from trajflow.pipelines.colocation import SPLIT_FROM_CPUS, rollout_colocated
    from trajflow.pipelines.ray.embedded import cluster_cpus

    assert SPLIT_FROM_CPUS == 4
    assert [rollout_colocated("auto", cpus) for cpus in (1, 2, 3.9, 4, 16)] == [True, True, True, False, False]
    assert rollout_colocated("rollout", 64) and not rollout_colocated("split", 2) and not rollout_colocated("off", 2)
    here = "rollout" if cluster_cpus() < SPLIT_FROM_CPUS else "split"  # 2 CPUs on this machine and its test Ray
    assert layout(max_staleness=2) == layout(max_staleness=2, colocate=here)


def test_colocate_rollout_puts_the_rollout_side_in_one_process():
    # the generator with reward, advantage, filter and the scorer; the trainer alone
    assert layout(max_staleness=1, colocate="rollout") == [
        ["generate", "reward", "advantage", "filter", "old_logprobs"], ["train"]]
    # what never shares still does not: dedicated's own scorer, a second generator
    assert layout(max_staleness=1, colocate="rollout", strategy="dedicated") == [
        ["generate"], ["old_logprobs", "reward", "advantage", "filter"], ["train"]]
    assert layout(max_staleness=1, colocate="rollout", num_generators=2) == [
        ["generate", "reward", "advantage", "filter"], ["old_logprobs"], ["train"]]
    assert layout(max_staleness=0, colocate="rollout") == layout(max_staleness=0)  # sync: one process anyway


def test_colocate_off_is_one_process_per_operator_stage():
    assert layout(max_staleness=2, colocate="off") == [
        ["generate"], ["reward", "advantage", "filter"], ["old_logprobs"], ["train"]]


def test_pool_sizes_custom_resources_and_gpus_never_share():
    # two generators: the scorer and the trainer (one each) cannot live in the generators' pool
    assert layout(max_staleness=0, num_generators=2) == [
        ["generate", "reward", "advantage", "filter"], ["old_logprobs", "train"]]
    # placement asked for by the user (custom resources) is kept
    placed = layout(max_staleness=0, generator={"resources": {"gen_node": 0.1}}, trainer={"resources": {"gpu_box": 0.1}})
    assert placed == [["generate", "reward", "advantage", "filter"], ["old_logprobs"], ["train"]]
    gpu = layout(max_staleness=0, trainer={"num_gpus": 1})
    assert gpu == [["generate", "reward", "advantage", "filter", "old_logprobs"], ["train"]]
    assert layout(max_staleness=0, strategy="behavior", generator={"num_gpus": 1}) == [
        ["generate", "reward", "advantage", "filter"], ["train"]]


def test_group_resources_take_the_largest_request():
    class A:
        def __init__(self, store) -> None:
            self.store = store

    group = [Stage("a", A, resources=ResourceConfig(num_cpus=0.25, resources={"x": 0.1})),
             Stage("f", len), Stage("b", A, resources=ResourceConfig(num_cpus=0.5, resources={"x": 0.2}))]
    assert group_resources(group, light_cpus=0.1) == (0.5, 0.0, {"x": 0.2})
    assert group_resources([Stage("f", len)], light_cpus=0.1) == (0.1, 0.0, {})
    assert group_name(group) == "A+builtin_function_or_method+A"


def test_explicit_colocation_overrides_the_plan_and_is_checked():
    pipe = RLPipeline(PipelineConfig(max_staleness=2, strategy="behavior"))
    pipe.colocation = [["generate"], ["reward", "advantage", "filter", "train"]]
    assert names(pipe.process_groups()) == pipe.colocation
    assert pipe.layout() == "processes: [generate] [reward advantage filter train]"
    pipe.colocation = [["generate", "advantage"], ["reward", "filter", "train"]]
    with pytest.raises(ValueError, match="every stage once, in order"):
        pipe.process_groups()


class AddColumn:
    """A class stage: constructed inside the group's process with the store and its kwargs."""

    def __init__(self, store, column: str) -> None:
        self.store, self.column = store, column

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch.append_column(self.column, pa.array([self.store] * batch.num_rows))


def test_stage_group_constructs_class_stages_and_carries_timings():
    double = Stage("double", lambda t: t.set_column(0, "x", pa.array([2 * v for v in t["x"].to_pylist()])))
    first = StageGroup([double, Stage("tag", AddColumn, {"column": "tag"})], store="S", timings="carry")
    out = first(pa.table({"x": [1, 2]}))
    assert out["x"].to_pylist() == [2, 4] and out["tag"].to_pylist() == ["S", "S"]
    measured, bare = pop_measurements(out)
    carried = measured["seconds/stage"]
    assert set(carried) == {"double", "tag"} and all(v >= 0 for v in carried.values())
    assert set(measured["seconds/startup"]) == {"double.process", "tag"}  # the first batch only
    assert bare.schema.metadata is None  # the stages themselves never see the timing metadata
    assert not {"seconds/startup", "node"} & set(pop_measurements(first(pa.table({"x": [1]})))[0])

    seen = []
    last = StageGroup([Stage("spy", lambda t: seen.append(t.schema.metadata) or t.slice(0, 1))], timings="emit")
    row = last(out)
    assert seen == [None]
    assert row.num_rows == 1
    assert set(row.column_names) == {"x", "tag", "seconds/stage/double", "seconds/stage/tag", "seconds/stage/spy",
                                     "seconds/startup/double.process", "seconds/startup/tag",
                                     "seconds/startup/spy.process", "node/function", "node/AddColumn"}
    assert row["seconds/stage/double"][0].as_py() == carried["double"]
    # where each stage's process runs (a lambda's class is `function`): no Ray here, no node id
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    assert measured["node"] == {"function": here, "AddColumn": here}
    assert row["node/AddColumn"].type == pa.string() and row["node/AddColumn"][0].as_py() == here


def test_fused_applies_callables_in_order_without_timings():
    fused = Fused([lambda t: t.append_column("y", t["x"]), lambda t: t.drop(["x"])])
    out = fused(pa.table({"x": [1]}))
    assert out.column_names == ["y"] and out.schema.metadata is None
