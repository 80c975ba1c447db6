"""The trainer's end of `weight_sync.method: collective` (operators/trainer/weight_sync.py has the
protocol both ends share): `WeightServer`, in the train step's process."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.trainer.addresses import LOOPBACK
from trajflow.operators.trainer.weight_sync import (
    CollectiveChannel,
    WeightSyncConfig,
    WeightSyncError,
    bucket_layout,
    element_size,
    first_line,
    link_device,
    torch_dtype,
)

if TYPE_CHECKING:
    from torch import Tensor


class WeightServer:
    """The trainer's end of `collective` (see the module docstring); in the train step's process.

    `shapes`: the model's state dict (names and full shapes; tensors shared by several names, tied
    weights, travel once). `dtypes`: the reader dtypes to serve (`reader_dtype` of each reader).
    `host`: the address it listens on and binds its links to (operators/trainer/addresses.py
    `serving_host`: 127.0.0.1 on one node, this node's address when readers may be elsewhere)."""

    def __init__(self, store: PolicyStoreClient, config: WeightSyncConfig, shapes: Mapping[str, Tensor],
                 dtypes: Iterable[str], device: str = "cpu", host: str = LOOPBACK) -> None:
        import torch
        import torch.distributed as dist

        from trajflow.engines.checkpoint import storage_key
        from trajflow.operators.trainer.collective import listening_socket

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
            layout = bucket_layout(like, bucket_bytes, element_size(torch_dtype(name)))
            self.buffers[name] = [torch.empty(b.numel, dtype=torch_dtype(name), device=device) for b in layout]
            self.slots[name] = {}
            for i, bucket in enumerate(layout):
                offset = 0
                for t in bucket.tensors:
                    self.slots[name][t.name] = (i, offset, t.numel)
                    offset += t.numel
        self.host = host
        listen = listening_socket(host)
        port = listen.getsockname()[1]
        self.timeout = timedelta(seconds=config.timeout_seconds)
        self.tcp = dist.TCPStore(host, port, is_master=True, master_listen_fd=listen.fileno(),
                                 wait_for_workers=False, timeout=self.timeout)
        listen.detach()  # the store owns the descriptor now
        self.tcp.set("layout", json.dumps({"bucket_bytes": bucket_bytes, "aliases": self.aliases, "device": device,
                                           "tensors": [[n, list(t.shape)] for n, t in like.items()]}))
        self.readers: list[tuple[CollectiveChannel, str, object]] = []  # (link, dtype, its prefix store)
        self.joined = 0
        self.version: int | None = None  # the version packed in the buffers
        self.error: WeightSyncError | None = None
        self.lost_readers: list[str] = []  # the line of each reader lost (its process died)
        self.moved_bytes = 0  # by the last transfer, to every reader
        self.seconds = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trajflow-weight-server", daemon=True)
        self._thread.start()
        store.set_weight_server(host, port)

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
                f"trajflow: weight_sync (trainer side): {first_line(error)}")
            self._idle.set()

    def _deliver(self, version: int) -> None:
        started = time.perf_counter()
        moved = 0
        for reader in list(self.readers):
            channel, dtype, store = reader
            if not store.check(["left"]) and self._send(channel, dtype, version):
                moved += self.version_bytes(dtype)
                continue
            self.readers.remove(reader)  # it left (Ray Data ends finished stages) or was lost
        self.seconds, self.moved_bytes = time.perf_counter() - started, moved
        self.store.register(version)
        self.store.add_counters({"weight_sync_seconds": self.seconds, "weight_sync_bytes": float(moved)})

    def _send(self, channel: CollectiveChannel, dtype: str, version: int) -> bool:
        """Send `version` to one reader; False when the reader is lost (its process died: Ray
        restarts it, and the restarted reader joins again and is sent the current version), which
        the store counts (`weight_sync_readers_lost`) and the other readers never wait for."""
        try:
            channel.send(version, self.buffers[dtype])
            return True
        except WeightSyncError as error:
            self.lost_readers.append(str(error))
            self.store.add_counters({"weight_sync_readers_lost": 1.0})
            return False

    def _serve_joins(self) -> None:
        import torch.distributed as dist

        while self.tcp.check([f"join/{self.joined}"]):
            n, self.joined = self.joined, self.joined + 1
            dtype, reader_device = json.loads(self.tcp.get(f"join/{n}"))
            if dtype not in self.buffers:
                raise WeightSyncError(f"trajflow: weight_sync: reader {n} asked for {dtype} weights; the trainer "
                                      f"serves {sorted(self.buffers)}")
            store = dist.PrefixStore(f"join/{n}/", self.tcp)
            try:
                channel = CollectiveChannel(rank=0, store=store, prefix=f"reader {n}", dtype=torch_dtype(dtype),
                                            bucket_mb=self.config.bucket_mb,
                                            timeout_seconds=self.config.timeout_seconds,
                                            device=link_device(self.device, reader_device), bind=self.host)
            except WeightSyncError as error:  # it died while joining
                self.lost_readers.append(str(error))
                self.store.add_counters({"weight_sync_readers_lost": 1.0})
                continue
            started = time.perf_counter()
            # a late joiner (a pool's next reader, a restarted one) gets the current version at once
            if self.version is not None and not self._send(channel, dtype, self.version):
                continue
            self.readers.append((channel, dtype, store))
            if self.version is not None:
                self.store.add_counters({"weight_sync_seconds": time.perf_counter() - started,
                                         "weight_sync_bytes": float(self.version_bytes(dtype))})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
