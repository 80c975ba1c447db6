"""One constructor for every generation engine: `make_engine("torch" | "vllm", model, ...)`.

Both engines meet the same contract (tests/test_engine_contract.py): `generate(prompts, n,
between_steps=None) -> list[Generation]`, `load_weights(state_dict, version)`, `version`,
`abort()`, and `generator` (a torch.Generator whose `manual_seed` makes later sampling
reproducible).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Union

from trajflow.engines.torch_engine import TorchEngine

EngineName = Literal["torch", "vllm"]
ENGINES: tuple[str, ...] = ("torch", "vllm")
Engine = Union[TorchEngine, "VllmEngine"]  # noqa: F821 (imported lazily: vllm is optional)


def make_engine(name: str, model: Any, **kwargs: Any) -> Engine:
    """Build the named engine: `TorchEngine(model, **kwargs)` or `VllmEngine(model, **kwargs)`.

    `model`: a `PreTrainedModel` or a local Hugging Face model directory (either engine).
    `kwargs`: the shared contract (eos_id, pad_id, sampling, inference_dtype, seed, version,
stop_token_ids, tokenizer — the last two for extra stop ids and `sampling.stop` strings), and
    for "vllm" its own knobs (see `VllmEngine`); an option the engine does not take is a TypeError
    that names it.
    """
    if name == "torch":
        if isinstance(model, (str, Path)):
            from trajflow.engines.models import load_model

            model = load_model(model)
        return TorchEngine(model, **kwargs)
    if name == "vllm":
        from trajflow.engines.vllm_engine import VllmEngine

        return VllmEngine(model, **kwargs)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
