"""Inference numerics: a copy of the training model whose arithmetic deliberately differs.

This makes the training–inference discrepancy r_d = π_train / μ (docs/design.md §1) real and
measurable on any machine:

- "float32": an exact copy; same weights, same kernels, so r_d ≡ 1 up to float rounding.
- "bfloat16": parameters cast to bf16, so the forward pass computes in bf16. Non-persistent float
  buffers (rotary inv_freq) stay float32, as real bf16 inference engines keep RoPE in fp32. Callers
  cast logits to float32 before `process_logits`.
- "fp8": simulated weight-only fp8 — each >= 2-D weight is quantised to float8_e4m3fn with a
  per-tensor absmax scale and immediately dequantised back to float32; compute stays float32. Only
  the weight rounding differs from training, like fp8 weight-only serving.
"""

from __future__ import annotations

import copy
from typing import Literal, get_args

import torch
from torch import Tensor
from transformers import PreTrainedModel

InferenceDtype = Literal["float32", "bfloat16", "fp8"]
INFERENCE_DTYPES: tuple[str, ...] = get_args(InferenceDtype)

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448.0


def check_inference_dtype(inference_dtype: str) -> str:
    """Return the name unchanged if valid, else raise a ValueError listing the valid names."""
    if inference_dtype not in INFERENCE_DTYPES:
        raise ValueError(
            f"unknown inference_dtype {inference_dtype!r}; expected one of {', '.join(INFERENCE_DTYPES)}"
        )
    return inference_dtype


def fp8_roundtrip(weight: Tensor) -> Tensor:
    """Quantise to float8_e4m3fn with a per-tensor absmax scale, then dequantise (same dtype)."""
    w = weight.float()
    absmax = w.abs().max()
    scale = absmax / _FP8_MAX if absmax > 0 else torch.ones((), dtype=w.dtype, device=w.device)
    q = (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return (q.float() * scale).to(weight.dtype)


def _unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    # named_parameters() de-duplicates tied weights (embedding == lm_head), so each is touched once.
    return [p for _, p in model.named_parameters()]


@torch.no_grad()
def _apply_numerics(model: PreTrainedModel, inference_dtype: str) -> None:
    """Impose the inference numerics on a model that currently holds float32 weights."""
    if inference_dtype == "bfloat16":
        for p in _unique_parameters(model):
            p.data = p.data.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
    elif inference_dtype == "fp8":
        for p in _unique_parameters(model):
            if p.dim() >= 2 and p.is_floating_point():
                p.data.copy_(fp8_roundtrip(p.data))


def make_inference_model(train_model: PreTrainedModel, inference_dtype: str = "float32") -> PreTrainedModel:
    """A detached deep copy of `train_model` (float32) with the given inference numerics."""
    check_inference_dtype(inference_dtype)
    model = copy.deepcopy(train_model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    if inference_dtype != "float32":
        for p in _unique_parameters(model):
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ValueError(f"train_model must be float32 to derive {inference_dtype} numerics, got {p.dtype}")
    _apply_numerics(model, inference_dtype)
    return model


@torch.no_grad()
def load_inference_weights(
    inference_model: PreTrainedModel, state_dict: dict[str, Tensor], inference_dtype: str
) -> None:
    """Load a float32 training state dict into `inference_model` in place, re-applying its numerics.

    Every parameter must be provided, except tied aliases (e.g. lm_head.weight when the embedding
    it shares storage with is present, as in safetensors files).
    """
    check_inference_dtype(inference_dtype)
    # Validate before copying anything, so a bad dict cannot leave a half-updated model behind.
    expected = set(inference_model.state_dict())
    provided = set(state_dict)
    if provided - expected:
        raise KeyError(f"state dict has keys the inference model lacks: {sorted(provided - expected)[:5]}")
    aliases: dict[int, set[str]] = {}  # tied parameters: one tensor, several names
    for name, p in inference_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(name)
    name_to_group = {n: names for names in aliases.values() for n in names}
    missing = [k for k in expected - provided if not (name_to_group.get(k, set()) & provided)]
    if missing:
        raise KeyError(f"state dict is missing weights: {sorted(missing)[:5]}")
    inference_model.load_state_dict(state_dict, strict=False)
    # bf16: load_state_dict's copy_ already cast into the bf16 parameters. fp8: the exact float32
    # values were loaded above and are quantised once here (no compounding across versions).
    if inference_dtype == "fp8":
        _apply_numerics(inference_model, "fp8")
