"""The asynchronous RL loop as one Ray Data pipeline whose output stream is metrics rows.

  prompts ─▶ generate ─▶ [dedicated old logits] ─▶ reward ─▶ advantage ─▶ filter
          ─▶ [snapshot old logits] ─▶ train step ─▶ metrics
                 ▲                                       │
                 └──────── policy store (versions) ◀─────┘

`RLPipeline(config)` holds the stages as a list you can edit before running — swap the strategy
in the config, or insert your own operator in one line:

    pipe = RLPipeline(config)
    pipe.insert_after("advantage", Stage("clip_rewards", MyOp()))
    metrics = pipe.run()            # a polars DataFrame, one row per train step

Source: one block per train step holding that step's prompt rows (`config.workload()`: a built-in
task or the user's dataset, see tasks/workload.py). Ordering: Ray Data runs with `preserve_order`,
so step b reaches the trainer as its b-th batch; every stage after generate sees whole steps
(batch_size = rows per step), so a group's samples always travel together. Consecutive light
stages are fused into one long-lived actor to keep operator boundaries (and imports) few.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import polars as pl
import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from trajflow.algorithms import CorrectionConfig
from trajflow.algorithms.proximal import STRATEGIES, format_strategies
from trajflow.engines.models import WARM_START_DIR
from trajflow.engines.sampling import SamplingParams
from trajflow.operators.advantage import Advantage
from trajflow.operators.filter import Filter
from trajflow.operators.generate import Generate
from trajflow.operators.old_logits import OldLogitsAtBehaviourVersion
from trajflow.operators.reward import Reward
from trajflow.operators.train_step import TrainStep, publish_weights
from trajflow.pipelines import executor_patch
from trajflow.pipelines.colocation import StageGroup, group_name, group_resources, plan_groups
from trajflow.pipelines.config import PipelineConfig, ResourceConfig
from trajflow.pipelines.policy_store import PolicyStore
from trajflow.tasks.workload import PromptSource

log = logging.getLogger("trajflow")


@dataclass
class Stage:
    """One operator of the pipeline.

    `fn` is either a class (run as a Ray Data actor pool, constructed with `kwargs` on each actor)
    or a callable instance/function (run as a Ray task; Arrow table in, Arrow table out).
    """

    name: str
    fn: Callable | type
    kwargs: dict[str, Any] = field(default_factory=dict)
    resources: ResourceConfig | None = None
    pool_size: int = 1

    @property
    def is_actor(self) -> bool:
        return isinstance(self.fn, type)


class Fused(StageGroup):
    """Light stages (callables) applied in order in one process — e.g. replay's light stages in
    one task. An actor or a long-lived task rather than a fresh task per batch on purpose: a fresh
    Ray task worker re-imports torch and transformers (measured: ~15 s per step under load on 2
    cores)."""

    def __init__(self, fns: list[Callable]) -> None:
        super().__init__([Stage(type(fn).__name__, fn) for fn in fns])


def in_order_pool(size: int) -> ActorPoolStrategy:
    """An actor pool that hands each actor one batch at a time.

    Ray Data otherwise queues several batches per actor and may start them in any order. The
    generator blocks on its admission permit, so step b+1 starting before step b on the same actor
    deadlocks (measured here); and the trainer must see steps in order.
    """
    return ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=1)


def ensure_ray(**init_kwargs) -> None:
    """Start an embedded Ray unless one is running (dashboard off; services bind to 127.0.0.1)."""
    if not ray.is_initialized():
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("configure_logging", False)
        ray.init(**init_kwargs)


class RLPipeline:
    def __init__(self, config: PipelineConfig, model_path: str | Path | None = None) -> None:
        self.config = config
        self.model_path = str(model_path or config.model or WARM_START_DIR)
        self.sampling = SamplingParams(**config.sampling.model_dump())
        self.workload = config.workload()
        self._prompts: PromptSource | None = None
        self.store: ray.actor.ActorHandle | None = None
        self.train_step_kwargs: dict[str, Any] = {}  # extra TrainStep kwargs (e.g. the job's on_step)
        self.colocation: list[list[str]] | None = None  # stage names per process; None: the default plan
        self.stages = self._default_stages()

    # -- editing -----------------------------------------------------------------------------------
    def _index(self, name: str) -> int:
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    def stage(self, name: str) -> Stage:
        return self.stages[self._index(name)]

    def insert_after(self, name: str, stage: Stage) -> "RLPipeline":
        self.stages.insert(self._index(name) + 1, stage)
        return self

    def insert_before(self, name: str, stage: Stage) -> "RLPipeline":
        self.stages.insert(self._index(name), stage)
        return self

    def replace(self, name: str, stage: Stage) -> "RLPipeline":
        self.stages[self._index(name)] = stage
        return self

    def remove(self, name: str) -> "RLPipeline":
        del self.stages[self._index(name)]
        return self

    # -- the default stage list ----------------------------------------------------------------
    def _default_stages(self) -> list[Stage]:
        c = self.config
        generate = Stage(
            "generate",
            Generate,
            dict(
                model_path=self.model_path,
                workload=self.workload,
                group_size=c.group_size,
                sampling=self.sampling,
                inference_dtype=c.inference_dtype,
                seed=c.seed,
                mid_generation_updates=c.mid_generation_updates,
                score_on_switch=c.strategy == "interrupt",
                simulate_decode_seconds=c.simulate_decode_seconds,
                torch_threads=c.generator.torch_threads,
                engine=c.engine,
                engine_kwargs=c.vllm.model_dump(exclude_none=True) if c.engine == "vllm" else {},
            ),
            c.generator,
            pool_size=c.num_generators,
        )
        old_logits = dict(model_path=self.model_path, sampling=self.sampling, torch_threads=c.scorer.torch_threads)
        stages = [generate]
        if c.strategy == "dedicated":
            stages.append(Stage("old_logits", OldLogitsAtBehaviourVersion, dict(old_logits, skip_filtered=False), c.scorer))
        stages += [
            Stage("reward", Reward(self.model_path, self.workload, self.sampling.stop)),
            Stage("advantage", Advantage(c.advantage)),
            Stage("filter", Filter(c.drop_zero_variance_groups)),
        ]
        if c.strategy == "snapshot":
            stages.append(Stage("old_logits", OldLogitsAtBehaviourVersion, dict(old_logits, skip_filtered=True), c.scorer))
        correction = CorrectionConfig(**c.correction.model_dump(), loss_norm_tokens=c.sampling.max_new_tokens)
        train = dict(
            model_path=self.model_path,
            workload=self.workload,
            strategy=c.strategy,
            correction=correction,
            sampling=self.sampling,
            max_staleness=c.max_staleness,
            **c.optimizer.model_dump(),
            ewma_window=c.ewma_window,
            ewma_tau=c.ewma.reset_threshold,
            loglinear_alpha=c.loglinear_alpha,
            eval_every=c.eval_every,
            eval_prompts=c.eval_prompts,
            torch_threads=c.trainer.torch_threads,
        )
        stages.append(Stage("train", TrainStep, train, c.trainer))
        return stages

    # -- building and running --------------------------------------------------------------------
    def start_store(self, initial_version: int = 0, initial_weights: dict | None = None) -> ray.actor.ActorHandle:
        """Create this run's policy store and publish the starting weights as `initial_version`."""
        from trajflow.engines.models import load_model

        ensure_ray()
        keep_history = self.config.strategy in ("snapshot", "dedicated")
        self.store = PolicyStore.options(name=f"trajflow_store_{uuid.uuid4().hex[:8]}").remote(
            self.config.max_staleness, keep_history, final_version=self.config.steps
        )
        model = load_model(self.model_path)
        if initial_weights is not None:
            model.load_state_dict(initial_weights)
        publish_weights(self.store, model, initial_version)
        return self.store

    def process_groups(self) -> list[list[Stage]]:
        """The stages of each actor process, in order: `self.colocation` (lists of stage names) if
        set, else the default plan for the config (see pipelines/colocation.py)."""
        if self.colocation is None:
            return plan_groups(self.stages, synchronous=self.config.max_staleness == 0,
                               colocate=self.config.colocate == "auto")
        names = [name for group in self.colocation for name in group]
        if names != [s.name for s in self.stages]:
            raise ValueError(f"colocation {self.colocation} must list every stage once, in order: "
                             f"{[s.name for s in self.stages]}")
        return [[self.stage(name) for name in group] for group in self.colocation]

    def layout(self) -> str:
        """One line: which stages share which process, e.g. `[generate reward ...] [train]`."""
        return "processes: " + " ".join("[" + " ".join(s.name for s in g) + "]" for g in self.process_groups())

    def build(self, first_step: int = 0) -> ray.data.Dataset:
        """The Ray Dataset whose rows are the metrics of train steps first_step .. steps-1."""
        c = self.config
        if self.store is None:
            self.start_store(first_step)
        executor_patch.apply()  # Ray Data's executor otherwise hands a batch on at most every 0.1 s
        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True  # step b must reach the trainer as batch b
        rows = c.rows_per_step
        # The source: one block per train step holding that step's prompt rows, built on the driver
        # (a read task would ask for a whole CPU); Generate reads the step from the rows.
        ds = ray.data.from_arrow([self.prompts.step_rows(step) for step in range(first_step, c.steps)])
        groups = self.process_groups()
        for i, group in enumerate(groups):
            num_cpus, num_gpus, custom = group_resources(group, c.light_stage_cpus)
            first = group[0]
            ds = ds.map_batches(
                type(group_name(group), (StageGroup,), {}),
                fn_constructor_kwargs=dict(
                    stages=group,
                    store=self.store,
                    extra_kwargs={s.name: self.train_step_kwargs for s in group
                                  if s.is_actor and issubclass(s.fn, TrainStep)},
                    timings="emit" if i == len(groups) - 1 else "carry",
                ),
                batch_size=c.prompts_per_step if first.is_actor and issubclass(first.fn, Generate) else rows,
                batch_format="pyarrow",
                compute=in_order_pool(max([s.pool_size for s in group if s.is_actor], default=1)),
                num_cpus=num_cpus,
                num_gpus=num_gpus or None,
                **({"resources": custom} if custom else {}),
            )
        return ds

    @property
    def prompts(self) -> PromptSource:
        """The prompt rows of each step (a dataset is read with Ray Data on first use)."""
        if self._prompts is None:
            from trajflow.engines.models import load_tokenizer

            ensure_ray()
            self._prompts = self.workload.prompt_source(load_tokenizer(self.model_path), self.config.seed,
                                                        self.config.prompts_per_step)
        return self._prompts

    def data_state(self) -> dict | None:
        """The dataset's identity and size, recorded with each checkpoint (None: a built-in task)."""
        if self.workload.data is None:
            return None
        dataset = self.prompts.dataset
        return {"fingerprint": self.workload.fingerprint(self.model_path, self.config.seed, self.config.prompts_per_step),
                "epoch_size": dataset.epoch_size, "prompts_dropped_too_long": dataset.dropped,
                "prompts_per_step": self.config.prompts_per_step}

    def describe(self) -> str:
        s = STRATEGIES[self.config.strategy]
        return (
            f"strategy {s.name} ({s.kind}): {s.meaning}\n"
            f"stages: {' -> '.join(stage.name for stage in self.stages)}\n"
            f"max_staleness {self.config.max_staleness}, inference_dtype {self.config.inference_dtype}, "
            f"{self.config.steps} steps x {self.config.rows_per_step} rows"
        )

    def iter_metrics(self, first_step: int = 0):
        """Run the pipeline, yielding one metrics dict per train step as it completes."""
        log.info("trajflow pipeline\n%s\n%s\nall strategies:\n%s", self.describe(), self.layout(), format_strategies())
        try:
            # Not iter_rows(): it prefetches one block, so row b would surface only once step b+1
            # has finished (measured: the status line, the progress bar and the end of the first
            # step were one step late).
            for batch in self.build(first_step).iter_batches(batch_size=None, batch_format="pyarrow",
                                                             prefetch_batches=0):
                yield from batch.to_pylist()
        finally:
            self.shutdown()

    def run(self, progress: bool = True) -> pl.DataFrame:
        """Run to the end and return the metrics as a polars DataFrame (one row per step)."""
        from tqdm.auto import tqdm

        rows = []
        with tqdm(total=self.config.steps, desc=f"trajflow {self.config.strategy}", disable=not progress) as bar:
            for row in self.iter_metrics():
                rows.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}", version=row["version"])
        return pl.DataFrame(rows)

    def shutdown(self) -> None:
        if self.store is not None:
            ray.kill(self.store)
            self.store = None


def build_pipeline(config: PipelineConfig) -> ray.data.Dataset:
    """The Ray Dataset of metrics rows for `config` (starts Ray and the policy store if needed)."""
    return RLPipeline(config).build()
