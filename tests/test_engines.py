"""Engines: sampling semantics, teacher-forced scoring, the torch engine, inference numerics.

What every engine must do (seeded reproducibility, the tempered distribution, abort, versions)
is in tests/test_engine_contract.py, parametrised over the torch and vLLM engines."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trajflow.engines import (
    Generation,
    SamplingConfig,
    TorchEngine,
    load_inference_weights,
    make_inference_model,
    process_logits,
    response_logprobs,
    score,
    token_logprobs,
)
from trajflow.engines.models import build_tiny_model
from trajflow.engines.tokenizer import EOS_ID, PAD_ID, encode_prompt

TOL = 1e-5

PROMPT_TEXTS = ["12+345=", "7+8=", "reverse: abcdef ="]  # different lengths -> left padding


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    return [encode_prompt(tok, t) for t in PROMPT_TEXTS]


def _engine(model, sampling, **kw) -> TorchEngine:
    return TorchEngine(model, eos_id=kw.pop("eos_id", EOS_ID), pad_id=PAD_ID, sampling=sampling, **kw)


def _score_generations(model, prompts, gens: list[Generation], sampling) -> list[np.ndarray]:
    return score(model, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)


def _max_abs_diff(gens: list[Generation], scored: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(g.logprobs) - s))) for g, s in zip(gens, scored))


def _mean_abs_diff(gens: list[Generation], scored: list[np.ndarray]) -> float:
    diffs = np.concatenate([np.asarray(g.logprobs) - s for g, s in zip(gens, scored)])
    return float(np.mean(np.abs(diffs)))


# ---------------------------------------------------------------------------------------------
# process_logits


def test_process_logits_filters_and_normalises():
    torch.manual_seed(0)
    logits = torch.randn(5, 64) * 3
    lp = process_logits(logits, SamplingConfig(temperature=0.5, top_k=10))
    assert torch.all(torch.isfinite(lp).sum(-1) == 10)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(5), atol=1e-6)
    # tempered softmax restricted to the top 10 and renormalised
    top = torch.topk(logits, 10, dim=-1).indices
    ref = torch.log_softmax((logits / 0.5).gather(-1, top), dim=-1)
    assert torch.allclose(lp.gather(-1, top), ref, atol=1e-6)

    # top-p keeps the smallest top set whose mass reaches p
    lp_p = process_logits(logits, SamplingConfig(top_p=0.6))
    for row_logits, row_lp in zip(logits, lp_p):
        probs = torch.softmax(row_logits, -1).sort(descending=True).values
        k = int((probs.cumsum(0) < 0.6).sum()) + 1
        assert int(torch.isfinite(row_lp).sum()) == k

    # greedy reports untempered log-probs
    assert torch.allclose(process_logits(logits, SamplingConfig(temperature=0)), torch.log_softmax(logits, -1))
    # token_logprobs (scoring form) == gather of process_logits
    sp = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    tokens = torch.argmax(logits, -1)
    assert torch.allclose(token_logprobs(logits, tokens, sp), process_logits(logits, sp).gather(-1, tokens[:, None])[:, 0], atol=1e-6)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)


# ---------------------------------------------------------------------------------------------
# generation log-probs == teacher-forced scoring (float32)

SAMPLINGS = {
    "t1": SamplingConfig(temperature=1.0, max_new_tokens=10),
    "t0.7": SamplingConfig(temperature=0.7, max_new_tokens=10),
    "t0.7_topk_topp": SamplingConfig(temperature=0.7, top_k=8, top_p=0.8, max_new_tokens=10),
    "greedy": SamplingConfig(temperature=0.0, max_new_tokens=10),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_generation_logprobs_match_scoring_float32(model, prompts, name):
    sampling = SAMPLINGS[name]
    gens = _engine(model, sampling, seed=1).generate(prompts, n=3)
    assert len(gens) == len(prompts) * 3
    assert [g.prompt_index for g in gens] == [i for i in range(len(prompts)) for _ in range(3)]
    scored = _score_generations(model, prompts, gens, sampling)
    diff = _max_abs_diff(gens, scored)
    assert diff < TOL, f"{name}: max |generation - scoring| = {diff:.3g}"
    if sampling.top_k or sampling.top_p < 1:
        # the filters really were active: the processed distribution excludes most tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompts[0]])).logits[0, -1]
        assert int(torch.isfinite(process_logits(logits, sampling)).sum()) <= sampling.top_k
    if sampling.greedy:
        assert all(g.response_tokens == gens[3 * g.prompt_index].response_tokens for g in gens)


# ---------------------------------------------------------------------------------------------
# sampling distribution


def test_sampling_respects_top_k_top_p(model, prompts):
    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.5, max_new_tokens=1)
    gens = _engine(model, sampling, seed=0).generate([prompts[0]], n=500)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    allowed = set(torch.nonzero(torch.isfinite(process_logits(logits, sampling))).flatten().tolist())
    assert 1 <= len(allowed) <= 5
    assert {g.response_tokens[0] for g in gens} <= allowed


# ---------------------------------------------------------------------------------------------
# weight swap mid-generation


def test_weight_swap_between_steps(model, prompts):
    new_model, _ = build_tiny_model(seed=1)
    new_state = {k: v.clone() for k, v in new_model.state_dict().items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sampling = SamplingConfig(temperature=0.8, top_k=20, max_new_tokens=9)
    swap_after = 4
    calls: list[int] = []

    def between_steps(engine: TorchEngine, partial: list[Generation]) -> None:
        calls.append(max(len(g.response_tokens) for g in partial))
        if calls[-1] == swap_after:
            engine.load_weights(new_state, version=7)

    engine = _engine(model, sampling, seed=3, version=2)
    gens = engine.generate(prompts, n=2, between_steps=between_steps)
    assert calls == list(range(1, len(calls) + 1))  # once per decode step
    assert engine.version == 7

    old_scores = _score_generations(model, prompts, gens, sampling)
    new_scores = _score_generations(new_model, prompts, gens, sampling)
    checked_after = 0
    for g, old, new in zip(gens, old_scores, new_scores):
        k = min(swap_after, len(g.response_tokens))
        assert g.versions == [2] * k + [7] * (len(g.response_tokens) - k)
        np.testing.assert_allclose(g.logprobs[:k], old[:k], atol=TOL, rtol=0)
        np.testing.assert_allclose(g.logprobs[k:], new[k:], atol=TOL, rtol=0)
        # the two versions really disagree on these tokens
        assert np.max(np.abs(old - new)) > 1e-2
        checked_after += len(g.response_tokens) - k
    assert checked_after > 0
    # the caller's model is untouched by the engine
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------
# finish reasons


def test_finish_reasons(model, prompts):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    gens = _engine(model, greedy).generate(prompts)
    assert all(g.finish_reason == "length" and len(g.response_tokens) == 8 for g in gens)
    assert all(EOS_ID not in g.response_tokens for g in gens)
    # Declare the 3rd greedy token of prompt 0 to be eos: greedy decoding must stop right there.
    reference = gens[0].response_tokens
    fake_eos = reference[2]
    stopped = _engine(model, greedy, eos_id=fake_eos).generate(prompts)
    first = stopped[0]
    assert first.finish_reason == "stop"
    assert first.response_tokens == reference[: reference.index(fake_eos) + 1]
    for g, ref in zip(stopped, gens):
        ref_tokens = ref.response_tokens
        if fake_eos in ref_tokens:
            assert g.response_tokens == ref_tokens[: ref_tokens.index(fake_eos) + 1] and g.finish_reason == "stop"
        else:
            assert g.response_tokens == ref_tokens and g.finish_reason == "length"
    # a finished row leaves the batch; the others still match scoring
    assert _max_abs_diff(stopped, _score_generations(model, prompts, stopped, greedy)) < TOL


# ---------------------------------------------------------------------------------------------
# scoring


def test_scoring_padding_invariance(model, prompts):
    sampling = SamplingConfig(temperature=0.7, top_k=30)
    responses = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    batch = score(model, prompts, responses, sampling)
    # arbitrary tokens: some fall outside the top 30 and score -inf (the same ones in every layout)
    assert any(np.isneginf(b).any() for b in batch) and any(np.isfinite(b).any() for b in batch)

    def same(a: np.ndarray, b: np.ndarray) -> bool:
        fin = np.isfinite(a)
        return np.array_equal(fin, np.isfinite(b)) and bool(np.all(np.abs(a[fin] - b[fin]) < TOL))

    for i in range(len(prompts)):
        alone = score(model, [prompts[i]], [responses[i]], sampling)[0]
        assert alone.dtype == np.float32 and alone.shape == (len(responses[i]),)
        assert same(alone, batch[i])
    # micro-batching gives the same numbers
    chunked = score(model, prompts, responses, sampling, batch_size=2)
    assert all(same(a, b) for a, b in zip(chunked, batch))
    lp, valid = response_logprobs(model, prompts, responses, sampling)
    assert lp.shape == valid.shape == (3, 11) and lp.dtype == torch.float32
    assert valid.sum(-1).tolist() == [7, 2, 11] and torch.all(lp[~valid] == 0)


def test_scoring_grad(prompts):
    train_model, _ = build_tiny_model(seed=0)
    train_model.train()
    responses = [[5, 6, 7], [8, 9], [10]]
    lp, valid = response_logprobs(train_model, prompts, responses, SamplingConfig(temperature=0.9), grad=True)
    assert lp.requires_grad
    (-lp[valid].sum()).backward()
    grads = [p.grad for p in train_model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    # grad=False builds no graph
    lp_ng, _ = response_logprobs(train_model, prompts, responses, SamplingConfig(temperature=0.9))
    assert not lp_ng.requires_grad
    assert torch.allclose(lp_ng, lp.detach(), atol=TOL)


# ---------------------------------------------------------------------------------------------
# inference numerics


def test_float32_engine_is_exact(model, prompts):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    gens = _engine(model, sampling, inference_dtype="float32", seed=2).generate(prompts, n=4)
    mean = _mean_abs_diff(gens, _score_generations(model, prompts, gens, sampling))
    print(f"\n[engines] inference_dtype=float32: mean |inference - float32 scoring| = {mean:.3e}")
    assert mean < 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_low_precision_inference_differs_measurably(model, prompts, dtype):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    engine = _engine(model, sampling, inference_dtype=dtype, seed=2)
    gens = engine.generate(prompts, n=4)
    scored_fp32 = _score_generations(model, prompts, gens, sampling)
    assert all(np.isfinite(s).all() for s in scored_fp32) and all(np.isfinite(g.logprobs).all() for g in gens)
    mean = _mean_abs_diff(gens, scored_fp32)
    worst = _max_abs_diff(gens, scored_fp32)
    print(f"\n[engines] inference_dtype={dtype}: mean |inference - float32 scoring| = {mean:.3e} (max {worst:.3e})")
    assert math.isfinite(mean) and mean > 1e-4
    if dtype == "fp8":
        # fp8 only rounds the weights (compute is fp32): the engine agrees with scoring of its own
        # dequantised model, so the discrepancy is purely the weight quantisation.
        assert _max_abs_diff(gens, _score_generations(engine.model, prompts, gens, sampling)) < TOL


def test_make_inference_model_dtypes(model):
    bf16 = make_inference_model(model, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert all(not p.requires_grad for p in bf16.parameters())
    fp8 = make_inference_model(model, "fp8")
    for (name, p), (_, q) in zip(model.named_parameters(), fp8.named_parameters()):
        assert q.dtype == torch.float32
        if p.dim() >= 2:
            scale = p.abs().max() / torch.finfo(torch.float8_e4m3fn).max
            assert torch.equal((q / scale).to(torch.float8_e4m3fn).float() * scale, q), name  # on the fp8 grid
            assert not torch.equal(p, q), name
        else:
            assert torch.equal(p, q), name
    assert next(model.parameters()).dtype == torch.float32  # the training model is untouched
    with pytest.raises(ValueError, match="inference_dtype"):
        make_inference_model(model, "float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_load_inference_weights(dtype):
    a, _ = build_tiny_model(seed=0)
    b, _ = build_tiny_model(seed=1)
    inf = make_inference_model(a, dtype)
    load_inference_weights(inf, b.state_dict(), dtype)
    expected = make_inference_model(b, dtype)
    for (name, p), (_, q) in zip(inf.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(p, q), name
    # safetensors-style dicts omit the tied lm_head alias; a truly missing weight is an error
    partial = {k: v for k, v in b.state_dict().items() if k != "lm_head.weight"}
    load_inference_weights(inf, partial, dtype)
    del partial["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_inference_weights(inf, partial, dtype)
