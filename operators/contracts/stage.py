"""A stage of the pipeline (an operator plus how to run it), and where a stage goes in a list.

`Stage` is what `RLPipeline.stages` holds (re-exported by `trajflow.pipelines.rl_loop`); a
strategy that computes old log-probs with an operator returns `Placement`s of its stages
relative to named ones (e.g. after "generate", before "train").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


class Resources(Protocol):
    """Ray resources of an actor stage (pipelines.config.ResourceConfig)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    torch_threads: int


@dataclass
class Stage:
    """One operator of the pipeline.

    `fn` is either a class (run as a Ray Data actor pool, constructed with `kwargs` on each actor;
    the pipeline adds `store=` the policy store) or a callable instance/function (a light stage:
    Arrow table in, Arrow table out). Which stages share a process is the pipeline's decision
    (pipelines/colocation.py); `own_process=True` keeps a class stage in a process of its own
    (e.g. `dedicated`'s scorer, whose point is its own CPU/GPU share).
    """

    name: str
    fn: Callable | type
    kwargs: dict[str, Any] = field(default_factory=dict)
    resources: Resources | None = None
    pool_size: int = 1
    own_process: bool = False

    @property
    def is_actor(self) -> bool:
        return isinstance(self.fn, type)


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
