"""Text <-> tokens: the built-in character tokenizer, and the prompt/response rules for any tokenizer.

Any local Hugging Face tokenizer works (`engines.models.load_tokenizer`). The rules, one place:

- A prompt is a string or a list of chat messages (`[{"role": ..., "content": ...}, ...]`).
  Messages always go through the tokenizer's chat template with `add_generation_prompt=True`;
  a string is raw text (bos, if the tokenizer has one, then the text's tokens) unless
  `apply_chat_template=True` wraps it as one user message. `encode_prompts` does both, batched.
- A response ends at its first stop token: the tokenizer's eos, plus the eos ids of the model's
  generation config (`stop_token_ids`). Its completion text is the decoded response up to that
  token with special tokens skipped, cut before the first `sampling.stop` string if any
  (`decode_responses`, vectorised over a whole Arrow column).

The character tokenizer (ids 0..3 = pad/bos/eos/unk, then one id per character) is what the
built-in tasks' warm starts use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,:;<>|()[]#\n")
VOCAB = SPECIAL_TOKENS + CHARACTERS
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

Prompt = str | list[dict[str, Any]]  # raw text, or chat messages


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


# -- prompts ---------------------------------------------------------------------------------------
def is_chat(prompt: object) -> bool:
    """True for a list of chat messages (dicts with `role` and `content`)."""
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, apply_chat_template: bool = False) -> list[int]:
    """Prompt ids (no eos: the response continues it). See the module docstring for the rules."""
    return encode_prompts(tokenizer, [prompt], apply_chat_template)[0]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt],
                   apply_chat_template: bool = False) -> list[list[int]]:
    """Batched `encode_prompt`: chat messages in one chat-template call, raw texts in one encode."""
    out: list[list[int] | None] = [None] * len(prompts)
    chats = [i for i, p in enumerate(prompts) if is_chat(p) or (apply_chat_template and isinstance(p, str))]
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and not apply_chat_template]
    bad = sorted(set(range(len(prompts))) - set(chats) - set(texts))
    if bad:
        raise TypeError(f"prompt {bad[0]} is neither a string nor a list of chat messages: {prompts[bad[0]]!r:.80}")
    if chats:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (needed for chat messages or apply_chat_template)")
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
                         for p in (prompts[i] for i in chats)]
        ids = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        for i, row in zip(chats, ids):
            out[i] = list(row)
    if texts:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        encoded = tokenizer([prompts[i] for i in texts], add_special_tokens=False)["input_ids"]
        for i, row in zip(texts, encoded):
            out[i] = bos + list(row)
    return out  # type: ignore[return-value]


def encode_response(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Target response ids for supervised data: the text's tokens, then eos."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


# -- responses -------------------------------------------------------------------------------------
def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> list[int]:
    """Ids that end a response: the tokenizer's eos, then the eos ids of the model's
    `generation_config.json` (e.g. a chat model's end-of-turn token), deduplicated."""
    ids = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    config = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        for token in (eos if isinstance(eos, list) else [eos] if eos is not None else []):
            if int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the tokenizer has no eos token and the model's generation config names none")
    return ids


def decode_responses(tokenizer: PreTrainedTokenizerBase, responses: pa.Array | pa.ChunkedArray | Sequence[Sequence[int]],
                     stop_ids: Sequence[int] | None = None, stop: Sequence[str] = ()) -> list[str]:
    """Completion texts of a column of responses (see the module docstring).

    Vectorised: the first stop token of every row is found on the flat token array, the cut rows
    are decoded in one batched call, and only rows containing a stop string are touched in Python.
    """
    if not isinstance(responses, (pa.Array, pa.ChunkedArray)):
        responses = pa.array([list(map(int, r)) for r in responses], pa.list_(pa.int32()))
    array = responses.combine_chunks() if isinstance(responses, pa.ChunkedArray) else responses
    if len(array) == 0:
        return []
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    offsets = offsets - offsets[0]
    stop_ids = [tokenizer.eos_token_id] if stop_ids is None else list(stop_ids)
    position = np.arange(len(values), dtype=np.int64)
    ends = np.full(len(values) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    ends[:-1] = np.where(np.isin(values, stop_ids), position, ends[:-1])
    # first stop position in each row (rows are contiguous ranges); empty rows read the sentinel
    first_stop = np.minimum.reduceat(ends, np.minimum(offsets[:-1], len(values)))
    cut = np.minimum(np.where(offsets[:-1] < offsets[1:], first_stop, offsets[:-1]), offsets[1:])
    rows = [values[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), cut.tolist())]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    if stop:
        texts = [cut_at_stop(t, stop) for t in texts]
    return texts


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[: min(found)] if found else text


@dataclass(frozen=True)
class TokenIds:
    """What generation needs of the tokenizer when it decodes nothing: eos, pad and the ids that
    end a response (`stop_token_ids`). The driver, which has loaded the tokenizer anyway, hands
    them to the generator so that it loads the tokenizer only to decode (`sampling.stop`
    strings, an environment's turns): a 131k-token tokenizer takes seconds to load."""

    eos_id: int
    pad_id: int | None
    stop_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> "TokenIds":
        return cls(tokenizer.eos_token_id, tokenizer.pad_token_id, tuple(stop_token_ids(tokenizer, model_dir)))


class StopStrings:
    """Detects `sampling.stop` strings in a response as it grows (both engines use it).

    Checked after every sampled token on the decoded tail of the response (special tokens
    skipped), long enough to hold the longest stop string, so a stop string is found at the token
    that completes it; that token is kept and the response ends with finish reason "stop".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        if self.stop and tokenizer is None:
            raise ValueError("sampling.stop strings need the engine's tokenizer")
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.stop), default=0) + 4  # tokens (each >= 1 character)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def hit(self, tokens: Sequence[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(list(tokens[-self.window:]), skip_special_tokens=True)
        return any(s in tail for s in self.stop)


def decode_response(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stop_ids: Sequence[int] | None = None,
                    stop: Sequence[str] = ()) -> str:
    """Completion text of one response (`decode_responses` of one row)."""
    return decode_responses(tokenizer, [ids], stop_ids, stop)[0]


def require_local_dir(path: str | Path) -> Path:
    """`path` if it is a local model directory (a config.json); FileNotFoundError otherwise."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {path} is not a local model directory (no config.json)")
    return path


# tokenizer_config.json's classes that are the fast tokenizer itself (transformers 5 names it
# TokenizersBackend), and the model types for which AutoTokenizer keeps that class (it maps some,
# e.g. qwen2, to a class of their own; tests/test_driver_imports.py checks these against it)
FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
FAST_TOKENIZER_MODEL_TYPES = ("llama",)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved beside a local model. Where `AutoTokenizer` would build the fast
    tokenizer itself (above) it is loaded directly: `AutoTokenizer` imports torch on the way
    (transformers' model configuration), which a driver that only tokenizes never needs."""
    path = require_local_dir(path)
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        named = model_type = None
    fast = named in FAST_TOKENIZER_CLASSES and model_type in FAST_TOKENIZER_MODEL_TYPES
    if fast and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
