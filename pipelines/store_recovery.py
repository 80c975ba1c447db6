"""A policy store that dies mid-run is rebuilt: a new actor, from the versions kept on disk.

The store's versions live only in its actor (it owns their objects), so its death takes them
along. The run's disk keeps them, when it is told to: `save_all_versions` writes every version
before it is published (jobs/recorder.py; a LoRA run's as PEFT adapter directories), and
checkpoints hold some. The driver watches the
store (`StoreGuard`, a thread); when it dies:

1. the newest version published is the newest on disk, or the one after the newest logged step
   (a step's rows are logged before its version is published);
2. the versions the live window may still read are that one and, for a strategy that scores
   old log-probs after generation (`keep_history`), the `max_staleness` before it;
3. a new store actor (the next generation of the name, RayStore) starts with those versions
   (kept until they leave the window: their in-flight pins died with the old store) and the
   count of trainers started; the readers' clients (`RayStore`) find it by name and make
   their call again there.

A version the window needs that is not on disk, or a spent `recovery.max_restarts` (a rebuilt
store counts as a restart), stops the run with one line naming the setting (`StoreLost`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trajflow.operators.trainer.recovery import RECOVERY_PREFIX, RESUME_HINT
from trajflow.pipelines.policy_store import RayStore, StoreLost

__all__ = ["RECONNECT_SECONDS", "StoreGuard", "StoreLost", "StoreConfig", "VersionArchive", "needed_versions",
           "rebuild", "refusal"]

if TYPE_CHECKING:
    from torch import Tensor

# How long a reader waits for the rebuilt store before its call fails (loading the versions
# from disk takes seconds for a large model; the driver stops the run sooner when it cannot rebuild).
RECONNECT_SECONDS = 300.0


class VersionArchive(Protocol):
    """Where a rebuilt store finds the versions (the job's run dir, jobs/recorder.py)."""

    def kept_versions(self, adapters: bool = False) -> list[int]:
        """Versions whose published payload is on disk, oldest first (`adapters`: a LoRA run's)."""

    def version_weights(self, version: int) -> Mapping[str, Tensor]:
        """The published payload of a kept version."""

    def last_logged_step(self) -> int:
        """The newest step whose rows the log holds (-1: none)."""


@dataclass(frozen=True)
class StoreConfig:
    """What a store is started with (RayStore.start) and rebuilt under."""

    max_staleness: int
    keep_history: bool
    max_restarts: int
    adapters: bool = False  # a LoRA run publishes adapters


def needed_versions(source: VersionArchive, spec: StoreConfig) -> tuple[list[int], list[int]]:
    """(versions the live window may read, those of them not on disk)."""
    kept = source.kept_versions(spec.adapters)
    latest = max([*kept, source.last_logged_step() + 1])
    oldest = max(0, latest - spec.max_staleness) if spec.keep_history else latest
    needed = list(range(oldest, latest + 1))
    return needed, [v for v in needed if v not in set(kept)]


def refusal(source: VersionArchive, spec: StoreConfig, restarts: int) -> str | None:
    """Why the store is not rebuilt as restart number `restarts`, or None."""
    if restarts > spec.max_restarts:
        return f"recovery.max_restarts ({spec.max_restarts}) is spent"
    _, missing = needed_versions(source, spec)
    if missing:
        listed = ", ".join(map(str, missing))
        return f"version{'s' if len(missing) > 1 else ''} {listed} not on disk (save_all_versions: true keeps them)"
    return None


def rebuild(store: RayStore, source: VersionArchive, spec: StoreConfig, restarts: int) -> tuple[RayStore, list[int]]:
    """A new store actor, the next generation of `store`, holding the needed versions read from
    disk (put by this process, which outlives the run's readers), and the versions it holds."""
    import ray

    from trajflow.schemas.weights import SharedStateDict

    needed, _ = needed_versions(source, spec)
    restored = []
    for version in needed:
        state = SharedStateDict.of(source.version_weights(version))
        restored.append((version, [ray.put(state)], state.nbytes))
    counters = {f"{RECOVERY_PREFIX}store_rebuilds": 1.0}
    return RayStore.start(spec.max_staleness, spec.keep_history, name=store.name,
                          reconnect_seconds=store.reconnect_seconds, generation=store.generation + 1,
                          restored=restored, trainers_started=restarts + 1, counters=counters), needed


class StoreGuard:
    """A driver thread that rebuilds the store when it dies (see the module docstring).

    `restarts()` gives the run's restarts so far (the trainer's, from its metrics rows); on a
    rebuild, `on_rebuilt(store, event)` hands over the new client and the `recovery/*` entries
    of the next metrics row. When the store cannot be rebuilt, `lost` holds the line and the
    readers waiting for a new store get it (`RayStore.give_up`): their operators fail, Ray Data
    ends the run and RLPipeline.iter_metrics raises StoreLost with the line."""

    def __init__(self, store: RayStore, source: VersionArchive, spec: StoreConfig, restarts: Callable[[], int],
                 on_rebuilt: Callable[[RayStore, dict], None]) -> None:
        self.store, self.source, self.spec = store, source, spec
        self.restarts, self.on_rebuilt = restarts, on_rebuilt
        self.lost: str | None = None
        self.tombstone = None  # the StoreTombstone actor, held while the run ends
        self.closing = False
        self.thread = threading.Thread(target=self._watch, name="trajflow-store-guard", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Before the store is killed on purpose (the run's end)."""
        import ray

        self.closing = True
        if self.tombstone is not None:
            ray.kill(self.tombstone)

    def _watch(self) -> None:
        while True:
            self.store.wait_until_dead()
            noticed = time.time()
            if self.closing:
                return
            restarts = self.restarts() + 1
            try:
                why = refusal(self.source, self.spec, restarts)
                if why is None:
                    self.store, versions = rebuild(self.store, self.source, self.spec, restarts)
            except Exception as e:  # e.g. a damaged version file: the run stops, saying why
                why = f"{type(e).__name__}: {e}"
            if why is not None:
                self.lost = f"the policy store's process died and is not rebuilt ({why}): {RESUME_HINT}"
                self.tombstone = self.store.give_up(self.lost)
                return
            seconds = time.time() - noticed
            held = f"version {versions[0]}" if len(versions) == 1 else f"versions {versions[0]}-{versions[-1]}"
            self.on_rebuilt(self.store, {
                f"{RECOVERY_PREFIX}event": f"the policy store died; rebuilt with {held} from disk in {seconds:.1f} s",
                f"{RECOVERY_PREFIX}seconds": seconds, f"{RECOVERY_PREFIX}replayed_steps": 0,
                f"{RECOVERY_PREFIX}restarts": restarts})
