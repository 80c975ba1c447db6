"""The policy store: the one owner of weight versions, in this process or as a Ray actor.

Version v means "the weights after v optimizer updates" (v = 0 is the initial model). The
trainer publishes each new version; generators take the newest one. The store also

- keeps *snapshots*: the weights of an older version stay while some in-flight token that may
  still be trained carries it (a pin), and are freed as soon as the last pin is released or the
  version falls out of the staleness window (then no token carrying it can be trained anyway);
  only a strategy that scores old log-probs after generation needs them (`keep_history`);
- enforces the staleness bound at admission: the rollout for train step b may start only once
  the trainer has published version b - max_staleness, so it runs at most max_staleness versions
  ahead. `max_staleness: 0` is the synchronous on-policy mode;
- collects timing counters from the actors (seconds generating, scoring, waiting) so that each
  train step can report them;
- keeps the newest version of every other learner (the critic: operators/trainer/critic.py) in
  a stream of its own, addressed by the learner's name; snapshots, pins, the staleness bound and
  admission are the policy's.

Three pieces (operators see only the `operators.contracts.store.PolicyStoreClient` protocol):

    PolicyStore     the bookkeeping above, for any payload (thread-safe; blocking waits)
    InProcessStore  a client in this process: payloads are cloned tensors (operator unit tests,
                    a notebook without Ray)
    RayStore        a client of a PolicyStore in a Ray actor (`RayStore.start(...)`): weights
                    travel as object refs, zero-copy on one node (schemas/weights.py); the actor
                    only holds the refs and never imports torch

Ownership under Ray: an object lives as long as the process that put it. The trainer's versions
are owned by the trainer actor, which is alive whenever a generator or scorer reads them; only the
run's *final* version is read after the stream has ended and Ray Data has torn the trainer down
(e.g. replay's final weights), so only that one is copied into the store actor's ownership on
publish (`final_version`; without it, every version is: the safe choice for a caller that does
not know where the run ends).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trajflow.operators.contracts.store import POLICY, StoreStats, VersionNotHeld
from trajflow.settings import check_number

if TYPE_CHECKING:
    import ray
    from torch import Tensor

    from trajflow.operators.trainer.weight_sync import ServerAddress

# Blocking calls (admission, waits) each hold one of the store actor's threads while they wait:
# one per generator and per waiting test; the rest answer publishes, reads and counters.
ACTOR_THREADS = 64


@dataclass
class _Version:
    payload: Any
    nbytes: int
    pins: int = 0
    # read back from disk by a rebuilt store (pipelines/store_recovery.py): the pins of its
    # in-flight tokens died with the old store, so it is kept until it leaves the staleness window
    restored: bool = False


class PolicyStore:
    """Owner of versions, snapshots, the admission bound and the step counters (any payload)."""

    def __init__(self, max_staleness: int, keep_history: bool) -> None:
        check_number("PolicyStore", max_staleness=max_staleness)
        self.max_staleness = max_staleness
        # Strategies that recompute old log-probs after generation (snapshot, dedicated) need the
        # weights of a version until its tokens are scored; the others only need the newest.
        self.keep_history = keep_history
        self.versions: dict[int, _Version] = {}
        self.latest = -1
        self.max_versions_held = 0
        self.max_snapshot_bytes = 0
        self.evicted_pinned = 0
        self.counters: dict[str, float] = defaultdict(float)
        self.changed = threading.Condition()
        self.trainers_started = 0
        self.server: tuple[str, int] | None = None  # weight_sync collective: the trainer's version server
        self.servers_started = 0  # its generation: a rebuilt trainer's server is the next one
        self.others: dict[str, tuple[int, Any]] = {}  # every other learner's newest (version, payload)

    def put(self, payload: Any, nbytes: int, version: int | None = None, restored: bool = False,
            learner: str = POLICY) -> int:
        """Register a payload of `learner` as `version` (default latest + 1); returns the version."""
        if learner != POLICY:
            return self._put_other(learner, payload, version)
        with self.changed:
            version = self.latest + 1 if version is None else version
            if version <= self.latest:
                raise ValueError(f"version {version} is not newer than the latest published {self.latest}")
            self.versions[version] = _Version(payload, nbytes, restored=restored)
            self.latest = version
            self._evict()
            self.changed.notify_all()
        return version

    def _put_other(self, learner: str, payload: Any, version: int | None) -> int:
        """Another learner's new newest version (the previous one is freed)."""
        with self.changed:
            latest = self.others.get(learner, (-1, None))[0]
            version = latest + 1 if version is None else version
            if version <= latest:
                raise ValueError(f"{learner} version {version} is not newer than the latest published {latest}")
            self.others[learner] = (version, payload)
            self.changed.notify_all()
        return version

    def register(self, version: int) -> int:
        """A version whose tensors the trainer sends to the readers itself (weight_sync collective).
        The newest version again is no change: a rebuilt trainer serves the version it recovered,
        which its predecessor may have delivered already."""
        with self.changed:
            if version == self.latest:
                return version
        return PolicyStore.put(self, None, 0, version)  # no payload: a subclass's put would store one

    def set_weight_server(self, host: str, port: int) -> None:
        with self.changed:
            self.server = (host, port)
            self.servers_started += 1

    def weight_server(self) -> ServerAddress | None:
        from trajflow.operators.trainer.weight_sync import ServerAddress

        with self.changed:
            return None if self.server is None else ServerAddress(*self.server, self.max_staleness,
                                                                  self.servers_started)

    def _evict(self) -> None:
        oldest_trainable = self.latest - self.max_staleness
        for v in list(self.versions):
            if v == self.latest:
                continue
            entry = self.versions[v]
            if v < oldest_trainable and entry.pins > 0:
                self.evicted_pinned += 1  # its tokens are over-stale and will be dropped
            if (entry.pins == 0 and not entry.restored) or v < oldest_trainable or not self.keep_history:
                del self.versions[v]
        self.max_versions_held = max(self.max_versions_held, len(self.versions))
        self.max_snapshot_bytes = max(self.max_snapshot_bytes, self._bytes())

    def _bytes(self) -> int:
        return sum(entry.nbytes for entry in self.versions.values())

    def wait_for_version(self, version: int, learner: str = POLICY) -> int:
        with self.changed:
            self.changed.wait_for(lambda: self.latest_version(learner) >= version)
            return self.latest_version(learner)

    def admit(self, step: int) -> int:
        return self.wait_for_version(step - self.max_staleness)

    def claim_trainer(self) -> int:
        with self.changed:
            self.trainers_started += 1
            return self.trainers_started - 1

    def latest_version(self, learner: str = POLICY) -> int:
        return self.latest if learner == POLICY else self.others.get(learner, (-1, None))[0]

    def get(self, version: int | None = None, pin: bool = False, learner: str = POLICY) -> tuple[int, Any]:
        """(version, payload) of `learner`'s `version` (default: newest). `pin` keeps a policy
        version until released."""
        if learner != POLICY:
            with self.changed:
                held, payload = self.others.get(learner, (-1, None))
                if held < 0 or version not in (None, held):
                    raise VersionNotHeld(f"{learner} weights of version {version} are not held by the policy store "
                                         f"(it keeps the newest: {held if held >= 0 else 'none yet'})")
                return held, payload
        with self.changed:
            version = self.latest if version is None else version
            if version not in self.versions:
                raise VersionNotHeld(f"weights of version {version} are not held by the policy store "
                                     f"(held: {sorted(self.versions)})")
            if self.versions[version].payload is None:
                raise VersionNotHeld(f"weights of version {version} went from the trainer to the readers "
                                     "(weight_sync.method: collective); the policy store holds its number only")
            if pin and self.keep_history:
                self.versions[version].pins += 1
            return version, self.versions[version].payload

    def release(self, version: int, count: int = 1) -> None:
        with self.changed:
            entry = self.versions.get(version)
            if entry is None:
                return
            entry.pins = max(0, entry.pins - count)
            self._evict()

    def add_counters(self, values: Mapping[str, float]) -> None:
        with self.changed:
            for key, value in values.items():
                self.counters[key] += value

    def stats(self, reset_counters: bool = False) -> StoreStats:
        with self.changed:
            stats = StoreStats(version=self.latest, versions_held=sorted(self.versions), snapshot_bytes=self._bytes(),
                               max_versions_held=self.max_versions_held, max_snapshot_bytes=self.max_snapshot_bytes,
                               evicted_pinned=self.evicted_pinned, keeps_history=self.keep_history,
                               counters=dict(self.counters))
            if reset_counters:
                self.counters.clear()
            return stats


class InProcessStore(PolicyStore):
    """A PolicyStoreClient in this process: each version is a clone of the published tensors."""

    def publish(self, weights: Mapping[str, Tensor], version: int | None = None, *, learner: str = POLICY) -> int:
        state = {name: t.detach().clone() for name, t in weights.items()}
        return self.put(state, sum(t.numel() * t.element_size() for t in state.values()), version, learner=learner)

    def weights(self, version: int | None = None, *, pin: bool = False,
                learner: str = POLICY) -> tuple[int, Mapping[str, Tensor]]:
        return self.get(version, pin, learner)


class PolicyStoreActor(PolicyStore):
    """The store inside its Ray actor: payloads are object refs (each wrapped in a list, so Ray
    does not resolve it on the way); versions from `final_version` on are copied into an object
    this actor owns (see the module docstring)."""

    def __init__(self, max_staleness: int, keep_history: bool, final_version: int | None = None,
                 restored: Sequence[tuple[int, list, int]] = (), trainers_started: int = 0,
                 counters: Mapping[str, float] | None = None) -> None:
        """`restored`: (version, [ref], nbytes) of a rebuilt store's versions, oldest first (refs
        the rebuilding process owns and outlives the run with); `trainers_started` and `counters`
        carry on the dead store's count and report the rebuild (pipelines/store_recovery.py)."""
        super().__init__(max_staleness, keep_history)
        self.final_version = final_version
        for version, (ref,), nbytes in restored:  # registered before any call reaches this actor
            PolicyStore.put(self, ref, nbytes, version, restored=True)
        self.trainers_started = trainers_started
        self.counters.update(counters or {})

    def put(self, wrapped_ref: list, nbytes: int, version: int | None = None, learner: str = POLICY) -> int:
        import ray

        ref = wrapped_ref[0]
        number = (self.latest_version(learner) + 1) if version is None else version
        if self.final_version is None or number >= self.final_version:
            ref = ray.put(ray.get(ref))  # raw buffers: this process never imports torch
        return super().put(ref, nbytes, version, learner=learner)

    def get(self, version: int | None = None, pin: bool = False, learner: str = POLICY) -> tuple[int, list]:
        version, ref = super().get(version, pin, learner)
        return version, [ref]


class StoreLost(RuntimeError):
    """The policy store died and is not rebuilt; the message is one line."""


class StoreTombstone:
    """The actor a run leaves, named `NAME.lost`, when its store died and is not rebuilt: the
    readers waiting for a rebuilt store read the one line here and stop (pipelines/store_recovery.py)."""

    def __init__(self, line: str) -> None:
        self.text = line

    def line(self) -> str:
        return self.text


class RayStore:
    """A PolicyStoreClient of a PolicyStoreActor: what the pipeline hands its operators (it
    travels into their actors with them). Weights cross the object store as SharedStateDict.

    With `reconnect_seconds` > 0 the run rebuilds a store that dies (pipelines/store_recovery.py)
    as a new actor named `NAME.1`, `NAME.2`, ... (Ray keeps a dead actor's name taken while a
    handle to it lives): a call that finds the actor dead (or a version whose owner, the old
    actor, died) waits up to that long for the next one and is made again there."""

    def __init__(self, actor: "ray.actor.ActorHandle", name: str, reconnect_seconds: float = 0.0,
                 generation: int = 0) -> None:
        self.actor = actor
        self.name = name  # the first store's; generation g > 0 is named f"{name}.{g}"
        self.reconnect_seconds = reconnect_seconds
        self.generation = generation

    @classmethod
    def start(cls, max_staleness: int, keep_history: bool, final_version: int | None = None,
              name: str | None = None, reconnect_seconds: float = 0.0, generation: int = 0,
              restored: Sequence[tuple[int, list, int]] = (), trainers_started: int = 0,
              counters: Mapping[str, float] | None = None) -> "RayStore":
        """A new store actor (named uniquely unless `name` is given; generation g > 0: a rebuilt
        store, see the class docstring) and its client; the rest: PolicyStoreActor's arguments."""
        import ray

        name = name or f"trajflow_store_{uuid.uuid4().hex[:8]}"
        actor = ray.remote(PolicyStoreActor).options(
            name=f"{name}.{generation}" if generation else name, num_cpus=0, max_concurrency=ACTOR_THREADS,
        ).remote(max_staleness, keep_history, final_version, list(restored), trainers_started, dict(counters or {}))
        return cls(actor, name, reconnect_seconds, generation)

    def publish(self, weights: Mapping[str, Tensor], version: int | None = None, *, learner: str = POLICY) -> int:
        import ray

        from trajflow.schemas.weights import PackedStateDict, SharedStateDict

        # a state dict of tensors, or one already as raw buffers (a model's files: no torch here)
        state = weights if isinstance(weights, (SharedStateDict, PackedStateDict)) else SharedStateDict.of(weights)
        ref = ray.put(state)
        try:
            return ray.get(self.actor.put.remote([ref], state.nbytes, version, learner))
        except ray.exceptions.ActorDiedError as died:
            self._reconnect(died)
            if version is not None and self._call("latest_version", learner) >= version:
                return version  # the rebuilt store read this version back from disk
            return self._call("put", [ref], state.nbytes, version, learner)

    def weights(self, version: int | None = None, *, pin: bool = False,
                learner: str = POLICY) -> tuple[int, Mapping[str, Tensor]]:
        import ray

        try:
            version, (ref,) = self._call("get", version, pin, learner)
            try:
                return version, ray.get(ref)
            except ray.exceptions.OwnerDiedError as died:  # the store died after handing the ref out
                self._reconnect(died)
                version, (ref,) = self._call("get", version, pin, learner)
                return version, ray.get(ref)
        except VersionNotHeld as e:  # Ray raises the actor's exception as a subclass of it
            raise VersionNotHeld(str(getattr(e, "cause", None) or e)) from None

    def latest_version(self, *, learner: str = POLICY) -> int:
        return self._call("latest_version", learner)

    def _put_other(self, learner: str, payload: Any, version: int | None) -> int:
        """Another learner's new newest version (the previous one is freed)."""
        with self.changed:
            latest = self.others.get(learner, (-1, None))[0]
            version = latest + 1 if version is None else version
            if version <= latest:
                raise ValueError(f"{learner} version {version} is not newer than the latest published {latest}")
            self.others[learner] = (version, payload)
            self.changed.notify_all()
        return version

    def register(self, version: int) -> int:
        return self._call("register", version)

    def set_weight_server(self, host: str, port: int) -> None:
        self._call("set_weight_server", host, port)

    def weight_server(self) -> ServerAddress | None:
        return self._call("weight_server")

    def wait_for_version(self, version: int, *, learner: str = POLICY) -> int:
        return self._call("wait_for_version", version, learner)

    def admit(self, step: int) -> int:
        return self._call("admit", step)

    def release(self, version: int, count: int = 1) -> None:
        self.actor.release.remote(version, count)  # a pin the dead store held died with it

    def add_counters(self, values: Mapping[str, float]) -> None:
        # Waited for: the actor is threaded, so a fire-and-forget call could land after a later stats().
        self._call("add_counters", dict(values))

    def stats(self, reset_counters: bool = False) -> StoreStats:
        return self._call("stats", reset_counters)

    def claim_trainer(self) -> int:
        return self._call("claim_trainer")

    def wait_until_dead(self) -> None:
        """Block until the store actor dies (or is killed)."""
        import ray

        while True:
            try:
                ray.get(self.actor.wait_for_version.remote(2**62))
            except ray.exceptions.ActorDiedError:
                return
            except ray.exceptions.ActorUnavailableError:  # e.g. a network blip: it may come back
                time.sleep(0.5)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)

    def give_up(self, line: str) -> "ray.actor.ActorHandle":
        """Tell the readers waiting for a rebuilt store that there will be none (`line`); the
        caller keeps the handle for the rest of the run."""
        import ray

        return ray.remote(StoreTombstone).options(name=f"{self.name}.lost", num_cpus=0).remote(line)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.ActorDiedError as died:
            self._reconnect(died)
            return ray.get(getattr(self.actor, method).remote(*args))

    def _reconnect(self, died: Exception) -> None:
        """Take the newest store the run has rebuilt since this client's; StoreLost when the
        run gave up on it; `died` (the dead store's error) when the run does not rebuild
        stores, or after `reconnect_seconds` without a new one."""
        import ray

        if not self.reconnect_seconds:
            raise died
        deadline = time.monotonic() + self.reconnect_seconds
        while True:
            found = None
            while True:  # the newest generation (a store may have died more than once meanwhile)
                try:
                    found = (ray.get_actor(f"{self.name}.{self.generation + 1}"), self.generation + 1)
                except ValueError:  # no actor of that name (yet)
                    break
                self.actor, self.generation = found
            if found is not None:
                return
            try:  # the run gave up on the store: its line, not a wait to the deadline
                raise StoreLost(ray.get(ray.get_actor(f"{self.name}.lost").line.remote())) from None
            except ValueError:
                pass
            if time.monotonic() > deadline:
                raise died
            time.sleep(0.1)
