"""The task interface (what any prompt source + verifier implements) and a base for synthetic tasks.

A task is a deterministic, seedable stream of prompts plus a verifier:

- ``prompts("train", seed)`` is infinite and deterministic given ``seed``; problems may repeat.
- ``prompts("test", seed)`` is the held-out split: no problem in it can ever appear in "train"
  (for the built-in tasks membership is a fixed hash of the problem text, so it does not depend on
  the seed), and it never repeats a problem. ``heldout(n)`` is its first ``n`` prompts for seed 0.
- ``reward(prompt_text, answer, response_text)`` returns a float in [0, 1] and never raises, whatever
  the response is (garbage, empty, not even a string).

``prompt_id`` identifies one *emitted* prompt: ``"<task>/<split>/<seed>/<index>"`` with ``index`` the
position in the stream (6+ digits). It is stable (same seed, same position, same id) and unique
across splits, seeds and positions, so it can serve as a group key even when the same problem is
drawn twice. The problem itself is identified by ``text``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

SPLITS = ("train", "test")
HELDOUT_SEED = 0
MAX_REJECTIONS = 100_000  # draws without a new prompt before a (finite) stream is declared done


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id, the text the model continues, and the reference answer."""

    prompt_id: str
    text: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """What a task source implements (built-in or external)."""

    name: str

    def prompts(self, split: str, seed: int) -> Iterator[Prompt]:
        """Deterministic prompt stream; infinite for "train", held-out (disjoint) for "test"."""
        ...

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the "test" split (a fixed set)."""
        ...

    def reward(self, prompt_text: str, answer: str, response_text: str) -> float:
        """Reward in [0, 1] for a response; must tolerate arbitrary responses."""
        ...


def exact_match_reward(answer: str, response_text: object) -> float:
    """1.0 iff the response equals the answer after stripping surrounding whitespace, else 0.0.

    Binary on purpose (what verifiable-reward RL expects). Non-string responses score 0.0.
    """
    if not isinstance(response_text, str) or not isinstance(answer, str):
        return 0.0
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def stable_fraction(key: str) -> float:
    """A platform- and process-independent number in [0, 1) derived from ``key`` (blake2b)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class SyntheticTask:
    """Base for generated tasks: subclasses define ``name`` and ``sample(rng) -> (text, answer)``.

    Split membership: a problem is in "test" iff ``stable_fraction(f"{name}:{text}") <
    test_fraction`` (default 10%), so train and test are disjoint by construction and the partition
    is the same for every seed and every machine. Train draws i.i.d. from ``sample`` rejecting
    test problems; test draws the same way, keeping only test problems, without repeats (so the
    test stream ends if a deliberately tiny problem space runs out of unseen test problems).
    """

    name: str = "synthetic"
    test_fraction: float = 0.1

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        raise NotImplementedError

    def split_of(self, text: str) -> str:
        """Which split a problem text belongs to ("train" or "test")."""
        return "test" if stable_fraction(f"{self.name}:{text}") < self.test_fraction else "train"

    def prompts(self, split: str, seed: int) -> Iterator[Prompt]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        rng = np.random.default_rng([int(seed), SPLITS.index(split)])
        seen: set[str] = set()
        for index in itertools.count():
            for _ in range(MAX_REJECTIONS):
                text, answer = self.sample(rng)
                if self.split_of(text) != split:
                    continue
                if split == "test":
                    if text in seen:
                        continue
                    seen.add(text)
                break
            else:  # a tiny problem space whose test split is used up: the stream ends
                return
            yield Prompt(prompt_id=f"{self.name}/{split}/{seed}/{index:06d}", text=text, answer=answer)

    def heldout(self, n: int) -> list[Prompt]:
        return list(itertools.islice(self.prompts("test", HELDOUT_SEED), n))

    def reward(self, prompt_text: str, answer: str, response_text: str) -> float:
        return exact_match_reward(answer, response_text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
