"""trajflow.engines: generation and scoring backends, model and tokenizer loading.

The names below load on first use (PEP 562), so `trajflow.engines.checkpoint`, which the CLI
needs to check a run dir, does not pay for importing torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.lazy import lazy_exports

_EXPORTS = {
    "INFERENCE_DTYPES": "numerics",
    "InferenceDtype": "numerics",
    "load_inference_weights": "numerics",
    "make_inference_model": "numerics",
    "SamplingConfig": "sampling",
    "process_logits": "sampling",
    "token_logprobs": "sampling",
    "response_logprobs": "scoring",
    "score": "scoring",
    "Generation": "torch_engine",
    "TorchEngine": "torch_engine",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from trajflow.engines.numerics import (
        INFERENCE_DTYPES,
        InferenceDtype,
        load_inference_weights,
        make_inference_model,
    )
    from trajflow.engines.sampling import SamplingConfig, process_logits, token_logprobs
    from trajflow.engines.scoring import response_logprobs, score
    from trajflow.engines.torch_engine import Generation, TorchEngine


__getattr__, __dir__ = lazy_exports(__name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()})
