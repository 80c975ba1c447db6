"""Data-parallel training: how a step's rows are shared out among the workers.

`trainer.num_workers: N` makes the train step a group of N workers joined in one
torch.distributed process group (gloo on CPU, NCCL on CUDA; operators/trainer/collective.py).
Worker 0 is the train-step operator the pipeline streams the steps into; it starts workers
1..N-1 (`TrainerRank`, the same update code) through a worker group (operators/trainer/group.py:
threads of this process, or Ray actors in a placement group, pipelines/ray/trainer_group.py),
and per step

  1. plans the shards (`plan_shards`): the step's minibatches are cut exactly as one worker cuts
     them, each minibatch's rows are dealt to the workers balanced by padded tokens, and each
     worker's rows are cut into micro-batches of at most `max_tokens_per_microbatch`;
  2. sends every worker its rows (one call per worker and step) and trains its own;
  3. every worker runs forward/backward on its micro-batches with the loss in *sum form*
     (`LossOutput.loss_sum`, with its aggregation count `LossOutput.count`), then one all-reduce
     per optimizer update sums the gradients, the loss sums and the counts of all workers; each
     divides once by the global count (`algorithms.objective.LossSum`) and steps. So token-mean divides by the update's kept tokens, seq-mean by
     its sequences and token-sum by its rows, whatever the split: N workers and any micro-batch
     budget give the update one worker with one batch gives (tests/test_trainer_dp.py);
  4. gathers the workers' per-token results and computes the step's diagnostics once; the
     strategy's after-step hook then runs on every worker with those global diagnostics (EWMA's
     reset decision is the same everywhere).

Why a flat all-reduce and not DDP: the loss's denominator is only known after every
micro-batch's forward pass (the r_d mask and the sampling-support filter decide which tokens
count), so gradients must be scaled after the reduction anyway, a worker may have no rows in an
update (DDP would need a dummy forward), and micro-batch accumulation would need `no_sync`. One
all-reduce of one flat buffer per update does all of it with the collective torch ships (the
`seconds/allreduce` metric measures its cost); DDP's overlap of communication with the
backward pass matters for large models on GPUs and is the next step there.

With `trainer.sharding: fsdp` (operators/trainer/fsdp.py) the workers hold 1/N of the parameters,
gradients and optimizer state each. The plan and the normalisation are the same; the gradients
are summed by FSDP's reduce-scatter during the backward passes instead of the flat all-reduce
(the loss sums and counts are still all-reduced once per update), and every worker runs the same
number of forward/backward passes per update (`plan_shards(lockstep=True)` pads a worker's
micro-batches with zero-weight dummy passes), since each pass of a sharded model is a collective.

A worker that dies (or does not join an all-reduce within `collective_timeout_seconds`) fails
the step with `TrainerStateLost`, naming the worker and its node: the group's optimizer and
strategy state is gone. Worker 0 then starts a new group (sharded: every worker, itself
included, from an unsharded model sharded again) and rebuilds the state from the last checkpoint
and the trajectory log (operators/trainer/recovery.py), up to `recovery.max_restarts` times;
past that, the run continues only by `--resume` from its last checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from trajflow.operators.contracts.stage import ResourceConfig
from trajflow.settings import fail, setting


@dataclass(frozen=True)
class TrainerConfig(ResourceConfig):
    """The train step (the `trainer:` section): the resources of each worker, as for any stage,
    and its data-parallel group. Each worker trains on CUDA when its resources include a GPU (Ray
    then makes one visible to it), else on the CPU; bf16 autocast comes from
    `optimizer.mixed_precision`."""

    num_workers: int = setting(
        1, "data-parallel workers (one torch.distributed group: gloo on CPU, NCCL on CUDA); losses are "
        "normalised over all of them, so N workers give the one-worker update", ge=1)
    max_tokens_per_microbatch: int | Literal["auto"] | None = setting(
        "auto", "padded tokens (rows x longest prompt+response) per forward/backward; gradients accumulate over "
        "the micro-batches of an update (null: one micro-batch per minibatch and worker; auto: what fits an "
        "eighth of the machine's memory, null if the largest update does: pipelines/config/auto.py)", ge=1)
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass (less memory)")
    sharding: Literal["none", "fsdp"] = setting(
        "none", "none: a full replica per worker; fsdp: parameters, gradients and optimizer state sharded over "
        "the workers (torch FSDP2, operators/trainer/fsdp.py)")
    cpu_offload: bool = setting(
        False, "fsdp on CUDA: shards, gradients and optimizer state in host memory, each layer copied to the "
        "GPU to compute (no effect on CPU workers)")
    placement: Literal["pack", "spread"] = setting(
        "pack", "workers 1..N-1: pack (fewest nodes) or spread (each on a node other than worker 0's)")
    collective_timeout_seconds: float = setting(
        300.0, "a worker that does not join a gradient all-reduce within this fails the step", gt=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cpu_offload and self.sharding != "fsdp":
            fail(self, "cpu_offload", "needs sharding: fsdp (a replicated worker keeps its state on its device)")


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPlan:
    """What each worker trains in one step: `microbatches[rank][m]` lists the micro-batches of
    minibatch m on that worker, each as row positions in the step's trained rows."""

    microbatches: list[list[list[list[int]]]]  # an empty micro-batch: a zero-weight dummy pass (lockstep)

    def rows(self, rank: int) -> list[int]:
        """The step rows worker `rank` trains, in the order its micro-batches list them."""
        return [row for minibatch in self.microbatches[rank] for micro in minibatch for row in micro]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches with rows (dummy passes not counted)."""
        return sum(bool(micro) for worker in self.microbatches for minibatch in worker for micro in minibatch)


def padded_tokens(lengths: np.ndarray) -> int:
    """The cost of one forward pass: rows x the longest prompt + response among them."""
    return int(len(lengths) * lengths.max()) if len(lengths) else 0


def plan_shards(lengths: np.ndarray, minibatches: int, world_size: int,
                max_tokens_per_microbatch: int | None, lockstep: bool = False) -> ShardPlan:
    """Deal rows (`lengths`: prompt + response tokens per row) to workers and micro-batches.

    Minibatches are `np.array_split` of the rows in order (as one worker cuts them). Within a
    minibatch, rows go longest first to the worker with the fewest tokens so far (ties: the
    lower rank), so workers finish together; a worker keeps its rows in step order. Its rows are
    then cut, in order, into micro-batches whose padded tokens stay within the budget (a row
    over the budget alone forms one). `lockstep` (sharded workers): every worker gets as many
    micro-batches per minibatch as the busiest, the missing ones empty (dummy passes).
    Deterministic: a pure function of its arguments.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    plan: list[list[list[list[int]]]] = [[] for _ in range(world_size)]
    for chunk in np.array_split(np.arange(len(lengths)), minibatches):
        load = np.zeros(world_size, dtype=np.int64)
        dealt: list[list[int]] = [[] for _ in range(world_size)]
        for row in sorted(chunk.tolist(), key=lambda r: (-lengths[r], r)):
            rank = int(np.argmin(load))
            dealt[rank].append(row)
            load[rank] += lengths[row]
        cut = [_microbatches(sorted(rows), lengths, max_tokens_per_microbatch) for rows in dealt]
        passes = max(len(micro) for micro in cut) if lockstep else 0
        for rank in range(world_size):
            plan[rank].append(cut[rank] + [[] for _ in range(passes - len(cut[rank]))])
    return ShardPlan(plan)


def _microbatches(rows: list[int], lengths: np.ndarray, budget: int | None) -> list[list[int]]:
    if budget is None:
        return [rows] if rows else []
    out: list[list[int]] = []
    for row in rows:
        if out and padded_tokens(lengths[out[-1] + [row]]) <= budget:
            out[-1].append(row)
        else:
            out.append([row])
    return out
