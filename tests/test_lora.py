"""LoRA (`lora:`, engines/lora.py, issue #22): the trainer trains and publishes a PEFT adapter.

- the section: declared once (engines.lora.LoraConfig), bounded, and the combinations it does
  not support refused by name before anything starts;
- a version's payload is the adapter: under 15 % of the full model's bytes at r 8 on the
  quickstart model (measured, printed);
- a run with `lora.r: 8` (snapshot, max_staleness 2, float32 inference) trains only the adapter
  (the base weights equal the warm start to the bit), every reader applies each version's adapter
  the same way (old log-probs = inference log-probs within 1e-5 on versions >= 1, which are
  adapters), the train step's pi_theta through PEFT's forward agrees with them, and the final
  checkpoint holds the adapter (+ optimizer) and exports a merged model that transformers loads
  and that gives the PEFT model's log-probs;
- a run resumed from a LoRA checkpoint equals the uninterrupted run (a SIGKILLed LoRA job and its
  `--resume` end to end: tests/test_jobs_run.py);
- with `engine: vllm` (vLLM reported installed) the engine keeps max_staleness + 1 adapters, a
  rank above 512 and an lm_head adapter are refused, and the adapter directory vLLM loads is
  PEFT's format (PEFT loads it as the same function); the runs: tests/vllm_tests/test_vllm_lora.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import max_abs_difference, run_with_final_weights

from trajflow.engines import lora
from trajflow.engines.paths import WARM_START_DIR
from trajflow.pipelines.config import PipelineConfig, preflight

LORA = dict(steps=3, prompts_per_step=4, group_size=4, drop_zero_variance_groups=False, seed=1, max_staleness=2,
            inference_dtype="float32", strategy="snapshot", lora={"r": 8, "alpha": 16.0},
            optimizer={"lr": 1e-2})


def test_the_section_is_checked_before_anything_starts():
    assert PipelineConfig(lora={"r": 8}).settings.lora == lora.LoraConfig(r=8)
    assert not PipelineConfig().settings.lora.enabled
    for bad, words in [({"r": -1}, "r"), ({"r": 8, "dropout": 0.1}, "dropout"), ({"r": 8, "alpha": 0}, "alpha"),
                       ({"r": 8, "target_modules": []}, "target_modules")]:
        with pytest.raises(ValueError, match=words):
            PipelineConfig(lora=bad)
    # sharded too: the adapter is sharded with its layer (operators/trainer/fsdp.py; tests/test_trainer_fsdp.py)
    assert PipelineConfig(lora={"r": 8}, trainer={"sharding": "fsdp"}).trainer.sharding == "fsdp"


def test_a_version_is_the_adapter_under_15_percent_of_the_full_bytes():
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.schemas.weights import SharedStateDict

    model = load_model(WARM_START_DIR)
    full = SharedStateDict.of(model.state_dict()).nbytes
    payload = lora.adapter_payload(lora.wrap(model, lora.LoraConfig(r=8)), 2.0)
    adapter = SharedStateDict.of(payload, None).nbytes
    print(f"\nr 8 adapter {adapter} B of {full} B full: {adapter / full:.1%}")
    assert lora.is_adapter(payload) and not lora.is_adapter(model.state_dict())
    assert adapter / full < 0.15


def _run(config: PipelineConfig, steps: range | None = None, recorder=None, initial_weights=None):
    """The pipeline's stages step by step in this process (test_trainer_dp's helper); the job's
    step hook also keeps each step's logged rows and, after the last, the trainer's base weights
    and adapter."""
    seen: list = []
    state: dict = {}

    class Hooks:
        on_start = recorder.on_start if recorder is not None else None
        on_rows = recorder.on_rows if recorder is not None else None

        @staticmethod
        def on_step(trainstep, batch, metrics) -> None:
            seen.append(batch)
            state.update(base={k: v.clone() for k, v in lora.base_weights(trainstep.policy.model)},
                         payload=trainstep.version_payload())
            if recorder is not None:
                recorder.on_step(trainstep, batch, metrics)

    metrics, weights = run_with_final_weights(config, steps, recorder=Hooks, initial_weights=initial_weights)
    return metrics, weights, seen, state


@pytest.mark.timeout(300)
def test_lora_run_trains_the_adapter_only_keeps_exactness_and_exports_a_merged_model(ray_session, tmp_path):
    import numpy as np
    from transformers import AutoModelForCausalLM

    from trajflow.engines import checkpoint as ckpt
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.engines.training_numerics import TrainingNumerics
    from trajflow.jobs.recorder import RunRecorder

    config = PipelineConfig(**LORA)
    recorder = RunRecorder(run_dir=str(tmp_path / "run"), steps=3, checkpoint_every=3, keep_checkpoints=2,
                           save_all_versions=False, trajectory_log=False)
    metrics, final, batches, state = _run(config, recorder=recorder)
    start = load_model(WARM_START_DIR).state_dict()
    # the base weights are the warm start's, to the bit; the adapter moved
    assert set(state["base"]) == set(start)
    assert all(torch.equal(state["base"][k], start[k]) for k in start)
    assert lora.is_adapter(final)
    moved = max(float(v.abs().max()) for k, v in final.items() if ".lora_B." in k)
    assert moved > 1e-4, "lora_B is still 0: nothing was trained"

    # exactness: every version >= 1 is an adapter; old (the scorer) = inference (the generator)
    worst, checked = 0.0, 0
    for batch in batches:
        versions = batch["versions"].to_pylist()
        for old, inference, vs in zip(batch["old_logprobs"].to_pylist(), batch["inference_logprobs"].to_pylist(),
                                      versions):
            if min(vs) >= 1:
                worst = max(worst, float(np.max(np.abs(np.subtract(old, inference)))))
                checked += 1
    print(f"\nold vs inference on {checked} adapter-version rows: max |diff| {worst:.1e}; "
          f"adapter moved up to {moved:.2e}; loss {metrics['loss'].to_list()}")
    assert checked > 0 and worst < 1e-5

    # the checkpoint holds the adapter (+ optimizer); its export is the merged model
    checkpoint = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert checkpoint.version == 3 and (checkpoint.path / ckpt.ADAPTER_FILE).is_file()
    adapter = checkpoint.model_state()
    assert lora.is_adapter(adapter) and max_abs_difference(adapter, final) == 0.0
    assert checkpoint.optimizer_state() is not None
    merged_model = AutoModelForCausalLM.from_pretrained(checkpoint.path).eval()
    peft_model = lora.wrap(load_model(WARM_START_DIR), config.settings.lora).eval()
    lora.load_adapter(peft_model, adapter)
    batch = batches[-1]
    prompts, responses = batch["prompt_tokens"].to_pylist(), batch["response_tokens"].to_pylist()
    numerics, sampling = TrainingNumerics(), SamplingConfig()
    width = max(len(r) for r in responses)
    a = numerics.logprobs(merged_model, prompts, responses, sampling, width=width)
    b = numerics.logprobs(peft_model, prompts, responses, sampling, width=width)
    base = numerics.logprobs(load_model(WARM_START_DIR).eval(), prompts, responses, sampling, width=width)
    print(f"merged export vs base + adapter: {float((a - b).abs().max()):.1e} (vs base: "
          f"{float((a - base).abs().max()):.1e})")
    assert float((a - b).abs().max()) < 1e-5 and float((a - base).abs().max()) > 1e-4


@pytest.mark.timeout(300)
def test_a_lora_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(ray_session, tmp_path):
    from trajflow.engines import checkpoint as ckpt
    from trajflow.jobs.recorder import RunRecorder

    config = PipelineConfig(**dict(LORA, steps=4, max_staleness=0))

    def recorder(run_dir, resume_from=None) -> RunRecorder:
        return RunRecorder(run_dir=str(run_dir), steps=4, checkpoint_every=2, keep_checkpoints=5,
                           save_all_versions=False, trajectory_log=False, resume_from=resume_from)

    whole, whole_adapter, _, _ = _run(config, recorder=recorder(tmp_path / "whole"))
    _run(config, range(0, 2), recorder=recorder(tmp_path / "cut"))  # then "killed"
    checkpoint = ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert checkpoint.version == 2 and lora.is_adapter(checkpoint.model_state())
    resumed, resumed_adapter, _, _ = _run(config, range(2, 4), initial_weights=checkpoint.model_state(),
                                          recorder=recorder(tmp_path / "cut", str(checkpoint.path)))
    print(f"\nresumed vs uninterrupted adapters differ by {max_abs_difference(resumed_adapter, whole_adapter):.1e}")
    assert resumed["loss"].to_list() == pytest.approx(whole["loss"].to_list()[2:], abs=1e-7)
    assert resumed["optimizer_steps"].to_list() == whole["optimizer_steps"].to_list()[2:]
    assert max_abs_difference(resumed_adapter, whole_adapter) < 1e-7


def test_a_lora_version_on_disk_is_a_peft_adapter_and_the_base_once(tmp_path):
    """save_all_versions with LoRA (engines/checkpoint.py): each version is the adapter in PEFT's
    format, at most 15 % of a full version file; the base weights are written once, as a model
    directory that transformers loads; PEFT applies the adapter to it as the trainer's function;
    `load_version` reads the payload back bitwise, and the space estimate is the adapter's size."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trajflow.engines import checkpoint as ckpt
    from trajflow.engines.models import load_model

    settings = lora.LoraConfig(r=8, alpha=16.0)
    model = lora.wrap(load_model(WARM_START_DIR), settings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    payload = lora.adapter_payload(model, settings.scaling)
    base_reads = []

    def base():
        base_reads.append(1)
        return load_model(WARM_START_DIR).state_dict().items()

    versions = tmp_path / "versions"
    for v in (0, 1):
        ckpt.save_adapter_version(versions, v, payload, base, WARM_START_DIR)
    assert len(base_reads) == 1  # the base once
    assert sorted(p.name for p in versions.iterdir()) == ["base", "v000000", "v000001"]
    full = ckpt.save_weights(load_model(WARM_START_DIR).state_dict(), tmp_path / "full.safetensors").stat().st_size
    adapter = sum(f.stat().st_size for f in (versions / "v000001").iterdir())
    print(f"\nLoRA version on disk: {adapter} B, a full version file {full} B ({adapter / full:.1%})")
    assert adapter <= 0.15 * full
    assert ckpt.saved_version(versions, 1) == versions / "v000001" and ckpt.saved_version(versions, 2) is None
    back = ckpt.load_version(versions / "v000001")
    assert back.keys() == payload.keys() and all(torch.equal(back[k], payload[k].cpu()) for k in payload)
    assert lora.adapter_nbytes(WARM_START_DIR, settings) == sum(
        t.numel() * 4 for k, t in payload.items() if k != lora.ADAPTER_SCALING)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(versions / "base"),
                                     str(versions / "v000001")).eval()
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        a, b = model.eval()(input_ids=ids).logits, peft(input_ids=ids).logits
    assert float((a - b).abs().max()) == 0.0


def test_engine_vllm_keeps_the_window_of_adapters_and_refuses_what_it_cannot_apply(monkeypatch, tmp_path):
    """The config choice (no vLLM here: `find_spec` reports it installed): with `engine: vllm` a
    LoRA run keeps max_staleness + 1 adapters resident in vLLM, the torch engine none (it merges);
    a rank above vLLM's largest and an lm_head adapter are refused by name. The adapter directory
    the vLLM engine registers is PEFT's format: PEFT loads it as the same function."""
    import importlib.util

    from peft import PeftModel

    from trajflow.engines.models import build_tiny_model
    from trajflow.engines.lora import write_peft_adapter
    from trajflow.engines.vllm_engine import vllm_lora_rank

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    for staleness in (0, 2):
        config = PipelineConfig(engine="vllm", lora={"r": 8}, max_staleness=staleness)
        assert config.engine_lora_slots() == staleness + 1
    assert PipelineConfig(engine="vllm").engine_lora_slots() == 0
    assert PipelineConfig(engine="torch", lora={"r": 8}, max_staleness=2).engine_lora_slots() == 0
    with pytest.raises(ValueError, match="lora.r: 513 is above vLLM's largest adapter rank 512"):
        PipelineConfig(engine="vllm", lora={"r": 513})
    head = {"r": 8, "target_modules": ["q_proj", "lm_head"]}
    # the warm start's output layer is its input embedding (read from disk: the preflight); under
    # engine: vllm an lm_head adapter is refused whatever the model (validation, below)
    with pytest.raises(ValueError, match="lora.target_modules: lm_head on a model whose output layer is its input"):
        preflight(PipelineConfig(engine="torch", lora=head))
    with pytest.raises(ValueError, match="lora.target_modules: lm_head with engine: vllm"):
        preflight(PipelineConfig(engine="vllm", lora=head))
    untied = tmp_path / "untied"
    shutil.copytree(WARM_START_DIR, untied)
    (untied / "config.json").write_text(json.dumps({**json.loads((untied / "config.json").read_text()),
                                                    "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lora.target_modules: lm_head with engine: vllm"):
        PipelineConfig(engine="vllm", model=untied, lora=head)
    PipelineConfig(engine="torch", model=untied, lora=head)
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        vllm_lora_rank(513)

    settings = lora.LoraConfig(r=4, alpha=6.0, target_modules=("q_proj", "down_proj"))
    peft = lora.wrap(build_tiny_model(seed=0)[0], settings)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    write_peft_adapter(lora.adapter_payload(peft, settings.scaling), str(tmp_path / "v1"))
    config = (tmp_path / "v1" / "adapter_config.json").read_text()
    assert '"r": 4' in config and '"lora_alpha": 6.0' in config and '["down_proj", "q_proj"]' in config
    loaded = PeftModel.from_pretrained(build_tiny_model(seed=0)[0], str(tmp_path / "v1")).eval()
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        a, b = peft.eval()(input_ids=ids).logits, loaded(input_ids=ids).logits
        base = build_tiny_model(seed=0)[0](input_ids=ids).logits
    assert float((a - b).abs().max()) == 0.0 and float((a - base).abs().max()) > 1e-3
