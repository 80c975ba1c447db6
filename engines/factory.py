"""Generation engines behind one registry (trajflow/registry.py): `make_engine(name, model, ...)`
builds any registered engine (`torch`, `vllm`, or one of yours) or one by import path.

Every engine meets the same contract (tests/test_engine_contract.py): `generate(prompts, n,
between_steps=None) -> list[Generation]`, `load_weights(state_dict, version)`, `version`,
`abort()`, and `generator` (a torch.Generator whose `manual_seed` makes later sampling
reproducible). An engine is registered as a `GenerationEngine`: its name, its settings
(`Settings`, e.g. vLLM's `VllmConfig`), how it is built (`build`, which imports the engine itself)
and what the config must not ask of it (`check`). Torch-free at import: a job config is validated
against these before Ray starts.

    @ENGINES.register("my_engine")           # `engine: my_engine` or `engine: {name: my_engine, ...}`
    class MyEngine(GenerationEngine):
        Settings = MySettings                 # optional: a frozen settings dataclass
        @classmethod
        def build(cls, model, settings, **contract): ...
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from trajflow.registry import Registry, settings_keys
from trajflow.settings import check_settings, setting

# The adapter ranks vLLM can be built for (vllm.config.lora.MaxLoRARanks, vLLM 0.32): its
# max_lora_rank is the smallest of these >= lora.r.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapter layers vLLM 0.32 may apply otherwise than the readers' merge (engines/lora.py): not
# checked against it, so refused.
VLLM_LORA_REFUSED_MODULES: tuple[str, ...] = ("lm_head",)


class GenerationEngine:
    """A generation engine as the config and the generator see it (never instantiated: the
    engine itself is what `build` returns).

    name             its registered name (`engine: NAME`)
    Settings         its settings, a frozen settings dataclass, or None
    section          the config section that holds its settings (vllm: `vllm:`); None: they are
                     given as `engine: {name: NAME, <settings>}`
    takes_model      `build` gets the policy in memory, on the generator's device (the torch
                     engine); False: the model directory, which the engine loads itself (vLLM)
    serves_adapters  it applies a LoRA version's adapter itself, keeping the staleness window's
                     adapters resident (`load_adapter`); else it gets each version merged
    """

    name: ClassVar[str]
    Settings: ClassVar[type | None] = None
    section: ClassVar[str | None] = None
    takes_model: ClassVar[bool] = True
    serves_adapters: ClassVar[bool] = False

    @classmethod
    def check(cls, config: Any) -> None:
        """Raise ValueError("key: why") if the PipelineConfig asks what this engine cannot do."""

    @classmethod
    def build(cls, model: Any, settings: Any, **contract: Any) -> Any:
        """The engine: `model` (a PreTrainedModel or a model directory, see `takes_model`), its
        `settings` (an instance of `Settings`, or None) and the shared contract's keywords
        (`make_engine` lists them). Import the engine's module here, not at the top."""
        raise NotImplementedError(f"engine {cls.name!r} does not define build()")


ENGINES: Registry[GenerationEngine] = Registry("engine", GenerationEngine, ("trajflow.engines.factory",))


@ENGINES.register("torch")
class Torch(GenerationEngine):
    """The built-in torch engine (engines/torch_engine.py): CPU and GPU, any Hugging Face causal LM,
    KV cache, per-token log-probs, new weights between decode steps."""

    @classmethod
    def build(cls, model: Any, settings: Any, **contract: Any) -> Any:
        from trajflow.engines.torch_engine import TorchEngine

        if isinstance(model, (str, Path)):
            from trajflow.engines.models import load_model

            model = load_model(model)
        return TorchEngine(model, **contract)


@dataclass(frozen=True)
class VllmConfig:
    """Knobs of the vLLM engine (`engine: vllm`; engines/vllm_engine.py). null = vLLM's default."""

    gpu_memory_utilization: float | None = setting(
        None, "share of GPU memory vLLM takes (on CPU: of node memory for the KV cache)", gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = setting(None, "explicit KV cache size (default 512 MiB on CPU)", gt=0)
    max_model_len: int | None = setting(None, "context length (default: the model's)", ge=1)
    enforce_eager: bool = setting(True, "no CUDA graphs / torch.compile: fast start-up")
    tensor_parallel_size: int = setting(1, "GPUs per engine (> 1 needs CUDA)", ge=1)
    enable_prefix_caching: bool = setting(True, "reuse the KV cache of shared prompt prefixes")

    def __post_init__(self) -> None:
        check_settings(self)


@ENGINES.register("vllm")
class Vllm(GenerationEngine):
    """vLLM (engines/vllm_engine.py; the optional extra trajflow[vllm]): the GPU engine, its settings
    the `vllm:` section; with `lora:` it serves the window's adapters itself."""

    Settings = VllmConfig
    section = "vllm"
    takes_model = False
    serves_adapters = True

    @classmethod
    def check(cls, config: Any) -> None:
        """Not installed, and what vLLM's LoRA cannot take, refused by key."""
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("engine: vllm is not installed (pip install 'trajflow[vllm]'), or use engine: torch")
        if config.lora.r > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora.r: {config.lora.r} is above vLLM's largest adapter rank "
                             f"{VLLM_LORA_RANKS[-1]}; use engine: torch")
        refused = sorted(set(config.lora.target_modules) & set(VLLM_LORA_REFUSED_MODULES)) if config.lora.r else []
        if refused:
            raise ValueError(f"lora.target_modules: {', '.join(refused)} with engine: vllm: vLLM's own lm_head "
                             "adapter is not checked against the scorers' merge (old = inference); use engine: torch")

    @classmethod
    def build(cls, model: Any, settings: VllmConfig, **contract: Any) -> Any:
        from trajflow.engines.vllm_engine import VllmEngine

        return VllmEngine(model, options=settings, **contract)


def make_engine(name: str, model: Any, *, settings: Any = None, **contract: Any) -> Any:
    """Build the engine `name` names (a registered engine or an import path, `ENGINES`).

    `model`: a `PreTrainedModel` or a local Hugging Face model directory (either built-in engine).
    `contract`: the shared contract (eos_id, pad_id, sampling, inference_dtype, seed, version,
    stop_token_ids, tokenizer — the last two for extra stop ids and `sampling.stop` strings —
    and top_k_logprobs: K > 0 records each token's top-K of the distribution it was sampled from).
    `settings`: the engine's settings (its `Settings`; None: their defaults); a field of them
    given as a keyword overrides it (e.g. `kv_cache_memory_bytes=64 << 20` for vllm). An option
    the engine does not take is a TypeError that names it.
    """
    engine = ENGINES.resolve(name)
    if engine.Settings is not None:
        given = {field: contract.pop(key) for key, field in settings_keys(engine.Settings).items() if key in contract}
        settings = dataclasses.replace(settings if settings is not None else engine.Settings(), **given)
    elif settings is not None:
        raise TypeError(f"engine {engine.name!r} takes no settings, got {settings!r}")
    return engine.build(model, settings, **contract)
