"""What an operator may ask of the policy store: `PolicyStoreClient`, a typed Protocol.

The policy store is the single owner of weight versions (docs/design.md §3). Operators never call it
by name over Ray: they are handed a client, so each runs in one process on an in-process store in
its tests (`pipelines.policy_store.InProcessStore`) and on the store's Ray actor in a pipeline
(`pipelines.policy_store.RayStore`). Version v means "the weights after v optimizer updates"
(v = 0: the initial model); see pipelines/policy_store.py for what the store keeps and when.

Every learner of the train step (operators/trainer/learner.py) has its own stream of versions,
addressed by its name (`learner=`): the policy's (the default: snapshots, the staleness bound,
admission) and the critic's (the newest version only, read by the values stage).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from trajflow.operators.trainer.weight_sync import ServerAddress


POLICY = "policy"  # the learners' names: the store's streams, a checkpoint's directories
CRITIC = "critic"


class VersionNotHeld(KeyError):
    """The store does not hold the weights of that version (never published, or freed: out of
    the staleness window, or no in-flight token needs it)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass
class StoreStats:
    """What the store reports to the train step (and tests)."""

    version: int
    versions_held: list[int]
    snapshot_bytes: int
    max_versions_held: int
    max_snapshot_bytes: int
    evicted_pinned: int
    keeps_history: bool
    counters: dict[str, float] = field(default_factory=dict)


class PolicyStoreClient(Protocol):
    """The policy store as operators see it (every call is synchronous unless it says so)."""

    def publish(self, weights: Mapping[str, Tensor], version: int | None = None, *, learner: str = POLICY) -> int:
        """Register new weights of `learner` as `version` (default: latest + 1); returns the version."""

    def register(self, version: int) -> int:
        """Register `version` without its tensors (`weight_sync.method: collective`: the trainer
        sends them to the readers itself); numbers and the staleness bound stay the store's. The
        newest version again is no change (a rebuilt trainer serves the version it recovered)."""

    def set_weight_server(self, host: str, port: int) -> None:
        """Where the trainer serves versions (collective; a rebuilt trainer's address replaces it,
        as the next generation of the server)."""

    def weight_server(self) -> ServerAddress | None:
        """The trainer's version server and the staleness bound, or None before it started."""

    def weights(self, version: int | None = None, *, pin: bool = False,
                learner: str = POLICY) -> tuple[int, Mapping[str, Tensor]]:
        """(version, weights) of `learner`'s `version` (default: the newest). The tensors are
        read-only: load them into a model, never write into them. `pin` keeps a policy version
        until released. VersionNotHeld if the store does not hold it."""

    def latest_version(self, *, learner: str = POLICY) -> int:
        """`learner`'s newest published version (-1 before the first)."""

    def wait_for_version(self, version: int, *, learner: str = POLICY) -> int:
        """Block until `learner`'s `version` or a newer one is published; returns the newest."""

    def admit(self, step: int) -> int:
        """The admission permit of the rollout of train step `step`: blocks until version
        step - max_staleness exists (the staleness bound at the source); returns the newest."""

    def release(self, version: int, count: int = 1) -> None:
        """Drop `count` pins of `version` (may return before the store has applied it)."""

    def add_counters(self, values: Mapping[str, float]) -> None:
        """Add to the step's timing counters, e.g. {"generate_seconds": 1.2} (may return early)."""

    def stats(self, reset_counters: bool = False) -> StoreStats:
        """Versions and bytes held, and the counters since the last reset."""

    def claim_trainer(self) -> int:
        """Called by each train step as it starts: how many started before it (a second one is a
        restarted process whose predecessor's optimizer state is gone)."""
