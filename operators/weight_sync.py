"""How a new weight version reaches its readers: the `weight_sync:` section and its transports.

`object_store`: the train step publishes the version's tensors to the policy store and each
reader fetches them (operators/store.py). `collective`: the store still assigns the version
number and enforces the staleness bound, but the tensors go from the trainer straight to each
reader over torch.distributed (gloo on CPU, NCCL on CUDA), in flat buckets of about `bucket_mb`,
cast on the trainer's side to the dtype the reader computes in — no float32 copy in the store.

Each reader has its own two-member group (trainer rank 0, reader rank 1) rendezvousing on a
127.0.0.1 TCP store under a fresh prefix per join: a reader that Ray recreates joins again under
a new prefix instead of wedging a fixed-size group. Every collective waits at most
`timeout_seconds`; a peer lost mid-transfer is a `WeightSyncError` (one line), never a hang.

The payload is any Mapping[str, Tensor] (full weights or a LoRA adapter's state dict): the
bucket layout carries names, shapes and dtypes, so the receiver needs nothing else.

Torch is imported inside functions: validating a job config must not import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, Protocol

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
    timeout_seconds: float = setting(120.0, "collective: a join or transfer that does not finish within this "
                                     "stops the run with one line", gt=0.0)

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


def pack(weights: Mapping[str, Tensor], bucket: Bucket, dtype: torch.dtype) -> Tensor:
    """The bucket's tensors as one contiguous buffer in `dtype` (the reader's compute dtype)."""
    import torch

    return torch.cat([weights[t.name].detach().reshape(-1).to(dtype) for t in bucket.tensors])


def unpack(flat: Tensor, bucket: Bucket) -> dict[str, Tensor]:
    """The bucket's tensors, views into `flat`."""
    out, offset = {}, 0
    for t in bucket.tensors:
        out[t.name] = flat[offset:offset + t.numel].view(t.shape)
        offset += t.numel
    return out


def payload_bytes(weights: Mapping[str, Tensor], dtype: torch.dtype) -> int:
    """Bytes one version occupies in `dtype` (what a reader holds per version of history)."""
    return sum(t.numel() for t in weights.values()) * _element_size(dtype)


class WeightChannel(Protocol):
    """One trainer -> reader link as the train step and a reader see it."""

    def send(self, version: int, weights: Mapping[str, Tensor]) -> None:
        """Trainer side: deliver `version` (blocks until the reader has it; WeightSyncError)."""

    def receive(self, version: int, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Reader side: the tensors of `version`, named and shaped like `like`, in the channel's dtype."""


class InProcessChannel:
    """A channel within one process (operator tests): the same buckets and casts, no process group."""

    def __init__(self, dtype: torch.dtype, bucket_mb: float = 64.0) -> None:
        self.dtype, self.bucket_bytes = dtype, int(bucket_mb * 2**20)
        self._held: dict[int, list[Tensor]] = {}

    def send(self, version: int, weights: Mapping[str, Tensor]) -> None:
        element = _element_size(self.dtype)
        self._held[version] = [pack(weights, b, self.dtype)
                               for b in bucket_layout(weights, self.bucket_bytes, element)]

    def receive(self, version: int, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        buffers = self._held.pop(version)
        layout = bucket_layout(like, self.bucket_bytes, _element_size(self.dtype))
        out: dict[str, Tensor] = {}
        for bucket, flat in zip(layout, buffers, strict=True):
            out.update(unpack(flat, bucket))
        return out


def _element_size(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def backend_for(device: str) -> str:
    """The torch.distributed backend of a link whose tensors live on `device`."""
    return "nccl" if device.startswith("cuda") else "gloo"


class CollectiveChannel:
    """A two-member torch.distributed group (rank 0: trainer, rank 1: reader) on a 127.0.0.1 TCP store.

    `prefix` names this join: a recreated reader joins under a new one (the trainer creates a fresh
    channel for it), so a stale member never blocks the group. The version number is sent first
    so that a reader that expected another version fails instead of loading the wrong weights."""

    def __init__(self, *, rank: int, port: int, prefix: str, dtype: torch.dtype, bucket_mb: float,
                 timeout_seconds: float, device: str = "cpu") -> None:
        import torch.distributed as dist

        self.rank, self.dtype, self.device = rank, dtype, device
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout = timedelta(seconds=timeout_seconds)
        self.prefix = prefix
        try:
            store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0,
                                  timeout=self.timeout, wait_for_workers=False)
            store = dist.PrefixStore(prefix, store)
            if backend_for(device) == "nccl":
                self._group = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
            else:
                self._group = dist.ProcessGroupGloo(store, rank, 2, self.timeout)
        except (RuntimeError, TimeoutError) as error:
            raise WeightSyncError(self._line(f"join failed: {_first_line(error)}")) from error
        self._store = store

    def _line(self, what: str) -> str:
        side = "trainer" if self.rank == 0 else "reader"
        return (f"trajflow: weight_sync ({self.prefix}, {side} side): {what} "
                f"(weight_sync.timeout_seconds={self.timeout.total_seconds():g})")

    def _broadcast(self, tensor: Tensor, what: str) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.timeout
        try:
            if not self._group.broadcast([tensor], options).wait(self.timeout):
                raise WeightSyncError(self._line(f"{what}: timed out"))
        except (RuntimeError, dist.DistError) as error:
            raise WeightSyncError(self._line(f"{what}: peer lost ({_first_line(error)})")) from error

    def send(self, version: int, weights: Mapping[str, Tensor]) -> None:
        import torch

        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device), "version header")
        for i, bucket in enumerate(bucket_layout(weights, self.bucket_bytes, _element_size(self.dtype))):
            self._broadcast(pack(weights, bucket, self.dtype).to(self.device), f"bucket {i} of version {version}")

    def receive(self, version: int, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        import torch

        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self._broadcast(header, "version header")
        if int(header.item()) != version:
            raise WeightSyncError(self._line(f"expected version {version}, the trainer sent {int(header.item())}"))
        out: dict[str, Tensor] = {}
        for i, bucket in enumerate(bucket_layout(like, self.bucket_bytes, _element_size(self.dtype))):
            flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self._broadcast(flat, f"bucket {i} of version {version}")
            out.update(unpack(flat, bucket))
        return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
