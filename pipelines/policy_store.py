"""The policy store: one Ray actor that owns weight versions.

Version v means "the weights after v optimizer updates" (v = 0 is the initial model). The
trainer publishes each new version; generators take the newest one. The store also

- keeps *snapshots*: the weights of an older version stay while some in-flight token that may
  still be trained carries it (a pin), and are freed as soon as the last pin is released or the
  version falls out of the staleness window (then no token carrying it can be trained anyway);
- enforces the staleness bound at admission: the rollout for train step b may start only once
  the trainer has published version b - max_staleness, so it runs at most max_staleness versions
  ahead. `max_staleness: 0` is the synchronous on-policy mode;
- collects timing counters from the actors (seconds generating, scoring, waiting) so that each
  train step can report them.

Weights travel as object refs (zero-copy on one node, see schemas/weights.py); the store
only holds the refs. A ref is always wrapped in a list when passed around so that Ray does not
resolve it on the way.

Ownership: an object lives as long as the process that put it. The trainer's versions are owned
by the trainer actor, which is alive whenever a generator or scorer reads them; only the run's
*final* version is read after the stream has ended and Ray Data has torn the trainer down (e.g.
replay's final weights), so only that one is copied into the store's ownership on publish
(`final_version`; without it, every version is, the safe choice for a caller that does not
know where the run ends).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import ray

STORE_NAME = "trajflow_policy_store"


@dataclass
class _Version:
    ref: ray.ObjectRef
    nbytes: int
    pins: int = 0


@dataclass
class StoreStats:
    """What the store reports to the train step (and tests)."""

    version: int
    versions_held: list[int]
    snapshot_bytes: int
    max_versions_held: int
    max_snapshot_bytes: int
    evicted_pinned: int
    counters: dict[str, float] = field(default_factory=dict)


@ray.remote(num_cpus=0)
class PolicyStore:
    """Owner of versions, snapshots, the admission bound and the step counters."""

    def __init__(self, max_staleness: int, keep_history: bool, final_version: int | None = None) -> None:
        self.max_staleness = max_staleness
        self.final_version = final_version
        # Strategies that recompute old logits after generation (snapshot, dedicated) need the
        # weights of a version until its tokens are scored; the others only need the newest.
        self.keep_history = keep_history
        self.versions: dict[int, _Version] = {}
        self.latest = -1
        self.max_versions_held = 0
        self.max_snapshot_bytes = 0
        self.evicted_pinned = 0
        self.counters: dict[str, float] = defaultdict(float)
        self.changed = asyncio.Condition()
        self.trainers_started = 0

    async def publish(self, wrapped_ref: list[ray.ObjectRef], nbytes: int, version: int | None = None) -> int:
        """Register new weights; returns their version (latest + 1 unless given, e.g. on resume).

        Versions from `final_version` on are copied into an object the store owns (one copy,
        once per run): they are read after the stream ends, when the trainer actor that put them
        is gone. Every other version stays the publisher's object: no copy.
        """
        ref = wrapped_ref[0]
        if self.final_version is None or (self.latest + 1 if version is None else version) >= self.final_version:
            ref = ray.put(await ref)  # before the version check: nothing awaits after it
        version = self.latest + 1 if version is None else version
        if version <= self.latest:
            raise ValueError(f"version {version} is not newer than the latest published {self.latest}")
        async with self.changed:
            self.versions[version] = _Version(ref, nbytes)
            self.latest = version
            self._evict()
            self.changed.notify_all()
        return version

    def _evict(self) -> None:
        oldest_trainable = self.latest - self.max_staleness
        for v in list(self.versions):
            if v == self.latest:
                continue
            entry = self.versions[v]
            if v < oldest_trainable and entry.pins > 0:
                self.evicted_pinned += 1  # its tokens are over-stale and will be dropped
            if entry.pins == 0 or v < oldest_trainable or not self.keep_history:
                del self.versions[v]
        self.max_versions_held = max(self.max_versions_held, len(self.versions))
        self.max_snapshot_bytes = max(self.max_snapshot_bytes, self._bytes())

    def _bytes(self) -> int:
        return sum(entry.nbytes for entry in self.versions.values())

    async def wait_for_version(self, min_version: int) -> int:
        """Block until version >= min_version is published; returns the newest version."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.latest >= min_version)
            return self.latest

    async def admit(self, train_step: int) -> int:
        """Admission for the rollout of train step `train_step`: waits for the staleness bound."""
        return await self.wait_for_version(train_step - self.max_staleness)

    def claim_trainer(self) -> int:
        """Called by each train step as it starts; returns how many started before it. A run has
        one: a second is a replacement Ray started after the first one's process died, and the
        first one's optimizer and strategy state is gone (operators/train_step.py refuses to go on)."""
        self.trainers_started += 1
        return self.trainers_started - 1

    def latest_version(self) -> int:
        return self.latest

    def get(self, version: int | None = None, pin: bool = False) -> tuple[int, list[ray.ObjectRef]]:
        """The (version, [ref]) of `version` (default: newest). `pin` keeps it until released."""
        version = self.latest if version is None else version
        if version not in self.versions:
            held = sorted(self.versions)
            raise KeyError(f"weights of version {version} are not held by the policy store (held: {held})")
        if pin and self.keep_history:
            self.versions[version].pins += 1
        return version, [self.versions[version].ref]

    def release(self, version: int, count: int = 1) -> None:
        """Drop `count` pins of a version; frees its snapshot when no pin is left."""
        entry = self.versions.get(version)
        if entry is None:
            return
        entry.pins = max(0, entry.pins - count)
        self._evict()

    def add_counters(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.counters[key] += value

    def stats(self, reset_counters: bool = False) -> StoreStats:
        stats = StoreStats(
            version=self.latest,
            versions_held=sorted(self.versions),
            snapshot_bytes=self._bytes(),
            max_versions_held=self.max_versions_held,
            max_snapshot_bytes=self.max_snapshot_bytes,
            evicted_pinned=self.evicted_pinned,
            counters=dict(self.counters),
        )
        if reset_counters:
            self.counters.clear()
        return stats



def get_store() -> ray.actor.ActorHandle:
    return ray.get_actor(STORE_NAME)
