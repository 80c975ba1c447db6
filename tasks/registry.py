"""Task registry: built-in tasks by name, and a hook for external task sources."""

from __future__ import annotations

from collections.abc import Callable

from trajflow.tasks.addition import AdditionTask
from trajflow.tasks.base import Task
from trajflow.tasks.environments import CalculatorEnv
from trajflow.tasks.reverse import ReverseTask

_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Register ``factory(**kwargs) -> Task`` under ``name`` (re-registering a name replaces it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"task name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for task {name!r} must be callable, got {factory!r}")
    _REGISTRY[name] = factory


def get_task(name: str, **kwargs) -> Task:
    """Build the task registered as ``name`` with ``kwargs`` (e.g. ``get_task("addition", max_digits=2)``)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(_REGISTRY)}") from None
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"factory for {name!r} returned {type(task).__name__}, which is not a Task")
    return task


def registered_tasks() -> list[str]:
    """Names of all registered tasks."""
    return sorted(_REGISTRY)


register_task("addition", AdditionTask)
register_task("reverse", ReverseTask)
register_task("calc", CalculatorEnv)
