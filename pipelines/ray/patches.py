"""Every patch trajflow applies to a third-party library's internals, behind one version check.

All five patch Ray 2.60 (`RAY_SERIES`), whose source they were written against. pyproject.toml
pins `ray[data]` (and the extras' `ray[default]`) to that series; tests/test_ray_patches.py fails
CI when the installed Ray is outside it or the pin and `RAY_SERIES` disagree.

On another Ray: warn, except for the loopback guarantee. No patch is applied, and one line says
so, once per process (`trajflow: Ray X is not the pinned 2.60.x: unpatched, slower; pip ...`).
Warn, not refuse: pip enforces the pin, so an off-series Ray was chosen on purpose -- most likely
to try a Ray that fixed a cause upstream, which is how a patch below gets dropped; and the three
speed patches change when and in which process work happens, never what is computed. The
exception is `loopback_node`, which carries a guarantee rather than speed: an off-series Ray whose
embedded instance would listen beyond 127.0.0.1 is refused before it starts (`RayVersionError`;
exporting RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Python starts keeps any Ray on loopback
without a patch).

The patches (measured figures: benchmarks/results/, on this 2-core machine, load in each table):

1. `loopback_node()`: the embedded Ray listens on 127.0.0.1 only. Ray 2.60 binds the GCS, the
   raylet, every worker's gRPC server and the agents to the node IP, and takes the machine's
   public address as node IP unless multi-node clusters are disabled
   (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`), an environment variable read once, at `import ray`,
   into `ray._private.ray_constants.ENABLE_RAY_CLUSTER`. When Ray was imported before the
   variable was set (pipelines/ray/embedded.py sets it), the constant is set for the start only.
   Buys: no socket of the embedded Ray beyond loopback (tests/test_jobs_local_ray.py lists
   them). Drop: when `ray.init` has a public way to start a loopback-only local instance (no
   upstream issue found), use it instead; the same test says whether it holds.
2. `lean_head()`: the head node of the embedded Ray starts without the autoscaler monitor,
   without the log monitor unless the driver reads worker output (`log_to_driver`), and without
   the API server when there is no dashboard (`ray.init` builds the head's parameters itself,
   so they are adjusted as `ray._private.node.Node` is constructed; its `start_api_server` is
   skipped). A single node has nothing to autoscale; without a dashboard the API server loads
   only its usage-stats module, and `ray.init` polls until it is up (the node then runs as when
   that server fails to start, a case Ray handles). Buys: up to three Python processes fewer
   (the log monitor only when worker output is not read), their memory and CPU, and part of
   `ray.init`'s wall time (benchmarks/results/startup.md; benchmarks/RESULTS.md "Start-up and
   memory"). Cost:
   without a dashboard the embedded Ray has no state API (`ray.util.state`): its client polls
   the GCS for the API server's address 20 x 2 s, then raises "Could not read 'dashboard' from
   GCS" -- a 40 s stall for any caller (use actor handles and `ray.get_runtime_context()`).
   Drop: when `ray.init` exposes `ray start --no-monitor` / `--include-log-monitor`
   (ray-project/ray#13505, #48891 added them to `ray start` only) and no longer starts the API
   server without a dashboard (it has since ray-project/ray#26042, for usage stats; disabling
   usage stats does not stop it in 2.60).
   The same block gives the raylet `RAYLET_REGISTER_SECONDS` (120) to register with the GCS
   where Ray gives it 30 (`Node.__init__` polls `services.get_node` and raises "The current node
   timed out during startup" after a fixed 30 s): on a saturated machine (a test suite beside
   two runs, load 10 on 2 cores) a raylet has taken longer, and the run died at start with Ray's
   traceback. Here each poll itself waits, polling, until the node is registered or the budget
   is spent. Drop: when that wait is a setting of `ray.init` (none in 2.60).
3. `data_services`: Ray Data's cluster-wide helper actors are answered in the driver on the
   embedded Ray. On its first execution Ray Data starts three, each a Ray worker process that
   imports Ray Data: `ActorLocationTracker` (which node each pool actor runs on: on one node,
   the driver's), `_StatsActor` (metrics for the dashboard's Data view, and dataset ids: without
   a dashboard nobody reads the metrics, and the id is a random uuid, as Ray Data does when the
   actor fails) and the autoscaling coordinator (nothing to scale on one node; a pipeline is the
   only execution on its embedded Ray, so what is reserved for it is the node). Only while this
   process is connected to the Ray it started; on any other Ray (a cluster, `ray_address`)
   every call goes to Ray Data's own actors. `TRAJFLOW_RAY_DATA_SERVICES=1` keeps them. Buys:
   three processes fewer, each 1.3-1.8 CPU s and ~120 MB PSS at quickstart size
   (benchmarks/results/startup.md; benchmarks/RESULTS.md "Start-up and memory"). Drop: when Ray
   Data skips these actors on a single node without a dashboard (no upstream issue found);
   tests/test_ray_data_services.py then finds no helper actors without the patch.
4. `executor`: event-driven wake-ups of Ray Data's streaming executor, applied by
   `RLPipeline.build()`. Each turn of its scheduling loop
   (`streaming_executor_state.process_completed_tasks`) calls `ray.wait(every active task,
   num_returns=all of them, timeout=0.1)`, so while any task stays active -- a generator blocked
   on its admission permit, the trainer mid-step -- the loop wakes only every 100 ms and every
   hand-over between operators waits for that tick; the threaded metadata fetcher adds one
   more tick per block. Inside that one module, `ray.wait` with `num_returns == len(refs)`
   returns as soon as one task has news, with every task that has news, bounded by the same
   timeout; and block metadata is read inline (`RAY_DATA_METADATA_PREFETCH_ON_THREAD=0`
   semantics). One guard: a task whose output is ready but left unread (output backpressure)
   would wake the loop at once on every turn; when the ready set repeats, the loop waits for new
   news at most `REPEAT_PACE_S`. Only the driver runs the executor; once applied it holds for
   every Ray Data execution in the process (it changes when the loop wakes, never what it does),
   and the driver's CPU goes down (the loop sleeps in `ray.wait` instead of ticking).
   `TRAJFLOW_EXECUTOR_PATCH=0` turns it off for a run. Buys: most of the gap between a
   quickstart step's compute and its wall time, sync and async (benchmarks/results/
   orchestration.md, "Ray Data as shipped" against "event-driven executor"). Drop: when ray-project/ray#42377 / #45934
   (100 ms gaps between tasks, open) are fixed: `python -m benchmarks.run_all --only
   orchestration` then shows "Ray Data as shipped" within noise of "event-driven executor".

5. `worker_output`: the lines Ray forwards from its worker processes to the driver (their
   stdout and stderr: Python warnings, transformers' and math-verify's notices, numpy's
   RuntimeWarnings) go to a file instead of the driver's terminal. Ray prints them through a
   handler ("ray_print_logs") of `ray._private.ray_logging.global_worker_stdstream_dispatcher`,
   which `ray.init(log_to_driver=True)` registers; `worker_output.to(path)` swaps that handler
   for one appending each line, prefixed like Ray's ("(ActorName pid=N) ..."), to `path`, and
   `to(None)` puts Ray's back. Buys: a run's output is trajflow's own lines, the workers' in
   RUN/workers.log (`--verbose` prints them as Ray does). `log_to_driver=False` would silence
   them too, but leave them only in Ray's session dir under /tmp/ray, one file per worker
   process. The errors the raylet publishes to the driver take another way: Ray's error thread
   (`listen_error_messages`) prints them through `ray._private.worker.print_to_stdstream`, looked
   up by name, whatever `log_to_driver` says; while the file is active that name points to the
   file too (seen here: "(raylet) Task MapWorker(...).submit failed ... killed by `ray.kill`" on
   stdout when a run stopping on a failed reward ended its actors on a loaded machine). Drop:
   when `ray.init` can send worker output and error messages to a file or a callback (no
   upstream issue found).

Each patch has `apply()`/`revert()`/`active()` (the executor's `revert()` serves side-by-side
benchmarks) or is a context manager around the `ray.init` that starts the embedded Ray.

Not here, on purpose (they change no third-party internals): loggers set to a level or
filtered, Ray Data's public `DataContext` settings and the filter of Ray's C++ notices on fd 2
(pipelines/ray/quiet.py; math-verify's timeout notice in tasks/rewards.py), operators/trainer/plan.py
filling the underscored fields of torch's process-group options (an object it builds, as
torch.distributed does), and engines/vllm_engine.py putting back `torch.set_num_threads` after
vLLM's CPU worker replaced it (an undo of vLLM's own patch, scoped to engine construction;
engines/ cannot import pipelines/).

One module on purpose (docs/design.md §4): every patch of a third-party library's internals,
behind one version check, so moving Ray's pin means reading this one file.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import ray

log = logging.getLogger("trajflow")

RAY_SERIES = "2.60"  # the Ray minor series these patches were read against; pyproject.toml pins it
RAYLET_REGISTER_SECONDS = 120.0  # the embedded raylet's time to register with the GCS
RAY_REGISTER_SECONDS = 30.0  # Ray's own (node.py), on a Ray outside the series
REPEAT_PACE_S = 0.005  # how long the executor waits for new news while an already-seen task stays ready

_told: set[str] = set()  # Ray versions the user was told about (once per process)


class RayVersionError(RuntimeError):
    """A Ray outside the pinned series whose embedded instance would listen beyond 127.0.0.1.
    (Exporting RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Python starts keeps any Ray on
    loopback without a patch, for whoever tries another Ray on purpose.)"""


def ray_in_series(version: str | None = None) -> bool:
    """Whether `version` (default: the installed Ray's) is in the pinned minor series."""
    found = re.match(r"(\d+)\.(\d+)(?!\d)", ray.__version__ if version is None else version)
    return found is not None and f"{found[1]}.{found[2]}" == RAY_SERIES


def patches_apply() -> bool:
    """Whether the speed patches apply: the installed Ray is the pinned series. When it is not,
    says so in one line, once per process, and every patch leaves Ray as shipped
    (`loopback_node` asks `ray_in_series` too, and refuses instead)."""
    if ray_in_series():
        return True
    if ray.__version__ not in _told:
        _told.add(ray.__version__)
        log.warning("trajflow: Ray %s is not the pinned %s.x: unpatched, slower; pip install 'ray[data]==%s.*'",
                    ray.__version__, RAY_SERIES, RAY_SERIES)
    return False


# -- 1. loopback node ------------------------------------------------------------------------


@contextmanager
def loopback_node() -> Iterator[None]:
    """Node IP = loopback for the Ray started inside this block, when `import ray` came before
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the caller sets the variable). On another Ray series,
    RayVersionError: its embedded Ray would listen on the machine's public address."""
    if not ray_in_series():
        raise RayVersionError(f"Ray {ray.__version__} would listen beyond 127.0.0.1: "
                              f"pip install the pinned 'ray[data]=={RAY_SERIES}.*'")
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


# -- 2. lean head node -----------------------------------------------------------------------


@contextmanager
def lean_head(*, log_monitor: bool) -> Iterator[None]:
    """No autoscaler monitor (and no log monitor unless `log_monitor`, nor an API server without
    the dashboard) for the head node of the Ray started inside this block."""
    if not patches_apply():
        yield
        return
    from ray._private import node, services

    original_init, original_api_server = node.Node.__init__, node.Node.start_api_server

    def init(self, ray_params, *args, head: bool = False, **kwargs):
        if head:
            ray_params.no_monitor = True
            if not log_monitor:
                ray_params.include_log_monitor = False
        original_init(self, ray_params, *args, head=head, **kwargs)

    def api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard:
            original_api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
        # else: what Ray starts is an API server with only its usage-stats module, and ray.init
        # polls until it is up; without it the node runs as when that server fails to start

    node.Node.__init__, node.Node.start_api_server = init, api_server
    original_get_node = services.get_node
    services.get_node = patient(original_get_node, RAYLET_REGISTER_SECONDS)
    try:
        yield
    finally:
        node.Node.__init__, node.Node.start_api_server = original_init, original_api_server
        services.get_node = original_get_node


def raylet_register_seconds() -> float:
    """How long the embedded start waits for its raylet to register: ours in the series, Ray's outside."""
    return RAYLET_REGISTER_SECONDS if ray_in_series() else RAY_REGISTER_SECONDS


def patient(get_node: Callable, seconds: float, poll_seconds: float = 0.1,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Callable:
    """`get_node` that, while it raises RuntimeError (the node is not registered yet), polls
    again until `seconds` after its first call, then raises what it last raised."""
    started: list[float] = []

    def wait_for_node(*args, **kwargs):
        if not started:
            started.append(clock())
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if clock() - started[0] >= seconds:
                    raise
            sleep(poll_seconds)

    return wait_for_node


# -- 3. Ray Data's helper actors answered locally --------------------------------------------


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


# `_StatsManager` methods that reach the stats actor, and what each does without it
_STATS_METHODS = {
    "gen_dataset_id_from_stats_actor": lambda: uuid.uuid4().hex,
    "register_dataset_to_stats_actor": lambda *args, **kwargs: None,
    "update_execution_metrics": lambda *args, **kwargs: None,
    "update_iteration_metrics": lambda *args, **kwargs: None,
}


class LocalDataServices:
    """Ray Data's cluster-wide helper actors answered in the driver (patch 3 of the module
    docstring), while this process is connected to the Ray it started."""

    def __init__(self) -> None:
        self._saved: dict[str, Any] | None = None  # Ray Data's originals while applied
        self._gcs_address: str | None = None  # the embedded Ray's
        self._dashboard = False

    def on_embedded_ray(self) -> bool:
        """Whether this process is connected to the Ray that `apply()` was called for."""
        if self._gcs_address is None or not ray.is_initialized():
            return False
        try:
            return ray.get_runtime_context().gcs_address == self._gcs_address
        except Exception:
            return False

    def apply(self, *, dashboard: bool = False) -> bool:
        """Leave Ray Data's helper actors out while this process is connected to the Ray it has
        just started (`dashboard`: that Ray runs the dashboard, so the stats actor stays).
        Returns whether the replacement is active."""
        if os.environ.get("TRAJFLOW_RAY_DATA_SERVICES") == "1" or not patches_apply():
            return False
        from ray.data._internal import stats
        from ray.data._internal.execution import streaming_executor
        from ray.data._internal.execution.operators import actor_pool_map_operator as pool

        self._gcs_address = ray.get_runtime_context().gcs_address
        self._dashboard = dashboard
        if self._saved is not None:
            return True
        manager = stats._StatsManager
        saved = self._saved = {
            "tracker": pool.get_or_create_actor_location_tracker,
            "locations": pool.get_actor_locations,
            "autoscaler": streaming_executor.create_cluster_autoscaler,
            **{name: manager.__dict__[name] for name in _STATS_METHODS},
        }

        def tracker():
            return LocalActorLocations() if self.on_embedded_ray() else saved["tracker"]()

        def locations(logical_actor_ids: tuple) -> dict:
            if not self.on_embedded_ray():
                return saved["locations"](logical_actor_ids)
            node = ray.get_runtime_context().get_node_id()
            return {actor_id: node for actor_id in logical_actor_ids}

        def autoscaler(*args, **kwargs):
            return SingleNodeAutoscaler() if self.on_embedded_ray() else saved["autoscaler"](*args, **kwargs)

        pool.get_or_create_actor_location_tracker = tracker
        pool.get_actor_locations = locations
        streaming_executor.create_cluster_autoscaler = autoscaler
        for name, local in _STATS_METHODS.items():
            setattr(manager, name, staticmethod(self._unless_dashboard(saved[name].__func__, local)))
        return True

    def _unless_dashboard(self, original, local):
        def call(*args, **kwargs):
            if self.on_embedded_ray() and not self._dashboard:
                return local(*args, **kwargs)
            return original(*args, **kwargs)

        return call

    def revert(self) -> None:
        """Ray Data's own helper actors again (for side-by-side measurements)."""
        saved, self._saved, self._gcs_address = self._saved, None, None
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

    def active(self) -> bool:
        return self._saved is not None and self.on_embedded_ray()


data_services = LocalDataServices()


# -- 4. event-driven executor wake-ups -------------------------------------------------------


class EventDrivenWait:
    """Stands in for the `ray` module inside `streaming_executor_state` (every other attribute is
    Ray's own). Its `wait` changes only the executor's "wait for all, up to a timeout" call."""

    def __init__(self, real: Any = ray) -> None:
        self._real = real
        self._seen_ready: frozenset = frozenset()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True):
        real_wait = self._real.wait
        if num_returns != len(refs) or timeout is None or timeout == 0:
            return real_wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
        everything = dict(num_returns=len(refs), timeout=0, fetch_local=fetch_local)
        ready, rest = real_wait(refs, **everything)
        if not ready or set(ready) <= self._seen_ready:
            # Nothing new: sleep until some other task has news (or, if an already-seen task is
            # still ready and unread, for at most the pace), then collect everything ready.
            if rest:
                real_wait(rest, num_returns=1, timeout=min(timeout, REPEAT_PACE_S) if ready else timeout,
                          fetch_local=fetch_local)
                ready, rest = real_wait(refs, **everything)
        self._seen_ready = frozenset(ready)
        return ready, rest


class ExecutorWakeups:
    """The event-driven wake-ups of Ray Data's streaming executor (patch 4 of the module
    docstring), in the driver."""

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    def apply(self) -> bool:
        """Patch the driver's Ray Data executor (idempotent). Returns whether the patch is active."""
        if self._saved:
            return True
        if os.environ.get("TRAJFLOW_EXECUTOR_PATCH", "1") == "0" or not patches_apply():
            return False
        from ray.data._internal.execution import metadata_fetcher, streaming_executor_state

        self._saved["ray"] = streaming_executor_state.ray
        self._saved["prefetch_on_thread"] = metadata_fetcher._PREFETCH_ON_THREAD
        streaming_executor_state.ray = EventDrivenWait(ray)
        metadata_fetcher._PREFETCH_ON_THREAD = False
        return True

    def revert(self) -> None:
        """Restore Ray Data's own executor behavior (for side-by-side measurements)."""
        if not self._saved:
            return
        from ray.data._internal.execution import metadata_fetcher, streaming_executor_state

        streaming_executor_state.ray = self._saved.pop("ray")
        metadata_fetcher._PREFETCH_ON_THREAD = self._saved.pop("prefetch_on_thread")

    def active(self) -> bool:
        return bool(self._saved)


executor = ExecutorWakeups()


# -- 5. worker output to a file --------------------------------------------------------------


class WorkerOutput:
    """Where the lines Ray forwards from its workers go (patch 5 of the module docstring)."""

    PRINTER = "ray_print_logs"  # Ray's handler: prints to the driver's stdout/stderr
    HANDLER = "trajflow_worker_output"

    def __init__(self) -> None:
        self._printer: Any = None  # Ray's handler while ours replaces it
        self._print_error: Any = None  # Ray's `print_to_stdstream` while ours replaces it
        self._file: TextIO | None = None

    def to(self, path: str | os.PathLike | None) -> None:
        """From now on (for this process's Ray connections), append the workers' lines to `path`;
        None: print them as Ray does. A Ray that forwards nothing (`log_to_driver=False`) is left
        as it is."""
        if not patches_apply():
            return
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        previous, self._file = self._file, None
        printers = [handler for name, handler in dispatcher.handlers if name == self.PRINTER]
        dispatcher.remove_handler(self.HANDLER)
        if path is None:
            if self._printer is not None and not printers:
                dispatcher.add_handler(self.PRINTER, self._printer)
            self._printer = None
        elif printers or self._printer is not None:
            self._printer = printers[0] if printers else self._printer
            dispatcher.remove_handler(self.PRINTER)
            self._file = open(Path(path), "a", buffering=1, encoding="utf-8", errors="replace")
            dispatcher.add_handler(self.HANDLER, self._write)
        self._route_errors(self._file is not None)
        if previous is not None:
            previous.close()

    def _route_errors(self, to_file: bool) -> None:
        """Point the name Ray's error thread prints through at `_print_or_write` (to_file), or back."""
        import ray._private.worker as ray_worker

        if to_file and self._print_error is None:
            self._print_error, ray_worker.print_to_stdstream = ray_worker.print_to_stdstream, self._print_or_write
        elif not to_file and self._print_error is not None:
            ray_worker.print_to_stdstream, self._print_error = self._print_error, None

    def _print_or_write(self, data: dict, ignore_prefix: bool) -> None:
        """`print_to_stdstream` while a file is active: the line goes there, else as Ray prints it."""
        if self._file is not None:
            self._write(data)
        else:
            self._print_error(data, ignore_prefix)

    def _write(self, data: dict) -> None:
        """Ray's dispatcher calls this (under its lock) with one batch of a worker's lines."""
        file = self._file
        if file is None:
            return
        name, pid = data.get("actor_name") or data.get("task_name"), data.get("pid")
        source = pid if pid in ("raylet", "autoscaler") else f"{name + ' ' if name else ''}pid={pid}"
        prefix = f"({source}{' stderr' if data.get('is_err') else ''}) "
        try:
            file.write("".join(prefix + line + "\n" for line in data.get("lines", [])))
        except ValueError:  # closed by a concurrent to(): the line is dropped
            pass

    def active(self) -> bool:
        return self._file is not None


worker_output = WorkerOutput()
