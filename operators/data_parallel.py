"""Data-parallel training: how a step's rows are shared out, and the group of worker processes.

`trainer.num_workers: N` makes the train step a group of N workers joined in one
torch.distributed process group (gloo on CPU, NCCL on CUDA). Worker 0 is the train-step actor
that Ray Data streams the steps into; it starts workers 1..N-1 (`TrainerRank` actors, the same
update code) in a placement group, and per step

  1. plans the shards (`plan_shards`): the step's minibatches are cut exactly as one worker cuts
     them, each minibatch's rows are dealt to the workers balanced by padded tokens, and each
     worker's rows are cut into micro-batches of at most `max_tokens_per_microbatch`;
  2. sends every worker its rows (one Ray call per worker and step) and trains its own;
  3. every worker runs forward/backward on its micro-batches with the loss in *sum form*
     (denominator 1), then one all-reduce per optimizer update sums the gradients, the loss sums
     and the aggregation counts (`algorithms.loss_denominator`) of all workers; each divides by
     the global count and steps. So token-mean divides by the update's kept tokens, seq-mean by
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
`trainer/allreduce_seconds` metric measures its cost); DDP's overlap of communication with the
backward pass matters for large models on GPUs and is the next step there.

With `trainer.sharding: fsdp` (operators/fsdp.py) the workers hold 1/N of the parameters,
gradients and optimizer state each. The plan and the normalisation are the same; the gradients
are summed by FSDP's reduce-scatter during the backward passes instead of the flat all-reduce
(the loss sums and counts are still all-reduced once per update), and every worker runs the same
number of forward/backward passes per update (`plan_shards(lockstep=True)` pads a worker's
micro-batches with zero-weight dummy passes), since each pass of a sharded model is a collective.

A worker that dies (or does not join an all-reduce within `collective_timeout_seconds`) fails
the step with `TrainerStateLost`, naming the worker and its node: the group's optimizer and
strategy state is gone, and the run continues only by `--resume` from its last checkpoint.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch


class TrainerStateLost(RuntimeError):
    """The trainer's optimizer/strategy state is gone (a worker died or was restarted): the run
    cannot go on without restoring it from a checkpoint. The message is one line."""


RESUME_HINT = "restart from the last checkpoint with `trajflow run --resume RUN_DIR`"


@dataclass(frozen=True)
class DataParallel:
    """How the train step trains: its workers, their resources and micro-batches (the
    `trainer:` section of the config, which holds the defaults and documents each key:
    pipelines/config.py `TrainerConfig`)."""

    num_workers: int
    max_tokens_per_microbatch: int | None
    gradient_checkpointing: bool
    sharding: str  # "none" (a full replica per worker) | "fsdp" (operators/fsdp.py)
    cpu_offload: bool  # fsdp on CUDA: shards and optimizer state in host memory
    placement: str  # "pack" | "spread"
    collective_timeout_seconds: float
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    group_name: str  # the placement group's name: the pipeline removes it when the run ends


def remove_placement_group_named(name: str) -> None:
    """Remove this job's placement group `name` if it exists (the workers in it end with it).

    Worker 0 creates the group; a placement group outlives the actor that made it (it belongs
    to the job), so the pipeline that started the train step removes it by name at the end —
    also when the train step was killed and never got to `close()`."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    if not name:
        return
    try:
        group = get_placement_group(name)
    except ValueError:  # none by that name: never created, or already removed
        return
    remove_placement_group(group)


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


# -- the process group -------------------------------------------------------------------------
def choose_backend(device: torch.device | str) -> str:
    """The collective backend for a worker's device: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` at a free port (the rendezvous store's: bound here, so
    it listens on this address only, and no other process can take the port in between)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


class Collective:
    """One worker's membership of the group: a torch.distributed process group (gloo or NCCL)
    built directly on a TCP store, not the process-global default group, so a process may hold
    a trainer and a test or replay its own. World size 1: every operation is the identity.

    `default_group` (a sharded trainer, operators/fsdp.py): the group is torch.distributed's
    default group instead, initialised on the same store (at world size 1 too), because FSDP's
    DeviceMesh accepts only a registered group; `mesh` is then the 1-D mesh over it, and
    `close()` destroys it. One such group per process."""

    def __init__(self, rank: int = 0, world_size: int = 1, *, host: str = "127.0.0.1", port: int = 0,
                 device: torch.device | str = "cpu", timeout_seconds: float = 300.0,
                 listen: socket.socket | None = None, default_group: bool = False) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.group = None
        self.default_group = default_group
        if world_size == 1 and not default_group:
            return
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_seconds)
        if world_size == 1:
            self._store = dist.HashStore()
        elif rank == 0:
            assert listen is not None, "worker 0 serves the rendezvous store on its listening socket"
            self._store = dist.TCPStore(host, listen.getsockname()[1], world_size=world_size, is_master=True,
                                        master_listen_fd=listen.fileno(), wait_for_workers=False, timeout=timeout)
            listen.detach()  # the store owns the descriptor now (and closes it)
        else:
            self._store = dist.TCPStore(host, port, world_size=world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore("trajflow_trainer", self._store)
        nccl = choose_backend(self.device) == "nccl"
        if nccl:
            options = dist.ProcessGroupNCCL.Options()
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        if not default_group:
            self.group = (dist.ProcessGroupNCCL if nccl else dist.ProcessGroupGloo)(store, rank, world_size, options)
            return
        from trajflow.operators.fsdp import register_bound_gloo

        if dist.is_initialized():
            raise RuntimeError("this process already holds torch.distributed's default group: one sharded "
                               "trainer per process")
        device_id = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        dist.init_process_group("nccl" if nccl else register_bound_gloo(), store=store, rank=rank,
                                world_size=world_size, timeout=timeout, pg_options=options, device_id=device_id)
        self.group = dist.group.WORLD

    @property
    def mesh(self):
        """The 1-D DeviceMesh over the default group (`default_group` only), on this device's type."""
        from torch.distributed.device_mesh import DeviceMesh

        assert self.default_group, "a mesh needs the default group (Collective(default_group=True))"
        return DeviceMesh.from_group(self.group, self.device.type)

    def all_reduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum `flat` (one tensor) over the workers, in place; returns it."""
        if self.world_size > 1:
            self.group.allreduce([flat]).wait()
        return flat

    def all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor from every worker (lengths may differ), concatenated in rank order."""
        if self.world_size == 1:
            return values
        device = values.device
        values = values.to(self.device)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        sizes[self.rank] = values.numel()
        self.all_reduce_sum(sizes)
        padded = torch.zeros(int(sizes.max()), dtype=values.dtype, device=self.device)
        padded[: values.numel()] = values
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.group.allgather([gathered], [padded]).wait()
        return torch.cat([g[: int(n)] for g, n in zip(gathered, sizes.tolist())]).to(device)

    def close(self) -> None:
        if self.default_group and self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        self.group = None
        self._store = None


def node_address() -> tuple[str, str]:
    """(node id, node IP) of this process's Ray node; outside Ray (an operator run in one
    process) the host name and the loopback address."""
    if not ray.is_initialized():
        return f"local:{socket.gethostname()}", "127.0.0.1"
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


# -- the group of workers, seen from worker 0 ---------------------------------------------------
class TrainerGroup:
    """Workers 1..N-1 of a train step, started and owned by worker 0 (the train-step actor).

    They run in a placement group of N-1 bundles of the trainer's resources: `pack` (PACK) or
    `spread` (STRICT_SPREAD, and none on worker 0's node). Worker 0 itself is where Ray Data
    placed the train stage. The rendezvous store listens on 127.0.0.1 when every worker is on
    worker 0's node, else on that node's IP. `close()` kills the workers and removes the
    placement group (when Ray Data ends the train step's actor gracefully, `StageGroup.__del__`
    calls it); if worker 0 dies, its workers die with it (Ray ties an actor to its owner) and the
    pipeline removes the placement group by name (`remove_placement_group_named`).
    """

    def __init__(self, rank_class: type, rank_kwargs: dict[str, Any], spec: DataParallel,
                 device: torch.device) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size, placement, timeout_seconds = spec.num_workers, spec.placement, spec.collective_timeout_seconds
        num_cpus, num_gpus, resources = spec.num_cpus, spec.num_gpus, dict(spec.resources)
        self.world_size = world_size
        self.node_id, node_ip = node_address()
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **resources}
        bundle = {k: v for k, v in bundle.items() if v}
        n = world_size - 1
        if placement == "spread":
            self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_SPREAD",
                                                   name=spec.group_name,
                                                   bundle_label_selector=[{"ray.io/node-id": f"!{self.node_id}"}] * n)
        else:
            self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK",
                                                   name=spec.group_name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_seconds)
        if not ready:
            self.close()
            where = "on nodes other than worker 0's, one per node" if placement == "spread" else ""
            raise RuntimeError(f"trainer.num_workers: {world_size} workers need {n} more bundles of {bundle} "
                               f"{where}; the cluster did not provide them within {timeout_seconds:.0f} s")
        remote = ray.remote(rank_class)
        self.ranks = [
            remote.options(num_cpus=num_cpus, num_gpus=num_gpus or None, resources=resources or None, max_restarts=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i - 1)
                           ).remote(rank=i, world_size=world_size, **rank_kwargs)
            for i in range(1, world_size)
        ]
        self.nodes = [self.node_id] + self._call_all("node_id", timeout_seconds)
        host = "127.0.0.1" if set(self.nodes) == {self.node_id} else node_ip
        listen = listening_socket(host)
        port = listen.getsockname()[1]
        joined = [r.join.remote(host, port, timeout_seconds) for r in self.ranks]
        self.collective = Collective(0, world_size, host=host, listen=listen, device=device,
                                     timeout_seconds=timeout_seconds, default_group=spec.sharding == "fsdp")
        self._get(joined, timeout_seconds)

    def submit(self, method: str, *args) -> list[ray.ObjectRef]:
        """Call `method(rank_args...)` on every worker 1..N-1; args[i] is a list: worker i+1's."""
        return [getattr(r, method).remote(*(a[i] for a in args)) for i, r in enumerate(self.ranks)]

    def _call_all(self, method: str, timeout: float) -> list:
        return self._get([getattr(r, method).remote() for r in self.ranks], timeout)

    def _get(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list:
        try:
            return ray.get(refs, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise self.lost(e) from None

    def get(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list:
        return self._get(refs, timeout)

    def lost(self, error: BaseException) -> TrainerStateLost:
        """The error that names the worker that is gone (or says the all-reduce failed)."""
        return self.dead_worker() or TrainerStateLost(
            f"the trainer's gradient all-reduce failed ({' '.join(str(error).split())[:200]}); the trainer's state "
            f"is inconsistent: {RESUME_HINT}")

    def dead_worker(self) -> TrainerStateLost | None:
        """A TrainerStateLost naming the first worker that no longer answers, if one does not."""
        for rank, ref in enumerate((r.node_id.remote() for r in self.ranks), start=1):
            try:
                ray.get(ref, timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                node = self.nodes[rank][:12] if rank < len(self.nodes) else "?"
                return TrainerStateLost(f"trainer worker {rank} of {self.world_size} (node {node}) died; the "
                                        f"trainer's optimizer and strategy state is lost: {RESUME_HINT}")
        return None

    def failure(self, error: BaseException, refs: list[ray.ObjectRef]) -> BaseException:
        """What worker 0's failed update should raise: a dead worker named; else the error a
        worker raised itself (it left the all-reduce that failed here); else `error`."""
        dead = self.dead_worker()
        if dead is not None:
            return dead
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as worker_error:  # a worker's own exception, e.g. its strategy refused the rows
                return worker_error
        return error

    def close(self) -> None:
        for r in getattr(self, "ranks", []):
            ray.kill(r)
        self.ranks = []
        if getattr(self, "collective", None) is not None:
            self.collective.close()
        if getattr(self, "placement_group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
