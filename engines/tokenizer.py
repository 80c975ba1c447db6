"""A character-level tokenizer built locally (no download): one token per character."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,:;<>|()[]#\n")
VOCAB = SPECIAL_TOKENS + CHARACTERS
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer: ids 0..3 are pad/bos/eos/unk, then one id per character."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def encode_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Prompt ids: bos followed by the text's tokens (no eos: the response continues it)."""
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


def encode_response(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Target response ids for supervised data: the text's tokens, then eos."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Response text up to (not including) the first eos; pad tokens dropped."""
    kept = []
    for token in ids:
        if token == tokenizer.eos_token_id:
            break
        if token != tokenizer.pad_token_id:
            kept.append(int(token))
    return tokenizer.decode(kept, skip_special_tokens=True)
