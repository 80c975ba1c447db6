"""The critic's model: a causal LM's trunk with a scalar value head, and its values of a response.

`load_value_model(path)` builds it from any local Hugging Face causal LM directory (the policy's
by default, `critic.model`): the architecture's token-classification class with one label
(`LlamaForTokenClassification`, ...: the decoder and a linear head on every position's hidden
state), the trunk's weights from the directory, the head zero-initialised, so every value is 0
before the first update and a fresh critic is the same on every worker and every run. A
directory written by the critic itself (`critic/` of a checkpoint, exported) holds its head too
and loads as it is. In eval mode: dropout off, as for every model the trainer runs.

`values(model, prompts, responses, width)` is V(s_t) for every response token t, the value of the
state before t (the prompt and the tokens before t), read from the same positions whose logits
predict token t (engines/scoring.py's layout), [B, width] float32, right-padded with 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForTokenClassification, PreTrainedModel

from trajflow.engines.scoring import _pad_id, pack_batch

HEAD_PREFIXES = ("score.", "classifier.")  # the value head's parameters, by the classes' own names


def is_value_model(path: str | Path) -> bool:
    """Whether `path` holds a critic already (a token-classification model with one label)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForTokenClassification") for a in config.get("architectures") or ()) \
        and len(config.get("id2label") or {0: 0}) == 1


def load_value_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The critic of the causal LM (or critic) directory `path` (module docstring)."""
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"critic model path {path} is not a local model directory (no config.json)")
    fresh = not is_value_model(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal LM has no value head: "newly initialized" is the point
    try:
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                                local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    if fresh:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.startswith(HEAD_PREFIXES):
                    parameter.zero_()
    return model.eval()


def values(model: PreTrainedModel, prompt_tokens: Sequence[Sequence[int]], response_tokens: Sequence[Sequence[int]],
           *, width: int, grad: bool = False) -> Tensor:
    """V(s_t) [B, width] float32 on the CPU for every response token (module docstring);
    differentiable with grad=True."""
    device = next(model.parameters()).device
    ids, mask, positions, P = pack_batch(prompt_tokens, response_tokens, _pad_id(model), device)
    T = ids.shape[1] - P
    if T == 0:
        return torch.zeros((len(prompt_tokens), width))
    lengths = torch.tensor([len(r) for r in response_tokens], device=device)
    with torch.set_grad_enabled(grad):
        out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                    use_cache=False).logits[:, P - 1:, 0]
        valid = torch.arange(T, device=out.device)[None, :] < lengths[:, None].to(out.device)
        out = out.float().masked_fill(~valid, 0.0)
    return torch.nn.functional.pad(out.cpu(), (0, width - T))
