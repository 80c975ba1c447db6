"""The user's code by import path — one loader for rewards, environments and strategies.

    package.module:name         an object in an importable module
    path/to/file.py:name        an object in a file (imported under a private module name)

A module that is not part of an installed distribution (a file, a module beside the job config or
in a notebook's directory) is registered with cloudpickle to travel *by value*: Ray workers
receive its code inside the pickled object and need not be able to import it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any


class UserCodeError(ValueError):
    """An import path that cannot be used; the message is one line naming it."""


def load_object(spec: str, key: str = "") -> Any:
    """`package.module:name` or `path/to/file.py:name` -> the object, shippable to Ray workers.
    `key` (the config key, e.g. "reward") starts the error message when given."""
    where = f"{key}: " if key else ""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise UserCodeError(f"{where}{spec!r} is not module:name or path/to/file.py:name")
    if module_part.endswith(".py"):
        module = _import_file(Path(module_part), where)
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's input
            raise UserCodeError(f"{where}cannot import {module_part} ({type(e).__name__}: {e})") from None
    if not hasattr(module, name):
        raise UserCodeError(f"{where}{module_part} has no {name!r}")
    register_by_value(module)
    return getattr(module, name)


def register_by_value(module: ModuleType) -> None:
    """Pickle `module`'s functions and classes by value (Ray's cloudpickle, and the standalone one
    if installed), unless workers can import it anyway (installed, trajflow, or __main__, which
    cloudpickle always ships by value). Without either installed (the in-process loop where Ray
    is not: scripts/gpu_check.sh) nothing is pickled, so nothing to register."""
    if module.__name__ == "__main__" or _installed(module):
        return
    picklers = []
    for name in ("ray.cloudpickle", "cloudpickle"):
        try:
            picklers.append(importlib.import_module(name))
        except ImportError:
            pass
    for pickler in picklers:
        try:
            pickler.register_pickle_by_value(module)
        except ValueError:  # already registered
            pass


def _import_file(path: Path, where: str) -> ModuleType:
    if not path.is_file():
        raise UserCodeError(f"{where}{path}: no such file")
    path = path.resolve()
    name = f"trajflow_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise UserCodeError(f"{where}{path} failed to import ({type(e).__name__}: {e})") from None
    return module


def _installed(module: ModuleType) -> bool:
    """True for a module of an installed distribution (site-packages) or of trajflow itself."""
    file = getattr(module, "__file__", None)
    if file is None or module.__name__.split(".")[0] == "trajflow":
        return True
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(Path(file).resolve().is_relative_to(Path(r).resolve()) for r in roots)
