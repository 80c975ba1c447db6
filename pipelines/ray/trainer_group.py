"""The trainer's data-parallel workers 1..N-1 as Ray actors: `RayWorkerGroup`, the Ray
implementation of operators/trainer/group.py's `WorkerGroup` (the in-process one is beside the
protocol). The pipeline hands it to the train stage (`workers=`); the train step never imports Ray.
Ray itself is imported where it is used: the pipeline's stage list (which names this class) is
built where Ray is not installed too (the in-process loop, pipelines/local.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trajflow.operators.trainer.collective import Collective, listening_socket, this_node
from trajflow.operators.trainer.group import WorkerGroup
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.recovery import RESUME_HINT, TrainerStateLost
from trajflow.operators.trainer.replica import TrainerRank
from trajflow.pipelines.ray.embedded import remove_placement_group_named

if TYPE_CHECKING:
    import ray


def node_address() -> tuple[str, str]:
    """(node id, node IP) of this process's Ray node; outside Ray (an operator run in one
    process) the host name and the loopback address."""
    import ray

    if not ray.is_initialized():
        return this_node(), "127.0.0.1"
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class RayWorkerGroup(WorkerGroup):
    """Workers 1..N-1 of a train step as Ray actors, started and owned by worker 0 (the train-step actor).

    They run in a placement group of N-1 bundles of the trainer's resources: `pack` (PACK) or
    `spread` (STRICT_SPREAD, and none on worker 0's node). Worker 0 itself is where Ray Data
    placed the train stage. The rendezvous store listens on 127.0.0.1 when every worker is on
    worker 0's node, else on that node's IP. `close()` kills the workers and removes the
    placement group (when Ray Data ends the train step's actor gracefully, `StageGroup.__del__`
    calls it); if worker 0 dies, its workers die with it (Ray ties an actor to its owner) and the
    pipeline removes the placement group by name (`remove_leftover`).
    """

    def __init__(self, rank_kwargs: dict[str, Any], config: TrainerConfig, device: torch.device,
                 name: str = "") -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size, placement, timeout_seconds = config.num_workers, config.placement, config.collective_timeout_seconds
        num_cpus, num_gpus, resources = config.num_cpus, config.num_gpus, dict(config.resources)
        self.world_size = world_size
        self.node_id, node_ip = node_address()
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **resources}
        bundle = {k: v for k, v in bundle.items() if v}
        n = world_size - 1
        if placement == "spread":
            self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_SPREAD",
                                                   name=name,
                                                   bundle_label_selector=[{"ray.io/node-id": f"!{self.node_id}"}] * n)
        else:
            self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK",
                                                   name=name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_seconds)
        if not ready:
            self.close()
            where = "on nodes other than worker 0's, one per node" if placement == "spread" else ""
            raise RuntimeError(f"trainer.num_workers: {world_size} workers need {n} more bundles of {bundle} "
                               f"{where}; the cluster did not provide them within {timeout_seconds:.0f} s")
        remote = ray.remote(TrainerRank)
        self.ranks = [
            remote.options(num_cpus=num_cpus, num_gpus=num_gpus or None, resources=resources or None, max_restarts=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i - 1)
                           ).remote(rank=i, world_size=world_size, **rank_kwargs)
            for i in range(1, world_size)
        ]
        self.nodes = [self.node_id] + self._get([r.node_id.remote() for r in self.ranks], timeout_seconds)
        host = "127.0.0.1" if set(self.nodes) == {self.node_id} else node_ip
        listen = listening_socket(host)
        port = listen.getsockname()[1]
        joined = [r.join.remote(host, port, timeout_seconds) for r in self.ranks]
        self.collective = Collective(0, world_size, host=host, listen=listen, device=device,
                                     timeout_seconds=timeout_seconds, default_group=config.sharding == "fsdp")
        self._get(joined, timeout_seconds)

    def _start(self, method: Callable, args: list[tuple]) -> list[ray.ObjectRef]:
        # an actor's method handle carries the method's name: the one place it is looked up by it
        return [getattr(r, method.__name__).remote(*a) for r, a in zip(self.ranks, args)]

    def _get(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise self.lost(e) from None

    def results(self, pending: list[ray.ObjectRef], timeout: float | None = None) -> list:
        return self._get(pending, timeout)

    def lost(self, error: BaseException) -> TrainerStateLost:
        """The error that names the worker that is gone (or says the all-reduce failed)."""
        return self.dead_worker() or TrainerStateLost(
            f"the trainer's gradient all-reduce failed ({' '.join(str(error).split())[:200]}); the trainer's state "
            f"is inconsistent: {RESUME_HINT}")

    def dead_worker(self) -> TrainerStateLost | None:
        """A TrainerStateLost naming the first worker that no longer answers, if one does not."""
        import ray

        for rank, ref in enumerate((r.node_id.remote() for r in self.ranks), start=1):
            try:
                ray.get(ref, timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                node = self.nodes[rank][:12] if rank < len(self.nodes) else "?"
                return TrainerStateLost(f"trainer worker {rank} of {self.world_size} (node {node}) died; the "
                                        f"trainer's optimizer and strategy state is lost: {RESUME_HINT}")
        return None

    def failure(self, error: BaseException, refs: list[ray.ObjectRef]) -> BaseException:
        import ray

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
        import ray

        for r in getattr(self, "ranks", []):
            ray.kill(r)
        self.ranks = []
        if getattr(self, "collective", None) is not None:
            self.collective.close()
        if getattr(self, "placement_group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None

    @classmethod
    def remove_leftover(cls, name: str) -> None:
        remove_placement_group_named(name)
