"""Ray Data's cluster-wide helper actors, left out on the embedded single-node Ray.

On its first execution Ray Data (2.60) starts three helper actors, each in a Ray worker process
of its own that imports Ray Data (measured at quickstart size: 1.3-1.8 CPU seconds and about
120 MB PSS each; benchmarks/results/startup.md):

- `ActorLocationTracker` records which node each pool actor runs on, for locality-aware dispatch.
  On one node every actor runs on the driver's node.
- `_StatsActor` collects each dataset's metrics for the Ray dashboard's Data view, and hands out
  dataset ids (a blocking call before the first execution). Without a dashboard nobody reads the
  metrics; the id falls back to a random uuid, as Ray Data itself does when the actor fails.
- the autoscaling coordinator asks the cluster for more nodes and tells each execution which
  resources are reserved for it. A single node has nothing to scale, and a pipeline is the only
  execution on its embedded Ray, so what is reserved for it is the node.

`apply()` (called when `start_local_ray` has started the embedded Ray) replaces these with local
answers in the driver — the only process that runs Ray Data's executor — while the Ray this
process started is the one it is connected to; on any other Ray (a cluster, `ray_address`) every
call goes to Ray Data's own actors as shipped. Applied only to Ray versions whose Ray Data
source was read (`VERIFIED_RAY`); `TRAJFLOW_RAY_DATA_SERVICES=1` keeps Ray Data's actors.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import ray

log = logging.getLogger("trajflow")

VERIFIED_RAY = ("2.60.",)  # Ray versions whose Ray Data helper actors this module was checked against
_state: dict[str, Any] = {}  # the originals while applied, and the embedded Ray's GCS address


class _NoOpRemote:
    def remote(self, *args, **kwargs) -> None:
        return None


class LocalActorLocations:
    """Stands in for Ray Data's `ActorLocationTracker` handle: each pool actor reports its node to
    it on start (a no-op here); the driver answers location queries with its own node."""

    update_actor_location = _NoOpRemote()


class SingleNodeAutoscaler:
    """Stands in for Ray Data's cluster autoscaler: nothing to scale; the execution's resources
    are the node's."""

    def try_trigger_scaling(self) -> None:
        return None

    def on_executor_shutdown(self) -> None:
        return None

    def get_total_resources(self):
        from ray.data._internal.execution.interfaces.execution_options import ExecutionResources

        return ExecutionResources.from_resource_dict(ray.cluster_resources())


def on_embedded_ray() -> bool:
    """Whether this process is connected to the Ray that `apply()` was called for."""
    address = _state.get("gcs_address")
    if address is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().gcs_address == address
    except Exception:
        return False


def apply(*, dashboard: bool = False) -> bool:
    """Leave Ray Data's helper actors out while this process is connected to the Ray it has just
    started (`dashboard`: that Ray runs the dashboard, so the stats actor stays). Returns whether
    the replacement is active."""
    if os.environ.get("TRAJFLOW_RAY_DATA_SERVICES") == "1" or not ray.__version__.startswith(VERIFIED_RAY):
        return False
    from ray.data._internal import stats
    from ray.data._internal.execution import streaming_executor
    from ray.data._internal.execution.operators import actor_pool_map_operator as pool

    _state["gcs_address"] = ray.get_runtime_context().gcs_address
    if "saved" in _state:
        _state["dashboard"] = dashboard
        return True
    _state["dashboard"] = dashboard
    manager = stats._StatsManager
    saved = {
        "tracker": pool.get_or_create_actor_location_tracker,
        "locations": pool.get_actor_locations,
        "autoscaler": streaming_executor.create_cluster_autoscaler,
        **{name: manager.__dict__[name] for name in _STATS_METHODS},
    }
    _state["saved"] = saved

    def tracker():
        return LocalActorLocations() if on_embedded_ray() else saved["tracker"]()

    def locations(logical_actor_ids: tuple) -> dict:
        if not on_embedded_ray():
            return saved["locations"](logical_actor_ids)
        node = ray.get_runtime_context().get_node_id()
        return {actor_id: node for actor_id in logical_actor_ids}

    def autoscaler(*args, **kwargs):
        return SingleNodeAutoscaler() if on_embedded_ray() else saved["autoscaler"](*args, **kwargs)

    pool.get_or_create_actor_location_tracker = tracker
    pool.get_actor_locations = locations
    streaming_executor.create_cluster_autoscaler = autoscaler
    for name, local in _STATS_METHODS.items():
        setattr(manager, name, staticmethod(_unless_dashboard(saved[name].__func__, local)))
    return True


def _unless_dashboard(original, local):
    def call(*args, **kwargs):
        if on_embedded_ray() and not _state["dashboard"]:
            return local(*args, **kwargs)
        return original(*args, **kwargs)

    return call


# `_StatsManager` methods that reach the stats actor, and what each does without it
_STATS_METHODS = {
    "gen_dataset_id_from_stats_actor": lambda: uuid.uuid4().hex,
    "register_dataset_to_stats_actor": lambda *args, **kwargs: None,
    "update_execution_metrics": lambda *args, **kwargs: None,
    "update_iteration_metrics": lambda *args, **kwargs: None,
}


def revert() -> None:
    """Ray Data's own helper actors again (for side-by-side measurements)."""
    saved = _state.pop("saved", None)
    _state.pop("gcs_address", None)
    if saved is None:
        return
    from ray.data._internal import stats
    from ray.data._internal.execution import streaming_executor
    from ray.data._internal.execution.operators import actor_pool_map_operator as pool

    pool.get_or_create_actor_location_tracker = saved["tracker"]
    pool.get_actor_locations = saved["locations"]
    streaming_executor.create_cluster_autoscaler = saved["autoscaler"]
    for name in _STATS_METHODS:
        setattr(stats._StatsManager, name, saved[name])


def active() -> bool:
    return on_embedded_ray() and "saved" in _state
