"""Offline replay: a logged trajectory dataset + its version weights, under any strategy.

    logged Parquet (validated) ─▶ one block per train step ─▶ advantage ─▶ filter
        ─▶ [old logits at each token's version]  (snapshot / dedicated / interrupt)
        ─▶ diagnose (metrics only)   or   train step (a new training run on the logged data)

The weights of each needed version are read from the checkpoints dir (`versions/v000012.safetensors`
as written with `save_all_versions: true`, or `checkpoints/step-000012/model.safetensors`) and
published into a policy store, so the same old-logit operator the live pipeline uses
(`OldLogitsAtBehaviourVersion`) scores each token under its own version. Every needed version is
checked before Ray starts: the ones missing are reported by number (`ReplayError`).

    --diagnose  needs, per step k, the trainer's weights of version k (pi_theta), plus each
                token's behaviour version for the exact strategies and k + 1 for ewma.
    --train     needs the weights of the first step's version (the trainer starts there) and,
                for the exact strategies, each token's behaviour version. The trainer publishes
                its own new versions to a separate store, so they never mix with the logged ones.

Rewards come from the log; advantages and filter reasons are recomputed (as live). Every step
must hold the same number of rows (the logged run's rows_per_step).

Memory: all needed versions are held in the object store at once (fine for small models; a
streaming variant would publish and release versions as the steps advance).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.engines import checkpoint as ckpt
from trajflow.pipelines.config import PipelineConfig
from trajflow.schemas import read_parquet

# torch, transformers and ray load lazily: every input is checked before they are needed

log = logging.getLogger("trajflow")

EXACT_STRATEGIES = ("snapshot", "dedicated", "interrupt")
ALL_STRATEGIES = ("snapshot", "dedicated", "interrupt", "ewma", "recompute", "behavior", "loglinear")
STEP_COLUMN = "trainer_version"  # the job's trajectory log records the train step of each row


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
def trajectory_files(path: str | Path) -> list[Path]:
    """The Parquet files of a trajectory log: a file, a dir of them (searched recursively), or a
    run dir (its `trajectories/`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ReplayError(f"{path}: no such file or directory")
    root = path / "trajectories" if (path / "trajectories").is_dir() else path
    files = sorted(p for p in root.rglob("*.parquet") if not any(part.startswith(".") for part in p.parts))
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


def load_trajectories(path: str | Path) -> dict[int, pa.Table]:
    """Read and validate every file (schemas.read_parquet); group the rows by train step."""
    tables = []
    for file in trajectory_files(path):
        table = read_parquet(file)  # SchemaError names the file and column
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
    """Drop what the replay recomputes: filter reasons, old log-probs, advantages."""
    from trajflow.operators.columns import FILTER_REASON, replace_column

    if FILTER_REASON in table.column_names:
        table = table.drop_columns([FILTER_REASON])
    table = replace_column(table, "old_logprobs", pa.nulls(table.num_rows, pa.list_(pa.float32())))
    return replace_column(table, "advantage", pa.nulls(table.num_rows, pa.float32()))


# -- which versions are needed, where they are -----------------------------------------------------
def required_versions(steps: dict[int, pa.Table], strategies: list[str], mode: str) -> set[int]:
    needed: set[int] = set()
    exact = any(s in EXACT_STRATEGIES for s in strategies)
    if exact:
        for table in steps.values():
            needed.update(pc.unique(pc.list_flatten(table["versions"])).to_pylist())
    if mode == "diagnose":
        needed.update(steps)
        if "ewma" in strategies:
            needed.update(k + 1 for k in steps)
    else:
        needed.add(min(steps))
    return needed


def version_candidates(checkpoints: Path, version: int) -> list[Path]:
    name = ckpt.version_file(".", version).name
    step = ckpt.checkpoint_dir(".", version).name
    return [
        checkpoints / name,
        checkpoints / "versions" / name,
        checkpoints / step / "model.safetensors",
        checkpoints / "checkpoints" / step / "model.safetensors",
    ]


def locate_versions(checkpoints: str | Path, versions: Iterable[int]) -> tuple[dict[int, Path], list[int]]:
    checkpoints = Path(checkpoints)
    found, missing = {}, []
    for v in sorted(set(versions)):
        path = next((p for p in version_candidates(checkpoints, v) if p.is_file()), None)
        if path is None:
            missing.append(v)
        else:
            found[v] = path
    return found, missing


# -- the replay ----------------------------------------------------------------------------------
@dataclass
class Replay:
    """A validated replay, ready to run (everything is checked in __post_init__, before Ray)."""

    config: PipelineConfig
    trajectories: str | Path
    checkpoints: str | Path
    strategies: list[str]
    mode: str = "diagnose"  # or "train"
    model_path: str | Path | None = None
    steps: dict[int, pa.Table] = field(init=False)
    weights: dict[int, Path] = field(init=False)

    def __post_init__(self) -> None:
        if self.mode not in ("diagnose", "train"):
            raise ReplayError(f"mode must be diagnose or train, got {self.mode!r}")
        unknown = [s for s in self.strategies if s not in ALL_STRATEGIES]
        if unknown or not self.strategies:
            raise ReplayError(f"unknown strategy {unknown or self.strategies}; choose from {', '.join(ALL_STRATEGIES)}")
        if self.mode == "train" and len(self.strategies) != 1:
            raise ReplayError("--train replays one strategy at a time")
        if self.model_path is None and self.config.model is None:
            from trajflow.engines.models import WARM_START_DIR

            self.model_path = WARM_START_DIR
        self.model_path = str(self.model_path or self.config.model)
        checkpoints = Path(self.checkpoints)
        if not checkpoints.is_dir():
            raise ReplayError(f"--checkpoints {checkpoints}: no such directory")
        self.steps = load_trajectories(self.trajectories)
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
        if missing:
            raise ReplayError(
                f"weights of {len(missing)} version(s) missing from {checkpoints}: {format_versions(missing)} "
                f"(needed {len(needed)} for {self.mode} {','.join(self.strategies)}; "
                "a run keeps every version with save_all_versions: true)"
            )

    # -- execution --------------------------------------------------------------------------------
    def _correction(self):
        from trajflow.algorithms import CorrectionConfig

        c = self.config
        return CorrectionConfig(**c.correction.model_dump(), loss_norm_tokens=c.sampling.max_new_tokens)

    def _publish_logged_versions(self):
        """A policy store holding every needed logged version (pinned for the whole replay)."""
        import ray

        from trajflow.pipelines.policy_store import PolicyStore, state_dict_nbytes

        store = PolicyStore.remote(10**9, True)
        uses: dict[int, int] = {}
        for table in self.steps.values():  # the old-logit operator releases each version once per batch
            for v in pc.unique(pc.list_flatten(table["versions"])).to_pylist():
                uses[v] = uses.get(v, 0) + 1
        for version in sorted(self.weights):
            state = ckpt.load_weights(self.weights[version])
            ray.get(store.publish.remote([ray.put(state)], state_dict_nbytes(state), version))
            ray.get([store.get.remote(version, True) for _ in range(uses.get(version, 0) + 1)])
        return store

    def dataset(self, stores: dict):
        import ray
        from ray.data import DataContext, TaskPoolStrategy

        from trajflow.engines.sampling import SamplingParams
        from trajflow.operators.advantage import Advantage
        from trajflow.operators.diagnose import Diagnose
        from trajflow.operators.filter import Filter
        from trajflow.operators.old_logits import OldLogitsAtBehaviourVersion
        from trajflow.operators.train_step import TrainStep
        from trajflow.pipelines.rl_loop import Fused, in_order_pool

        c = self.config
        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True
        rows = c.rows_per_step
        sampling = SamplingParams(**c.sampling.model_dump())
        ds = ray.data.from_arrow([_prepare(t) for _, t in sorted(self.steps.items())])
        # One task at a time: every step is available at once, and each new task worker would
        # import torch (seconds and ~350 MB each) for a millisecond of numpy.
        ds = ds.map_batches(Fused([Advantage(c.advantage), Filter(c.drop_zero_variance_groups)]), batch_size=rows,
                            batch_format="pyarrow", num_cpus=c.light_stage_cpus, zero_copy_batch=True,
                            compute=TaskPoolStrategy(size=1))

        def actor(ds, fn, kwargs, res):
            extra = {"resources": res.resources} if res.resources else {}
            return ds.map_batches(fn, fn_constructor_kwargs=kwargs, batch_size=rows, batch_format="pyarrow",
                                  compute=in_order_pool(1), num_cpus=res.num_cpus,
                                  num_gpus=res.num_gpus or None, **extra)

        if any(s in EXACT_STRATEGIES for s in self.strategies):
            ds = actor(ds, OldLogitsAtBehaviourVersion,
                       dict(store=stores["logged"], model_path=self.model_path, sampling=sampling,
                            skip_filtered=True, torch_threads=c.scorer.torch_threads), c.scorer)
        if self.mode == "diagnose":
            return actor(ds, Diagnose, dict(
                store=stores["logged"], model_path=self.model_path, strategies=self.strategies,
                correction=self._correction(), sampling=sampling, max_staleness=c.max_staleness,
                ewma_window=c.ewma_window, ewma_tau=c.ewma.reset_threshold, loglinear_alpha=c.loglinear_alpha,
                torch_threads=c.trainer.torch_threads), c.trainer)
        (strategy,) = self.strategies
        return actor(ds, TrainStep, dict(
            store=stores["trainer"], model_path=self.model_path, workload=c.workload(), strategy=strategy,
            correction=self._correction(), sampling=sampling, max_staleness=c.max_staleness,
            **c.optimizer.model_dump(), ewma_window=c.ewma_window, ewma_tau=c.ewma.reset_threshold,
            loglinear_alpha=c.loglinear_alpha, eval_every=c.eval_every, eval_prompts=c.eval_prompts,
            torch_threads=c.trainer.torch_threads), c.trainer)

    def iter_rows(self):
        """Run on the current Ray (started by the caller); yields metrics rows as they complete.
        In train mode the final weights are in `self.final_weights` afterwards."""
        import ray

        from trajflow.pipelines.policy_store import PolicyStore, state_dict_nbytes

        stores = {"logged": self._publish_logged_versions()}
        if self.mode == "train":
            first = min(self.steps)
            state = ckpt.load_weights(self.weights[first])
            stores["trainer"] = PolicyStore.remote(self.config.max_staleness, False)
            ray.get(stores["trainer"].publish.remote([ray.put(state)], state_dict_nbytes(state), first))
        try:
            for row in self.dataset(stores).iter_rows():
                yield row
            if self.mode == "train":
                _, (ref,) = ray.get(stores["trainer"].get.remote(None))
                self.final_weights = ray.get(ref)
        finally:
            for store in stores.values():
                ray.kill(store)

    def run(self) -> pl.DataFrame:
        rows = list(self.iter_rows())
        return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()
