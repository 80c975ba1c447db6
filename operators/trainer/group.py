"""Workers 1..N-1 of a data-parallel train step as worker 0 sees them: the `WorkerGroup`.

Worker 0 (the train step, operators/train_step.py) reaches every other worker through typed
methods — `update`, `full_weights_of`, `save_shards`, ... — each of which starts the method of the
same name of `TrainerRank` on workers 1..N-1 and returns at once (the collectives inside need
every worker at the same time, worker 0 included); `results()` waits for their values. Two
implementations, chosen by the pipeline (the train stage's `workers=`), so the train step never
imports Ray:

    InProcessGroup   threads of this process (one per worker): no Ray needed; the in-process
                     loop (pipelines/local.py) and the tests use it
    RayWorkerGroup   Ray actors in a placement group, on any node (pipelines/ray/trainer_group.py)

A worker that dies, or leaves an all-reduce, fails the step with `TrainerStateLost` (one line
naming it): the group's optimizer and strategy state is gone; operators/trainer/recovery.py
rebuilds it when it can, else the run goes on only by `--resume`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from trajflow.operators.trainer.collective import Collective, listening_socket, this_node
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.replica import ShardWork, TrainerRank

if TYPE_CHECKING:
    import torch


Pending = list  # the started calls of one method, one per worker 1..N-1 (opaque to the caller)


class WorkerGroup(ABC):
    """Workers 1..N-1, started by worker 0 from `rank_kwargs` (TrainerRank's store, spec and
    version) with the `trainer:` section's resources, and joined with it in one process group
    (`collective`: worker 0's membership). `name`: what the group's resources are known by (a Ray
    placement group's name)."""

    world_size: int
    nodes: list[str]  # the node of each worker, by rank (worker 0 first)
    collective: Collective

    @abstractmethod
    def __init__(self, rank_kwargs: dict[str, Any], config: TrainerConfig, device: torch.device,
                 name: str = "") -> None: ...

    # -- the typed calls: TrainerRank's method of the same name on workers 1..N-1 -----------------
    def update(self, work: Sequence[ShardWork]) -> Pending:
        """Each worker trains its share of the step (`work[i]`: worker i + 1's)."""
        return self._start(TrainerRank.update, [(w,) for w in work])

    def critic_values(self, prompts: list, responses: list, width: int) -> Pending:
        return self._on_each(TrainerRank.critic_values, prompts, responses, width)

    def full_weights_of(self, name: str, dtype: torch.dtype | None) -> Pending:
        return self._on_each(TrainerRank.full_weights_of, name, dtype)

    def payload_of(self, name: str) -> Pending:
        return self._on_each(TrainerRank.payload_of, name)

    def save_shards(self, name: str, directory: str) -> Pending:
        return self._on_each(TrainerRank.save_shards, name, directory)

    def load_shards(self, name: str, directory: str) -> Pending:
        return self._on_each(TrainerRank.load_shards, name, directory)

    def load_checkpoint_state(self, name: str, optimizer: dict | None, extra: dict | None) -> Pending:
        return self._on_each(TrainerRank.load_checkpoint_state, name, optimizer, extra)

    def load_checkpoint(self, directory: str, version: int) -> Pending:
        return self._on_each(TrainerRank.load_checkpoint, directory, version)

    def finish_step(self, diagnostics: dict, trained_policy: bool) -> Pending:
        return self._on_each(TrainerRank.finish_step, diagnostics, trained_policy)

    def advance_version(self) -> Pending:
        return self._on_each(TrainerRank.advance_version)

    def _on_each(self, method: Callable, *args: Any) -> Pending:
        return self._start(method, [args] * (self.world_size - 1))

    # -- what an implementation provides ----------------------------------------------------------
    @abstractmethod
    def _start(self, method: Callable, args: list[tuple]) -> Pending:
        """Start `method(worker, *args[i])` on worker i + 1, for every worker; return at once."""

    @abstractmethod
    def results(self, pending: Pending, timeout: float | None = None) -> list:
        """The started calls' values, by rank; TrainerStateLost when a worker is gone, or the
        exception a worker raised itself."""

    @abstractmethod
    def failure(self, error: BaseException, pending: Pending) -> BaseException:
        """What worker 0's failed part of a collective call should raise: a dead worker named,
        else the error a worker raised itself (it left the collective that failed here), else
        `error`."""

    @abstractmethod
    def close(self) -> None:
        """End workers 1..N-1 and leave the process group."""

    @classmethod
    def remove_leftover(cls, name: str) -> None:
        """Free what a dead worker 0's group named `name` may still hold (a restarted train step
        calls it before starting its own group)."""


class InProcessGroup(WorkerGroup):
    """Workers 1..N-1 as objects of this process, each called on a thread of its own (one call at
    a time per worker, in order), joined over gloo (NCCL on CUDA) on 127.0.0.1.

    Replicated workers only: a sharded worker (FSDP) holds torch.distributed's default group,
    of which a process has one; `trainer.sharding: fsdp` with several workers needs Ray."""

    def __init__(self, rank_kwargs: dict[str, Any], config: TrainerConfig, device: torch.device,
                 name: str = "") -> None:
        if config.sharding == "fsdp":
            raise ValueError("trainer.sharding: fsdp with several workers needs a process per worker (the Ray "
                             "pipeline); in one process use trainer.sharding: none")
        self.world_size = config.num_workers
        self.timeout = config.collective_timeout_seconds
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"trajflow-trainer-{rank}")
                         for rank in range(1, self.world_size)]
        built = [t.submit(TrainerRank, rank=rank, world_size=self.world_size, **rank_kwargs)
                 for rank, t in enumerate(self._threads, start=1)]
        self.ranks = [f.result() for f in built]
        self.nodes = [this_node()] * self.world_size
        listen = listening_socket("127.0.0.1")
        port = listen.getsockname()[1]
        joined = self._start(TrainerRank.join, [("127.0.0.1", port, self.timeout)] * len(self.ranks))
        self.collective = Collective(0, self.world_size, host="127.0.0.1", listen=listen, device=device,
                                     timeout_seconds=self.timeout)
        self.results(joined, self.timeout)

    def _start(self, method: Callable, args: list[tuple]) -> Pending:
        return [t.submit(method, rank, *a) for t, rank, a in zip(self._threads, self.ranks, args)]

    def results(self, pending: Pending, timeout: float | None = None) -> list:
        return [f.result(timeout) for f in pending]

    def failure(self, error: BaseException, pending: Pending) -> BaseException:
        done, _ = wait(pending, timeout=5)
        for future in (f for f in pending if f in done):
            if future.exception() is not None:
                return future.exception()
        return error

    def close(self) -> None:
        for rank in getattr(self, "ranks", []):
            rank.collective.close()
        self.ranks = []
        for thread in getattr(self, "_threads", []):
            thread.shutdown(wait=False)
        self._threads = []
        if getattr(self, "collective", None) is not None:
            self.collective.close()
