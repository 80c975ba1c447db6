"""How a new weight version reaches its readers: the `weight_sync:` section and its transports.

`object_store`: the train step publishes the version's tensors to the policy store and each
reader fetches them (`StoreWeights`, operators/trainer/weight_receiver.py). `collective`: the store still numbers the versions and
enforces the staleness bound (the trainer `register`s each one), but the tensors go from the
trainer straight to each reader over torch.distributed (gloo on CPU, NCCL on CUDA), in flat
buckets of about `bucket_mb`, cast on the trainer's side to the dtype the reader computes in
(`reader_dtype`: bf16 for a bf16 generator, float32 for the exact scorers and for `interrupt`'s
generator, which scores prefixes under the training numerics) — no float32 copy in the store.

Trainer side (`WeightServer`, operators/trainer/weight_server.py, in the train step's process): a
TCP store whose address the policy store hands to readers, and one thread that serves joins and
sends versions. It listens on 127.0.0.1 when the Ray cluster is this one node, else on the
trainer node's address as Ray reports it (never 0.0.0.0), and each reader binds its end to its
own interface toward it (operators/trainer/addresses.py). `offer()`
gathers the full tensors (under FSDP one tensor at a time, every worker in step) into one set of
flat buckets per reader dtype, kept until the next version, so a reader that joins late (Ray Data
re-creates actors on each dataset execution; a pool holds several readers) is sent the current
version at once. A version is registered in the policy store only once every joined reader has
it: a reader that finds version v in the store holds v (or a newer one). The run's starting
version is the one the store holds (the driver published it): readers take it there, without
waiting for the trainer to start.

Reader side (`WeightReceiver`, operators/trainer/weight_receiver.py, in a generator's or scorer's process): a thread that joins and
receives every version into memory, keeping the newest one (a generator) or the staleness window
v-S..v (an exact scorer: `snapshot` and `dedicated` score tokens of older versions) in host
memory, in float32: (S+1) x 4 bytes per parameter per scorer (`held_bytes()`).

Each reader has its own two-member group (trainer rank 0, reader rank 1) under a fresh prefix per
join, so a recreated reader joins again instead of wedging a fixed-size group. Between versions a
reader waits on a key of the TCP store (announce, then transfer). Every collective waits at most
`timeout_seconds`: a peer lost mid-transfer is a `WeightSyncError` (one line), never a hang. A
reader that ends (`close()`, also at its process's exit: Ray Data ends a finished stage's actors)
leaves first, and the trainer stops sending to it. One that vanishes without leaving (its process
died) is dropped and counted (`weight_sync_readers_lost`): the other readers get the version, the
store registers it, and Ray's restart of the reader's process joins again as a late joiner.

A trainer that dies takes its server along; readers keep the versions they hold. The policy store
numbers each server started (`ServerAddress.generation`): a reader that loses its server (between
versions or mid-transfer, the partial version dropped) joins the next one, which a trainer
rebuilt from its checkpoint (operators/trainer/recovery.py) starts, and which first serves the
version the rebuilt trainer recovered. A reader that needs a version no server delivers within
`timeout_seconds` fails with one line naming the lost trainer.

This module holds what both ends share: the section, the buckets, the two-member channel.
Torch is imported inside functions: validating a job config must not import it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from trajflow.operators.trainer.addresses import LOOPBACK
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class WeightSyncConfig:
    """How each new weight version reaches the generators and scorers (the `weight_sync:` section)."""

    method: Literal["object_store", "collective"] = setting(
        "object_store", "object_store: versions travel as tensors through the policy store; collective: the "
        "trainer sends them to each reader over torch.distributed (gloo on CPU, NCCL on CUDA), in the reader's dtype")
    bucket_mb: float = setting(64.0, "collective: size of each flat buffer sent (MiB); a tensor larger than it "
                               "travels alone", gt=0.0)
    timeout_seconds: float = setting(120.0, "collective: how long a join or transfer may take (a reader lost "
                                     "mid-transfer is dropped; its restart joins again) and how long a reader waits "
                                     "for a version it needs (then the run stops with one line)", gt=0.0)

    def __post_init__(self) -> None:
        check_settings(self)


class WeightSyncError(RuntimeError):
    """A transfer failed (peer lost, timeout); the message is one `trajflow: ...` line."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: its tensors in order, at consecutive offsets."""

    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def bucket_layout(weights: Mapping[str, Tensor], bucket_bytes: int, element_size: int) -> list[Bucket]:
    """The payload cut into buckets of at most `bucket_bytes` (a larger tensor: a bucket of its own),
    in the mapping's order (both sides derive the same layout from the same names and shapes)."""
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    size = 0
    for name, tensor in weights.items():
        spec = TensorSpec(name, tuple(tensor.shape), tensor.numel())
        nbytes = spec.numel * element_size
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current)))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


def unpack(flat: Tensor, bucket: Bucket) -> dict[str, Tensor]:
    """The bucket's tensors, views into `flat`."""
    out, offset = {}, 0
    for t in bucket.tensors:
        out[t.name] = flat[offset:offset + t.numel].view(t.shape)
        offset += t.numel
    return out


def reader_dtype(inference_dtype: str, exact: bool) -> str:
    """The dtype a reader receives versions in: float32 where it scores under the training numerics
    (`exact`: float32 parameters, bf16 autocast or not) or samples in float32, else bfloat16 (an
    fp8 engine quantises from it)."""
    return "float32" if exact or inference_dtype == "float32" else "bfloat16"


def element_size(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def backend_for(device: str) -> str:
    """The torch.distributed backend of a link whose tensors live on `device`."""
    return "nccl" if device.startswith("cuda") else "gloo"


def link_device(mine: str, other: str) -> str:
    """Where a trainer -> reader link's buffers live on this end (device `mine`, the other end on
    `other`): this GPU (NCCL) when both ends are on CUDA, else host memory (gloo; a GPU end copies
    each bucket to or from the host)."""
    return mine if mine.startswith("cuda") and other.startswith("cuda") else "cpu"


class CollectiveChannel:
    """A two-member torch.distributed group (rank 0: trainer, rank 1: reader) on `store` (the
    trainer's TCP store, under a prefix of its own: `prefix` names this join in messages); this
    end's gloo sockets bind to `bind` (collective.py `local_address`).

    Each transfer is announced on the store (key `announce/<n>`: the version), then sent: the
    version number as a header (a reader that expected another version fails instead of loading
    the wrong weights), the buckets, and the reader's receipt (the version back)."""

    def __init__(self, *, rank: int, store, prefix: str, dtype: torch.dtype, bucket_mb: float,
                 timeout_seconds: float, device: str = "cpu", bind: str = LOOPBACK) -> None:
        import torch.distributed as dist

        self.rank, self.dtype, self.device = rank, dtype, device
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout = timedelta(seconds=timeout_seconds)
        self.prefix = prefix
        self.transfers = 0  # announced (trainer) or taken (reader) so far
        self._store = store
        try:
            if backend_for(device) == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._group = dist.ProcessGroupNCCL(store, rank, 2, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
                options._timeout = self.timeout
                self._group = dist.ProcessGroupGloo(store, rank, 2, options)
        except (RuntimeError, TimeoutError) as error:
            raise WeightSyncError(self._line(f"join failed: {first_line(error)}")) from error

    def _line(self, what: str) -> str:
        side = "trainer" if self.rank == 0 else "reader"
        return (f"trajflow: weight_sync ({self.prefix}, {side} side): {what} "
                f"(weight_sync.timeout_seconds={self.timeout.total_seconds():g})")

    def _broadcast(self, tensor: Tensor, what: str, root: int = 0) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        options.timeout = self.timeout
        try:
            if not self._group.broadcast([tensor], options).wait(self.timeout):
                raise WeightSyncError(self._line(f"{what}: timed out"))
        except (RuntimeError, dist.DistError) as error:
            if isinstance(error, WeightSyncError):
                raise
            raise WeightSyncError(self._line(f"{what}: peer lost ({first_line(error)})")) from error

    def send(self, version: int, buffers: Sequence[Tensor]) -> None:
        """Trainer side: deliver `version`, packed (the buckets of `bucket_layout`, in this dtype);
        returns once the reader confirmed it (WeightSyncError)."""
        import torch

        self._store.set(f"announce/{self.transfers}", str(version))
        self.transfers += 1
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device), "version header")
        for i, flat in enumerate(buffers):
            self._broadcast(flat.to(self.device), f"bucket {i} of version {version}")
        # a send completes once in the socket's buffers: the reader confirms it holds the version
        receipt = torch.empty(1, dtype=torch.int64, device=self.device)
        self._broadcast(receipt, f"receipt of version {version}", root=1)
        if int(receipt.item()) != version:
            raise WeightSyncError(self._line(f"the reader confirmed version {int(receipt.item())}, not {version}"))

    def next_version(self, stop: threading.Event) -> int | None:
        """Reader side: wait for the next announced version (None once `stop` is set). Waiting
        between versions is not a transfer: it may last longer than a timeout (a slow train step),
        so a wait that times out is repeated; a trainer that is gone is a WeightSyncError."""
        import torch.distributed as dist

        key = f"announce/{self.transfers}"
        while not stop.is_set():
            try:
                self._store.wait([key], self.timeout)
            except dist.DistStoreError:  # not yet announced
                continue
            except (RuntimeError, dist.DistError) as error:
                raise WeightSyncError(self._line(f"trainer lost ({first_line(error)})")) from error
            self.transfers += 1
            version = int(self._store.get(key))
            return version if version >= 0 else None  # -1: the reader's own close() woke it
        return None

    def receive(self, version: int, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Reader side: the tensors of `version`, named and shaped like `like`, in this dtype."""
        import torch

        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self._broadcast(header, "version header")
        if int(header.item()) != version:
            raise WeightSyncError(self._line(f"expected version {version}, the trainer sent {int(header.item())}"))
        out: dict[str, Tensor] = {}
        for i, bucket in enumerate(bucket_layout(like, self.bucket_bytes, element_size(self.dtype))):
            flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self._broadcast(flat, f"bucket {i} of version {version}")
            out.update(unpack(flat, bucket))
        self._broadcast(header, f"receipt of version {version}", root=1)
        return out


def first_line(error: BaseException) -> str:
    """The error's first sentence, without a leading `[file.cc:123]` source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.splitlines()[0].split(". ")[0] if text else type(error).__name__


@dataclass(frozen=True)
class ServerAddress:
    """What the policy store tells a joining reader: where the trainer serves versions, the
    staleness bound (how many versions an exact scorer keeps), and which server it is (the
    count of servers started: a trainer rebuilt after a fault serves as the next one)."""

    host: str
    port: int
    max_staleness: int
    generation: int = 1
