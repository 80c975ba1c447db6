"""A stage of the pipeline (an operator plus how to run it), and where a stage goes in a list.

`Stage` is what `RLPipeline.stages` holds (re-exported by `trajflow.pipelines.rl_loop`); a
strategy that computes old log-probs with an operator returns `Placement`s of its stages
relative to named ones (e.g. after "generate", before "train").
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from trajflow.settings import check_number, check_settings, setting


@dataclass(frozen=True)
class ResourceConfig:
    """The Ray resources of an actor stage (the `generator:` and `scorer:` sections; `trainer:`
    adds its data-parallel group). Fractional CPUs on purpose: two actors that each reserve a
    whole CPU take both cores of a 2-core machine, and every stage after them waits forever
    (docs/design.md §5)."""

    num_cpus: float = setting(0.5, "CPUs Ray reserves for each actor of the stage (fractions allowed)", ge=0.0)
    num_gpus: float = setting(0.0, "GPUs of each actor; above 0 the stage computes on CUDA", ge=0.0)
    resources: dict[str, float] = setting(
        doc="custom Ray resources of each actor, e.g. {gen_node: 0.1} to place it on the nodes that offer "
        "gen_node", default_factory=dict, ge=0.0)
    torch_threads: int | Literal["auto"] = setting(
        "auto", "torch intra-op threads in each actor (torch.set_num_threads); auto: from the CPUs, the model's "
        "size and sync or async (pipelines/config/auto.py; the run's header says what it chose)", ge=1)

    def __post_init__(self) -> None:
        check_settings(self)


class ClassRef:
    """A class named by its module and name, imported only where it is used: the pipeline names
    its own operators this way, so the driver that builds the stage list never imports their
    modules (torch, transformers' modeling), and each actor imports its own. Called, it constructs
    the class; `load()` is the class. A stage given a ref is checked where it is loaded
    (tests/test_driver_imports.py checks the pipeline's own against their constructors)."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.__name__ = name

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClassRef):
            return (self.module, self.__name__) == (other.module, other.__name__)
        return isinstance(other, type) and (other.__module__, other.__qualname__) == (self.module, self.__name__)

    def __hash__(self) -> int:
        return hash((self.module, self.__name__))

    def __repr__(self) -> str:
        return f"ClassRef({self.module}.{self.__name__})"


def loaded(cls: "type | ClassRef") -> type:
    """The class itself (a ClassRef imported)."""
    return cls.load() if isinstance(cls, ClassRef) else cls


@dataclass
class Stage:
    """One operator of the pipeline.

    `fn` is either a class or a `ClassRef` to one (run as a Ray Data actor pool, constructed with
    `kwargs` on each actor; the pipeline adds `store=` the policy store) or a callable
    instance/function (a light stage: Arrow table in, Arrow table out). Which stages share a
    process is the pipeline's decision (pipelines/colocation.py); `own_process=True` keeps a
    class stage in a process of its own (e.g. `dedicated`'s scorer, whose point is its own
    CPU/GPU share).
    """

    name: str
    fn: Callable | type | ClassRef
    kwargs: dict[str, Any] = field(default_factory=dict)
    resources: ResourceConfig | None = None
    pool_size: int = 1
    own_process: bool = False

    def __post_init__(self) -> None:
        check_number("Stage", pool_size=self.pool_size)
        if isinstance(self.fn, type):
            check_arguments(self.name, self.fn, self.kwargs)

    @property
    def is_actor(self) -> bool:
        return isinstance(self.fn, (type, ClassRef))


def check_arguments(name: str, cls: type, kwargs: dict[str, Any]) -> None:
    """A class stage's arguments against its constructor, when the stage is built (so before Ray
    starts, not when an actor is): every required one given, none unknown, each an instance of
    its annotated type where the annotation names one. TypeError naming the stage and argument."""
    try:
        inspect.signature(cls).bind(**{"store": None, **kwargs})  # the pipeline adds the policy store
    except TypeError as e:
        raise TypeError(f"stage {name!r}: {cls.__name__}: {e}") from None
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation only a type checker resolves: nothing to check against
        return
    for key, value in kwargs.items():
        expected = hints.get(key)
        if expected is not None and not _instance_of(value, expected):
            raise TypeError(f"stage {name!r}: {cls.__name__}({key}=...): expected {_name(expected)}, "
                            f"got {type(value).__name__}")


def _instance_of(value: Any, annotation: Any) -> bool:
    """Whether `value` fits `annotation`, as far as a runtime check can tell (generics by their
    origin; protocols, literals' values and anything else it cannot judge pass)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_instance_of(value, a) for a in typing.get_args(annotation))
    if origin is type:
        (kind,) = typing.get_args(annotation) or (object,)
        return isinstance(value, type) and (not isinstance(kind, type) or issubclass(value, kind))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    target = origin if isinstance(origin, type) else annotation
    if not isinstance(target, type) or getattr(target, "_is_protocol", False):
        return True
    try:
        return isinstance(value, target)
    except TypeError:
        return True


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


@dataclass(frozen=True)
class Placement:
    """Insert `stage` right after the stage named `after`, or right before the one named `before`."""

    stage: Stage
    after: str | None = None
    before: str | None = None

    def __post_init__(self) -> None:
        if (self.after is None) == (self.before is None):
            raise ValueError(f"placement of stage {self.stage.name!r}: give exactly one of after= or before=")

    @property
    def anchor(self) -> str:
        return self.after if self.after is not None else self.before  # type: ignore[return-value]


def stage_index(stages: list[Stage], name: str) -> int:
    for i, stage in enumerate(stages):
        if stage.name == name:
            return i
    raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in stages]}")


def place(stages: list[Stage], placement: Placement) -> None:
    """Insert the placement's stage into `stages` (in place)."""
    i = stage_index(stages, placement.anchor)
    stages.insert(i + 1 if placement.after is not None else i, placement.stage)
