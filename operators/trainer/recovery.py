"""Recovery of a lost trainer: rebuild its state from the last checkpoint and the trajectory log.

The trainer's state (weights, optimizer, strategy) lives only in the train step's processes. When
one dies — a data-parallel worker (`TrainerRank`), or the train step's own process, which Ray Data
restarts and whose in-flight step it retries — the state since the last checkpoint is rebuilt
exactly rather than lost:

1. every worker loads the last checkpoint (weights, optimizer and strategy state, its version v);
   a rebuilt worker reads its weights there, never in the policy store (which holds no tensors
   of a version under `weight_sync.method: collective`);
2. the steps v .. s-1 (s: the step at hand, or the one after the newest logged step for a
   restarted train step, which recovers as it starts) are trained again from the rows the
   trajectory log holds for them — the same rows in the same order, with the old log-probs they
   carried — with nothing logged or checkpointed (all of it already was);
3. the version the run goes on from is published if the store lacks it (the trainer died
   between logging a step and publishing its version), and a rebuilt weight server
   (collective) serves it first: its readers kept the versions they held and join it;
4. step s is trained as usual, from the live stream.

No rollout is generated again and none is trained twice into the final state: a logged step is
re-applied only to state that was rolled back to before it. The generators keep going meanwhile
(the staleness bound holds them back as usual).

The run dir is the job's (jobs/recorder.py): the job gives the train step a `TrainerSource`
(`StepHooks.source`) that finds the checkpoint and reads a step's logged rows. `max_restarts`
bounds the recoveries of a run (the policy store counts the trainers started); past it, or
without a source, checkpoint or log, the run stops with today's one line (`--resume` goes on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from trajflow.settings import setting

RESUME_HINT = "restart from the last checkpoint with `trajflow run --resume RUN_DIR`"
RECOVERY_PREFIX = "recovery/"  # the metrics of recoveries: restarts, seconds, replayed_steps, event
# `recovery/restarted/<process>`: times Ray restarted a stage process that died (a generator, a
# scorer: pipelines/colocation.py), counted in the row of the step during which it came back
RESTARTED_PREFIX = f"{RECOVERY_PREFIX}restarted/"


class TrainerStateLost(RuntimeError):
    """The trainer's optimizer/strategy state is gone (a worker died or was restarted): the run
    cannot go on without restoring it from a checkpoint. The message is one line."""


@dataclass(frozen=True)
class RecoveryConfig:
    """How a run heals itself (the `recovery:` section of the config)."""

    max_restarts: int = setting(
        3, "times a run rebuilds its trainer (from the last checkpoint and the trajectory log) after a "
        "trainer process dies; 0: stop with one line naming `trajflow run --resume`", ge=0)


class TrainerSource(Protocol):
    """Where a rebuilt trainer finds its state (the job's run dir, jobs/recorder.py)."""

    def last_checkpoint(self, at_most: int) -> tuple[str, int] | None:
        """(directory, version) of the newest complete checkpoint of a version <= `at_most`, or None."""

    def last_logged_step(self) -> int:
        """The newest step whose rows the log holds (-1: none): the trainer that died trained it
        (and may have published its version: rows are logged before the version is published)."""

    def metrics_logged(self, step: int) -> bool:
        """Whether step `step`'s metrics row was written (the trainer may die between rows and metrics)."""

    def logged_rows(self, step: int) -> pa.Table | None:
        """Step `step`'s rows as the train step received them, in order (None: not all logged)."""

    def refusal(self) -> str | None:
        """Why this run cannot be rebuilt at all (e.g. its trajectory log is off), or None."""


@dataclass
class Fault:
    """A trainer process that died: what it was, and when the loss was noticed (wall clock)."""

    what: str  # e.g. "trainer worker 1 of 2 (node 1a2b3c4d5e6f) died"
    noticed: float


def refusal(config: RecoveryConfig, source: TrainerSource | None, restarts: int) -> str | None:
    """Why fault number `restarts` (1, 2, ...) of a run is not recovered, or None."""
    if restarts > config.max_restarts:
        return f"recovery.max_restarts ({config.max_restarts}) is spent"
    if source is None:
        return "the pipeline runs without a run dir to rebuild the trainer from"
    return source.refusal()


def replay_plan(source: TrainerSource, step: int | None = None) -> tuple[str, int, list[pa.Table]]:
    """The checkpoint to load and the logged rows of its version up to the step at hand, in step
    order; RuntimeError (one line) when the checkpoint or a step's rows are missing.

    The step at hand (`step`, the batch the trainer was training when a worker died; None for a
    train step's restarted process, which recovers before its first batch) may be one the trainer
    that died had already trained and logged: Ray Data retries a lost task whole, and one task can
    hold several steps. Every logged step is retrained from the log, so the plan runs through the
    newest logged step, and the train step skips live batches of the steps it covers."""
    end = max(step or 0, source.last_logged_step() + 1)
    found = source.last_checkpoint(at_most=end)
    if found is None:
        raise RuntimeError("no checkpoint to rebuild the trainer from yet (checkpoint_every)")
    directory, version = found
    batches = []
    for k in range(version, end):
        rows = source.logged_rows(k)
        if rows is None:
            raise RuntimeError(f"the trajectory log lacks rows of step {k} (trajectory_log)")
        batches.append(rows)
    return directory, version, batches


def event_metrics(fault: Fault, step: int, version: int, replayed: int, seconds: float, restarts: int) -> dict:
    """The `recovery/*` entries of the metrics row of `step`, the first trained after a recovery."""
    steps = f"steps {version}-{version + replayed - 1}" if replayed else "no steps"
    return {f"{RECOVERY_PREFIX}restarts": restarts, f"{RECOVERY_PREFIX}seconds": seconds,
            f"{RECOVERY_PREFIX}replayed_steps": replayed,
            f"{RECOVERY_PREFIX}event": f"{fault.what} at step {step}; rebuilt from checkpoint {version}, retrained "
                                        f"{steps} from the trajectory log in {seconds:.1f} s"}
