"""LoRA versions on the vLLM engine (issue #22): each version's adapter registered as a vLLM
LoRARequest over base weights held once, the window's adapters resident, the current one on
every request (engines/vllm_engine.py).

- engine: with adapters of non-zero B the samples' log-probs differ from the base's and equal the
  float32 teacher-forced scoring of the merged weights (engines/lora.py) within 1e-4, the
  tolerance of the vLLM exactness tests (tests/vllm_tests/test_pipeline_vllm.py: vLLM's CPU
  kernels are not HF's); a zero-B adapter gives the base's log-probs; `lora_slots` versions are
  resident at once, asked from vLLM, and older ones leave as newer ones arrive; full weights still
  load into vLLM's LoRA-wrapped layers (scored exactly) and clear the adapter;
- pipeline: a `lora.r: 8` run on `engine: vllm` (snapshot and interrupt, max_staleness 2,
  float32) completes, old log-probs = inference log-probs within 1e-4, and the generator's engine
  held the window's max_staleness + 1 = 3 adapters at once, older ones leaving as it moved.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trajflow.engines import SamplingConfig, lora, score
from trajflow.engines.factory import make_engine
from trajflow.engines.models import build_tiny_model
from trajflow.engines.tokenizer import EOS_ID, PAD_ID, encode_prompt

TOL = 1e-4  # the vLLM exactness tests' tolerance (module docstring)
SETTINGS = lora.LoraConfig(r=8, alpha=16.0)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0)


def _adapter(seed: int, std: float) -> dict[str, torch.Tensor]:
    """A version's payload: PEFT's adapter on the tiny model with B drawn N(0, std) (std 0: the
    fresh adapter, the base function)."""
    peft = lora.wrap(build_tiny_model(seed=0)[0], SETTINGS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return {k: v.clone() for k, v in lora.adapter_payload(peft, SETTINGS.scaling).items()}


def _merged_model(payload):
    model = build_tiny_model(seed=0)[0]
    model.load_state_dict(lora.merged(model.state_dict(), payload))
    return model.eval()


@pytest.mark.timeout(300)
def test_adapter_versions_are_vllm_lora_requests_resident_in_a_window(tiny):
    model, tok = tiny
    prompts = [encode_prompt(tok, t) for t in ["12+345=", "7+8=", "reverse: abcdef ="]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    engine = make_engine("vllm", model, eos_id=EOS_ID, pad_id=PAD_ID, sampling=sampling, seed=3,
                         kv_cache_memory_bytes=64 << 20, max_model_len=64, lora_slots=3, lora_rank=SETTINGS.r)

    def sample_and_score(reference):
        engine.generator.manual_seed(11)
        gens = engine.generate(prompts, n=2)
        scored = score(reference, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens],
                       sampling)
        return gens, float(max(np.max(np.abs(np.asarray(g.logprobs) - s)) for g, s in zip(gens, scored)))

    try:
        engine.load_weights(model.state_dict(), version=0)
        base_gens, base_diff = sample_and_score(model)
        engine.load_adapter(_adapter(0, 0.0), version=1)  # B = 0: the base function
        zero_gens, zero_diff = sample_and_score(_merged_model(_adapter(0, 0.0)))
        assert [g.response_tokens for g in zero_gens] == [g.response_tokens for g in base_gens]
        assert all(set(g.versions) == {1} for g in zero_gens)

        worst, moved = 0.0, []
        for version in (2, 3):
            payload = _adapter(version, 0.05)
            engine.load_adapter(payload, version)
            gens, diff = sample_and_score(_merged_model(payload))
            worst = max(worst, diff)
            assert all(set(g.versions) == {version} for g in gens)
            # the adapter's own log-probs, compared with the base's on the same tokens
            base_scored = score(model, [prompts[g.prompt_index] for g in gens], [g.response_tokens for g in gens],
                                sampling)
            moved.append(float(max(np.max(np.abs(np.asarray(g.logprobs) - s)) for g, s in zip(gens, base_scored))))
        assert engine.resident_adapters() == [1, 2, 3]  # three versions held by vLLM at once
        engine.load_adapter(_adapter(4, 0.05), version=4)
        assert engine.resident_adapters() == [2, 3, 4]  # version 1 left the window
        engine.load_adapter(_adapter(2, 0.05), version=2)  # still resident: no reload
        assert engine.resident_adapters() == [2, 3, 4] and engine.version == 2
        other = build_tiny_model(seed=1)[0]
        engine.load_weights(other.state_dict(), version=5)  # full weights into vLLM's LoRA layers
        after_gens, after_diff = sample_and_score(other)  # and no adapter on the requests
        assert [g.response_tokens for g in after_gens] != [g.response_tokens for g in base_gens]
        assert all(set(g.versions) == {5} for g in after_gens)
        print(f"\n[vllm lora] |vLLM - merged scoring|: base {base_diff:.1e}, zero adapter {zero_diff:.1e}, "
              f"adapters {worst:.1e}, new full weights {after_diff:.1e}; adapter vs base log-probs up to {moved}")
        assert max(base_diff, zero_diff, worst, after_diff) < TOL
        assert min(moved) > 10 * TOL, "the adapter did not change the distribution"
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["snapshot", "interrupt"])
def test_a_lora_run_on_vllm_keeps_exactness_with_several_adapters_resident(ray_session, publish_inside_rollouts,
                                                                            tmp_path, strategy):
    """`interrupt` also switches adapters mid-generation (abort, resubmit under the new adapter)
    and scores each prefix with the merged weights before the switch."""
    import dataclasses

    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    log = tmp_path / "resident.jsonl"
    steps = 8
    config = PipelineConfig(steps=steps, prompts_per_step=4, group_size=4, drop_zero_variance_groups=False, seed=1,
                            max_staleness=2, inference_dtype="float32", strategy=strategy,
                            lora={"r": 8, "alpha": 16.0}, optimizer={"lr": 1e-2}, engine="vllm",
                            vllm={"kv_cache_memory_bytes": 64 << 20})
    assert config.engine_lora_slots() == 3
    pipe = publish_inside_rollouts(RLPipeline(config))
    generate = pipe.stage("generate")

    class GenerateRecordingAdapters(generate.fn):
        """After each version switch, the versions whose adapters vLLM holds (asked from vLLM)."""

        def load_newest(self, pins) -> None:
            super().load_newest(pins)
            with open(log, "a") as f:
                f.write(json.dumps([self.engine.version, self.engine.resident_adapters()]) + "\n")

    pipe = pipe.replace("generate", dataclasses.replace(generate, fn=GenerateRecordingAdapters))
    m = pipe.run(progress=False)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    print(f"\n[vllm lora pipeline] {strategy}: max|log r_d|={m['mismatch/max_abs_log_rd'].max():.2e} "
          f"max lag={m['staleness/max'].max()} spanning rows={m['rows_spanning_versions'].sum()} "
          f"(version, resident adapters): {seen}")
    assert m["step"].to_list() == list(range(steps))
    assert m["mismatch/max_abs_log_rd"].max() < TOL
    assert m["mask/token_kept_frac"].min() == 1.0
    assert m["staleness/over_stale_tokens"].sum() == 0
    if strategy == "interrupt":
        assert m["rows_spanning_versions"].sum() > 0, "no trajectory spanned two adapter versions"
    assert all(version == 0 or resident[-1] == version for version, resident in seen)
    assert all(len(resident) <= 3 and all(v > version - 3 for v in resident) for version, resident in seen)
    assert max(len(resident) for _, resident in seen) == 3, "never the window's adapters resident at once"
    assert any(resident and resident[0] > 1 for _, resident in seen), "no adapter left the window"
