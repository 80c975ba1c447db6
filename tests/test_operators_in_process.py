"""Every operator in one process on the in-process policy store, without Ray.

The operators are built with the kwargs the pipeline itself gives them (`RLPipeline(config)`'s
stage list, which starts nothing), the store is `InProcessStore`, and the `without_ray` fixture
makes any Ray call (init, get, put, remote, the runtime context...) fail the test, and reports Ray
as not initialised even if another test of the session started it. Numbers checked: exactness
(old = inference within 1e-5 in float32, at staleness 0 and 1), the train step's version and
publish, its diagnostics against a hand computation, and diagnose reproducing the train step.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from trajflow.engines.models import load_tokenizer
from trajflow.operators.diagnose import Diagnose
from trajflow.operators.inference_as_old import InferenceAsOld
from trajflow.operators.old_logprobs import OldLogprobsAtBehaviorVersion
from trajflow.operators.train_step import TrainStep
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.schemas import validate

RAY_ENTRY_POINTS = ("init", "get", "put", "wait", "remote", "kill", "get_actor", "get_runtime_context")


@pytest.fixture
def without_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("an operator called Ray in a test that runs it in one process")

    for name in RAY_ENTRY_POINTS:
        monkeypatch.setattr(ray, name, refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def _config(**overrides) -> PipelineConfig:
    """float32 on both sides, with the old log-probs' forward pass (the operator under test)."""
    base = dict(strategy="snapshot", prompts_per_step=4, group_size=4, max_staleness=1, inference_dtype="float32",
                drop_zero_variance_groups=False, seed=3, steps=3, old_logprob_forward="always")
    return PipelineConfig(**{**base, **overrides})


def _build(pipe: RLPipeline, store) -> dict:
    """Each stage of the pipeline's own list, constructed as its actor would construct it."""
    return {s.name: s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn for s in pipe.stages}


def _store(pipe: RLPipeline) -> InProcessStore:
    from trajflow.engines.models import load_model

    store = InProcessStore(pipe.config.max_staleness, pipe.config.keeps_history(pipe.strategy))
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    return store


def _prompt_rows(pipe: RLPipeline, step: int) -> pa.Table:
    source = pipe.workload.prompt_source(load_tokenizer(pipe.model_path), pipe.config.seed,
                                         pipe.config.prompts_per_step)
    return source.step_rows(step)


def pc_set_filtered(batch: pa.Table) -> pa.Table:
    """Every row marked filtered (as when all groups have zero reward variance)."""
    i = batch.schema.get_field_index("filter_reason")
    return batch.set_column(i, "filter_reason", pa.array(["zero_variance"] * batch.num_rows, pa.string()))


def _max_gap(table: pa.Table) -> float:
    trained = table.filter(pc.is_null(table["filter_reason"])) if "filter_reason" in table.column_names else table
    old = pc.list_flatten(trained["old_logprobs"]).to_numpy(zero_copy_only=False)
    inference = pc.list_flatten(trained["inference_logprobs"]).to_numpy(zero_copy_only=False)
    return float(np.abs(old - inference).max())


@pytest.mark.timeout(300)
def test_snapshot_pipeline_runs_step_by_step_in_one_process(without_ray, one_torch_thread):
    pipe = RLPipeline(_config())
    store = _store(pipe)
    ops = _build(pipe, store)
    assert list(ops) == ["generate", "reward", "advantage", "filter", "old_logprobs", "train"]
    metrics, scored = [], []
    for step in range(3):
        batch = _prompt_rows(pipe, step)
        for name, op in ops.items():
            batch = op(batch)
            if name == "old_logprobs":
                scored.append(batch)
        metrics.append(batch.to_pylist()[0])

    for step, table in enumerate(scored):
        validate(table)
        assert table.num_rows == 16
        versions = set(pc.list_flatten(table["versions"]).to_pylist())
        # synchronous here: the generator takes the newest version, the one the trainer trains
        assert versions == {step}
        # exactness: float32 inference and training numerics are the same computation
        assert _max_gap(table) < 1e-5
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert store.latest_version() == 3  # PublishWeights ran in this process
    for m in metrics:
        assert m["mask/token_kept_frac"] == 1.0  # r_d == 1 exactly kept by the sequence mask
        assert abs(m["mismatch/k3"]) < 1e-9
        assert np.isfinite(m["loss"])
        assert m["snapshot/versions_held"] >= 1  # a history-keeping strategy reports its snapshots
    # the weights moved: version 3 differs from version 0
    _, w3 = store.weights(3)
    assert store.stats().keeps_history
    assert all(torch.isfinite(t).all() for t in w3.values())
    # a step whose rows are all filtered trains nothing, and its log keeps the schema of the others
    logged = []
    ops["train"].on_step = lambda step, batch, m: logged.append(batch)
    ops["train"](ops["old_logprobs"](pc_set_filtered(ops["filter"](ops["advantage"](ops["reward"](
        ops["generate"](_prompt_rows(pipe, 3))))))))
    assert logged[0]["loss_old_logprobs"].null_count == logged[0].num_rows == 16


@pytest.mark.timeout(300)
def test_the_in_process_loop_runs_its_stages_by_name_and_names_one_that_fails(without_ray, one_torch_thread,
                                                                              monkeypatch):
    """pipelines/local.py: with lag 1 both rollouts run every rollout-side stage when generated,
    before the first train step; the train step runs last. A stage that raises ends the loop with
    one line naming it, the original exception as its cause."""
    from trajflow.operators.contracts.stage import Stage
    from trajflow.pipelines import local

    calls, build = [], local.build

    class Recorded:
        def __init__(self, name, operator):
            self.name, self.operator = name, operator

        def __call__(self, batch):
            calls.append(self.name)
            return self.operator(batch)

        def close(self):
            getattr(self.operator, "close", lambda: None)()

    monkeypatch.setattr(local, "build", lambda stage, store, workers: Recorded(stage.name, build(stage, store, workers)))
    metrics = local.run_in_process(RLPipeline(_config(steps=2)), lag=1)
    rollout = ["generate", "reward", "advantage", "filter", "old_logprobs"]
    assert calls == rollout + rollout + ["train", "train"]
    assert metrics["version"].to_list() == [1, 2]

    def broken(batch: pa.Table) -> pa.Table:
        raise ValueError("reward out of range\nsecond line")

    calls.clear()
    pipe = RLPipeline(_config(steps=1)).insert_after("reward", Stage("broken", broken))
    with pytest.raises(local.StageFailed) as failed:
        local.run_in_process(pipe)
    assert str(failed.value) == "stage 'broken' failed: ValueError: reward out of range"
    assert isinstance(failed.value.__cause__, ValueError) and calls == ["generate", "reward", "broken"]


@pytest.mark.timeout(300)
def test_old_logprobs_score_each_token_at_its_own_version(without_ray, one_torch_thread):
    """Staleness 1 by hand: step 1's rollout is generated at version 0 while the trainer holds
    version 1. Snapshot scores every token under version 0 (not the trainer's weights): exact."""
    pipe = RLPipeline(_config())
    store = _store(pipe)
    ops = _build(pipe, store)
    light = [ops["reward"], ops["advantage"], ops["filter"]]
    stale = ops["generate"](_prompt_rows(pipe, 1))  # generated at version 0 (the only one)
    for op in light:
        stale = op(stale)
    # the trainer trains step 0 and publishes version 1; version 0 stays pinned by `stale`
    fresh = ops["generate"](_prompt_rows(pipe, 0))
    for op in light + [ops["old_logprobs"], ops["train"]]:
        fresh = op(fresh)
    assert store.latest_version() == 1 and 0 in store.stats().versions_held
    scored = ops["old_logprobs"](stale)
    assert set(pc.list_flatten(scored["versions"]).to_pylist()) == {0}
    assert _max_gap(scored) < 1e-5
    # and the train step at version 1 trains it with lag 1, within max_staleness
    metrics = ops["train"](scored).to_pylist()[0]
    assert metrics["staleness/mean"] == 1.0 and metrics["rows_trained"] == 16
    # the store freed version 0 once its last tokens were scored
    assert store.stats().versions_held == [2]


@pytest.mark.timeout(300)
def test_dedicated_scores_right_after_generate_every_row(without_ray, one_torch_thread):
    pipe = RLPipeline(_config(strategy="dedicated"))
    store = _store(pipe)
    ops = _build(pipe, store)
    assert list(ops)[:2] == ["generate", "old_logprobs"]
    assert isinstance(ops["old_logprobs"], OldLogprobsAtBehaviorVersion)
    batch = ops["old_logprobs"](ops["generate"](_prompt_rows(pipe, 0)))
    assert batch["old_logprobs"].null_count == 0  # every row, before any filter
    assert _max_gap(batch) < 1e-5


def test_the_redundant_forward_is_skipped_only_where_it_is_exactly_redundant(without_ray, one_torch_thread):
    """`old_logprob_forward: auto` (the default): in float32 with the torch engine the exact
    strategies' old log-probs would be the inference ones recomputed, so they are copied (no model,
    no snapshots kept) and the header says so; any source of mismatch keeps the forward pass."""
    for strategy in ("snapshot", "dedicated"):
        pipe = RLPipeline(_config(strategy=strategy, old_logprob_forward="auto"))
        assert pipe.config.old_is_inference(pipe.strategy) and not pipe.config.keeps_history(pipe.strategy)
        assert "old log-probs: the inference ones, reused" in pipe.describe()
        ops = _build(pipe, _store(pipe))
        assert isinstance(ops["old_logprobs"], InferenceAsOld)
        batch = ops["old_logprobs"](ops["generate"](_prompt_rows(pipe, 0)))
        assert batch["old_logprobs"].equals(batch["inference_logprobs"])
    for mismatch in ({"inference_dtype": "bfloat16"}, {"inference_dtype": "fp8"}, {"partial_rollout": True},
                     {"optimizer": {"mixed_precision": "bf16"}}, {"sampling": {"top_p": 0.9}},
                     {"sampling": {"top_k": 4}}, {"top_k_logprobs": 2}, {"lora": {"r": 2}},
                     {"old_logprob_forward": "always"}, {"strategy": "interrupt"}):
        pipe = RLPipeline(_config(**{"old_logprob_forward": "auto", **mismatch}))
        assert not pipe.config.old_is_inference(pipe.strategy), mismatch
        assert "reused" not in pipe.describe()
        stages = {stage.name: stage for stage in pipe.stages}  # interrupt scores inside generation
        assert "old_logprobs" not in stages or stages["old_logprobs"].is_actor, mismatch  # the forward's actor


@pytest.mark.timeout(300)
def test_diagnose_reproduces_the_train_step_in_one_process(without_ray, one_torch_thread):
    """Diagnose of a step under its own strategy, on the weights the trainer had, gives the
    train step's logged diagnostics; another strategy on the same rows gives its own."""
    pipe = RLPipeline(_config(strategy="recompute", inference_dtype="bfloat16"))
    store = _store(pipe)
    ops = _build(pipe, store)
    assert isinstance(ops["train"], TrainStep)
    batch = _prompt_rows(pipe, 0)
    for name in ("generate", "reward", "advantage", "filter"):
        batch = ops[name](batch)
    logged = batch.append_column("trainer_version", pa.array(np.zeros(batch.num_rows, np.int32)))
    logged_store = InProcessStore(10**9, True)  # a replay's store: the logged versions, kept
    logged_store.publish(store.weights(0)[1], 0)
    trained = ops["train"](batch).to_pylist()[0]

    c = pipe.config
    strategies = [pipe.strategy, PipelineConfig(strategy="behavior").build_strategy()]
    diagnose = Diagnose(logged_store, pipe.model_path, strategies, c.settings.correction, c.settings.kl, pipe.sampling,
                        c.max_staleness, c.settings.numerics, 1)
    rows = {r["strategy"]: r for r in diagnose(logged).to_pylist()}
    for key in ("mask/token_kept_frac", "clip/frac", "mismatch/k3", "rows_trained"):
        assert rows["recompute"][key] == pytest.approx(trained[key], rel=1e-6, abs=1e-9), key
    assert rows["recompute"]["loss"] == pytest.approx(trained["loss"], abs=1e-6)  # ~0: r_s = 1 on-policy
    # behavior (old := mu): r_d == 1, so its mask keeps every token; recompute's r_d is the
    # bf16-vs-float32 gap, which its k3 shows
    assert rows["behavior"]["mismatch/k3"] == 0.0 and rows["recompute"]["mismatch/k3"] > 0.0


@pytest.mark.timeout(300)
def test_diagnose_gradients_against_the_exact_strategy(without_ray, one_torch_thread):
    """At staleness 0 recompute's pi_old is the exact one (pi of the trainer's own version, same
    numerics): its gradient equals snapshot's. behavior's pi_old is mu (bf16 inference), so its
    gradient departs; and with exact old log-probs the whole log-ratio is engine mismatch (the
    staleness part has variance 0)."""
    pipe = RLPipeline(_config(inference_dtype="bfloat16"))
    store = _store(pipe)
    ops = _build(pipe, store)
    batch = _prompt_rows(pipe, 0)
    for name in ("generate", "reward", "advantage", "filter", "old_logprobs"):
        batch = ops[name](batch)
    logged = batch.append_column("trainer_version", pa.array(np.zeros(batch.num_rows, np.int32)))
    logged_store = InProcessStore(10**9, True)
    logged_store.publish(store.weights(0)[1], 0)
    c = pipe.config
    strategies = [PipelineConfig(strategy=s).build_strategy() for s in ("snapshot", "recompute", "behavior")]
    diagnose = Diagnose(logged_store, pipe.model_path, strategies, c.settings.correction, c.settings.kl, pipe.sampling,
                        c.max_staleness, c.settings.numerics, 1, gradients=True)
    rows = {r["strategy"]: r for r in diagnose(logged).to_pylist()}
    assert rows["snapshot"]["grad/cos_vs_exact"] == pytest.approx(1.0, abs=1e-12)
    assert rows["snapshot"]["grad/rel_err_vs_exact"] == 0.0 and rows["snapshot"]["grad/norm"] > 0
    assert rows["recompute"]["grad/cos_vs_exact"] == pytest.approx(1.0, abs=1e-6)
    assert rows["recompute"]["grad/rel_err_vs_exact"] < 1e-5
    assert rows["behavior"]["grad/rel_err_vs_exact"] > 1e-4
    assert 0.0 < rows["behavior"]["grad/cos_vs_exact"] < 1.0
    assert rows["snapshot"]["split/var_log_rs"] == 0.0 < rows["snapshot"]["split/var_log_rd"]
    assert rows["snapshot"]["split/var_log_total"] == pytest.approx(rows["snapshot"]["split/var_log_rd"])
    # the trainer's micro-batches (here about one row each) give the whole step's numbers: the
    # losses and gradients add up in sum form and are divided once by the step's count
    longest = max(len(p) + len(r) for p, r in zip(logged["prompt_tokens"].to_pylist(),
                                                   logged["response_tokens"].to_pylist()))
    micro = Diagnose(logged_store, pipe.model_path, strategies, c.settings.correction, c.settings.kl, pipe.sampling,
                     c.max_staleness, c.settings.numerics, 1, gradients=True, max_tokens_per_microbatch=longest)
    cut = {r["strategy"]: r for r in micro(logged).to_pylist()}
    for name, row in rows.items():
        for key in ("loss", "mask/token_kept_frac", "clip/frac", "mismatch/k3", "split/var_log_rd", "grad/norm",
                    "grad/cos_vs_exact"):
            assert cut[name][key] == pytest.approx(row[key], rel=1e-4, abs=1e-7), (name, key)
    # without an exact strategy there is nothing to compare with
    with pytest.raises(ValueError, match="exact strategy"):
        Diagnose(logged_store, pipe.model_path, strategies[1:], c.settings.correction, c.settings.kl, pipe.sampling,
                 c.max_staleness, c.settings.numerics, 1, gradients=True)
