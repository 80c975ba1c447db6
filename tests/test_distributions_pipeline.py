"""The distributions through the real operators, in one process without Ray: the sampler's top-k
in the record, pi_old on it at each token's own version (exact: equal to the sampler's in float32
within 1e-5, for snapshot, dedicated and interrupt across a weight switch), the mismatch metric
and its mask, Score Centering's train step, the teacher operator and distillation's terms, and a
record without top-k (K = 0) that is today's."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from trajflow.engines.models import build_tiny_model, load_model, load_tokenizer, save_model
from trajflow.operators.generate import Generate
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.local import run_in_process
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.schemas import COLUMNS, META_TOP_K_KEY, TopKSemantics, top_k_semantics, validate
from trajflow.schemas.columns import nested_array, nested_rows, replace_column

K = 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def without_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("an operator called Ray in a test that runs it in one process")

    for name in ("init", "get", "put", "wait", "remote", "kill", "get_actor", "get_runtime_context"):
        monkeypatch.setattr(ray, name, refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def _config(**overrides) -> PipelineConfig:
    base = dict(strategy="snapshot", prompts_per_step=4, group_size=4, max_staleness=1, inference_dtype="float32",
                drop_zero_variance_groups=False, seed=3, steps=2, top_k_logprobs=K)
    return PipelineConfig(**{**base, **overrides})


def _ops(pipe: RLPipeline, store=None) -> tuple[dict, InProcessStore]:
    if store is None:
        store = InProcessStore(pipe.config.max_staleness, pipe.strategy.keep_history)
        store.publish(load_model(pipe.model_path).state_dict(), 0)
    return {s.name: s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn for s in pipe.stages}, store


def _prompts(pipe: RLPipeline, step: int) -> pa.Table:
    source = pipe.workload.prompt_source(load_tokenizer(pipe.model_path), pipe.config.seed, pipe.config.prompts_per_step)
    return source.step_rows(step)


def _before_train(ops: dict, batch: pa.Table) -> pa.Table:
    """`batch` through every stage before the train step."""
    for name, op in ops.items():
        if name == "train":
            break
        batch = op(batch)
    return batch


def _top_k_gap(table: pa.Table) -> float:
    """max |pi_old - mu| over the top-k entries of the scored rows (-inf must match -inf)."""
    worst = 0.0
    for mu, old in zip(nested_rows(table["top_k_inference_logprobs"]), nested_rows(table["top_k_old_logprobs"])):
        if old is None:
            continue
        assert (np.isneginf(mu) == np.isneginf(old)).all()
        finite = np.isfinite(mu)
        worst = max(worst, float(np.abs(mu[finite] - old[finite]).max(initial=0.0)))
    return worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["snapshot", "dedicated"])
def test_exact_old_top_k_equals_the_samplers_in_float32(without_ray, strategy):
    """Same version, same numerics: pi_old on the sampler's top-k ids is the sampler's top-k within
    1e-5, with top-k/top-p filters on (-inf entries past the support, matched)."""
    pipe = RLPipeline(_config(strategy=strategy, sampling={"temperature": 0.8, "top_k": 6, "top_p": 0.95}))
    ops, _ = _ops(pipe)
    batch = _before_train(ops, _prompts(pipe, 0))
    validate(batch)
    assert top_k_semantics(batch) == TopKSemantics(K, 64)
    ids = nested_rows(batch["top_k_ids"])
    mu = nested_rows(batch["top_k_inference_logprobs"])
    assert all(r.shape == (len(t), K) for r, t in zip(ids, batch["response_tokens"].to_pylist()))
    assert all((m[:, :-1] >= m[:, 1:]).all() for m in mu)  # most likely first
    assert all(np.isneginf(m[:, 6:]).all() for m in mu)  # K = 8 past the sampler's top_k = 6
    assert batch["top_k_old_logprobs"].null_count == 0
    assert _top_k_gap(batch) < 1e-5


@pytest.mark.timeout(600)
def test_interrupt_scores_the_top_k_of_each_token_at_its_own_version_across_a_switch(without_ray):
    """A new version arrives after the first decode step: interrupt scores the prefix's top-k under
    the resident version before switching, the rest under the new one; each equals the sampler's."""
    pipe = RLPipeline(_config(strategy="interrupt", sampling={"max_new_tokens": 5}))
    ops, store = _ops(pipe)
    other = build_tiny_model(seed=7)[0].state_dict()
    published = []

    def switch_once(self, pins, views, old_logprobs, supports=None, old_top_k=None):
        if not published:
            store.publish(other, 1)
            published.append(1)
        return Generate._switch_if_newer(self, pins, views, old_logprobs, supports, old_top_k)

    ops["generate"]._switch_if_newer = switch_once.__get__(ops["generate"])
    batch = ops["generate"](_prompts(pipe, 0))
    validate(batch)
    spans = [set(v) for v in batch["versions"].to_pylist()]
    assert any(s == {0, 1} for s in spans)  # the rows really span the switch
    assert _top_k_gap(batch) < 1e-5


@pytest.mark.timeout(600)
def test_without_top_k_the_record_is_todays(without_ray):
    """K = 0 (the default): the columns and schema metadata of the record as before, no top-k."""
    pipe = RLPipeline(_config(top_k_logprobs=0))
    ops, _ = _ops(pipe)
    batch = ops["generate"](_prompts(pipe, 0))
    assert not [c for c in batch.column_names if c.startswith("top_k_") or c.startswith("teacher")]
    assert batch.column_names[: len(COLUMNS)] == COLUMNS
    assert META_TOP_K_KEY not in (batch.schema.metadata or {})


@pytest.mark.timeout(900)
def test_the_mismatch_metric_and_its_mask_through_the_train_step(without_ray):
    """bf16 inference: a real mismatch. The exact strategy reports it, behavior reports 0 (its
    pi_old is mu), and a tight dist_mask drops tokens from the kept set (and reports how many)."""
    common = dict(inference_dtype="bfloat16", max_staleness=0, steps=1)
    snap = run_in_process(RLPipeline(_config(**common))).to_dicts()[0]
    assert 1e-6 < snap["mismatch/tv"] < 0.1 and snap["mismatch/kl_support"] > 0
    assert snap["mismatch/tv_max"] >= snap["mismatch/tv"] and 0.9 < snap["mismatch/support_mass"] <= 1.0
    behavior = run_in_process(RLPipeline(_config(strategy="behavior", **common))).to_dicts()[0]
    assert behavior["mismatch/tv"] == 0.0 and behavior["mismatch/kl_support"] == 0.0
    masked = run_in_process(RLPipeline(_config(correction={"dist_mask": snap["mismatch/tv"], "mask_level": "none"},
                                               **common))).to_dicts()[0]
    assert 0.0 < masked["mask/dist_kept_frac"] < 1.0
    assert masked["mask/token_kept_frac"] == pytest.approx(masked["mask/dist_kept_frac"])
    # float32: the exact strategy's distributions agree
    exact = run_in_process(RLPipeline(_config(max_staleness=0, steps=1))).to_dicts()[0]
    assert exact["mismatch/tv"] < 1e-6


@pytest.mark.timeout(900)
def test_score_centering_trains_and_reports(without_ray):
    metrics = run_in_process(RLPipeline(_config(strategy="score_centering", inference_dtype="bfloat16")))
    row = metrics.to_dicts()[-1]
    assert np.isfinite(row["loss"]) and row["clip/frac"] == 0.0  # REINFORCE: no clip
    assert row["sc/center_norm"] > 0 and 0.5 < row["sc/alpha"] < 2.0
    assert "mismatch/tv" in row


@pytest.mark.timeout(900)
def test_the_teacher_scores_the_students_tokens_and_distillation_trains(without_ray, tmp_path):
    """A teacher with the student's own weights scores exactly what pi_old does (float32): reverse
    KL 0, forward KL 0; a different teacher gives positive values and the step trains."""
    same = _config(teacher=str(_warm_start_copy(tmp_path)), distill={"forward_kl_coef": 1.0}, max_staleness=0,
                   steps=1)
    pipe = RLPipeline(same)
    assert [s.name for s in pipe.stages][-3:] == ["old_logprobs", "teacher", "train"]
    ops, _ = _ops(pipe)
    batch = _before_train(ops, _prompts(pipe, 0))
    validate(batch)
    teacher = pc.list_flatten(batch["teacher_logprobs"]).to_numpy()
    old = pc.list_flatten(batch["old_logprobs"]).to_numpy()
    assert np.abs(teacher - old).max() < 1e-5
    row = ops["train"](batch).to_pylist()[0]
    assert abs(row["distill/reverse_kl"]) < 1e-5 and abs(row["distill/forward_kl"]) < 1e-5

    other = tmp_path / "other"
    save_model(build_tiny_model(seed=5)[0], load_tokenizer(pipe.model_path), other)
    row = run_in_process(RLPipeline(_config(teacher=str(other), distill={"forward_kl_coef": 0.5,
                                                                         "reverse_kl_student": "old"}, steps=1,
                                            max_staleness=0))).to_dicts()[0]
    assert row["distill/reverse_kl"] > 0.1 and row["distill/forward_kl"] > 0.1 and np.isfinite(row["loss"])


def _warm_start_copy(tmp_path):
    path = tmp_path / "teacher"
    model_dir = RLPipeline(_config()).model_path
    save_model(load_model(model_dir), load_tokenizer(model_dir), path)
    return path


@pytest.mark.timeout(600)
def test_a_fixed_lag_makes_every_rollout_that_many_versions_old(without_ray):
    """run_in_process(lag=S): step k's tokens come from version max(0, k - S), whatever the load
    (the stale-rollout experiments of benchmarks/distillation.py)."""
    metrics = run_in_process(RLPipeline(_config(top_k_logprobs=0, max_staleness=2, steps=4)), lag=2)
    assert metrics["staleness/mean"].to_list() == [0.0, 1.0, 2.0, 2.0]
    assert metrics["version"].to_list() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="lag: 3 must be in"):
        run_in_process(RLPipeline(_config(max_staleness=2)), lag=3)


@pytest.mark.timeout(900)
def test_a_nan_in_a_tokens_top_k_takes_that_token_out_and_nothing_else(without_ray, tmp_path):
    """Score Centering and the forward KL together, one token's sampler top-k corrupted (NaN): the
    token leaves the loss and is counted; loss and weights stay finite."""
    pipe = RLPipeline(_config(strategy="score_centering", teacher=str(_warm_start_copy(tmp_path)), max_staleness=0,
                              distill={"forward_kl_coef": 1.0, "reverse_kl_coef": 0.5}, steps=1))
    ops, store = _ops(pipe)
    batch = _before_train(ops, _prompts(pipe, 0))
    rows = nested_rows(batch["top_k_inference_logprobs"])
    rows[0] = rows[0].copy()
    rows[0][0, 3] = np.nan
    batch = replace_column(batch, "top_k_inference_logprobs", nested_array(rows, pa.float32(), K))
    row = ops["train"](batch).to_pylist()[0]
    assert row["support/outside_tokens"] >= 1.0 and np.isfinite(row["loss"])
    _, weights = store.weights(1)
    assert all(np.isfinite(t.numpy()).all() for t in weights.values())
