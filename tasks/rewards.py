"""Reward functions: the built-in verifiers, the user's function by import path, and the runner that
keeps one bad item from failing a batch.

Every reward follows TRL's convention, batched:

    fn(prompts, completions, **columns) -> list[float]

`prompts` as in the dataset (strings or chat messages), `completions` the decoded responses,
`columns` every other dataset column as a keyword list (e.g. `answer=[...]`). An `async def` works
too. Names (the `reward:` key):

    exact                       1.0 iff the completion equals `answer` (surrounding whitespace stripped)
    math                        math-verify equivalence with `answer` (the `trajflow[math]` extra)
    package.module:function     a function in an importable module
    path/to/file.py:function    a function in a file (shipped to Ray workers by value)

`RewardRunner` calls the function, built-in or not, under the per-item timeout and turns failure
into per-item errors: the batch is called once with `timeout` seconds; if it raises or runs over,
every item is called alone (concurrently, `timeout` seconds each). An item whose call raises, runs
over, or gives None / NaN / inf / a non-number is an error: no score, and a one-line reason
(`ValueError: ...`, at most ERROR_CHARS characters) that the trajectory log keeps. A batch that
returns the wrong number of values is not retried item by item (the length is the function's
bug, not one item's): every item gets that as its error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.user_code import UserCodeError, load_object

BUILTIN_REWARDS = ("exact", "math")
# How many items of a failed batch are retried at once (each in its own thread or coroutine).
FALLBACK_CONCURRENCY = 64
ERROR_CHARS = 200  # an item's error as logged: "Type: message", cut to this length
# math-verify's notice when its own (SIGALRM) timeouts are off; RewardRunner's timeout covers them
MATH_VERIFY_TIMEOUT_NOTICE = "Timeout is disabled"


class RewardSpecError(UserCodeError):
    """A `reward:` (or `env:`) name cannot be used; the message is one line naming it."""


# -- the built-in verifiers ------------------------------------------------------------------------
def exact_match(prompts: Sequence, completions: Sequence[str], answer: Sequence, **_: Any) -> list[float]:
    """1.0 iff completion == answer after stripping surrounding whitespace (vectorised)."""
    answers = pa.array([a if isinstance(a, str) else (None if a is None else str(a)) for a in answer], pa.string())
    same = pc.equal(pc.utf8_trim_whitespace(pa.array(completions, pa.string())), pc.utf8_trim_whitespace(answers))
    return pc.fill_null(same, False).cast(pa.float32()).to_numpy(zero_copy_only=False).astype(float).tolist()


class MathVerify:
    """`reward: math`: Hugging Face math-verify, 1.0 iff the completion is mathematically equal to
    `answer` ("\\frac{1}{2}" == "0.5"; the last expression or \\boxed{} of a completion counts).

    Batched: a completion that equals its answer as a string scores without parsing, and each
    distinct answer and completion is parsed once per batch (a group's samples share an answer).

    Timeouts: math-verify's own use SIGALRM, which works on the main thread only. In a run the
    call comes from RewardRunner's thread, under its per-item timeout, so math-verify's are off
    there and its notice that they are (logged once per process) is dropped; on the main thread
    (a direct call) math-verify's 5 s apply.
    """

    def __init__(self) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise RewardSpecError("reward: math needs the math extra: pip install 'trajflow[math]'") from None

    def __call__(self, prompts: Sequence, completions: Sequence[str], answer: Sequence, **_: Any) -> list[float]:
        from math_verify import parse, verify

        on_main = threading.current_thread() is threading.main_thread()
        timeout = 5 if on_main else None
        if not on_main:
            _drop_timeout_notice()
        answers = ["" if a is None else str(a) for a in answer]
        parsed: dict[str, Any] = {}

        def parsed_of(text: str):
            if text not in parsed:
                parsed[text] = parse(text, parsing_timeout=timeout)
            return parsed[text]

        scores = []
        for gold, completion in zip(answers, completions):
            if completion.strip() == gold.strip() and gold.strip():
                scores.append(1.0)
                continue
            gold_parsed, target = parsed_of(gold), parsed_of(completion)
            ok = bool(gold_parsed) and bool(target) and verify(gold_parsed, target, timeout_seconds=timeout)
            scores.append(1.0 if ok else 0.0)
        return scores


class _NotTheTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(MATH_VERIFY_TIMEOUT_NOTICE)


def _drop_timeout_notice() -> None:
    """Drop math-verify's "timeouts are off" notice in this process (idempotent): the caller
    enforces the timeout. Its other warnings (e.g. a parse that timed out) are kept."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NotTheTimeoutNotice) for f in logger.filters):
            logger.addFilter(_NotTheTimeoutNotice())


# -- import paths ----------------------------------------------------------------------------------
def resolve_reward(spec: str) -> Callable:
    """The reward callable named by `spec` (a built-in name or an import path)."""
    if spec == "exact":
        return exact_match
    if spec == "math":
        return MathVerify()
    fn = load_object(spec, "reward")
    check_reward_signature(fn, spec)
    return fn


def check_reward_signature(fn: Any, spec: str, columns: Sequence[str] | None = None) -> None:
    """`fn` must be callable as fn(prompts, completions, **columns); with `columns` given, each
    column must be accepted as a keyword (by name or by **kwargs)."""
    if not callable(fn):
        raise RewardSpecError(f"reward: {spec} is not callable (it is a {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not var_positional:
        raise RewardSpecError(f"reward: {spec} must take (prompts, completions, **columns); its signature is "
                              f"{signature}")
    required = [p.name for p in params[2:] if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                   p.KEYWORD_ONLY)]
    if columns is None:
        return
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params)
    names = {p.name for p in params[2:]}
    missing = [c for c in columns if c not in names] if not accepts_any else []
    if missing:
        raise RewardSpecError(f"reward: {spec} does not accept the dataset column(s) {', '.join(missing)} "
                              f"(add **kwargs); its signature is {signature}")
    unknown = [r for r in required if r not in columns]
    if unknown:
        raise RewardSpecError(f"reward: {spec} requires argument(s) {', '.join(unknown)}, which are not dataset "
                              f"columns ({', '.join(columns) or 'none'})")


def reward_columns(fn: Any, columns: Sequence[str]) -> list[str]:
    """The dataset columns `fn` requires by name (parameters after prompts and completions, without
    a default): no row may leave them null. A column it takes with a default (`note=None`) or
    only through **kwargs is optional."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty}
    return [c for c in columns if c in named]


# -- the runner ------------------------------------------------------------------------------------
class RewardScores(NamedTuple):
    """Per item: the score (None when the reward failed) and why it failed (None when it scored)."""

    scores: list[float | None]
    errors: list[str | None]


def error_text(error: BaseException | str) -> str:
    """One line, at most ERROR_CHARS characters: "Type: message" (or the text given)."""
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    text = " ".join(error.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


class RewardRunner:
    """Call a reward function on a batch under the per-item timeout; one failing item never
    fails the batch (see the module docstring)."""

    def __init__(self, fn: Callable, timeout: float = 30.0) -> None:
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardScores:
        n = len(completions)
        if n == 0:
            return RewardScores([], [])
        batch = self._run([(prompts, completions, columns)])[0]
        if not isinstance(batch, BaseException):
            return _checked(batch, n)
        scores: list[float | None] = []
        errors: list[str | None] = []
        for start in range(0, n, FALLBACK_CONCURRENCY):
            items = [([prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()})
                     for i in range(start, min(n, start + FALLBACK_CONCURRENCY))]
            for out in self._run(items):
                single = RewardScores([None], [error_text(out)]) if isinstance(out, BaseException) else _checked(out, 1)
                scores += single.scores
                errors += single.errors
        return RewardScores(scores, errors)

    def _run(self, calls: list[tuple[list, list, dict]]) -> list[Any]:
        """Each call with `timeout` seconds, concurrently; a result or the exception per call."""
        over = TimeoutError(f"the reward took longer than reward_timeout_seconds ({self.timeout:g} s)")
        if self.is_async:
            results = _in_thread(lambda: asyncio.run(self._gather(calls)), self.timeout + 5.0) or [over] * len(calls)
            return [over if isinstance(r, TimeoutError) and not str(r) else r for r in results]  # wait_for's
        results: list[Any] = [over] * len(calls)

        def run_one(i: int, call) -> None:
            try:
                results[i] = self.fn(call[0], call[1], **call[2])
            except BaseException as e:  # noqa: BLE001 - the user's code: any failure is an error
                results[i] = e

        threads = [threading.Thread(target=run_one, args=(i, c), daemon=True) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))  # a thread still running is abandoned (daemon)
        return [r if not t.is_alive() else over for r, t in zip(results, threads)]

    async def _gather(self, calls):
        async def one(call):
            return await asyncio.wait_for(self.fn(call[0], call[1], **call[2]), self.timeout)

        return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


def _in_thread(fn: Callable[[], Any], timeout: float) -> Any:
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _checked(values: Any, n: int) -> RewardScores:
    """The n scores as floats, or per item why not: a non-finite or non-numeric item is that
    item's error; a result that is not a sequence of n items is every item's."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = _count(len(values), "value") if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        error = error_text(f"the reward returned {got} for {_count(n, 'completion')} (one score per completion)")
        return RewardScores([None] * n, [error] * n)
    scores: list[float | None] = []
    errors: list[str | None] = []
    for v in values:
        number = float(v) if isinstance(v, (int, float, np.bool_, np.integer, np.floating)) else None
        if number is not None and math.isfinite(number):
            scores.append(number)
            errors.append(None)
            continue
        what = repr(v) if number is not None or v is None else f"{v!r} ({type(v).__name__}), not a number"
        scores.append(None)
        errors.append(error_text(f"the reward returned {what}"))
    return RewardScores(scores, errors)
