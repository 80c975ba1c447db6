"""Names renamed in this release (config keys, public imports) keep working for one release,
each with a one-line notice (TRL's deprecation path); the old name goes in the next.

    __getattr__ = renamed_names(__name__, {"OldName": NewName})   # at the end of a module
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


class TrajflowDeprecation(FutureWarning):
    """A name renamed in this release; the old one goes in the next (one-line notice)."""


def notice(old: str, new: str, stacklevel: int = 3) -> None:
    """Say once per call site that `old` is now `new`."""
    warnings.warn(f"{old}: use {new}; the old name goes in the next release", TrajflowDeprecation,
                  stacklevel=stacklevel)


def renamed_names(module: str, renamed: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` that serves each old name of `renamed` (old -> the object now under
    its new name) with a notice, and raises AttributeError for anything else."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new = renamed[name]
            notice(f"{module}.{name}", f"{getattr(new, '__module__', module)}.{getattr(new, '__name__', name)}")
            return new
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
