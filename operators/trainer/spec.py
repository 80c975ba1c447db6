"""What a train step is built from: `TrainStepConfig` (every data-parallel worker's settings) and
`StepHooks` (the job's hooks, run in worker 0's process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig, KLConfig, OptimizerConfig
from trajflow.engines import lora
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.strategies.base import Strategy
from trajflow.operators.trainer.critic_config import CriticConfig
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.recovery import TrainerSource

if TYPE_CHECKING:
    from trajflow.operators.train_step import TrainStep


@dataclass(frozen=True)
class TrainStepConfig:
    """What every data-parallel worker of a train step is built from: the run's typed settings
    (pipelines/config/ holds their defaults; each worker binds its own copy of the strategy)."""

    model_path: str
    strategy: Strategy
    correction: CorrectionConfig
    kl: KLConfig
    optimizer: OptimizerConfig
    sampling: SamplingConfig
    numerics: TrainingNumerics
    trainer: TrainerConfig
    total_updates: int | None = None  # optimizer updates in the run (steps x minibatches_per_step): the lr schedule's N
    lora: lora.LoraConfig = lora.LoraConfig()  # r > 0: train and publish an adapter (engines/lora.py)
    group_name: str = ""  # the placement group of workers 1..N-1 (Ray): the pipeline removes it at the end
    distill: DistillConfig | None = None  # on-policy distillation's terms (a teacher scores the rows); None: off
    critic: CriticConfig | None = None  # PPO's value function, the second learner (operators/trainer/critic.py)
    critic_model_path: str = ""  # the critic's model directory (critic.model, else model_path)
    advantage: AdvantageConfig = AdvantageConfig()  # GAE's settings, when the critic's values are the trainer's

    def __post_init__(self) -> None:
        if self.critic is not None and not self.critic_model_path:
            object.__setattr__(self, "critic_model_path", self.critic.model or self.model_path)


@dataclass
class StepHooks:
    """The job's hooks, run in the train step's process (jobs/recorder.py): `on_start(trainstep)`
    once before the first step (a resumed job restores optimizer and strategy state there),
    `on_step(trainstep, batch, metrics)` after each step's services (logs, checkpoints), and
    `source`, where a trainer rebuilt after a fault finds its state (operators/trainer/recovery.py)."""

    on_start: Callable[["TrainStep"], None] | None = None
    on_step: Callable[["TrainStep", pa.Table, dict], None] | None = None
    # the step's rows as trained, before its version is published: a version a reader may hold
    # always has its rows in the log, so a rebuilt trainer can reproduce it (operators/trainer/recovery.py)
    on_rows: Callable[["TrainStep", pa.Table, int], None] | None = None
    source: TrainerSource | None = None
    on_lost: Callable[[str], None] | None = None  # the TrainerStateLost line, as the step raises it
