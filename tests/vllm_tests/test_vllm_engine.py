"""vLLM-specific behavior beyond the shared contract (tests/test_engine_contract.py): construction
from an in-memory model, inference dtypes, configuration errors, greedy-with-filters log-probs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trajflow.engines import SamplingConfig, score
from trajflow.engines.factory import make_engine
from trajflow.engines.models import build_tiny_model
from trajflow.engines.sampling import process_logits
from trajflow.engines.tokenizer import EOS_ID, PAD_ID, encode_prompt
from trajflow.engines.vllm_engine import VllmEngine, _greedy_filtered_logprob


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts(tiny):
    return [encode_prompt(tiny[1], t) for t in ["12+345=", "7+8=", "reverse: abcdef ="]]


def test_bfloat16_from_in_memory_model(tiny, prompts):
    """A PreTrainedModel is saved to a temporary directory; bf16 numerics differ measurably from
    float32 training-side scoring but stay finite; the caller's thread control keeps working."""
    model = tiny[0]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    engine = make_engine("vllm", model, eos_id=EOS_ID, pad_id=PAD_ID, sampling=sampling,
                         inference_dtype="bfloat16", seed=2, kv_cache_memory_bytes=64 << 20, max_model_len=64)
    tmp = Path(engine.model_path)
    assert (tmp / "config.json").is_file()
    try:
        assert isinstance(engine, VllmEngine)
        gens = engine.generate(prompts, n=4)
        scored = score(model, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)
        diffs = np.concatenate([np.asarray(g.logprobs) - s for g, s in zip(gens, scored)])
        assert np.isfinite(diffs).all()
        mean = float(np.mean(np.abs(diffs)))
        print(f"\n[vllm] inference_dtype=bfloat16: mean |inference - float32 scoring| = {mean:.3e}")
        assert mean > 1e-4
        # vLLM's CPU worker disables torch.set_num_threads process-wide; the engine restores it.
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(previous)
    finally:
        engine.close()
    assert not tmp.exists()


def test_weight_update_through_a_safetensors_dir(tiny, prompts):
    """The tensor-parallel route (workers in other processes read a safetensors file), exercised
    in-process on CPU: same outputs as an engine started from the new weights."""
    other, tok = build_tiny_model(seed=1)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    engine = make_engine("vllm", tiny[0], eos_id=EOS_ID, pad_id=PAD_ID, sampling=greedy,
                         kv_cache_memory_bytes=64 << 20, max_model_len=64)
    try:
        engine._weights_via_path = True
        before = engine.generate(prompts)
        engine.load_weights(other.state_dict(), version=4)  # tied embedding: saved untied
        after = engine.generate(prompts)
        reference = make_engine("torch", other, eos_id=EOS_ID, pad_id=PAD_ID, sampling=greedy).generate(prompts)
        assert [g.response_tokens for g in after] == [g.response_tokens for g in reference]
        assert [g.response_tokens for g in after] != [g.response_tokens for g in before]
        assert all(set(g.versions) == {4} for g in after)
    finally:
        engine.close()


def test_fp8_and_tensor_parallel_need_cuda(tiny):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: fp8 and tensor parallelism are available")
    kw = dict(eos_id=EOS_ID, pad_id=PAD_ID, sampling=SamplingConfig())
    with pytest.raises(NotImplementedError, match="fp8"):
        make_engine("vllm", tiny[0], inference_dtype="fp8", **kw)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs CUDA"):
        make_engine("vllm", tiny[0], tensor_parallel_size=2, **kw)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor_parallel_size=2 needs two CUDA GPUs")
def test_tensor_parallel_two_gpus(tiny, prompts):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    engine = make_engine("vllm", tiny[0], eos_id=EOS_ID, pad_id=PAD_ID, sampling=sampling,
                         tensor_parallel_size=2, gpu_memory_utilization=0.3)
    try:
        gens = engine.generate(prompts)
        other, _ = build_tiny_model(seed=1)
        engine.load_weights(other.state_dict(), version=1)  # via a safetensors directory under TP
        after = engine.generate(prompts)
        assert all(set(g.versions) == {1} for g in after)
        assert [g.response_tokens for g in gens] != [g.response_tokens for g in after]
    finally:
        engine.close()


def test_factory_rejects_unknown_engine_and_bad_model(tiny):
    kw = dict(eos_id=EOS_ID, pad_id=PAD_ID, sampling=SamplingConfig())
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt", tiny[0], **kw)
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_engine("vllm", "/nonexistent/model", **kw)
    with pytest.raises(TypeError, match="enforce_eager"):
        make_engine("torch", tiny[0], enforce_eager=True, **kw)


def _entry(logprobs: torch.Tensor, n: int) -> dict:
    top = torch.topk(logprobs, n)
    return {int(t): SimpleNamespace(logprob=float(v)) for v, t in zip(top.values, top.indices)}


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.4), (7, 0.5)])
def test_greedy_filtered_logprob_matches_process_logits(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(64) * 2
    raw = torch.log_softmax(logits, -1)  # what vLLM reports for greedy requests
    sampling = SamplingConfig(temperature=0.0, top_k=top_k, top_p=top_p)
    token = int(torch.argmax(logits))
    expected = float(process_logits(logits, sampling)[token])
    got = _greedy_filtered_logprob(_entry(raw, top_k or 64), token, sampling)
    assert math.isclose(got, expected, abs_tol=1e-5)
    if not top_k:  # the top-N log-probs must reach the top-p mass, else the kept set is unknown
        wide = SamplingConfig(temperature=0.0, top_p=0.99)
        with pytest.raises(RuntimeError, match="max_logprobs"):
            _greedy_filtered_logprob(_entry(raw, 2), token, wide)
