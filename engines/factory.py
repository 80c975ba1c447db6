"""One constructor for every generation engine: `make_engine("torch" | "vllm", model, ...)`.

Both engines meet the same contract (tests/test_engine_contract.py): `generate(prompts, n,
between_steps=None) -> list[Generation]`, `load_weights(state_dict, version)`, `version`,
`abort()`, and `generator` (a torch.Generator whose `manual_seed` makes later sampling
reproducible).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Union

from trajflow.engines.sampling import SamplingParams
from trajflow.engines.torch_engine import TorchEngine

EngineName = Literal["torch", "vllm"]
ENGINES: tuple[str, ...] = ("torch", "vllm")
Engine = Union[TorchEngine, "VllmEngine"]  # noqa: F821 (imported lazily: vllm is optional)


def make_engine(
    name: str,
    model: Any,
    *,
    eos_id: int,
    pad_id: int,
    sampling: SamplingParams,
    inference_dtype: str = "float32",
    seed: int = 0,
    version: int = 0,
    **engine_kwargs: Any,
) -> Engine:
    """Build the named engine.

    `model`: a `PreTrainedModel` or a local Hugging Face model directory (either engine).
    `engine_kwargs` are engine-specific knobs: none for "torch"; for "vllm" see `VllmEngine`
    (gpu_memory_utilization, kv_cache_memory_bytes, max_model_len, enforce_eager,
    tensor_parallel_size, enable_prefix_caching, max_logprobs, llm_kwargs).
    """
    common = dict(eos_id=eos_id, pad_id=pad_id, sampling=sampling, inference_dtype=inference_dtype,
                  seed=seed, version=version)
    if name == "torch":
        if engine_kwargs:
            raise TypeError(f"the torch engine takes no engine options, got {sorted(engine_kwargs)}")
        if isinstance(model, (str, Path)):
            from trajflow.engines.models import load_model

            model = load_model(model)
        return TorchEngine(model, **common)
    if name == "vllm":
        from trajflow.engines.vllm_engine import VllmEngine

        return VllmEngine(model, **common, **engine_kwargs)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
