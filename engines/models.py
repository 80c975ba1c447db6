"""Model and tokenizer loading: the built-in tiny model, and any local Hugging Face causal LM."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers import PreTrainedTokenizerFast

from trajflow.engines.paths import REPO_ROOT, WARM_START_DIR  # noqa: F401 (re-exported)
from trajflow.engines.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, build_char_tokenizer
from trajflow.engines.tokenizer import load_tokenizer, require_local_dir  # noqa: F401 (load_tokenizer re-exported)


# A Llama-style decoder small enough to train with RL on two CPU cores.
TINY_CONFIG: dict = dict(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=True,
)
assert len(VOCAB) <= TINY_CONFIG["vocab_size"]


def build_tiny_model(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A freshly initialised tiny Llama and the character tokenizer, without any download."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_CONFIG), dtype=torch.float32)
    return model.eval(), build_char_tokenizer()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local directory in Hugging Face format (never from the hub)."""
    model = AutoModelForCausalLM.from_pretrained(require_local_dir(path), dtype=dtype, local_files_only=True)
    return model.eval()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """Save weights as safetensors plus config and tokenizer files."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
