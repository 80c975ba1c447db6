"""A model directory's weights read straight from its safetensors files, without torch.

The driver publishes a run's version 0 (pipelines/rl_loop.py `publish_start`). Building the model
for it would import torch and transformers' modeling into a process that never computes
(benchmarks/results/startup.md: ~2.8 CPU s and ~0.3 GiB); instead the files' tensors go to the
policy store as the wire format's raw buffers (schemas/weights.py), in float32 as a published
version always is, under the names of the model's state dict: the files' names, and the output
layer under the embedding's tensor when the config ties them (the file then holds it once).

That equals `load_model(path).state_dict()` only where the model's state dict is exactly its
files' tensors (no renamed keys, no persistent buffers), which is checked per architecture
(tests/test_driver_imports.py, against the loaded model, bit for bit); any other directory gets
None and the caller builds the model as before.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from trajflow.schemas.weights import PackedStateDict

# architectures whose state dict is their safetensors' tensors (+ a tied output layer)
FILE_STATE_MODEL_TYPES = ("llama",)
EMBEDDING, OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}


def _weight_files(path: Path) -> list[Path] | None:
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return None


def _float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """`raw` bytes of one tensor as float32 (exact: every source dtype here fits in float32)."""
    kind = _DTYPES[dtype]
    if kind == "bfloat16":  # the upper half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(kind).astype(np.float32, copy=False)


def read_tensors(file: Path) -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
    """name -> (float32 values, shape) of one safetensors file (its format: an 8-byte header
    length, a JSON header of dtypes, shapes and offsets, then the raw data)."""
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        tensors[name] = (_float32(data[start:end], entry["dtype"]), tuple(entry["shape"]))
    return tensors


def file_state(path: str | Path) -> PackedStateDict | None:
    """The model's float32 state dict as raw buffers (module docstring), or None where it cannot
    be read from the files alone (another architecture, a dtype not listed, no safetensors)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        files = _weight_files(path)
    except (OSError, ValueError, KeyError):
        return None
    if config.get("model_type") not in FILE_STATE_MODEL_TYPES or not files:
        return None
    try:
        tensors = {name: t for file in files for name, t in read_tensors(file).items()}
    except (KeyError, OSError, ValueError):  # a dtype not listed, a damaged file: the model's own loader says
        return None
    tied = config.get("tie_word_embeddings", False) and EMBEDDING in tensors
    if tied:
        tensors.pop(OUTPUT, None)  # the output layer is the embedding's tensor
    names = list(tensors)
    slots = list(range(len(names)))
    if tied:
        names.append(OUTPUT)
        slots.append(names.index(EMBEDDING))
    buffers = [values.view(np.uint8) for values, _ in tensors.values()]
    specs = [("float32", shape) for _, shape in tensors.values()]
    return PackedStateDict(names, slots, buffers, specs)
