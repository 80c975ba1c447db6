"""Llama-style models of a given size from a config (random init: enough for throughput and cost
measurements), saved with the character tokenizer as a local model directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trajflow.engines.models import TINY_CONFIG, save_model
from trajflow.engines.tokenizer import build_char_tokenizer

# name -> overrides of the built-in tiny config (0.6 M parameters); counts printed by `python -m benchmarks.models`
SIZES: dict[str, dict] = {
    "0.6M": {},
    "25M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=256),
    "100M": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=4, max_position_embeddings=256),
}
# sizes only the benchmarks that name them build (weight_sync.py): too large to be every one's default
LARGE: dict[str, dict] = {
    "400M": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=26, num_attention_heads=16,
                 num_key_value_heads=4, max_position_embeddings=256),
}


def build_model(size: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, **{**SIZES, **LARGE}[size]})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def model_dir(size: str, root: Path) -> Path:
    """A local model directory of `size` under `root` (built once, then reused)."""
    path = Path(root) / f"llama-{size}"
    if not (path / "config.json").is_file():
        save_model(build_model(size), build_char_tokenizer(), path)
    return path


if __name__ == "__main__":
    for size in {**SIZES, **LARGE}:
        print(f"{size}: {sum(p.numel() for p in build_model(size).parameters()):,} parameters")
