"""The engine contract, run against every engine (torch, vllm): same tests, same tolerances.

float32 log-probs equal teacher-forced training-side scoring; sampling at temperature T follows the
tempered softmax; a weight update switches outputs to the new version's; an interrupted request
resumes under the new weights with per-token versions of both.

The vLLM parameters need the `vllm` package. Without it they skip with a reason (the main venv);
with TRAJFLOW_REQUIRE_VLLM=1 (set by .ci/vllm-tests) a missing vLLM fails instead. vLLM starts in
seconds, not milliseconds, so one vLLM engine serves the whole module: each test re-targets it with
`load_weights` (itself part of the contract), its sampling parameters and a reseed.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from trajflow.engines import Generation, SamplingConfig, score
from trajflow.engines.factory import ENGINES, make_engine
from trajflow.engines.models import build_tiny_model, save_model
from trajflow.engines.tokenizer import EOS_ID, PAD_ID, encode_prompt

TOL = 1e-4  # the contract's float32 bound (measured: < 1e-6 for both engines)
PROMPT_TEXTS = ["12+345=", "7+8=", "reverse: abcdef ="]  # different lengths


def require_vllm() -> None:
    """Skip (locally) or fail (TRAJFLOW_REQUIRE_VLLM=1, CI) when vLLM is not importable."""
    try:
        from vllm import LLM  # noqa: F401
    except ImportError as e:
        reason = (f"vllm is not importable ({e}); the vLLM engine tests run in .venv-vllm via "
                  ".ci/vllm-tests")
        if os.environ.get("TRAJFLOW_REQUIRE_VLLM") == "1":
            pytest.fail(f"TRAJFLOW_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def other_model():
    return build_tiny_model(seed=1)[0]


@pytest.fixture(scope="module")
def prompts(tiny):
    return [encode_prompt(tiny[1], t) for t in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def shared_vllm(tiny, tmp_path_factory):
    """One vLLM engine for the module, built from a saved local model directory."""
    require_vllm()
    path = tmp_path_factory.mktemp("tiny_model")
    save_model(tiny[0], tiny[1], path)
    engine = make_engine("vllm", path, eos_id=EOS_ID, pad_id=PAD_ID, sampling=SamplingConfig(),
                         inference_dtype="float32", seed=0, version=0, kv_cache_memory_bytes=128 << 20)
    yield engine
    engine.close()


@pytest.fixture(params=list(ENGINES.builtins()))
def make(request):
    """make(model, sampling, seed=, version=, eos_id=) -> an engine holding `model`'s weights."""
    name = request.param
    if name == "torch":
        def _torch(model, sampling, *, seed=0, version=0, eos_id=EOS_ID, stop_token_ids=(), tokenizer=None,
                   top_k_logprobs=0):
            return make_engine("torch", model, eos_id=eos_id, pad_id=PAD_ID, sampling=sampling,
                               inference_dtype="float32", seed=seed, version=version,
                               stop_token_ids=stop_token_ids, tokenizer=tokenizer, top_k_logprobs=top_k_logprobs)
        return _torch
    require_vllm()
    engine = request.getfixturevalue("shared_vllm")

    def _vllm(model, sampling, *, seed=0, version=0, eos_id=EOS_ID, stop_token_ids=(), tokenizer=None,
              top_k_logprobs=0):
        engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, version)
        engine.sampling = sampling
        engine.top_k_logprobs = top_k_logprobs  # within the max_logprobs the engine was built with (64)
        engine.eos_id = eos_id
        engine.stop_token_ids = tuple(stop_token_ids)
        engine.tokenizer = tokenizer
        engine.generator.manual_seed(seed)
        return engine
    return _vllm


def _scored(model, prompts, gens: list[Generation], sampling) -> list[np.ndarray]:
    return score(model, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)


def _max_abs_diff(gens: list[Generation], scored: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(g.logprobs) - s))) for g, s in zip(gens, scored))


def _check_shape(gens: list[Generation], n_prompts: int, n: int, sampling: SamplingConfig) -> None:
    assert len(gens) == n_prompts * n
    assert [g.prompt_index for g in gens] == [i for i in range(n_prompts) for _ in range(n)]
    for g in gens:
        assert len(g.response_tokens) == len(g.logprobs) == len(g.versions) >= 1
        assert g.finish_reason in ("stop", "length")
        assert (g.finish_reason == "stop") == (g.response_tokens[-1] == EOS_ID)
        assert EOS_ID not in g.response_tokens[:-1]
        if g.finish_reason == "length":
            assert len(g.response_tokens) == sampling.max_new_tokens


SAMPLINGS = {
    "t1": SamplingConfig(temperature=1.0, max_new_tokens=10),
    "t0.7": SamplingConfig(temperature=0.7, max_new_tokens=10),
    "t0.7_topk_topp": SamplingConfig(temperature=0.7, top_k=8, top_p=0.8, max_new_tokens=10),
    "greedy": SamplingConfig(temperature=0.0, max_new_tokens=10),
    "greedy_topk_topp": SamplingConfig(temperature=0.0, top_k=6, top_p=0.5, max_new_tokens=10),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_float32_logprobs_equal_training_scoring(make, model, prompts, name):
    sampling = SAMPLINGS[name]
    engine = make(model, sampling, seed=1, version=3)
    gens = engine.generate(prompts, n=3)
    _check_shape(gens, len(prompts), 3, sampling)
    assert all(g.versions == [3] * len(g.response_tokens) for g in gens)
    diff = _max_abs_diff(gens, _scored(model, prompts, gens, sampling))
    print(f"\n[contract] {type(engine).__name__} {name}: max |inference - float32 scoring| = {diff:.2e}")
    assert diff < TOL
    if sampling.greedy:
        assert all(g.response_tokens == gens[3 * g.prompt_index].response_tokens for g in gens)


@pytest.mark.parametrize("name", ["t1", "t0.7_topk_topp", "greedy"])
def test_float32_top_k_equals_training_scoring(make, model, prompts, name):
    """The sampler's top-K of each token (the processed distribution it sampled from, most likely
    first, -inf past a filter's support) equals the training-side scores of the same ids."""
    from trajflow.engines.training_numerics import TrainingNumerics

    sampling, k = SAMPLINGS[name], 8
    gens = make(model, sampling, seed=1, top_k_logprobs=k).generate(prompts, n=2)
    _check_shape(gens, len(prompts), 2, sampling)
    scored: list[np.ndarray] = []
    TrainingNumerics().score(model, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens],
                             sampling, top_k_ids=[np.asarray(g.top_k_ids) for g in gens], top_k=scored)
    worst = 0.0
    for g, top in zip(gens, scored):
        mine = np.asarray(g.top_k_logprobs)
        assert mine.shape == top.shape == (len(g.response_tokens), k)
        assert (mine[:, :-1] >= mine[:, 1:]).all()  # most likely first
        assert (np.isneginf(mine) == np.isneginf(top)).all()
        finite = np.isfinite(mine)
        worst = max(worst, float(np.abs(mine[finite] - top[finite]).max(initial=0.0)))
    print(f"\n[contract] top-{k} {name}: max |inference - float32 scoring| = {worst:.2e}")
    assert worst < TOL
    if sampling.top_k:
        assert all(np.isneginf(np.asarray(g.top_k_logprobs)[:, sampling.top_k:]).all() for g in gens)


def test_same_seed_reproduces(make, model, prompts):
    sampling = SAMPLINGS["t1"]
    a = make(model, sampling, seed=5).generate(prompts, n=2)
    b = make(model, sampling, seed=5).generate(prompts, n=2)
    c = make(model, sampling, seed=6).generate(prompts, n=2)
    assert [g.response_tokens for g in a] == [g.response_tokens for g in b]
    assert [g.response_tokens for g in a] != [g.response_tokens for g in c]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square, categories with expected count < 5 pooled into one. -> (stat, dof)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_sampling_at_temperature_matches_tempered_softmax(make, prompts):
    peaked, _ = build_tiny_model(seed=0)
    with torch.no_grad():
        peaked.model.norm.weight.mul_(8.0)  # logits x8: far from uniform, so temperature matters
    temperature, draws = 0.7, 4000
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=1)
    gens = make(peaked, sampling, seed=0).generate([prompts[0]], n=draws)
    counts = np.bincount([g.response_tokens[0] for g in gens], minlength=64).astype(float)
    with torch.no_grad():
        logits = peaked(torch.tensor([prompts[0]])).logits[0, -1].double()
    tempered = torch.softmax(logits / temperature, -1).numpy()
    untempered = torch.softmax(logits, -1).numpy()
    stat, dof = _chi_square(counts, tempered)
    threshold = dof + 10 * math.sqrt(2 * dof)  # right tail < 1e-9 for these dof
    assert stat < threshold, f"chi2 {stat:.1f} vs tempered softmax (dof {dof}, threshold {threshold:.1f})"
    wrong, wrong_dof = _chi_square(counts, untempered)
    assert wrong > wrong_dof + 10 * math.sqrt(2 * wrong_dof), "test cannot tell T from 1"
    # the recorded log-probs are the tempered ones
    tokens = [g.response_tokens[0] for g in gens]
    assert np.allclose([g.logprobs[0] for g in gens], np.log(tempered[tokens]), atol=TOL)


def test_weight_update_switches_to_new_version(make, model, other_model, prompts):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    engine = make(model, greedy, version=1)
    before = engine.generate(prompts)
    assert engine.version == 1 and all(set(g.versions) == {1} for g in before)

    engine.load_weights({k: v.detach().clone() for k, v in other_model.state_dict().items()}, version=2)
    assert engine.version == 2
    after = engine.generate(prompts)
    assert all(set(g.versions) == {2} for g in after)
    # the outputs are the new version's: its greedy continuations, scored under it
    reference = make_engine("torch", other_model, eos_id=EOS_ID, pad_id=PAD_ID, sampling=greedy).generate(prompts)
    assert [g.response_tokens for g in after] == [g.response_tokens for g in reference]
    assert [g.response_tokens for g in after] != [g.response_tokens for g in before]
    assert _max_abs_diff(after, _scored(other_model, prompts, after, greedy)) < TOL
    assert _max_abs_diff(after, _scored(model, prompts, after, greedy)) > 1e-2


def test_interrupted_request_resumes_under_new_version(make, model, other_model, prompts):
    sampling = SamplingConfig(temperature=0.8, top_k=20, max_new_tokens=9)
    new_state = {k: v.detach().clone() for k, v in other_model.state_dict().items()}
    swap_after = 4
    lengths: list[int] = []

    def between_steps(engine, partial: list[Generation]) -> None:
        lengths.append(max(len(g.response_tokens) for g in partial))
        if lengths[-1] == swap_after and engine.version == 2:
            engine.load_weights(new_state, version=7)

    engine = make(model, sampling, seed=3, version=2)
    gens = engine.generate(prompts, n=2, between_steps=between_steps)
    assert lengths == list(range(1, len(lengths) + 1))  # called once per decode step
    assert engine.version == 7
    _check_shape(gens, len(prompts), 2, sampling)

    old_scores = _scored(model, prompts, gens, sampling)
    new_scores = _scored(other_model, prompts, gens, sampling)
    spanning = 0
    worst = 0.0
    for g, old, new in zip(gens, old_scores, new_scores):
        k = min(swap_after, len(g.response_tokens))
        assert g.versions == [2] * k + [7] * (len(g.response_tokens) - k)
        worst = max(worst, float(np.max(np.abs(np.asarray(g.logprobs[:k]) - old[:k]))))
        if len(g.response_tokens) > k:
            worst = max(worst, float(np.max(np.abs(np.asarray(g.logprobs[k:]) - new[k:]))))
            spanning += 1
        assert np.max(np.abs(old - new)) > 1e-2  # the two versions really disagree
    print(f"\n[contract] {type(engine).__name__} interrupt: max |logprob - scoring at own version| = {worst:.2e}")
    assert worst < TOL
    assert spanning > 0


def test_abort_from_between_steps(make, model, prompts):
    def stop_at_2(engine, partial: list[Generation]) -> None:
        if len(partial[0].response_tokens) == 2:
            engine.abort()

    gens = make(model, SAMPLINGS["t1"]).generate(prompts, between_steps=stop_at_2)
    assert all(g.finish_reason in ("abort", "stop") and len(g.response_tokens) <= 2 for g in gens)
    assert any(g.finish_reason == "abort" for g in gens)
    assert all(len(g.logprobs) == len(g.versions) == len(g.response_tokens) for g in gens)


@pytest.mark.parametrize("declared_as", ["eos_id", "stop_token_ids"])
def test_stop_token_ends_the_response(make, model, prompts, declared_as):
    """eos, and any extra stop id (a chat model's generation-config eos), ends a response (kept)."""
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    reference = make(model, greedy).generate(prompts)
    assert all(g.finish_reason == "length" and EOS_ID not in g.response_tokens for g in reference)
    stop = reference[0].response_tokens[2]  # declare the 3rd greedy token of prompt 0 a stop token
    kwargs = {"eos_id": stop} if declared_as == "eos_id" else {"stop_token_ids": (stop,)}
    stopped = make(model, greedy, **kwargs).generate(prompts)
    for g, ref in zip(stopped, reference):
        tokens = ref.response_tokens
        if stop in tokens:
            assert g.response_tokens == tokens[: tokens.index(stop) + 1] and g.finish_reason == "stop"
        else:
            assert g.response_tokens == tokens and g.finish_reason == "length"
    assert stopped[0].finish_reason == "stop"


def test_stop_strings_end_the_response(make, model, tiny, prompts):
    """A `sampling.stop` string ends the response at the token that completes it (kept, "stop")."""
    tokenizer = tiny[1]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    reference = make(model, greedy).generate(prompts, n=2)
    stop = tokenizer.decode(reference[0].response_tokens[2:4])  # two characters greedy prompt 0 produces
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, stop=(stop, "never-sampled"))
    stopped = make(model, sampling, tokenizer=tokenizer).generate(prompts, n=2)
    for g, ref in zip(stopped, reference):
        text = [tokenizer.decode(ref.response_tokens[: k + 1]) for k in range(len(ref.response_tokens))]
        hit = next((k for k, t in enumerate(text) if stop in t), None)
        if hit is None:
            assert g.response_tokens == ref.response_tokens and g.finish_reason == "length"
        else:
            assert g.response_tokens == ref.response_tokens[: hit + 1] and g.finish_reason == "stop"
            assert len(g.logprobs) == len(g.versions) == hit + 1
    assert stopped[0].finish_reason == "stop" and len(stopped[0].response_tokens) <= 4
    with pytest.raises(ValueError, match="need the engine's tokenizer"):
        make(model, sampling).generate(prompts)


def test_rejects_bad_arguments(make, model, prompts):
    engine = make(model, SAMPLINGS["t1"])
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(prompts, n=0)
    assert engine.generate([], n=2) == []
