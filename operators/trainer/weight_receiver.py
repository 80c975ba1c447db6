"""The readers' end of weight sync (operators/trainer/weight_sync.py has the protocol both ends
share): where a generator or scorer takes the weights of a version from (`WeightSource`) — the
policy store's tensors (`object_store`), or a `WeightReceiver` that the trainer's server sends
every version to (`collective`)."""

from __future__ import annotations

import atexit
import json
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from trajflow.operators.contracts.store import PolicyStoreClient, VersionNotHeld
from trajflow.operators.trainer.addresses import local_address, reachable
from trajflow.operators.trainer.weight_sync import (
    CollectiveChannel,
    ServerAddress,
    WeightSyncConfig,
    WeightSyncError,
    first_line,
    link_device,
    torch_dtype,
)

if TYPE_CHECKING:
    from torch import Tensor


class WeightSource(Protocol):
    """Where a reader (generator, scorer) takes the weights of a version from."""

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        """The newest version (at least the store's latest) and its weights; on the object store,
        the reader holds a pin on it."""

    def weights(self, version: int) -> Mapping[str, Tensor]:
        """The weights of `version`; VersionNotHeld if they are gone (out of the window)."""


class StoreWeights:
    """`weight_sync.method: object_store`: versions are the policy store's tensors."""

    def __init__(self, store: PolicyStoreClient) -> None:
        self.store = store

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        return self.store.weights(None, pin=True)

    def weights(self, version: int) -> Mapping[str, Tensor]:
        return self.store.weights(version)[1]


def weight_source(store: PolicyStoreClient, config: WeightSyncConfig, dtype: str, history: bool,
                   device: str = "cpu") -> WeightSource:
    """A reader's source of versions under `config.method`: receiving in `dtype` on `device`
    (the reader's; NCCL when the trainer's is a GPU too), keeping the staleness window
    (`history`: an exact scorer) or only the newest version."""
    if config.method == "object_store":
        return StoreWeights(store)
    return WeightReceiver(store, config, dtype, history, device)


class WeightReceiver:
    """A reader's end of `collective` (see the module docstring): a thread joins the trainer's
    server (its address from the policy store) and receives every version in `dtype`."""

    def __init__(self, store: PolicyStoreClient, config: WeightSyncConfig, dtype: str, history: bool,
                 device: str = "cpu") -> None:
        import torch  # noqa: F401 - the store's versions arrive as tensors only where torch is loaded (schemas/weights.py)

        self.store, self.config, self.dtype, self.history, self.device = store, config, dtype, history, device
        self.held: dict[int, dict[str, Tensor]] = {}
        self.keep: int | None = None  # versions kept: 1, or the staleness window S+1 (history)
        self.lost: str | None = None  # why the last server was left (its trainer died), until the next one joins
        self.joins = 0  # servers joined: more than one after a trainer was rebuilt
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

    def _server(self, gone: int) -> ServerAddress | None:
        """The newest server the store names that is not server `gone` (0: none yet) and that
        takes connections; waits while there is none (the trainer is starting, or being rebuilt).
        None once this reader is closed."""
        while True:
            address = self.store.weight_server()
            if address is not None and address.generation != gone:
                if reachable(address.host, address.port):
                    return address
                gone = address.generation  # its trainer died before this reader joined it
            if self._closed.wait(0.1):
                return None

    def _join(self, address: ServerAddress) -> tuple[CollectiveChannel, dict[str, Tensor], dict[str, str]]:
        import torch
        import torch.distributed as dist

        self.keep = address.max_staleness + 1 if self.history else 1
        timeout = timedelta(seconds=self.config.timeout_seconds)
        tcp = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
        layout = json.loads(tcp.get("layout"))
        like = {name: torch.empty(tuple(shape), device="meta") for name, shape in layout["tensors"]}
        n = tcp.add("joined", 1) - 1
        self._wake = (address.host, address.port, f"join/{n}/")
        tcp.set(f"join/{n}", json.dumps([self.dtype, self.device]))
        channel = CollectiveChannel(rank=1, store=dist.PrefixStore(f"join/{n}/", tcp), prefix=f"reader {n}",
                                    dtype=torch_dtype(self.dtype), bucket_mb=layout["bucket_bytes"] / 2**20,
                                    timeout_seconds=self.config.timeout_seconds,
                                    device=link_device(self.device, layout["device"]),
                                    bind=local_address(address.host))
        return channel, like, layout["aliases"]

    def _receive(self) -> None:
        """Join the trainer's server and take every version it sends. Whatever ends the link (the
        trainer's process died: between versions, mid-transfer, mid-join) ends it for this
        server only: the reader keeps what it holds and joins the next server (a rebuilt
        trainer's); a version it needs meanwhile waits up to `timeout_seconds` (`weights`)."""
        gone = 0
        while not self._closed.is_set():
            address = self._server(gone)
            if address is None:  # closed while no server was up
                return
            try:
                channel, like, aliases = self._join(address)
                self._channel, self.lost = channel, None
                self.joins += 1
                self._take(channel, like, aliases)
            except Exception as error:  # noqa: BLE001 - the link is gone; the reason is kept for the one line
                if self._closed.is_set():
                    return
                self._channel, self._wake, gone = None, None, address.generation
                with self._changed:
                    self.lost = first_line(error)
                    self._changed.notify_all()

    def _take(self, channel: CollectiveChannel, like: dict[str, Tensor], aliases: dict[str, str]) -> None:
        """Receive versions from `channel` until this reader is closed (WeightSyncError: the server is lost)."""
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
                lambda: self.held and max(self.held) >= version,
                timeout=self.config.timeout_seconds)
            if version in self.held:
                return self.held[version]
            if not arrived:
                lost = f" (its trainer was lost: {self.lost}; no rebuilt trainer served it)" if self.lost else ""
                raise WeightSyncError(self._line(f"version {version} did not arrive{lost}"))
            raise VersionNotHeld(f"weights of version {version} are not held by this reader "
                                 f"(held: {sorted(self.held)})")

    def newest(self) -> tuple[int, Mapping[str, Tensor]]:
        latest = self.store.latest_version()
        with self._changed:  # a late joiner may already hold a newer version than the store names
            ahead = bool(self.held) and max(self.held) >= latest
        if not ahead:
            try:
                self.weights(latest)
            except VersionNotHeld:  # a newer version arrived while it waited and replaced `latest`
                pass  # (a reader keeping one version): the newest is what is asked for
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
