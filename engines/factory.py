"""One constructor for every generation engine: `make_engine("torch" | "vllm", model, ...)`.

Both engines meet the same contract (tests/test_engine_contract.py): `generate(prompts, n,
between_steps=None) -> list[Generation]`, `load_weights(state_dict, version)`, `version`,
`abort()`, and `generator` (a torch.Generator whose `manual_seed` makes later sampling
reproducible). Torch-free at import: a job config's `vllm:` section is built from `VllmConfig`
before Ray starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from trajflow.deprecations import renamed_names
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:
    from trajflow.engines.torch_engine import TorchEngine
    from trajflow.engines.vllm_engine import VllmEngine

ENGINES: tuple[str, ...] = ("torch", "vllm")
# The adapter ranks vLLM can be built for (vllm.config.lora.MaxLoRARanks, vLLM 0.32): its
# max_lora_rank is the smallest of these >= lora.r.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapter layers vLLM 0.32 may apply otherwise than the readers' merge (engines/lora.py): not
# checked against it, so refused.
VLLM_LORA_REFUSED_MODULES: tuple[str, ...] = ("lm_head",)
Engine = Union["TorchEngine", "VllmEngine"]


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


VLLM_OPTIONS = tuple(f.name for f in dataclasses.fields(VllmConfig))


def make_engine(name: str, model: Any, *, vllm: VllmConfig | None = None, **kwargs: Any) -> Engine:
    """Build the named engine: `TorchEngine(model, **kwargs)` or `VllmEngine(model, **kwargs)`.

    `model`: a `PreTrainedModel` or a local Hugging Face model directory (either engine).
    `kwargs`: the shared contract (eos_id, pad_id, sampling, inference_dtype, seed, version,
    stop_token_ids, tokenizer — the last two for extra stop ids and `sampling.stop` strings —
    and top_k_logprobs: K > 0 records each token's top-K of the distribution it was sampled from).
    `vllm`: the vLLM engine's options (ignored by the torch engine); a VllmConfig field given as
    a keyword overrides it (e.g. `kv_cache_memory_bytes=64 << 20`). An option the engine does not
    take is a TypeError that names it.
    """
    if name == "torch":
        from trajflow.engines.torch_engine import TorchEngine

        if isinstance(model, (str, Path)):
            from trajflow.engines.models import load_model

            model = load_model(model)
        return TorchEngine(model, **kwargs)
    if name == "vllm":
        from trajflow.engines.vllm_engine import VllmEngine

        given = {key: kwargs.pop(key) for key in VLLM_OPTIONS if key in kwargs}
        return VllmEngine(model, options=dataclasses.replace(vllm or VllmConfig(), **given), **kwargs)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")


__getattr__ = renamed_names(__name__, {"VllmOptions": VllmConfig})  # one release: the old name, with a notice
