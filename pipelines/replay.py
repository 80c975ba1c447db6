"""Offline replay: a logged trajectory dataset + its version weights, under any strategy.

The stages are the live pipeline's own (`RLPipeline(config).stages`, or the stages of a pipeline
you pass, with the stages you inserted), turned into a replay by one rule:

    live:    generate ─▶ reward ─▶ [your stages] ─▶ advantage ─▶ filter ─▶ [strategy's] ─▶ train
    replay:  the log ─────────────▶ [your stages] ─▶ advantage ─▶ filter ─▶ [strategies'] ─▶ diagnose | train

- `generate` is replaced by the log, one block per logged train step (every step must hold the
  config's rows_per_step rows).
- `values` (a critic's, scored at rollout time) are the log's too, each token's at its recorded
  `value_versions`: the values GAE read, which the replay's advantage stage turns into GAE again
  (a log of `critic.values_at: train` diagnoses on its `train_values`; a `--train` replay's own
  critic, started from the first step's critic checkpoint, scores and trains as live).
- `reward` is the log's: the reward as trained, after the verifier or the environment (whose
  reward the generator wrote) and after every live stage that edited it. The reward stage is not
  re-run (an external reward may be slow, paid or not deterministic) and no replayed stage can
  change the reward: a stage you inserted that edits it is already in the logged value, so it is
  not applied twice. Stages still *read* it as trained.
- Everything else a stage writes is recomputed: `advantage`, `filter_reason` and `old_logprobs`
  are cleared and rebuilt by replaying advantage, filter and the strategies' stages, and a stage
  you inserted runs again (e.g. your row filter marks its rows again).
- The live strategy's own stages are dropped; each replayed strategy brings its replay stages
  (`Strategy.replay_stages`: e.g. the old log-prob operator at each token's version for the exact
  strategies — for `interrupt` too, whose live values came from the generator).
- `train` becomes `Diagnose` (metrics only, several strategies at once) or a fresh train step
  under the one strategy asked for.

The weights of each needed version are read from the checkpoints dir (`versions/v000012.safetensors`
as written with `save_all_versions: true`, a LoRA run's adapter directory `versions/v000012/`, or
`checkpoints/step-000012/model.safetensors` / `adapter.safetensors`) and published into a policy
store (a LoRA run's adapters as such: each reader merges them into the base, as live). Every
needed version is checked before Ray starts: the ones missing are reported by number
(`ReplayError`).

    --diagnose  needs, per step k, the trainer's weights of version k (pi_theta), plus what each
                strategy asks (`Strategy.replay_versions`: each token's behavior version for the
                strategies that read old_logprobs, k + 1 for one that follows the updates, EWMA).
    --train     needs the weights of the first step's version (the trainer starts there) and
                what the strategy asks. The trainer publishes its own new versions to a separate
                store, so they never mix with the logged ones.

Memory: all needed versions are held in the object store at once (fine for small models; a
streaming variant would publish and release versions as the steps advance).

One module on purpose: what a replay needs (the logged steps, each strategy's versions, where
they are on disk) and how it runs (the live stage list re-cut around the log) are one set of
rules; split, each half would have to restate the other's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.engines import checkpoint as ckpt
from trajflow.operators.contracts.stage import ClassRef
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.ray.quiet import quiet_run
from trajflow.schemas import nonfinite_rows, read_parquet

# torch, transformers and ray load lazily: every input is checked before they are needed

log = logging.getLogger("trajflow")

STEP_COLUMN = "trainer_version"  # the job's trajectory log records the train step of each row
PINNED = "reward"  # the column a replay takes from the log as trained (see the module docstring)


class ReplayError(ValueError):
    """Replay cannot start (missing weights, unusable data); the message is one line."""


def format_versions(versions: Iterable[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> '1-3, 7, 9-10'."""
    vs = sorted(set(versions))
    parts, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        parts.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ", ".join(parts)


# -- the logged data -----------------------------------------------------------------------------
# what a run dir holds besides its trajectories (jobs/recorder.py RunPaths): never read as a log
RUN_DIR_MARKERS = ("config.yaml", "run.json", "metrics", "metrics.parquet")


def trajectory_files(path: str | Path) -> list[Path]:
    """The Parquet files of a trajectory log: a file, a dir of them (searched recursively), or a
    run dir (its `trajectories/`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ReplayError(f"{path}: no such file or directory")
    if not (path / "trajectories").is_dir() and any((path / name).exists() for name in RUN_DIR_MARKERS):
        raise ReplayError(f"{path}: the run logged no trajectories (no trajectories/ dir: it ran with "
                          "trajectory_log: false or stopped before its first step); nothing to replay")
    root = path / "trajectories" if (path / "trajectories").is_dir() else path
    # hidden files under the log (e.g. writers' temp files) are skipped; dots above it are the user's
    files = sorted(p for p in root.rglob("*.parquet")
                   if not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ReplayError(f"{path}: no Parquet files found")
    return files


def _step_from_path(path: Path) -> int | None:
    for part in reversed(path.parts):
        if part.startswith("step="):
            try:
                return int(part[5:].split(".")[0])
            except ValueError:
                return None
    return None


def load_trajectories(path: str | Path, allow_nonfinite: bool = False) -> dict[int, pa.Table]:
    """Read and validate every file (schemas.read_parquet); group the rows by train step."""
    tables = []
    for file in trajectory_files(path):
        table = read_parquet(file, allow_nonfinite=allow_nonfinite)  # SchemaError names the file and column
        if STEP_COLUMN not in table.column_names:
            step = _step_from_path(file)
            if step is None and "rollout_step" in table.column_names:
                steps = table["rollout_step"]
            elif step is not None:
                steps = pa.array(np.full(table.num_rows, step, np.int32))
            else:
                raise ReplayError(f"{file}: no train step (a `{STEP_COLUMN}` or `rollout_step` column, "
                                  "or a step=N partition dir)")
            table = table.append_column(STEP_COLUMN, pc.cast(steps, pa.int32()))
        if "rollout_step" not in table.column_names:
            table = table.append_column("rollout_step", pc.cast(table[STEP_COLUMN], pa.int32()))
        tables.append(table)
    by_step: dict[int, list[pa.Table]] = {}
    for table in tables:
        for step in np.unique(table[STEP_COLUMN].to_numpy()):
            part = table.filter(pc.equal(table[STEP_COLUMN], int(step)))
            by_step.setdefault(int(step), []).append(part)
    out = {}
    for step, parts in sorted(by_step.items()):
        try:
            out[step] = pa.concat_tables(parts, promote_options="permissive")
        except pa.ArrowInvalid as e:
            raise ReplayError(f"step {step}: its files do not share one schema: {e}") from None
        ids = out[step]["trajectory_id"]
        if pc.count_distinct(ids).as_py() != len(ids):
            raise ReplayError(f"step {step}: duplicate trajectory_id in the log")
    return out


def _prepare(table: pa.Table) -> pa.Table:
    """Drop what the replay recomputes: filter reasons, old, the loss's old, reference and teacher
    log-probs (pi_old's and the teacher's on the top-k ids too), the KL penalty, advantages and
    GAE's returns. The sampler's top-k (ids, mu) and a critic's values are the log's, like the
    tokens."""
    from trajflow.schemas.columns import (
        FILTER_REASON,
        KL_PENALTY_COLUMN,
        FORMER_LOSS_OLD_COLUMN,
        LOSS_OLD_COLUMN,
        REFERENCE_COLUMN,
        RETURNS_COLUMN,
        TOKEN_ADVANTAGE_COLUMN,
        replace_column,
    )

    recomputed = (FILTER_REASON, LOSS_OLD_COLUMN, REFERENCE_COLUMN, KL_PENALTY_COLUMN, TOKEN_ADVANTAGE_COLUMN,
                  RETURNS_COLUMN, "top_k_old_logprobs", "teacher_logprobs", "top_k_teacher_logprobs",
                  FORMER_LOSS_OLD_COLUMN)
    table = table.drop_columns([c for c in recomputed if c in table.column_names])
    table = replace_column(table, "old_logprobs", pa.nulls(table.num_rows, pa.list_(pa.float32())))
    return replace_column(table, "advantage", pa.nulls(table.num_rows, pa.float32()))


# -- which versions are needed, where they are -----------------------------------------------------
def required_versions(steps: dict[int, pa.Table], strategies: list, mode: str) -> set[int]:
    """Versions whose weights a replay of `steps` under `strategies` (Strategy objects) needs."""
    needed: set[int] = {min(steps)} if mode == "train" else set(steps)
    for k, table in steps.items():
        tokens = set(pc.unique(pc.list_flatten(table["versions"])).to_pylist())
        for strategy in strategies:
            needed |= strategy.replay_versions(k, tokens, mode)
    return needed


def resolve_strategies(config: PipelineConfig, strategies: list) -> list:
    """Strategy objects from names / import paths or objects. `config.strategy_options` are the
    settings of `config.strategy`; another strategy named here takes its own defaults."""
    from trajflow.operators.strategies import resolve_strategy, strategy_class

    out = []
    defaults = config.model_copy(update={"strategy_options": {}})
    for s in strategies:
        try:
            if isinstance(s, str):
                cls = resolve_strategy(s)
                out.append(cls.from_config(config if cls is resolve_strategy(config.strategy) else defaults))
            else:
                strategy_class(s)
                out.append(s)
        except ValueError as e:
            raise ReplayError(f"--strategy: {e}") from None
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ReplayError(f"--strategy: each strategy once, got {', '.join(names)}")
    return out


def version_candidates(checkpoints: Path, version: int) -> list[Path]:
    """Where version `version`'s payload may be, in order: a version file or (a LoRA run) a PEFT
    adapter directory, in `checkpoints` or its versions/; a checkpoint's weights or adapter."""
    versions = [ckpt.saved_version(checkpoints, version), ckpt.saved_version(checkpoints / "versions", version)]
    step = ckpt.checkpoint_dir(".", version).name
    in_checkpoints = [root / step / name for root in (checkpoints, checkpoints / "checkpoints")
                      for name in ("model.safetensors", ckpt.ADAPTER_FILE)]
    return [p for p in versions if p is not None] + in_checkpoints


def critic_candidates(checkpoints: Path, version: int) -> list[Path]:
    """Where the critic's weights of `version` may be: its version file (versions/critic/), or a
    checkpoint's critic directory."""
    from trajflow.operators.contracts.store import CRITIC

    step = ckpt.checkpoint_dir(".", version).name
    return [ckpt.version_file(root / CRITIC, version) for root in (checkpoints, checkpoints / "versions")] + \
        [root / step / CRITIC / "model.safetensors" for root in (checkpoints, checkpoints / "checkpoints")]


def locate_versions(checkpoints: str | Path, versions: Iterable[int]) -> tuple[dict[int, Path], list[int]]:
    checkpoints = Path(checkpoints)
    found, missing = {}, []
    for v in sorted(set(versions)):
        path = next((p for p in version_candidates(checkpoints, v) if p.exists()), None)
        if path is None:
            missing.append(v)
        else:
            found[v] = path
    return found, missing


def replay_support(trajectory_log: bool, save_all_versions: bool, kept: Iterable[int]) -> str:
    """One line for a run's summary: whether `trajflow replay` can replay the run exactly and, if
    not, which replays need which versions the run did not keep (`kept`: its checkpoints')."""
    from trajflow.operators.strategies.registry import BUILTIN

    if not trajectory_log:
        return "replay: not possible (trajectory_log: false, so no trajectories were logged)"
    if save_all_versions:
        return "replay: exact under any strategy (--diagnose, --train): every version's weights are in versions/"
    exact = ", ".join(name for name, cls in BUILTIN.items() if cls.old_from_column)
    return (f"replay: not possible, save_all_versions is false (versions kept: {format_versions(kept) or 'none'}): "
            f"--diagnose needs every version; --train the first logged step's, plus, under {exact}, "
            "each token's behavior version")


# -- the pinned reward ---------------------------------------------------------------------------
def keep_logged(before: pa.Table, after: pa.Table, column: str = PINNED) -> pa.Table:
    """`after` with `column` put back to its value in `before` (rows matched by trajectory_id)."""
    from trajflow.schemas.columns import replace_column

    index = pc.index_in(after["trajectory_id"], value_set=before["trajectory_id"])
    return replace_column(after, column, pc.take(before[column], index))


class KeepLoggedReward:
    """A replayed light stage that cannot change the logged reward."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, batch: pa.Table) -> pa.Table:
        return keep_logged(batch, self.fn(batch))


class KeepLoggedRewardActor:
    """A replayed actor stage that cannot change the logged reward (`inner` built as live)."""

    def __init__(self, inner: type | ClassRef, **kwargs) -> None:
        self.inner = inner(**kwargs)  # a ClassRef constructs its class (imported here, in the actor)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return keep_logged(batch, self.inner(batch))


def replayed(stage):
    """The replay form of a live stage that runs after the logged reward."""
    import dataclasses

    if stage.is_actor:
        return dataclasses.replace(stage, fn=KeepLoggedRewardActor, kwargs={"inner": stage.fn, **stage.kwargs})
    return dataclasses.replace(stage, fn=KeepLoggedReward(stage.fn))


# -- the replay ----------------------------------------------------------------------------------
@dataclass
class Replay:
    """A validated replay, ready to run (everything is checked in __post_init__, before Ray).

    strategies: names, import paths or Strategy objects. pipeline: the live RLPipeline whose stages
    to replay (default: the config's own, `RLPipeline(config)`).
    """

    config: PipelineConfig
    trajectories: str | Path
    checkpoints: str | Path
    strategies: list
    mode: str = "diagnose"  # or "train"
    model_path: str | Path | None = None
    # NaN/inf log-probs: refuse the log (default), or keep such rows out of training and the
    # diagnostics (the filter marks them `nonfinite`) and count them in `quarantined`
    quarantine_nonfinite: bool = False
    # diagnose: each strategy's parameter gradient against the exact one's (operators/diagnose.py)
    gradients: bool = False
    pipeline: Any = None
    steps: dict[int, pa.Table] = field(init=False)
    weights: dict[int, Path] = field(init=False)
    quarantined: dict[int, int] = field(init=False)  # step -> rows with NaN/inf log-probs

    def __post_init__(self) -> None:
        if self.mode not in ("diagnose", "train"):
            raise ReplayError(f"mode must be diagnose or train, got {self.mode!r}")
        if not self.strategies:
            raise ReplayError("--strategy: give at least one strategy")
        self.strategies = resolve_strategies(self.config, list(self.strategies))
        if self.mode == "train" and len(self.strategies) != 1:
            raise ReplayError("--train replays one strategy at a time")
        if self.gradients and (self.mode != "diagnose" or not any(s.kind == "exact" for s in self.strategies)):
            raise ReplayError("--gradients compares against an exact strategy in --diagnose: add one, "
                              "e.g. --strategy snapshot")
        if self.model_path is None:
            self.model_path = self.pipeline.model_path if self.pipeline is not None else self.config.model_path
        self.model_path = str(self.model_path)
        checkpoints = Path(self.checkpoints)
        if not checkpoints.is_dir():
            raise ReplayError(f"--checkpoints {checkpoints}: no such directory")
        self.steps = load_trajectories(self.trajectories, allow_nonfinite=self.quarantine_nonfinite)
        counts = {k: int(nonfinite_rows(t).sum()) for k, t in self.steps.items()}
        self.quarantined = {k: n for k, n in counts.items() if n}
        if not self.steps:
            raise ReplayError(f"{self.trajectories}: the log holds no rows")
        rows = self.config.rows_per_step
        wrong = {k: t.num_rows for k, t in self.steps.items() if t.num_rows != rows}
        if wrong:
            k, n = next(iter(wrong.items()))
            raise ReplayError(f"step {k} holds {n} rows, the config's rows_per_step is {rows} "
                              f"(prompts_per_step x group_size); steps affected: {format_versions(wrong)}")
        needed = required_versions(self.steps, self.strategies, self.mode)
        self.weights, missing = locate_versions(checkpoints, needed)
        self.critic_start = None  # a --train replay's critic: the first step's version of it
        if self.mode == "train" and self.config.critic is not None:
            first = min(self.steps)
            self.critic_start = next((p for p in critic_candidates(checkpoints, first) if p.exists()), None)
            if self.critic_start is None:
                raise ReplayError(f"the critic's weights of version {first} are missing from {checkpoints} (a "
                                  "--train replay starts its critic there: a checkpoint of that version, or "
                                  "save_all_versions: true)")
        if missing:
            names = ",".join(s.name for s in self.strategies)
            raise ReplayError(
                f"weights of {len(missing)} version(s) missing from {checkpoints}: {format_versions(missing)} "
                f"(needed {len(needed)} for {self.mode} {names}; "
                "a run keeps every version with save_all_versions: true)"
            )

    # -- the stages --------------------------------------------------------------------------------
    def stages(self, stores: dict) -> list:
        """The live stage list turned into the replay's (the rule of the module docstring)."""
        from trajflow.operators.contracts.stage import Stage, place
        from trajflow.operators.diagnose import Diagnose
        from trajflow.pipelines.rl_loop import RLPipeline

        live = self.pipeline or RLPipeline(self.config, model_path=self.model_path)
        # logged versions are read from the replay's own stores, whatever the live run's weight_sync
        ctx = dataclasses.replace(live.stage_context(), weight_sync=WeightSyncConfig())
        own = {p.stage.name for p in live.strategy.stages(ctx)}
        # Sentinels where generate and train were, so strategies can place relative to them.
        chain = [Stage("generate", _nothing)]
        chain += [replayed(s) for s in live.stages if s.name not in {"generate", "reward", "values", "train"} | own]
        critic = self.config.settings.critic
        if critic is not None and critic.values_at == "train" and self.mode == "diagnose":  # GAE on the log's
            from trajflow.operators.advantage import Advantage
            from trajflow.schemas.columns import TRAIN_VALUES_COLUMN

            s = self.config.settings
            chain = [replayed(Stage("advantage", Advantage(s.advantage, TRAIN_VALUES_COLUMN, s.kl)))
                     if stage.name == "advantage" else stage for stage in chain]
        chain.append(Stage("train", _nothing))
        placed: set[str] = set()
        for strategy in self.strategies:
            for placement in strategy.replay_stages(ctx):
                if placement.stage.name not in placed:
                    place(chain, placement)
                    placed.add(placement.stage.name)
        chain = [s for s in chain if s.fn is not _nothing]
        c = self.config
        if self.mode == "diagnose":
            s = c.settings
            diagnose = dict(model_path=self.model_path, strategies=self.strategies, correction=s.correction, kl=s.kl,
                            sampling=live.sampling, max_staleness=c.max_staleness, numerics=s.numerics,
                            torch_threads=s.trainer.torch_threads, gradients=self.gradients,
                            distill=s.distill, max_tokens_per_microbatch=s.trainer.max_tokens_per_microbatch)
            return chain + [Stage("diagnose", Diagnose, diagnose, s.trainer)]
        train = live.train_stage(self.strategies[0])
        train.kwargs["store"] = stores["trainer"]  # its own store: new versions never mix with logged ones
        train.kwargs["weight_sync"] = WeightSyncConfig()  # nothing reads its versions but the end of the replay
        train.kwargs["failed_rewards"] = None  # every logged step is trained, whatever its rewards were
        self._trainer_group_name = train.kwargs["spec"].group_name  # removed when the replay ends
        return chain + [train]

    # -- execution --------------------------------------------------------------------------------
    def _publish_logged_versions(self):
        """A policy store holding every needed logged version (pinned for the whole replay)."""
        from trajflow.pipelines.policy_store import RayStore

        # The driver put these versions and outlives the replay: the store never copies them.
        store = RayStore.start(10**9, True, final_version=max(self.weights) + 1)
        uses: dict[int, int] = {}
        for table in self.steps.values():  # the old log-prob operator releases each version once per batch
            for v in pc.unique(pc.list_flatten(table["versions"])).to_pylist():
                uses[v] = uses.get(v, 0) + 1
        for version in sorted(self.weights):
            store.publish(ckpt.load_version(self.weights[version]), version)
            for _ in range(uses.get(version, 0) + 1):
                store.weights(version, pin=True)
        return store

    def dataset(self, stores: dict):
        import ray
        from ray.data import DataContext

        from trajflow.pipelines.colocation import plan_groups
        from trajflow.pipelines.rl_loop import map_stages

        DataContext.get_current().execution_options.preserve_order = True
        ds = ray.data.from_arrow([_prepare(t) for _, t in sorted(self.steps.items())])
        # Everything before the last stage shares one process, the last (diagnose or train) its own:
        # every logged step is available at once, so scoring step b + 1 overlaps diagnosing step b.
        groups = plan_groups(self.stages(stores), synchronous=False, colocate=self.config.colocate != "off",
                             rollout=self.config.colocate == "rollout")
        rows = self.config.rows_per_step
        return map_stages(ds, groups, store=stores["logged"], rows=rows, first_rows=rows,
                          light_stage_cpus=self.config.light_stage_cpus)

    def iter_rows(self):
        """Run on the current Ray (started by the caller); yields metrics rows as they complete.
        In train mode the final weights are in `self.final_weights` afterwards."""
        from trajflow.pipelines.policy_store import RayStore

        stores = {"logged": self._publish_logged_versions()}
        if self.mode == "train":
            first = min(self.steps)
            # The trainer's last version is read after Ray Data has torn the trainer down: the
            # store copies that one (and only that one) into its own ownership.
            stores["trainer"] = RayStore.start(self.config.max_staleness, False, final_version=first + len(self.steps))
            stores["trainer"].publish(ckpt.load_version(self.weights[first]), first)
            if self.critic_start is not None:
                from trajflow.operators.contracts.store import CRITIC

                stores["trainer"].publish(ckpt.load_weights(self.critic_start), first, learner=CRITIC)
        try:
            for batch in self.dataset(stores).iter_batches(batch_size=None, batch_format="pyarrow",
                                                           prefetch_batches=0):
                yield from batch.to_pylist()
            if self.mode == "train":
                _, self.final_weights = stores["trainer"].weights()
        finally:
            from trajflow.pipelines.ray.embedded import remove_placement_group_named

            remove_placement_group_named(getattr(self, "_trainer_group_name", ""))
            for store in stores.values():
                store.kill()

    def run(self, progress: bool = True, verbose: bool = False) -> pl.DataFrame:
        """The rows of `iter_rows()` as a DataFrame, with a progress bar over the logged steps.
        `verbose`: also what Ray, Ray Data and transformers print of their own (pipelines/ray/quiet.py)."""
        from tqdm.auto import tqdm

        rows: list[dict] = []
        with quiet_run(verbose), tqdm(total=len(self.steps), desc=f"replay ({self.mode})", unit="step",
                                      disable=not progress) as bar:
            for row in self.iter_rows():  # diagnose: one row per step and strategy
                if not rows or row["step"] != rows[-1]["step"]:
                    bar.update(1)
                rows.append(row)
        return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()


def _nothing(batch: pa.Table) -> pa.Table:
    return batch
