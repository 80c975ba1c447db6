"""One step, top to bottom: the RL loop over the pipeline's own operators, in this process.

`run_in_process(pipe)` runs an `RLPipeline`'s stage list synchronously, without Ray: the same
operator objects Ray Data would run in its actors (each is a callable, Arrow table in, Arrow table
out), an in-process policy store, and the train step's data-parallel workers as threads of this
process (operators/trainer/group.py `InProcessGroup`). Each operator runs under its stage's name
(`pipe.stages`): an exception in one ends the loop as `StageFailed`, one line naming the stage,
with the original as its cause. A rollout never runs ahead of the trainer, so every step is
on-policy in time (tokens of version k are trained at version k) whatever `max_staleness` says;
numerics still differ between inference and training as configured.
`lag=S` (at most max_staleness) instead generates each step's rollout S steps ahead: step k's
tokens come from version max(0, k - S), the steady state of the asynchronous pipeline when
generation outpaces training, with a staleness fixed by construction rather than by the
machine's load (staleness studies that repeat exactly). Every stage before the train step runs
when its rollout is generated, as in the pipeline, where they follow generation: what they
read of the store is what it holds then (the critic's values come from the critic of that
time, `value_versions` S behind the trainer's).

Read it as the algorithm: per train step k,

    prompts   the step's prompt rows (a built-in task or your dataset)
    generate  sample group_size responses per prompt with version k's weights (inference numerics),
              each token's inference log-prob and version
    reward    score every response (the task's verifier or your function)
    old log-probs  (exact strategies) each token under its own version in training numerics
    advantage group-normalised rewards
    filter    drop what is not trained (zero-variance groups)
    train     the update (operators/train_step.py, operators/trainer/replica.py) and version k + 1
              published to the store: the next step's generate samples with it

The Ray pipeline (pipelines/rl_loop.py) runs the same stages as a stream, asynchronously, in
processes of their own; this loop is where to read, debug or step through the algorithm, and
what runs where Ray cannot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import pyarrow as pa

from trajflow.operators.contracts.stage import Stage
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.trainer.group import InProcessGroup, WorkerGroup
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.settings import check_number


def run_in_process(pipe: RLPipeline, final_weights: bool = False, *, steps: range | None = None,
                   store: PolicyStoreClient | None = None, workers: type[WorkerGroup] = InProcessGroup,
                   lag: int = 0):
    """Run `pipe`'s stages here for `steps` (default: all of `pipe.config.steps`); the metrics as
    a polars DataFrame (one row per step), and with `final_weights=True` also the last version's
    weights. `store`: a policy store holding the first step's version (default: a new in-process
    one with the model at `pipe.model_path` as version 0); `workers`: how the train step starts
    its data-parallel workers 1..N-1 (default: threads of this process); `lag`: generate each
    rollout that many steps ahead (module docstring)."""
    import polars as pl

    steps = range(pipe.config.steps) if steps is None else steps
    check_number("run_in_process", lag=lag)
    if not 0 <= lag <= pipe.config.max_staleness:
        raise ValueError(f"lag: {lag} must be in [0, max_staleness = {pipe.config.max_staleness}]")
    if store is None:
        store = InProcessStore(pipe.config.max_staleness, pipe.config.keeps_history(pipe.strategy))
        pipe.publish_start(store, steps.start)  # the model at model_path (and a critic's start)
    rows = [row for _, row in iter_in_process(pipe, store, steps, workers, lag)]
    metrics = pl.from_dicts(rows, infer_schema_length=None)
    if not final_weights:
        return metrics
    return metrics, {k: v.clone() for k, v in store.weights(steps.stop)[1].items()}


def iter_in_process(pipe: RLPipeline, store: PolicyStoreClient, steps: range,
                    workers: type[WorkerGroup] = InProcessGroup, lag: int = 0) -> Iterator[tuple[pa.Table, dict]]:
    """The loop itself: per step, the batch as it reached the train step and the step's metrics
    row; `lag`: each rollout generated that many steps ahead (module docstring). A stage that
    raises ends the loop with `StageFailed` naming it. Needs neither Ray nor polars
    (scripts/gpu_check.sh runs it where neither is installed)."""
    stages = [(stage.name, build(stage, store, workers)) for stage in pipe.stages]
    *rollout, train = stages  # generate -> reward -> ... -> filter, then the train step
    rollouts: deque = deque()  # generated, not yet trained (lag > 0: up to `lag` steps ahead)
    try:
        for step in steps:
            while len(rollouts) <= lag and step + len(rollouts) < steps.stop:
                # sampled with the newest version: the trainer's, `len(rollouts)` steps before its step
                batch = pipe.prompts.step_rows(step + len(rollouts))
                for stage in rollout:  # one Arrow table to the next
                    batch = run_stage(stage, batch)
                rollouts.append(batch)
            batch = rollouts.popleft()
            for row in run_stage(train, batch).to_pylist():  # the step's metrics row (none: nothing trained)
                yield batch, row
    finally:
        for _, operator in stages:  # a train step with data-parallel workers ends them
            if hasattr(operator, "close"):
                operator.close()


class StageFailed(RuntimeError):
    """A stage of the in-process loop raised: one line naming it; the original is `__cause__`."""


def run_stage(stage: tuple[str, Callable[[pa.Table], pa.Table]], batch: pa.Table) -> pa.Table:
    """`batch` through one named stage's operator; what it raises is re-raised as `StageFailed`
    naming the stage (the operators do not know their stage's name)."""
    name, operator = stage
    try:
        return operator(batch)
    except Exception as error:
        detail = str(error).strip().partition("\n")[0]
        raise StageFailed(f"stage {name!r} failed: {type(error).__name__}" + (f": {detail}" if detail else "")) from error


def build(stage: Stage, store: PolicyStoreClient,
          workers: type[WorkerGroup] = InProcessGroup) -> Callable[[pa.Table], pa.Table]:
    """The stage's operator: a class stage constructed as its actor would be (with `store=`;
    a train step's data-parallel workers from `workers`), a function stage as it is."""
    if not stage.is_actor:
        return stage.fn
    kwargs = {"store": store, **stage.kwargs}
    if "workers" in kwargs:
        kwargs["workers"] = workers
    return stage.fn(**kwargs)
