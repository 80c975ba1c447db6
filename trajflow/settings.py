"""Settings declared once: a frozen dataclass per settings group, each field with its default,
its documentation and its bounds, checked on construction.

    @dataclass(frozen=True)
    class CorrectionConfig:
        mask_c_seq: float = setting(1.05, "sequence mask keeps 1/c <= r_d <= c", gt=1.0)
        def __post_init__(self) -> None:
            check_settings(self)

The same declaration serves a library user (`CorrectionConfig(mask_c_seq=1.01)`: checked here)
and a job config (pipelines/config/sections.py builds each YAML section from its dataclass: the
same fields, defaults, descriptions and checks), so the two can never disagree. A boolean is never
a number (`tis_cap=True` is an error, not 1.0), numbers must be finite, and a value outside its
bounds is a `SettingError` naming `Class.field`.

Torch-free on purpose: validating a job config must not import torch (tests/test_startup.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import MISSING
from typing import Any, Literal

BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
          "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


class SettingError(ValueError):
    """A setting has a wrong type or is out of bounds; `field` names it (e.g. `mask_c_seq`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def setting(default: Any = MISSING, doc: str = "", *, default_factory: Any = MISSING, key: str | None = None,
            **bounds: float) -> Any:
    """A dataclass field with its documentation and numeric bounds (ge, gt, le, lt). `key`: its
    name in a job config when the field's name cannot be it (a Python keyword: `in_` -> `in`)."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"setting(): unknown bound(s) {sorted(unknown)}; use {sorted(BOUNDS)}")
    metadata = {"doc": doc, **bounds, **({"key": key} if key else {})}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def describe(cls: type) -> dict[str, str]:
    """Field name -> its documentation, for a settings dataclass."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a settings class (once per class: resolving them is most of
    what checking a config costs)."""
    return typing.get_type_hints(cls)


MAPPING = "a mapping of keys to values (e.g. {key: value})"


def described(value: Any) -> str:
    """`a list [1, 2]`, `the string 'abc'`: what was given instead of a mapping, briefly."""
    if value is None:
        return "null"
    kind = {list: "a list", str: "the string", bool: "the boolean", int: "the number",
            float: "the number"}.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _wants_mapping(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_wants_mapping(a) for a in typing.get_args(annotation))
    return typing.get_origin(annotation) is dict


def _kind(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_kind(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} numbers"
    if dataclasses.is_dataclass(annotation):
        return f"mappings with the keys {', '.join(f.name for f in dataclasses.fields(annotation))}"
    if origin is list:
        return f"a list of {_kind(args[0])}s" if args else "a list"
    if origin is dict:
        return MAPPING
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _converted(annotation: Any, value: Any) -> tuple[bool, Any]:
    """(accepted, value converted to the annotation's type) — strict: no bool for a number, no
    string for a number, numbers finite."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, converted = _converted(arg, value)
            if ok:
                return True, converted
        return False, value
    if annotation is type(None):
        return value is None, value
    if origin is Literal:
        return (not isinstance(value, bool) or any(isinstance(a, bool) for a in args)) and value in args, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if annotation is str:
        return isinstance(value, str), value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False, value
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_converted(args[0], v) for v in value]
        elif len(value) == len(args):
            items = [_converted(a, v) for a, v in zip(args, value)]
        else:
            return False, value
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):  # a nested settings group
        try:
            return True, annotation(**value)
        except TypeError:  # an unknown or missing key
            return False, value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [_converted(args[0], v) for v in value] if args else [(True, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        if not isinstance(value, dict):
            return False, value
        items = [(_converted(args[0], k), _converted(args[1], v)) for k, v in value.items()]
        return all(k[0] and v[0] for k, v in items), {k[1]: v[1] for k, v in items}
    if isinstance(annotation, type):
        return isinstance(value, annotation), value
    return True, value


def check_setting(cls: type, name: str, value: Any) -> Any:
    """`value` checked against field `name` of settings dataclass `cls`; returns it converted
    (an int for a float field becomes a float, a list for a tuple field a tuple). SettingError
    if it has the wrong type or breaks a bound."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    annotation = field_types(cls)[name]
    ok, converted = _converted(annotation, value)
    if not ok:
        if _wants_mapping(annotation) and not isinstance(value, dict):
            got = described(value)
        else:
            got = f"the boolean {str(value).lower()}" if isinstance(value, bool) else repr(value)
        raise SettingError(name, f"expected {_kind(annotation)}, got {got}")
    originals = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (tuple, list)) \
        else (value,)
    for key, (symbol, holds) in BOUNDS.items():
        if key in field.metadata:
            for number in originals:
                if isinstance(number, (int, float)) and not isinstance(number, bool) \
                        and not holds(number, field.metadata[key]):
                    raise SettingError(name, f"must be {symbol} {field.metadata[key]:g}, got {number!r}")
    return converted


def check_settings(obj: Any) -> None:
    """Check (and convert in place) every field of a frozen settings dataclass instance; call it
    first in `__post_init__`. SettingError names `Class.field`."""
    for field in dataclasses.fields(obj):
        try:
            value = check_setting(type(obj), field.name, getattr(obj, field.name))
        except SettingError as e:
            raise SettingError(field.name, f"{type(obj).__name__}.{field.name}: {e}") from None
        object.__setattr__(obj, field.name, value)


def fail(obj: Any, field: str, why: str) -> None:
    """Raise the SettingError of a cross-field check (after check_settings)."""
    raise SettingError(field, f"{type(obj).__name__}.{field}: {why}, got {getattr(obj, field)!r}")


class NotANumber(TypeError, ValueError):
    """A public function's argument that should be a number is not (a boolean, a string): a
    TypeError, and a ValueError as a setting's wrong value is."""


def check_number(function: str, **values: Any) -> None:
    """The one check that a public function's numeric arguments are numbers: a boolean is refused
    (`WholeUpdate(denominator=True)` is a typo, not 1) as settings refuse it. None passes (an
    optional argument left out), and so do tensors and arrays (they carry their own dtype).
    NotANumber (a TypeError and a ValueError) naming `function(name=...)`."""
    for name, value in values.items():
        if value is None or hasattr(value, "dtype"):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            got = f"the boolean {value}" if isinstance(value, bool) else repr(value)
            raise NotANumber(f"{function}({name}=...): expected a number, got {got}")
