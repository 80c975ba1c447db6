"""Multi-digit addition: prompt "a+b=", answer the decimal sum (e.g. "12+345=" -> "357")."""

from __future__ import annotations

import numpy as np

from trajflow.tasks.base import SyntheticTask


class AdditionTask(SyntheticTask):
    """Addition of two non-negative integers of ``min_digits``..``max_digits`` digits each.

    Each operand independently draws its digit count uniformly from the range, then a value
    uniformly among numbers with exactly that many digits (one digit means 0-9). So small problems
    are common and every size is represented. Answers are the plain decimal sum, no leading zeros.
    """

    name = "addition"

    def __init__(self, min_digits: int = 1, max_digits: int = 3, test_fraction: float = 0.1):
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.test_fraction = test_fraction

    def _operand(self, rng: np.random.Generator) -> int:
        digits = int(rng.integers(self.min_digits, self.max_digits + 1))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10**digits))

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        a, b = self._operand(rng), self._operand(rng)
        return f"{a}+{b}=", str(a + b)

    def __repr__(self) -> str:
        return f"AdditionTask(min_digits={self.min_digits}, max_digits={self.max_digits})"
