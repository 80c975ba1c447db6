"""How a run's failure becomes one line: the errors `trajflow run` ends with, and the line of a
lost trainer, store or weight transfer found behind whatever Ray Data wraps it in."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run cannot start or resume; the message is one line."""


class RunFailed(RuntimeError):
    """A started run stopped and can only go on with `--resume` (e.g. a trainer worker died, or
    the reward failed on every row of too many steps); the message is one line (the CLI prints
    it and exits 1)."""


def trainer_state_lost(error: BaseException) -> str | None:
    """The one-line message of a TrainerStateLost behind `error`, else None (`stop_line`)."""
    from trajflow.operators.trainer.recovery import TrainerStateLost

    return stop_line(error, TrainerStateLost)


def stop_line(error: BaseException, kind: type[BaseException]) -> str | None:
    """The one-line message of a `kind` exception behind `error`, else None.

    Ray Data wraps the step's error (UserCodeException, RayTaskError), appends its retry advice
    ("To change retry attempts, ... `ray.data.DataContext` ...") to the message of the exception
    it re-raises, and across processes only the text of the cause may survive. So the message is
    taken from the first line after `<kind>: ` in any text of the chain, never from a whole
    `str(e)` (whose last lines may be Ray's advice)."""
    import re

    pattern = re.compile(rf"{kind.__name__}: ([^\n]+)")
    for e, text in _chain_texts(error):
        if isinstance(e, kind) and e.args and isinstance(e.args[0], str) and e.args[0].strip():
            return e.args[0].strip().splitlines()[0]
        found = pattern.search(text)
        if found:
            return found.group(1).strip()
    return None


def store_lost(error: BaseException) -> str | None:
    """One line when the policy store's actor died behind `error` (Ray names its class in the
    ActorDiedError that the operator calling it raised), else None: a run that does not rebuild
    its store (`recovery.max_restarts: 0`, or weight_sync collective; pipelines/store_recovery.py)."""
    from trajflow.operators.trainer.recovery import RESUME_HINT
    from trajflow.pipelines.policy_store import PolicyStoreActor

    for _, text in _chain_texts(error):
        if f"class_name: {PolicyStoreActor.__name__}" in text and ("actor died" in text or "actor is dead" in text):
            return f"the policy store's process died; the run stops: {RESUME_HINT}"
    return None


def _chain_texts(error: BaseException):
    """(exception, text) for each exception behind `error` and each of its texts (its message and,
    for Ray's errors, the traceback of the remote process), cause chain included."""
    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for text in (str(e), getattr(e, "traceback_str", None)):
            if isinstance(text, str):
                yield e, text
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
