"""Checks of a local Hugging Face model directory and its tokenizer, before Ray starts.

A job's `model:` is checked here (config.json, a tokenizer, a causal-LM architecture, weights),
each failure one line naming the file; the tokenizer is loaded once per process and reused by
the run's prompt source.
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path
from typing import Any

# files that hold a tokenizer (tokenizer_config.json only configures one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_dir(path: Path, architecture: bool = True) -> None:
    """A local Hugging Face model dir: config.json (a JSON object), a tokenizer, an architecture
    transformers knows as a causal LM (`architecture=False` skips it: it imports transformers)
    and weights. ValueError (one line) if not."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} is not a local model directory (no config.json)")
    try:
        data = json.loads(config.read_text())
        if not isinstance(data, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{config} is not a JSON object") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = " (tokenizer_config.json configures a tokenizer but does not hold one)" \
            if (path / "tokenizer_config.json").is_file() else ""
        raise ValueError(f"{path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)}{found}")
    if architecture:
        _check_architecture(config, data.get("model_type"))
    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()] or sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path} has no weights (none of {', '.join(WEIGHT_FILES)})")
    if weights[0].name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(weights[0].read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{weights[0]} is not a weight index (a JSON object with a weight_map)") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"{path} lacks the weight file {missing[0]} named in {weights[0].name}")


def ties_embeddings(model: Path) -> bool:
    """Whether the model's output layer is its input embedding (one tensor): an lm_head adapter
    merged into it would change the embedding too, which PEFT's adapter does not."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False))


@functools.lru_cache(maxsize=1)
def causal_lm_model_types() -> frozenset[str]:
    """The model types transformers builds a causal LM for (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
    read from its source: importing the module imports torch, which a driver never needs. Empty
    if the table is not a literal there (another transformers): the caller then imports it."""
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.auto.modeling_auto")
    try:
        tree = ast.parse(Path(spec.origin).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                    for t in node.targets):
                return frozenset(name for name, _ in ast.literal_eval(node.value.args[0]))
    except (AttributeError, IndexError, OSError, SyntaxError, TypeError, ValueError):
        pass
    return frozenset()


def _check_architecture(config: Path, model_type: object) -> None:
    if isinstance(model_type, str) and model_type in causal_lm_model_types():
        return
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str):
        raise ValueError(f"{config} has no model_type (the architecture)")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"{config}: model_type {model_type!r} is an architecture transformers "
                         f"{transformers.__version__} does not know")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{config}: model_type {model_type!r} is not a causal language model")


_TOKENIZERS: dict[tuple, Any] = {}


def checked_tokenizer(path: Path):
    """The tokenizer of a checked model dir, loaded once per process while its files are unchanged
    (a config is validated more than once before a run starts). ValueError (one line) naming the
    file if it does not load."""
    from trajflow.engines.tokenizer import load_tokenizer

    path = Path(path).resolve()
    ident = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()) if f.is_file()
                  and f.suffix != ".safetensors")
    if (path, ident) in _TOKENIZERS:
        return _TOKENIZERS[(path, ident)]
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - a user's files: say which one
        for name in ("tokenizer.json", "tokenizer_config.json"):
            try:
                if (path / name).is_file():
                    json.loads((path / name).read_bytes())
            except ValueError as bad:
                raise ValueError(f"{path / name}: not valid JSON ({bad})") from None
        raise ValueError(f"{path}: the tokenizer does not load ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    _TOKENIZERS.clear()  # one model's tokenizer at a time
    _TOKENIZERS[(path, ident)] = tokenizer
    return tokenizer


def model_vocab_size(path: Path) -> int | None:
    """The vocabulary size a local model directory's config.json declares (None: not declared)."""
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None
