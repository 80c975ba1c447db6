"""The strategy registry (trajflow/registry.py): the built-ins, user strategies registered by
name, and user strategies by import path.

    strategy: snapshot                           a registered name (`trajflow configs` lists them)
    strategy: {name: ewma, window: 4}            with its settings (the strategy's `Settings`)
    strategy: my_package.corrections:MyStrategy  module:Class, importable from the Python path
    strategy: /path/to/my_strategy.py:MyStrategy a file:Class (relative paths: from the cwd)

A user class subclasses `Strategy` and sets kind and meaning (and name, or takes it from
`@STRATEGIES.register("name")`); settings of its own are a `Settings` dataclass. Its module is
registered with Ray's cloudpickle to travel *by value*, so Ray workers need not be able to import
it (a notebook cell or a file beside the job config works as well as an installed package).
"""

from __future__ import annotations

import sys
import textwrap

from trajflow.operators.strategies.base import KINDS, Strategy
from trajflow.registry import Registry
from trajflow.user_code import register_by_value


def _check_kind(cls: type[Strategy]) -> None:
    if cls.kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {cls.kind!r}")


# each built-in registers itself in its own file, named after it
STRATEGIES: Registry[Strategy] = Registry(
    "strategy", Strategy,
    tuple(f"trajflow.operators.strategies.{name}" for name in (
        "snapshot", "dedicated", "interrupt", "ewma", "recompute", "behavior", "loglinear", "m2po",
        "score_centering")),
    required=("name", "kind", "meaning"), check=_check_kind, summary=lambda cls: cls.meaning)
BUILTIN = STRATEGIES.builtins()  # name -> class of the built-ins


def strategy_names() -> list[str]:
    """The registered strategies: the built-ins, then those registered since."""
    return STRATEGIES.names()


def format_strategies(classes: list[type[Strategy]] | None = None, width: int = 100) -> str:
    """The catalogue as aligned text within `width` columns: name, kind, where pi_old comes from
    (the old_logprobs column, or the trainer), meaning."""
    lines = []
    for cls in classes or list(STRATEGIES.parts().values()):
        source = "column" if cls.old_from_column else "trainer"
        head = f"{cls.name:<10} {cls.kind:<12} {source:<8} "
        lines.append(textwrap.fill(cls.meaning, width, initial_indent=head, subsequent_indent=" " * len(head)))
    return "\n".join(lines)


def resolve_strategy(spec: str) -> type[Strategy]:
    """The Strategy class a config names. Raises ValueError with a one-line reason."""
    return STRATEGIES.resolve(spec)


def strategy_class(obj: Strategy) -> type[Strategy]:
    """Check a strategy given as an object (RLPipeline(config, strategy=obj)) and make it shippable."""
    cls = STRATEGIES.check_class(type(obj), f"strategy object {obj!r}")
    register_by_value(sys.modules[cls.__module__])
    return cls
