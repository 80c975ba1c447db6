"""One way to extend every part: a registry per kind of part (correction strategies, generation
engines, trackers, advantage estimators), each a base class to subclass and a name to select it by.

    STRATEGIES = Registry("strategy", Strategy, ("trajflow.operators.strategies.snapshot", ...))

    @STRATEGIES.register("halfway")              # in your module: selectable as `strategy: halfway`
    class Halfway(Strategy): ...

    strategy: my_package.corrections:Halfway     # or by import path, without registering
    strategy: path/to/file.py:Halfway

A config selects a part by `KEY: NAME`, or with settings by `KEY: {name: NAME, <settings>}`. A part
declares its settings as `Settings`, a frozen settings dataclass (trajflow/settings.py: each key
with its default, documentation and bounds, `check_settings` in `__post_init__`), so they are
checked and documented like every key (docs/configuration.md lists every registered part).

The built-ins register themselves when their modules are imported; the registry imports those
modules on first use, and they stay torch-free at import (validating a config imports no torch).
A part registered by a module outside the built-ins is stored in a config as its import path
(`canonical`), so Ray workers and a resumed run find it without the registration; one registered
in `__main__` (a notebook, a script) is found by name in its own process only.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from trajflow.settings import SettingError
from trajflow.user_code import load_object

P = TypeVar("P")
IMPORT_PATH = "an import path module:Class / path/to/file.py:Class"


def first_paragraph(cls: type) -> str:
    """A class's docstring up to its first blank line, on one line."""
    return " ".join((cls.__doc__ or "").split("\n\n")[0].split())


def settings_keys(settings: type) -> dict[str, str]:
    """YAML key -> field name of a settings dataclass (a field named like a keyword has a `key`)."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(settings)}


class Registry(Generic[P]):
    """The parts of one kind: the built-ins, those registered, and import paths.

    kind      what a part is, for messages ("engine")
    base      the class every part subclasses
    builtins  the modules whose import registers the built-ins, in the order they are listed
    key       the config key that selects a part (e.g. "advantage.estimator"; default: kind)
    required  class attributes a part must set (strings), `name` first
    check     the kind's own check of a part class: raise ValueError("why") to refuse it
    summary   a part's one-line description (default: its docstring's first paragraph)
    """

    def __init__(self, kind: str, base: type[P], builtins: tuple[str, ...], *, key: str | None = None,
                 required: tuple[str, ...] = ("name",), check: Callable[[type[P]], None] | None = None,
                 summary: Callable[[type[P]], str] = first_paragraph) -> None:
        self.kind = kind
        self.base = base
        self.key = key or kind
        self.summary = summary
        self._builtin_modules = builtins
        self._required = required
        self._check = check
        self._parts: dict[str, type[P]] = {}
        self._loaded = False

    # -- registering ------------------------------------------------------------------------------
    def register(self, name: str | None = None) -> Callable[[type[P]], type[P]]:
        """A class decorator: register the class under `name` (which it then holds as `name`;
        without `name`, under the `name` it sets). A name held by another class is refused."""

        def add(cls: type[P]) -> type[P]:
            where = f"{cls.__module__}.{cls.__qualname__}"
            declared = cls.__dict__.get("name")
            if name is not None and declared is not None and declared != name:
                raise ValueError(f"{where}: registered as {self.kind} {name!r} but its name is {declared!r}")
            part = name if name is not None else getattr(cls, "name", None)
            if not isinstance(part, str) or ":" in part or not part.strip():
                raise ValueError(f"{where}: a {self.kind}'s name is a string without ':', got {part!r}")
            if cls.__module__ not in self._builtin_modules:
                self._load()  # a built-in's name is taken before a user's part can take it
            held = self._parts.get(part)
            if held is not None and _qualified(held) != _qualified(cls):
                raise ValueError(f"{self.kind} {part!r} is registered already ({_qualified(held)})")
            cls.name = part
            self._parts[part] = self.check_class(cls, where)
            return cls

        return add

    def unregister(self, name: str) -> None:
        """Forget a registered part (a test's or a notebook's that is defined again)."""
        self._parts.pop(name, None)

    # -- looking up -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The registered names: the built-ins in the order of their modules, then the others in
        the order they were registered."""
        return list(self.parts())

    def parts(self) -> dict[str, type[P]]:
        """Name -> class of every registered part, in the order of `names`."""
        self._load()
        order = {module: i for i, module in enumerate(self._builtin_modules)}
        ranked = sorted(enumerate(self._parts.items()),
                        key=lambda item: (order.get(item[1][1].__module__, len(order)), item[0]))
        return {name: cls for _, (name, cls) in ranked}

    def builtins(self) -> Mapping[str, type[P]]:
        """The built-in parts, name -> class (a live view: read when used)."""
        return _Builtins(self)

    def resolve(self, spec: str) -> type[P]:
        """The class a config names: a registered name, else an import path (checked to be a part
        of this kind). ValueError, one line naming the registered names, otherwise."""
        if not isinstance(spec, str):
            raise ValueError(f"expected a {self.kind} name or {IMPORT_PATH}, got {spec!r}")
        parts = self.parts()
        if spec in parts:
            return parts[spec]
        where, sep, attr = spec.rpartition(":")
        if not sep or not where or not attr:
            raise ValueError(f"unknown {self.kind} {spec!r}; registered: {self.choices()}")
        return self.check_class(load_object(spec), spec)  # UserCodeError is a ValueError

    def choices(self) -> str:
        """`a, b, c, or an import path ...`: what a config may name."""
        return f"{', '.join(self.names())}, or {IMPORT_PATH}"

    def canonical(self, spec: str) -> str:
        """`spec` as a config stores it: a file path absolute (the saved config works from any
        directory), and a name registered outside the built-ins as its import path (workers and a
        resumed run need not repeat the registration); a built-in's name as it is."""
        where, sep, attr = spec.rpartition(":")
        if sep and where.endswith(".py"):
            return f"{Path(where).resolve()}:{attr}"
        cls = self.parts().get(spec)
        if cls is None or cls.__module__ in self._builtin_modules or cls.__module__ == "__main__":
            return spec
        module = sys.modules[cls.__module__]
        file = getattr(module, "__file__", None)
        if cls.__module__.startswith("trajflow_user_") and file:  # loaded from a file (trajflow/user_code.py)
            return f"{Path(file).resolve()}:{cls.__qualname__}"
        return f"{cls.__module__}:{cls.__qualname__}"

    # -- checking ---------------------------------------------------------------------------------
    def check_class(self, cls: object, where: str) -> type[P]:
        """`cls` if it is a part of this kind; ValueError naming `where` otherwise."""
        base = self.base
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{where} is not a {base.__name__} subclass ({base.__module__}.{base.__name__})")
        missing = [a for a in self._required if not isinstance(getattr(cls, a, None), str)]
        if missing:
            raise ValueError(f"{where} must set the class attributes {', '.join(missing)}")
        settings = getattr(cls, "Settings", None)
        if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
            raise ValueError(f"{where}: Settings must be a settings dataclass (trajflow/settings.py)")
        if self._check is not None:
            try:
                self._check(cls)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        return cls

    def settings_class(self, spec: str | type[P]) -> type | None:
        """The part's settings dataclass (`Settings`), or None when it takes none."""
        cls = self.resolve(spec) if isinstance(spec, str) else spec
        return getattr(cls, "Settings", None)

    def settings(self, spec: str | type[P], values: Mapping[str, Any]) -> Any:
        """The part's settings built from a config's mapping (None for a part without `Settings`);
        an unknown key, a wrong type or a value out of bounds is one ValueError line naming
        `KEY.<setting>` (e.g. `strategy.window`)."""
        cls = self.resolve(spec) if isinstance(spec, str) else spec
        settings = self.settings_class(cls)
        accepted = settings_keys(settings) if settings is not None else {}
        unknown = [k for k in values if k not in accepted]
        if unknown:
            takes = f"takes {', '.join(accepted)}" if accepted else "takes no settings"
            raise ValueError(f"{self.key}.{unknown[0]}: unknown key ({self.kind} {cls.name} {takes})")
        if settings is None:
            return None
        missing = [k for k, name in accepted.items() if k not in values and _required(settings, name)]
        if missing:
            raise ValueError(f"{self.key}.{missing[0]}: required ({self.kind} {cls.name} has no default for it)")
        try:
            return settings(**{accepted[k]: v for k, v in values.items()})
        except SettingError as e:
            field = {v: k for k, v in accepted.items()}.get(e.field, e.field)
            why = str(e).removeprefix(f"{settings.__name__}.{e.field}: ")
            raise ValueError(f"{self.key}.{field}: {why}") from None

    def split(self, value: Any) -> tuple[Any, dict[str, Any]]:
        """(name, settings) of a config's `NAME` or `{name: NAME, <settings>}`; anything else is
        returned as the name, for the key's own validation to refuse."""
        if not isinstance(value, Mapping):
            return value, {}
        if "name" not in value:
            raise ValueError(f"{self.key}: a mapping names its {self.kind}: {{name: NAME, <its settings>}}, "
                             f"got the keys {', '.join(map(str, value)) or 'none'}")
        settings = dict(value)
        return settings.pop("name"), settings

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # before importing: the built-ins register while they import
        for module in self._builtin_modules:
            importlib.import_module(module)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


class _Builtins(Mapping):
    """The built-in parts of a registry, read when used (the modules register as they import)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def _items(self) -> dict[str, type]:
        modules = self._registry._builtin_modules
        return {n: c for n, c in self._registry.parts().items() if c.__module__ in modules}

    def __getitem__(self, name: str) -> type:
        return self._items()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _required(settings: type, field: str) -> bool:
    """Whether a settings dataclass's field has no default."""
    f = settings.__dataclass_fields__[field]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
