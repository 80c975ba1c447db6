"""Names renamed in this release (config keys, public imports) keep working for one release,
each with a one-line notice (TRL's deprecation path); the old name goes in the next.

    __getattr__ = renamed_names(__name__, {"OldName": NewName})   # at the end of a module
    RENAMED_MODULES                                               # modules that moved (a finder serves them)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

# old module -> its new place (the layout of docs/design.md §4)
RENAMED_MODULES = {
    "trajflow.operators.correction": "trajflow.operators.trainer.correction",
    "trajflow.operators.columns": "trajflow.schemas.columns",
    "trajflow.operators.store": "trajflow.operators.contracts.store",
    "trajflow.operators.stage": "trajflow.operators.contracts.stage",
    "trajflow.operators.data_parallel": "trajflow.operators.trainer.plan",
    "trajflow.operators.fsdp": "trajflow.operators.trainer.fsdp",
    "trajflow.operators.recovery": "trajflow.operators.trainer.recovery",
    "trajflow.operators.after_step": "trajflow.operators.trainer.services",
    "trajflow.operators.weight_sync": "trajflow.operators.trainer.weight_sync",
    "trajflow.pipelines.local_ray": "trajflow.pipelines.ray.embedded",
    "trajflow.pipelines.ray_watchdog": "trajflow.pipelines.ray.watchdog",
    "trajflow.pipelines.quiet": "trajflow.pipelines.ray.quiet",
    "trajflow.pipelines.ray_patches": "trajflow.pipelines.ray.patches",
}


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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `import trajflow.<old module>` as its new module, with a notice."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in RENAMED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        notice(spec.name, RENAMED_MODULES[spec.name], stacklevel=6)
        return importlib.import_module(RENAMED_MODULES[spec.name])

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported


def serve_moved_modules() -> None:
    """Install the finder of RENAMED_MODULES (once; trajflow/__init__.py calls it)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
