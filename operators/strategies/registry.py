"""The strategy registry: built-in names, and user strategies by import path.

    strategy: snapshot                           a built-in name (BUILTIN below)
    strategy: my_package.corrections:MyStrategy  module:Class, importable from the Python path
    strategy: /path/to/my_strategy.py:MyStrategy a file:Class (relative paths: from the cwd)

A user class subclasses `Strategy` and sets name, kind and meaning. Its module is registered with
Ray's cloudpickle to travel *by value*, so Ray workers need not be able to import it (a notebook
cell or a file beside the job config works as well as an installed package).
"""

from __future__ import annotations

import sys
import textwrap

from trajflow.operators.strategies.base import KINDS, Strategy
from trajflow.operators.strategies.behavior import Behavior
from trajflow.operators.strategies.dedicated import Dedicated
from trajflow.operators.strategies.ewma import Ewma
from trajflow.operators.strategies.interrupt import Interrupt
from trajflow.operators.strategies.loglinear import Loglinear
from trajflow.operators.strategies.m2po import M2po
from trajflow.operators.strategies.recompute import Recompute
from trajflow.operators.strategies.score_centering import ScoreCentering
from trajflow.operators.strategies.snapshot import Snapshot
from trajflow.user_code import load_object, register_by_value

BUILTIN: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Snapshot, Dedicated, Interrupt, Ewma, Recompute, Behavior, Loglinear, M2po,
                              ScoreCentering)
}


def strategy_names() -> list[str]:
    return list(BUILTIN)


def format_strategies(classes: list[type[Strategy]] | None = None, width: int = 100) -> str:
    """The catalogue as aligned text within `width` columns: name, kind, where pi_old comes from
    (the old_logprobs column, or the trainer), meaning."""
    lines = []
    for cls in classes or list(BUILTIN.values()):
        source = "column" if cls.old_from_column else "trainer"
        head = f"{cls.name:<10} {cls.kind:<12} {source:<8} "
        lines.append(textwrap.fill(cls.meaning, width, initial_indent=head, subsequent_indent=" " * len(head)))
    return "\n".join(lines)


def check_strategy_class(cls: object, where: str) -> type[Strategy]:
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"{where} is not a Strategy subclass (from trajflow.operators.strategies import Strategy)")
    missing = [a for a in ("name", "kind", "meaning") if not isinstance(getattr(cls, a, None), str)]
    if missing:
        raise ValueError(f"{where} must set the class attributes {', '.join(missing)}")
    if cls.kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {cls.kind!r}")
    return cls


def resolve_strategy(spec: str) -> type[Strategy]:
    """The Strategy class a config names. Raises ValueError with a one-line reason."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"unknown strategy {spec!r}: built-in {', '.join(BUILTIN)}, "
                         "or an import path module:Class or file.py:Class")
    return check_strategy_class(load_object(spec), spec)  # UserCodeError is a ValueError


def strategy_class(obj: Strategy) -> type[Strategy]:
    """Check a strategy given as an object (RLPipeline(config, strategy=obj)) and make it shippable."""
    cls = check_strategy_class(type(obj), f"strategy object {obj!r}")
    register_by_value(sys.modules[cls.__module__])
    return cls
