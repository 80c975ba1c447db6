"""Multi-turn environments: a task whose episodes alternate policy turns and environment answers.

An environment is a `Task` (prompt stream, held-out split, a single-turn `reward`) that can also
run episodes:

    episode = env.reset(prompt)             # one episode per sampled trajectory
    step = episode.step("12*34")            # the policy's turn as text (eos stripped)
    step.observation, step.reward, step.done  # "=408;", 0.0, False

The rollout loop (tasks/rollout.py) appends the observation's characters to the trajectory
as environment tokens (never trained), and ends the episode when the environment says `done`,
after `max_turns` policy turns, or when the response reaches `max_response_tokens` tokens
(policy and environment tokens together). The episode's reward is the sum of its step rewards.
A policy turn ends at eos or at the engine's per-turn limit (`SamplingConfig.max_new_tokens`).

Built in: `CalculatorEnv` ("calc"), arithmetic with a calculator tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from trajflow.tasks.base import Prompt, SyntheticTask, Task, exact_match_reward


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one policy turn."""

    observation: str  # text appended after the policy's turn (tool output); may be ""
    reward: float  # this step's reward; the episode's reward is the sum (kept in [0, 1])
    done: bool


class EnvEpisode(Protocol):
    """The state of one episode; `step` must tolerate arbitrary text and never raise."""

    def step(self, action: str) -> EnvStep: ...


@runtime_checkable
class Environment(Task, Protocol):
    """A task whose trajectories are multi-turn episodes (see the module docstring)."""

    max_turns: int  # policy turns per episode
    max_response_tokens: int  # token budget of the response: policy + environment tokens

    def reset(self, prompt: Prompt) -> EnvEpisode:
        """Start an episode on `prompt` (deterministic: same prompt, same episode)."""
        ...


def is_environment(task: object) -> bool:
    """True if `task` runs multi-turn episodes (implements `reset`, `max_turns`, ...)."""
    return isinstance(task, Environment)


# -- the calculator environment ----------------------------------------------------------------

_NUMBER = re.compile(r"[0-9]{1,9}")
_CALL = re.compile(r"([0-9]{1,6})([-+*])([0-9]{1,6})")


def calculator(expression: str) -> str | None:
    """Evaluate ``"<int><op><int>"`` with op in + - * (non-negative operands up to 6 digits).

    Returns the result as decimal text, or None if the expression is not one such call.
    """
    match = _CALL.fullmatch(expression)
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


class CalculatorEpisode:
    """One episode of `CalculatorEnv`."""

    def __init__(self, answer: str, max_turns: int) -> None:
        self.answer = answer
        self.max_turns = max_turns
        self.turns = 0

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        text = action.strip() if isinstance(action, str) else ""
        if _NUMBER.fullmatch(text):  # a bare number is the final answer
            return EnvStep("", exact_match_reward(self.answer, text), True)
        result = calculator(text)
        return EnvStep(f"={'?' if result is None else result};", 0.0, False)


class CalculatorEnv(SyntheticTask):
    """Arithmetic with a calculator tool: prompt ``"a*b+c="``, the policy must answer a*b+c.

    The model is far too small to multiply; it has a calculator that evaluates one binary
    operation per call. A policy turn is either a call ``"<int><op><int>"`` (op in ``+-*``),
    answered with ``"=<result>;"`` (``"=?;"`` for anything else that is not a number), or a bare
    number: the final answer, which ends the episode with reward 1 if it is right, else 0. The
    expert episode (3 policy turns, 2 observations)::

        <bos>12*34+56=  12*34<eos>  =408;  408+56<eos>  =464;  464<eos>

    Operands: each draws its digit count uniformly in ``1..max_digits`` then a value with exactly
    that many digits (one digit means 1-9: no zero operands). Split membership by problem text, as
    for every `SyntheticTask`. `reward(prompt, answer, response)` is the single-turn verifier
    (the response as a direct final answer).
    """

    name = "calc"

    def __init__(self, max_digits: int = 2, max_turns: int = 4, max_response_tokens: int = 40,
                 test_fraction: float = 0.1):
        if not 1 <= max_digits <= 3:
            raise ValueError(f"need 1 <= max_digits <= 3, got {max_digits}")
        if max_turns < 1 or max_response_tokens < 1:
            raise ValueError("max_turns and max_response_tokens must be >= 1")
        self.max_digits = max_digits
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens
        self.test_fraction = test_fraction

    def _operand(self, rng: np.random.Generator) -> int:
        digits = int(rng.integers(1, self.max_digits + 1))
        low = 1 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10**digits))

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        a, b, c = self._operand(rng), self._operand(rng), self._operand(rng)
        return f"{a}*{b}+{c}=", str(a * b + c)

    def reset(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(prompt.answer, self.max_turns)

    def expert_turns(self, prompt: Prompt) -> list[str]:
        """The policy turns of a perfect episode (for warm starts and tests)."""
        a, rest = prompt.text.rstrip("=").split("*")
        b, c = rest.split("+")
        product = str(int(a) * int(b))
        return [f"{a}*{b}", f"{product}+{c}", prompt.answer]

    def __repr__(self) -> str:
        return (f"CalculatorEnv(max_digits={self.max_digits}, max_turns={self.max_turns}, "
                f"max_response_tokens={self.max_response_tokens})")
