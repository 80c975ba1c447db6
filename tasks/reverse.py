"""String reversal, a task with variable-length answers: "rev:abcd=" -> "dcba"."""

from __future__ import annotations

import numpy as np

from trajflow.tasks.base import SyntheticTask


class ReverseTask(SyntheticTask):
    """Reverse a string of ``min_len``..``max_len`` characters drawn uniformly from ``alphabet``.

    The length is uniform over the range, then each character uniform, so answers have variable
    length (``min_len`` to ``max_len`` characters).
    """

    name = "reverse"

    def __init__(self, min_len: int = 2, max_len: int = 6,
                 alphabet: str = "abcdefghijklmnopqrstuvwxyz", test_fraction: float = 0.1):
        if not 1 <= min_len <= max_len <= 32:
            raise ValueError(f"need 1 <= min_len <= max_len <= 32, got {min_len}, {max_len}")
        if not alphabet or len(set(alphabet)) != len(alphabet) or set(alphabet) & set(":="):
            raise ValueError(f"alphabet must be distinct characters without ':' or '=': {alphabet!r}")
        self.min_len = min_len
        self.max_len = max_len
        self.alphabet = alphabet
        self.test_fraction = test_fraction

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        chars = rng.integers(0, len(self.alphabet), size=length)
        word = "".join(self.alphabet[int(i)] for i in chars)
        return f"rev:{word}=", word[::-1]

    def __repr__(self) -> str:
        return f"ReverseTask(min_len={self.min_len}, max_len={self.max_len}, alphabet={self.alphabet!r})"
