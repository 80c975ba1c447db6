"""Names renamed in this release (config keys, metric keys, a strategy's hook) keep working for one
release, each with a one-line notice (TRL's deprecation path); the old name goes in the next."""

from __future__ import annotations

import warnings


class TrajflowDeprecation(FutureWarning):
    """A name renamed in this release; the old one goes in the next (one-line notice)."""


def notice(old: str, new: str, stacklevel: int = 3) -> None:
    """Say once per call site that `old` is now `new`."""
    warnings.warn(f"{old}: use {new}; the old name goes in the next release", TrajflowDeprecation,
                  stacklevel=stacklevel)
