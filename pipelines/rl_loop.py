"""The asynchronous RL loop as one Ray Data pipeline whose output stream is metrics rows.

  prompts ─▶ generate ─▶ [values] ─▶ [dedicated old log-probs] ─▶ reward ─▶ advantage ─▶ filter
          ─▶ [snapshot old log-probs] ─▶ [reference] ─▶ [teacher] ─▶ train step ─▶ metrics
                 ▲                                       │
                 └──────── policy store (versions) ◀─────┘

`RLPipeline(config)` holds the stages as a list you can edit before running — swap the strategy
in the config (or pass one: `RLPipeline(config, strategy=MyStrategy())`), or insert your own
operator in one line:

    pipe = RLPipeline(config)
    pipe.insert_after("advantage", Stage("clip_rewards", MyOp()))
    metrics = pipe.run()            # a polars DataFrame, one row per train step

The strategy object (operators/strategies/) decides the bracketed stages, what the policy store
keeps and whether generation scores prefixes at a weight switch; the builder asks it, never its
name. A `replay` of a logged run starts from this same stage list (pipelines/replay.py).

Source: one block per train step holding that step's prompt rows (`config.workload()`: a built-in
task or the user's dataset, see tasks/workload.py). Ordering: Ray Data runs with `preserve_order`,
so step b reaches the trainer as its b-th batch; every stage after generate sees whole steps
(batch_size = rows per step), so a group's samples always travel together.

Processes: which consecutive stages share one actor process is decided apart from the stage list
(pipelines/colocation.py; `pipe.layout()` shows it), and Ray Data's executor is patched to hand a
batch on as soon as it is ready (pipelines/ray/patches.py).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from trajflow.engines.paths import WARM_START_DIR
from trajflow.engines.tokenizer import TokenIds
from trajflow.engines.training_numerics import checkpoint_dropout
from trajflow.operators.advantage import Advantage
from trajflow.operators.contracts.rollout import EngineConfig, RolloutConfig
from trajflow.operators.contracts.stage import ClassRef, Placement, Stage, place, stage_index
from trajflow.operators.contracts.store import CRITIC, POLICY, PolicyStoreClient
from trajflow.operators.filter import Filter
from trajflow.operators.reward import FailedRewardSteps, Reward
from trajflow.operators.strategies import StageContext, Strategy, format_strategies, strategy_class
from trajflow.operators.trainer.services import HeldoutEvaluation, PublishWeights, StoreStatistics
from trajflow.operators.trainer.spec import StepHooks, TrainStepConfig
from trajflow.pipelines.colocation import StageGroup, group_name, group_resources, plan_groups, rollout_colocated
from trajflow.pipelines.config import PipelineConfig, checked_tokenizer, preflight
from trajflow.pipelines.policy_store import RayStore
from trajflow.pipelines.ray.embedded import cluster_cpus, remove_placement_group_named, start_local_ray
from trajflow.pipelines.ray.quiet import quiet_run
from trajflow.schemas.columns import VALUES_COLUMN
from trajflow.pipelines.store_recovery import RECONNECT_SECONDS, StoreConfig, StoreGuard, StoreLost, VersionArchive
from trajflow.tasks.workload import PromptSource

# The actor stages by name: the driver that builds the stage list imports neither their modules nor
# torch; each actor imports its own (operators/contracts/stage.py `ClassRef`).
GENERATE = ClassRef("trajflow.operators.generate", "Generate")
TRAIN_STEP = ClassRef("trajflow.operators.train_step", "TrainStep")
REFERENCE = ClassRef("trajflow.operators.reference", "ReferenceLogprobs")
TEACHER = ClassRef("trajflow.operators.teacher", "TeacherLogprobs")
CRITIC_VALUES = ClassRef("trajflow.operators.values", "CriticValues")
RAY_WORKERS = ClassRef("trajflow.pipelines.ray.trainer_group", "RayWorkerGroup")

if TYPE_CHECKING:  # Ray and polars load where the pipeline runs on Ray: building its stages needs neither
    import polars as pl
    import ray
    from ray.data import ActorPoolStrategy

__all__ = ["Fused", "Placement", "RLPipeline", "Stage", "in_order_pool", "map_stages"]

log = logging.getLogger("trajflow")


class Fused(StageGroup):
    """Light stages (callables) applied in order in one process. An actor or a long-lived task
    rather than a fresh task per batch on purpose: a fresh Ray task worker re-imports torch and
    transformers for every batch."""

    def __init__(self, fns: list[Callable]) -> None:
        super().__init__([Stage(type(fn).__name__, fn) for fn in fns])


def in_order_pool(size: int) -> ActorPoolStrategy:
    """An actor pool that hands each actor one batch at a time.

    Ray Data otherwise queues several batches per actor and may start them in any order. The
    generator blocks on its admission permit, so step b+1 starting before step b on the same actor
    deadlocks (measured here); and the trainer must see steps in order.
    """
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=1)


def group_pool_size(group: list[Stage]) -> int:
    """Actors in a group's pool: its largest stage pool (e.g. num_generators)."""
    return max([s.pool_size for s in group if s.is_actor], default=1)


def map_stages(ds: ray.data.Dataset, groups: list[list[Stage]], *, store: PolicyStoreClient, rows: int,
               first_rows: int, light_stage_cpus: float) -> ray.data.Dataset:
    """Apply the stages of `groups` to `ds`, one actor pool per group (pipelines/colocation.py).

    Each group's actor constructs its class stages with `store=` and their kwargs, and passes
    each batch through its stages in order. Batches are whole steps: `first_rows` rows into the
    first group (the prompt rows of a step), `rows` after it. The last group adds the stages'
    timings to the metrics rows."""
    for i, group in enumerate(groups):
        num_cpus, num_gpus, custom = group_resources(group, light_stage_cpus)
        ds = ds.map_batches(
            type(group_name(group), (StageGroup,), {}),
            fn_constructor_kwargs=dict(
                stages=group,
                store=store,
                timings="emit" if i == len(groups) - 1 else "carry",
            ),
            batch_size=first_rows if i == 0 else rows,
            batch_format="pyarrow",
            compute=in_order_pool(group_pool_size(group)),
            num_cpus=num_cpus,
            num_gpus=num_gpus or None,
            **({"resources": custom} if custom else {}),
        )
    return ds


class RLPipeline:
    def __init__(self, config: PipelineConfig, model_path: str | Path | None = None,
                 strategy: Strategy | None = None) -> None:
        if config.team is not None:
            raise ValueError("team: a team of agents runs with pipelines/team.py (TeamPipeline.from_config, "
                             "run_team_in_process) or `trajflow run`, not RLPipeline")
        config = preflight(config)  # what needs the disk (model dir, dataset), before Ray starts
        self.config = config
        self.settings = config.settings  # every section as the settings dataclass its operators take
        self.model_path = str(model_path or config.model or WARM_START_DIR)
        self.sampling = self.settings.sampling
        if strategy is None:
            strategy = config.build_strategy()
        else:  # an object from Python (a notebook, a test): checked like a config's, before Ray starts
            strategy_class(strategy)
            strategy.check(config)
        self.strategy = strategy
        self.workload = config.workload()
        self._prompts: PromptSource | None = None
        self.store: RayStore | None = None
        # where a store that dies is rebuilt from (the job's run dir; None: it is not rebuilt)
        self.version_archive: VersionArchive | None = None
        self.store_guard: StoreGuard | None = None
        self.restarts = 0  # the run's recoveries so far (recovery.max_restarts), as the driver saw them
        self.pending_recoveries: list[dict] = []  # a rebuilt store's recovery/* entries, for the next row
        self._hooks = StepHooks()
        self.colocation: list[list[str]] | None = None  # stage names per process; None: the default plan
        # the placement group of the train step's data-parallel workers 1..N-1, removed at shutdown
        self.trainer_group_name = f"trajflow_trainer_{uuid.uuid4().hex[:8]}"
        self.stages = self._default_stages()

    @property
    def hooks(self) -> StepHooks:
        """The job's hooks in the train step's process (jobs/recorder.py): set its fields, e.g.
        `pipe.hooks.on_step = fn`, before running (every train stage holds this one object)."""
        return self._hooks

    # -- editing -----------------------------------------------------------------------------------
    def _index(self, name: str) -> int:
        return stage_index(self.stages, name)

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
    def stage_context(self) -> StageContext:
        """What a strategy's operator stages are built from."""
        s = self.settings
        return StageContext(self.model_path, self.sampling, s.numerics, s.scorer, s.weight_sync,
                            old_is_inference=self.config.old_is_inference(self.strategy))

    def failed_reward_steps(self) -> FailedRewardSteps:
        """A count of consecutive steps whose reward failed on every row (reward_max_failed_steps)."""
        return FailedRewardSteps(self.workload.reward_name(), self.config.reward_max_failed_steps)

    def train_stage(self, strategy: Strategy) -> Stage:
        """The train step under `strategy`, with the services that run in its process after each
        step: publish, held-out evaluation (every eval_every versions), store statistics."""
        c, s = self.config, self.settings
        services: list = [PublishWeights()]
        if c.eval_every:
            services.append(HeldoutEvaluation(self.model_path, self.workload, c.eval_every, c.eval_prompts,
                                              c.sampling.max_new_tokens, c.sampling.stop))
        services.append(StoreStatistics())
        spec = TrainStepConfig(model_path=self.model_path, strategy=strategy, correction=s.correction, kl=s.kl,
                               optimizer=s.optimizer, sampling=self.sampling, numerics=s.numerics, trainer=s.trainer,
                               total_updates=c.steps * c.optimizer.minibatches_per_step, lora=s.lora,
                               group_name=self.trainer_group_name, distill=s.distill, critic=s.critic,
                               advantage=s.advantage)
        train = dict(spec=spec, max_staleness=c.max_staleness, after_step=services, hooks=self.hooks,
                     recovery=s.recovery, failed_rewards=self.failed_reward_steps(), weight_sync=s.weight_sync,
                     reader_dtypes=c.reader_dtypes(strategy), workers=RAY_WORKERS)
        return Stage("train", TRAIN_STEP, train, s.trainer)

    def _default_stages(self) -> list[Stage]:
        c, s, strategy = self.config, self.settings, self.strategy
        rollout = RolloutConfig(group_size=c.group_size, sampling=self.sampling, seed=c.seed,
                                partial_rollout=c.partial_rollout, scores_at_switch=strategy.scores_at_switch,
                                simulate_decode_seconds=c.simulate_decode_seconds,
                                top_k_logprobs=c.top_k_logprobs)
        engine = EngineConfig(name=c.engine, inference_dtype=c.inference_dtype, settings=s.engine,
                              lora_slots=c.engine_lora_slots(), lora_rank=c.lora.r,
                              token_ids=self.token_ids())
        generate = Stage("generate", GENERATE,
                         dict(model_path=self.model_path, workload=self.workload, rollout=rollout, engine=engine,
                              numerics=s.numerics, weight_sync=s.weight_sync, torch_threads=s.generator.torch_threads),
                         s.generator, pool_size=c.num_generators)
        critic = s.critic
        gae_values = None if critic is not None and critic.values_at == "train" else VALUES_COLUMN
        stages = [
            generate,
            Stage("reward", Reward(self.model_path, self.workload, self.sampling.stop)),
            Stage("advantage", Advantage(s.advantage, gae_values, s.kl)),
            Stage("filter", Filter(c.drop_zero_variance_groups)),
            self.train_stage(strategy),
        ]
        for placement in strategy.stages(self.stage_context()):
            place(stages, placement)
        if critic is not None and critic.needs_values_stage:  # V(s_t) at behavior time, from the critic's newest
            place(stages, Placement(self.values_stage(), after="generate"))
        if c.kl.beta > 0:  # a frozen reference model, scored like an old log-prob (beta 0 builds none)
            place(stages, self.reference_stage())
        if c.teacher is not None:  # distillation: a second model scores the student's tokens
            place(stages, self.teacher_stage())
        return stages

    def token_ids(self) -> TokenIds:
        """eos, pad and stop ids of the tokenizer the config's validation loaded (the generator
        then loads it only to decode)."""
        return TokenIds.of(checked_tokenizer(self.model_path), self.model_path)

    def reference_stage(self) -> Placement:
        """The reference model's log-probs (operators/reference.py): before the advantage when the
        KL is in the reward (it shapes the advantage), else before the train step (trained rows only)."""
        s = self.settings
        in_reward = s.kl.in_ == "reward"
        kwargs = dict(model_path=self.model_path, kl=s.kl, sampling=self.sampling, numerics=s.numerics,
                      skip_filtered=not in_reward, torch_threads=s.scorer.torch_threads)
        stage = Stage("reference", REFERENCE, kwargs, s.scorer)
        return Placement(stage, before="advantage") if in_reward else Placement(stage, before="train")

    def values_stage(self) -> Stage:
        """The critic's values of every row right after generation (operators/values.py), on a
        scorer's resources."""
        s = self.settings
        kwargs = dict(model_path=self.critic_model_path, numerics=s.numerics, torch_threads=s.scorer.torch_threads)
        return Stage("values", CRITIC_VALUES, kwargs, s.scorer)

    @property
    def learner_names(self) -> list[str]:
        """The run's learners (operators/trainer/learner.py): the policy, and the critic if any."""
        return [POLICY, *([CRITIC] if self.settings.critic is not None else [])]

    @property
    def critic_model_path(self) -> str:
        """The critic's model directory: `critic.model`, else the policy's."""
        return self.settings.critic.model or self.model_path

    def publish_start(self, store: PolicyStoreClient, version: int, weights: dict[str, dict] | None = None) -> None:
        """Publish the run's starting version of every learner: `weights` by learner name (a
        resumed run's checkpoint; a LoRA policy's: its adapter), else the model directories'
        (the critic: the policy's trunk with a zero value head)."""
        from trajflow.engines.lora import is_adapter

        weights = weights or {}
        policy = weights.get(POLICY)
        files = None
        if policy is None and isinstance(store, RayStore):  # raw buffers cross to Ray's object store:
            from trajflow.engines.model_files import file_state  # no model built here, no torch

            files = file_state(self.model_path)
        if policy is not None and is_adapter(policy):  # a LoRA run's version: its adapter
            store.publish(policy, version)
        elif files is not None:
            store.publish(files, version)
        else:
            from trajflow.engines.models import load_model

            model = load_model(self.model_path)
            if policy is not None:
                model.load_state_dict(policy)
            store.publish(model.state_dict(), version)
        if self.settings.critic is not None:
            from trajflow.engines.value_model import load_value_model

            critic = weights.get(CRITIC)
            store.publish(critic if critic is not None else load_value_model(self.critic_model_path).state_dict(),
                          version, learner=CRITIC)

    def teacher_stage(self) -> Placement:
        """The teacher's log-probs (operators/teacher.py), right before the train step on the rows
        it trains, on a scorer's resources."""
        c = self.config
        s = self.settings
        kwargs = dict(model_path=str(c.teacher), sampling=self.sampling, numerics=s.numerics,
                      skip_filtered=True, torch_threads=s.scorer.torch_threads)
        return Placement(Stage("teacher", TEACHER, kwargs, s.scorer), before="train")

    # -- building and running --------------------------------------------------------------------
    def start_store(self, initial_version: int = 0, initial_weights: dict[str, dict] | None = None) -> RayStore:
        """Create this run's policy store actor and publish every learner's starting weights as
        `initial_version` (`publish_start`)."""
        start_local_ray()
        c = self.config
        # a trainer that may be rebuilt (recovery) dies with the versions it put: the store owns them all
        final = c.steps if c.recovery.max_restarts == 0 else None
        # a store that dies is rebuilt from the run dir's versions (not under weight_sync collective,
        # where the versions' tensors and the trainer's server address are not the store's)
        rebuilt = (self.version_archive is not None and c.recovery.max_restarts > 0
                   and c.weight_sync.method != "collective")
        self.store = RayStore.start(c.max_staleness, c.keeps_history(self.strategy), final_version=final,
                                    reconnect_seconds=RECONNECT_SECONDS if rebuilt else 0.0)
        self.publish_start(self.store, initial_version, initial_weights)
        if rebuilt:
            spec = StoreConfig(c.max_staleness, c.keeps_history(self.strategy), c.recovery.max_restarts, c.lora.r > 0)
            self.store_guard = StoreGuard(self.store, self.version_archive, spec, lambda: self.restarts,
                                          self._store_rebuilt)
        return self.store

    def _store_rebuilt(self, store: RayStore, event: dict) -> None:
        """The store guard's new store (this driver's client) and the recovery's metrics entries."""
        self.store = store
        self.restarts = event["recovery/restarts"]
        self.pending_recoveries.append(event)

    def process_groups(self) -> list[list[Stage]]:
        """The stages of each actor process, in order: `self.colocation` (lists of stage names) if
        set, else the default plan for the config (see pipelines/colocation.py)."""
        if self.colocation is None:
            return plan_groups(self.stages, synchronous=self.config.max_staleness == 0,
                               colocate=self.config.colocate != "off",
                               rollout=rollout_colocated(self.config.colocate, cluster_cpus()))
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
        import ray
        from ray.data import DataContext

        from trajflow.pipelines.ray import patches as ray_patches

        ray_patches.executor.apply()  # Ray Data's executor otherwise hands a batch on at most every 0.1 s
        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True  # step b must reach the trainer as batch b
        # The source: one block per train step holding that step's prompt rows, built on the driver
        # (a read task would ask for a whole CPU); Generate reads the step from the rows.
        # `from_blocks`, not `from_arrow`: the latter runs a Ray task per block to read metadata the
        # driver already has (two worker processes busy at start-up for nothing).
        ds = ray.data.from_blocks([self.prompts.step_rows(step) for step in range(first_step, c.steps)])
        return map_stages(ds, self.process_groups(), store=self.store, rows=c.rows_per_step,
                          first_rows=c.prompts_per_step, light_stage_cpus=c.light_stage_cpus)

    @property
    def prompts(self) -> PromptSource:
        """The prompt rows of each step (a dataset's are checked and tokenized once per process)."""
        if self._prompts is None:
            from trajflow.pipelines.config import checked_tokenizer

            # the tokenizer the config's validation loaded (a 128k-token one takes seconds to load)
            self._prompts = self.workload.prompt_source(checked_tokenizer(self.model_path), self.config.seed,
                                                        self.config.prompts_per_step)
        return self._prompts

    def resource_demand(self) -> list[tuple[str, int, dict[str, float]]]:
        """What the run's actors ask of Ray, all held at once: (which, how many actors, the Ray
        resources of each) per actor process group (map_stages), then the train step's
        data-parallel workers 1..N-1 (one placement-group bundle each)."""
        demand = []
        for group in self.process_groups():
            num_cpus, num_gpus, custom = group_resources(group, self.config.light_stage_cpus)
            demand.append((group_name(group), group_pool_size(group), {"CPU": num_cpus, "GPU": num_gpus, **custom}))
        t = self.settings.trainer
        if t.num_workers > 1:
            demand.append(("trainer.num_workers", t.num_workers - 1,
                           {"CPU": t.num_cpus, "GPU": t.num_gpus, **t.resources}))
        return demand

    def data_state(self) -> dict | None:
        """The dataset's identity and size, recorded with each checkpoint (None: a built-in task)."""
        if self.workload.data is None:
            return None
        dataset = self.prompts.dataset
        return {"fingerprint": self.workload.fingerprint(self.model_path, self.config.seed, self.config.prompts_per_step),
                "epoch_size": dataset.epoch_size, "prompts_dropped_too_long": dataset.dropped,
                "prompts_per_step": self.config.prompts_per_step}

    def describe(self) -> str:
        s, c = self.strategy, self.config
        dropout = checkpoint_dropout(self.model_path)
        off = f"; the checkpoint's {', '.join(f'{k} {v}' for k, v in dropout.items())} is off" if dropout else ""
        return (
            f"strategy {s.name} ({s.kind}): {s.meaning}\n"
            f"stages: {' -> '.join(stage.name for stage in self.stages)}\n"
            f"training numerics: {self.settings.numerics.describe()}{off}\n"
            f"max_staleness {c.max_staleness}, inference_dtype {c.inference_dtype}, "
            f"{c.steps} steps x {c.rows_per_step} rows"
            + (f"\n{auto}" if (auto := self.settings.auto_choices()) else "")
            + ("\nold log-probs: the inference ones, reused (the same numerics: torch engine, float32, no weight "
               "change inside a rollout; old_logprob_forward: always recomputes them)"
               if c.old_is_inference(s) else "")
        )

    def iter_metrics(self, first_step: int = 0):
        """Run the pipeline, yielding one metrics dict per train step as it completes. Raises
        RewardFailed (one line) once the reward has failed on every row of
        `reward_max_failed_steps` consecutive steps."""
        log.info("trajflow pipeline\n%s\n%s\nall strategies:\n%s", self.describe(), self.layout(),
                 format_strategies())
        failed_rewards = self.failed_reward_steps()
        try:
            # Not iter_rows(): it prefetches one block, so row b would surface only once step b+1
            # has finished (measured: the status line, the progress bar and the end of the first
            # step were one step late).
            for batch in self.build(first_step).iter_batches(batch_size=None, batch_format="pyarrow",
                                                             prefetch_batches=0):
                for row in batch.to_pylist():
                    self.restarts = max(self.restarts, int(row.get("recovery/restarts") or 0))
                    if self.pending_recoveries and not row.get("recovery/event"):
                        row.update(self.pending_recoveries.pop(0))  # the driver's record of a rebuilt store
                    yield row
                    failed_rewards.check(row)  # after the caller has shown the step: RewardFailed
        except Exception:
            if self.store_guard is not None and self.store_guard.lost is not None:  # what the readers failed on
                raise StoreLost(self.store_guard.lost) from None
            raise
        finally:
            self.shutdown()

    def run(self, progress: bool = True, verbose: bool = False) -> pl.DataFrame:
        """Run to the end and return the metrics as a polars DataFrame (one row per step).
        `verbose`: also what Ray, Ray Data and transformers print of their own (pipelines/ray/quiet.py)."""
        from tqdm.auto import tqdm

        rows = []
        with quiet_run(verbose), tqdm(total=self.config.steps, desc=f"trajflow {self.strategy.name}",
                                      disable=not progress) as bar:
            for row in self.iter_metrics():
                rows.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", version=row["version"])
        import polars as pl

        return pl.DataFrame(rows)

    def shutdown(self) -> None:
        import sys

        if self.store_guard is not None:
            self.store_guard.close()
            self.store_guard = None
        ray = sys.modules.get("ray")  # never imported: no Ray started here (the in-process loop)
        if ray is not None and ray.is_initialized():
            remove_placement_group_named(self.trainer_group_name)
        if self.store is not None:
            self.store.kill()
            self.store = None
