"""How a new weight version reaches its readers: the `weight_sync:` section and its transports.

`object_store`: the train step publishes the version's tensors to the policy store and each
reader fetches them (`StoreVersions`). `collective`: the store still numbers the versions and
enforces the staleness bound (the trainer `register`s each one), but the tensors go from the
trainer straight to each reader over torch.distributed (gloo on CPU, NCCL on CUDA), in flat
buckets of about `bucket_mb`, cast on the trainer's side to the dtype the reader computes in
(`reader_dtype`: bf16 for a bf16 generator, float32 for the exact scorers and for `interrupt`'s
generator, which scores prefixes under the training numerics) — no float32 copy in the store.

Trainer side (`WeightServer`, in the train step's process): a TCP store on 127.0.0.1 whose address
the policy store hands to readers, and one thread that serves joins and sends versions. `offer()`
gathers the full tensors (under FSDP one tensor at a time, every worker in step) into one set of
flat buckets per reader dtype, kept until the next version, so a reader that joins late (Ray Data
re-creates actors on each dataset execution; a pool holds several readers) is sent the current
version at once. A version is registered in the policy store only once every joined reader has
it: a reader that finds version v in the store holds v (or a newer one). The run's starting
version is the one the store holds (the driver published it): readers take it there, without
waiting for the trainer to start.

Reader side (`WeightReceiver`, in a generator's or scorer's process): a thread that joins and
receives every version into memory, keeping the newest one (a generator) or the staleness window
v-S..v (an exact scorer: `snapshot` and `dedicated` score tokens of older versions) in host
memory, in float32: (S+1) x 4 bytes per parameter per scorer (`held_bytes()`).

Each reader has its own two-member group (trainer rank 0, reader rank 1) under a fresh prefix per
join, so a recreated reader joins again instead of wedging a fixed-size group. Between versions a
reader waits on a key of the TCP store (announce, then transfer). Every collective waits at most
`timeout_seconds`: a peer lost mid-transfer is a `WeightSyncError` (one line), never a hang. A
reader that ends (`close()`, also at its process's exit: Ray Data ends a finished stage's actors)
leaves first, and the trainer stops sending to it; one that vanishes without leaving stops the run.

Torch is imported inside functions: validating a job config must not import it.
"""

from __future__ import annotations

import atexit
import json
import queue
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, Protocol

from trajflow.operators.store import PolicyStoreClient, VersionNotHeld
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


def _element_size(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _dtype(name: str) -> torch.dtype:
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
    """A two-member torch.distributed group (rank 0: trainer, rank 1: reader) on `store` (a TCP store
    on 127.0.0.1, under a prefix of its own: `prefix` names this join in messages).

    Each transfer is announced on the store (key `announce/<n>`: the version), then sent: the
    version number as a header (a reader that expected another version fails instead of loading
    the wrong weights), the buckets, and the reader's receipt (the version back)."""

    def __init__(self, *, rank: int, store, prefix: str, dtype: torch.dtype, bucket_mb: float,
                 timeout_seconds: float, device: str = "cpu") -> None:
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
                options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                options._timeout = self.timeout
                self._group = dist.ProcessGroupGloo(store, rank, 2, options)
        except (RuntimeError, TimeoutError) as error:
            raise WeightSyncError(self._line(f"join failed: {_first_line(error)}")) from error

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
            raise WeightSyncError(self._line(f"{what}: peer lost ({_first_line(error)})")) from error

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
                raise WeightSyncError(self._line(f"trainer lost ({_first_line(error)})")) from error
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
        for i, bucket in enumerate(bucket_layout(like, self.bucket_bytes, _element_size(self.dtype))):
            flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self._broadcast(flat, f"bucket {i} of version {version}")
            out.update(unpack(flat, bucket))
        self._broadcast(header, f"receipt of version {version}", root=1)
        return out


def _first_line(error: BaseException) -> str:
    """The error's first sentence, without a leading `[file.cc:123]` source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.splitlines()[0].split(". ")[0] if text else type(error).__name__


# -- the readers' view of versions ----------------------------------------------------------------
class VersionSource(Protocol):
    """Where a reader (generator, scorer) takes the weights of a version from."""

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        """The newest version (at least the store's latest) and its weights; on the object store,
        the reader holds a pin on it."""

    def weights(self, version: int) -> Mapping[str, Tensor]:
        """The weights of `version`; VersionNotHeld if they are gone (out of the window)."""


class StoreVersions:
    """`weight_sync.method: object_store`: versions are the policy store's tensors."""

    def __init__(self, store: PolicyStoreClient) -> None:
        self.store = store

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        return self.store.weights(None, pin=True)

    def weights(self, version: int) -> Mapping[str, Tensor]:
        return self.store.weights(version)[1]


def version_source(store: PolicyStoreClient, config: WeightSyncConfig, dtype: str, history: bool,
                   device: str = "cpu") -> VersionSource:
    """A reader's source of versions under `config.method`: receiving in `dtype` on `device`
    (the reader's; NCCL when the trainer's is a GPU too), keeping the staleness window
    (`history`: an exact scorer) or only the newest version."""
    if config.method == "object_store":
        return StoreVersions(store)
    return WeightReceiver(store, config, dtype, history, device)


@dataclass(frozen=True)
class ServerAddress:
    """What the policy store tells a joining reader: where the trainer serves versions, and the
    staleness bound (how many versions an exact scorer keeps)."""

    host: str
    port: int
    max_staleness: int


class WeightServer:
    """The trainer's end of `collective` (see the module docstring); in the train step's process.

    `shapes`: the model's state dict (names and full shapes; tensors shared by several names, tied
    weights, travel once). `dtypes`: the reader dtypes to serve (`reader_dtype` of each reader)."""

    def __init__(self, store: PolicyStoreClient, config: WeightSyncConfig, shapes: Mapping[str, Tensor],
                 dtypes: Iterable[str], device: str = "cpu") -> None:
        import torch
        import torch.distributed as dist

        from trajflow.engines.checkpoint import storage_key
        from trajflow.operators.data_parallel import listening_socket

        self.store, self.config, self.device = store, config, device
        first: dict[tuple, str] = {}
        self.aliases: dict[str, str] = {}
        like: dict[str, Tensor] = {}
        for name, tensor in shapes.items():
            key = storage_key(tensor) if tensor.numel() else (name,)  # empty tensors share address 0
            if key in first:
                self.aliases[name] = first[key]
            else:
                first[key] = name
                like[name] = torch.empty(tuple(tensor.shape), device="meta")
        bucket_bytes = int(config.bucket_mb * 2**20)
        # per dtype: its buckets (one flat buffer each, reused for every version) and each tensor's slot
        self.buffers: dict[str, list[Tensor]] = {}
        self.slots: dict[str, dict[str, tuple[int, int, int]]] = {}
        for name in sorted(set(dtypes)):
            layout = bucket_layout(like, bucket_bytes, _element_size(_dtype(name)))
            self.buffers[name] = [torch.empty(b.numel, dtype=_dtype(name), device=device) for b in layout]
            self.slots[name] = {}
            for i, bucket in enumerate(layout):
                offset = 0
                for t in bucket.tensors:
                    self.slots[name][t.name] = (i, offset, t.numel)
                    offset += t.numel
        listen = listening_socket("127.0.0.1")
        port = listen.getsockname()[1]
        self.timeout = timedelta(seconds=config.timeout_seconds)
        self.tcp = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=listen.fileno(),
                                 wait_for_workers=False, timeout=self.timeout)
        listen.detach()  # the store owns the descriptor now
        self.tcp.set("layout", json.dumps({"bucket_bytes": bucket_bytes, "aliases": self.aliases, "device": device,
                                           "tensors": [[n, list(t.shape)] for n, t in like.items()]}))
        self.readers: list[tuple[CollectiveChannel, str, object]] = []  # (link, dtype, its prefix store)
        self.joined = 0
        self.version: int | None = None  # the version packed in the buffers
        self.error: WeightSyncError | None = None
        self.moved_bytes = 0  # by the last transfer, to every reader
        self.seconds = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trajflow-weight-server", daemon=True)
        self._thread.start()
        store.set_weight_server("127.0.0.1", port)

    def version_bytes(self, dtype: str) -> int:
        """Bytes of one version in `dtype` as sent (tied weights once)."""
        return sum(b.numel() * b.element_size() for b in self.buffers[dtype])

    def offer(self, version: int, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Make `version` the one served: wait until the previous one reached every reader, pack
        `weights` (iterated to the end: under FSDP every worker gathers in step) into the buffers,
        and hand it to the sending thread, which registers it in the store once delivered."""
        if not self._idle.wait(self.config.timeout_seconds):
            raise WeightSyncError(f"trajflow: weight_sync: version {self.version} still not delivered after "
                                  f"weight_sync.timeout_seconds={self.config.timeout_seconds:g}")
        self.check()
        with self._lock:
            for name, tensor in weights:
                if name in self.aliases:
                    continue
                flat = tensor.reshape(-1)
                for dtype, slots in self.slots.items():
                    i, offset, numel = slots[name]
                    self.buffers[dtype][i][offset:offset + numel].copy_(flat)
            self.version = version
            self._idle.clear()
            self._queue.put(version)

    def wait(self) -> None:
        """Block until the offered version reached every reader (WeightSyncError)."""
        if not self._idle.wait(self.config.timeout_seconds):
            raise WeightSyncError(f"trajflow: weight_sync: version {self.version} still not delivered after "
                                  f"weight_sync.timeout_seconds={self.config.timeout_seconds:g}")
        self.check()

    def check(self) -> None:
        """Raise the sending thread's failure (a reader lost mid-transfer), if any."""
        if self.error is not None:
            raise self.error

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = None
                with self._lock:
                    if item is not None:
                        self._deliver(item)
                    self._serve_joins()
                if item is not None:
                    self._idle.set()
        except Exception as error:  # noqa: BLE001 - every failure ends the run with its one line
            self.error = error if isinstance(error, WeightSyncError) else WeightSyncError(
                f"trajflow: weight_sync (trainer side): {_first_line(error)}")
            self._idle.set()

    def _deliver(self, version: int) -> None:
        started = time.perf_counter()
        moved = 0
        for reader in list(self.readers):
            channel, dtype, store = reader
            try:
                if not store.check(["left"]):
                    channel.send(version, self.buffers[dtype])
                    moved += self.version_bytes(dtype)
                    continue
            except WeightSyncError:
                if not store.check(["left"]):
                    raise  # lost, not left: the run stops
            self.readers.remove(reader)  # its process ended its work (Ray Data ends finished stages)
        self.seconds, self.moved_bytes = time.perf_counter() - started, moved
        self.store.register(version)
        self.store.add_counters({"weight_sync_seconds": self.seconds, "weight_sync_bytes": float(moved)})

    def _serve_joins(self) -> None:
        import torch.distributed as dist

        while self.tcp.check([f"join/{self.joined}"]):
            n, self.joined = self.joined, self.joined + 1
            dtype, reader_device = json.loads(self.tcp.get(f"join/{n}"))
            if dtype not in self.buffers:
                raise WeightSyncError(f"trajflow: weight_sync: reader {n} asked for {dtype} weights; the trainer "
                                      f"serves {sorted(self.buffers)}")
            store = dist.PrefixStore(f"join/{n}/", self.tcp)
            channel = CollectiveChannel(rank=0, store=store, prefix=f"reader {n}", dtype=_dtype(dtype),
                                        bucket_mb=self.config.bucket_mb, timeout_seconds=self.config.timeout_seconds,
                                        device=link_device(self.device, reader_device))
            self.readers.append((channel, dtype, store))
            if self.version is not None:  # a late joiner gets the current version at once
                started = time.perf_counter()
                channel.send(self.version, self.buffers[dtype])
                self.store.add_counters({"weight_sync_seconds": time.perf_counter() - started,
                                         "weight_sync_bytes": float(self.version_bytes(dtype))})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)


class WeightReceiver:
    """A reader's end of `collective` (see the module docstring): a thread joins the trainer's
    server (its address from the policy store) and receives every version in `dtype`."""

    def __init__(self, store: PolicyStoreClient, config: WeightSyncConfig, dtype: str, history: bool,
                 device: str = "cpu") -> None:
        self.store, self.config, self.dtype, self.history, self.device = store, config, dtype, history, device
        self.held: dict[int, dict[str, Tensor]] = {}
        self.keep: int | None = None  # versions kept: 1, or the staleness window S+1 (history)
        self.error: WeightSyncError | None = None
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._wake: tuple[str, int, str] | None = None  # where close() announces "no more versions"
        self._channel: CollectiveChannel | None = None
        self._thread = threading.Thread(target=self._receive, name="trajflow-weight-receiver", daemon=True)
        self._thread.start()
        # a thread still inside a native wait when the interpreter finalises aborts the process
        # (Ray Data ends its actors by a normal exit): end it first
        atexit.register(self.close)

    def _line(self, what: str) -> str:
        return (f"trajflow: weight_sync (reader side): {what} "
                f"(weight_sync.timeout_seconds={self.config.timeout_seconds:g})")

    def _join(self) -> tuple[CollectiveChannel, dict[str, Tensor], dict[str, str]]:
        import torch
        import torch.distributed as dist

        while (address := self.store.weight_server()) is None:  # the trainer is still starting
            if self._closed.wait(0.1):
                raise WeightSyncError(self._line("closed before the trainer served versions"))
        self.keep = address.max_staleness + 1 if self.history else 1
        timeout = timedelta(seconds=self.config.timeout_seconds)
        tcp = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
        layout = json.loads(tcp.get("layout"))
        like = {name: torch.empty(tuple(shape), device="meta") for name, shape in layout["tensors"]}
        n = tcp.add("joined", 1) - 1
        self._wake = (address.host, address.port, f"join/{n}/")
        tcp.set(f"join/{n}", json.dumps([self.dtype, self.device]))
        channel = CollectiveChannel(rank=1, store=dist.PrefixStore(f"join/{n}/", tcp), prefix=f"reader {n}",
                                    dtype=_dtype(self.dtype), bucket_mb=layout["bucket_bytes"] / 2**20,
                                    timeout_seconds=self.config.timeout_seconds,
                                    device=link_device(self.device, layout["device"]))
        return channel, like, layout["aliases"]

    def _receive(self) -> None:
        try:
            channel, like, aliases = self._join()
            self._channel = channel
            while (version := channel.next_version(self._closed)) is not None:
                weights = channel.receive(version, like)
                if self.history:  # the window lives in host memory
                    weights = {k: v.cpu() for k, v in weights.items()}
                weights.update({alias: weights[name] for alias, name in aliases.items()})
                with self._changed:
                    self.held[version] = weights
                    for old in sorted(self.held)[:-self.keep]:  # (the starting version may be held too)
                        del self.held[old]
                    self._changed.notify_all()
        except Exception as error:  # noqa: BLE001 - surfaces as one line where a version is needed
            self.error = error if isinstance(error, WeightSyncError) else WeightSyncError(
                self._line(_first_line(error)))
            with self._changed:
                self._changed.notify_all()

    def weights(self, version: int) -> Mapping[str, Tensor]:
        with self._changed:
            if version in self.held:
                return self.held[version]
        try:  # the run's starting version is the store's (published before the trainer started)
            _, start = self.store.weights(version)
        except VersionNotHeld:
            pass
        else:
            with self._changed:
                self.held.setdefault(version, dict(start))
                return self.held[version]
        with self._changed:
            arrived = self._changed.wait_for(
                lambda: self.error is not None or (self.held and max(self.held) >= version),
                timeout=self.config.timeout_seconds)
            if version in self.held:
                return self.held[version]
            if self.error is not None:
                raise self.error
            if not arrived:
                raise WeightSyncError(self._line(f"version {version} did not arrive"))
            raise VersionNotHeld(f"weights of version {version} are not held by this reader "
                                 f"(held: {sorted(self.held)})")

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        self.weights(self.store.latest_version())
        with self._changed:
            version = max(self.held)
            return version, self.held[version]

    def held_bytes(self) -> int:
        """Bytes of the versions held (tied weights once)."""
        with self._changed:
            return sum(t.numel() * t.element_size() for w in self.held.values()
                       for t in {id(t): t for t in w.values()}.values())

    def close(self) -> None:
        """Stop receiving: tell the trainer this reader left (it then stops sending to it instead of
        stopping the run), wake the thread (an announcement of version -1 on a connection of its
        own; the thread's waits on the trainer's store are native calls) and let it end."""
        import torch.distributed as dist

        self._closed.set()
        if self._wake is not None and self._channel is not None and self._thread.is_alive():
            host, port, prefix = self._wake
            try:
                client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
                mine = dist.PrefixStore(prefix, client)
                mine.set("left", "1")
                mine.set(f"announce/{self._channel.transfers}", "-1")
            except (RuntimeError, dist.DistError):
                pass  # the trainer is gone: the thread's wait fails and it ends anyway
        self._thread.join(timeout=5)
