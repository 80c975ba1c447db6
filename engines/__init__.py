"""trajflow.engines: generation and scoring backends, model and tokenizer loading."""

from trajflow.engines.numerics import (
    INFERENCE_DTYPES,
    InferenceDtype,
    load_inference_weights,
    make_inference_model,
)
from trajflow.engines.sampling import SamplingParams, process_logits, token_logprobs
from trajflow.engines.scoring import response_logprobs, score
from trajflow.engines.torch_engine import Generation, TorchEngine

__all__ = [
    "INFERENCE_DTYPES",
    "Generation",
    "InferenceDtype",
    "SamplingParams",
    "TorchEngine",
    "load_inference_weights",
    "make_inference_model",
    "process_logits",
    "response_logprobs",
    "score",
    "token_logprobs",
]
