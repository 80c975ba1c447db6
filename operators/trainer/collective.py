"""A data-parallel worker's membership of the trainer's process group (torch.distributed: gloo
on CPU, NCCL on CUDA), built directly on a TCP store so a process may hold several.
"""

from __future__ import annotations

import datetime
import socket
import sys

import torch

from trajflow.operators.trainer.addresses import local_address


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

    `default_group` (a sharded trainer, operators/trainer/fsdp.py): the group is torch.distributed's
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
            # this worker's own sockets: loopback, or its interface toward the rendezvous host
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host))]
        options._timeout = timeout
        if not default_group:
            self.group = (dist.ProcessGroupNCCL if nccl else dist.ProcessGroupGloo)(store, rank, world_size, options)
            return
        from trajflow.operators.trainer.fsdp import register_bound_gloo

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


def this_node() -> str:
    """The node this process runs on: Ray's node id inside a Ray process, else `local:HOSTNAME`
    (an operator run in one process). Never starts Ray."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return f"local:{socket.gethostname()}"
