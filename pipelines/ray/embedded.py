"""The embedded Ray of a run, a replay or a notebook: listens on 127.0.0.1 only, starts its
workers without a runtime-env round trip, keeps Ray's own notices out of the output, and ends
with the process that started it.

    start_local_ray()                   # idempotent; `trajflow run`, RLPipeline and the tests use it

- Loopback only. Ray 2.60 binds every listener to the node IP, and resolves a node IP of
  127.0.0.1 to the machine's public address unless multi-node clusters are disabled
  (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: the default on macOS and Windows). An embedded Ray is
  single-node by definition, so it is started with that setting (restored afterwards, so a later
  connection to a real cluster is unaffected; pipelines/ray/patches.py, patch 1).
- Worker environment. The variables in WORKER_ENV are set in the driver's environment before
  `ray.init`, which every Ray process inherits; a job-level `runtime_env` would instead make Ray
  start each worker through the runtime-env agent and never reuse its prestarted workers.
- Ended with its driver. Ray's dashboard and runtime-env agents outlive a SIGKILLed driver for
  minutes; a tiny watchdog (watchdog.py) ends every process of this Ray when the driver dies.
- Quiet. The token-authentication notice and Ray Data's "progress bars disabled" warning are
  logged below the shown level unless `verbose`.
- Lean. No autoscaler monitor, no log monitor when nobody reads worker output
  (`log_to_driver=False`), no usage-stats-only API server without the dashboard, and Ray Data's
  cluster-wide helper actors answered in the driver (pipelines/ray/patches.py, patches 2 and 3,
  with what each buys). Without the dashboard the state API (`ray.util.state`) is unavailable.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from trajflow.pipelines.ray.quiet import quiet_ray
from trajflow.pipelines.ray.watchdog import MARKER_ENV

# Environment for every Ray worker of a job: offline hub, no per-worker progress bars.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")

_watchdog_write_fd: int | None = None


@contextmanager
def _env(**values: str):
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _single_node():
    """Node IP = loopback for the Ray started inside this block."""
    import ray

    from trajflow.pipelines.ray import patches as ray_patches

    with _env(**{SINGLE_NODE_ENV: "0"}):
        if ray.util.get_node_ip_address() in LOOPBACK:
            yield
            return
        # ray was imported before the variable was set, and reads it once at import
        with ray_patches.loopback_node():
            yield


def _start_watchdog(marker: str) -> None:
    """One watchdog per driver process: it reaps every Ray this process starts (each gets its own
    marker; the driver's later Rays are covered by restarting the watchdog with the new marker)."""
    global _watchdog_write_fd
    if not sys.platform.startswith("linux"):
        return
    if _watchdog_write_fd is not None:  # a previous embedded Ray of this process: replace its watchdog
        os.close(_watchdog_write_fd)  # (it reaps what is left of that Ray and exits)
        _watchdog_write_fd = None
    read_fd, write_fd = os.pipe()  # both ends close-on-exec: only the watchdog gets the read end
    script = Path(__file__).with_name("watchdog.py")
    try:
        # its own session: Ray's reaper SIGKILLs the driver's process group when the driver dies,
        # which would end the watchdog before it has ended the agents (seen on a loaded machine)
        subprocess.Popen([sys.executable, "-S", str(script), str(os.getpid()), str(read_fd), marker],
                         pass_fds=(read_fd,), stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)
    finally:
        os.close(read_fd)
    _watchdog_write_fd = write_fd


def _import_in_background(modules: Sequence[str]) -> threading.Thread | None:
    """Import `modules` in a thread: `ray.init` mostly waits for Ray's processes to come up, so
    a driver that needs torch and transformers next can import them meanwhile (measured: the
    two overlap almost entirely; benchmarks/results/startup.md). An import error is left to the
    caller's own import, which raises it where it belongs."""
    if not modules:
        return None

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:
                pass

    thread = threading.Thread(target=load, name="trajflow-imports", daemon=True)
    thread.start()
    return thread


def start_local_ray(*, dashboard: bool = False, verbose: bool = False, imports: Sequence[str] = (),
                    **init_kwargs) -> None:
    """Start an embedded single-node Ray bound to 127.0.0.1, unless Ray is already initialised.

    `dashboard` starts the dashboard (on 127.0.0.1); `imports` are modules the caller needs
    next, imported while Ray starts; `init_kwargs` go to `ray.init` (num_cpus,
    object_store_memory, log_to_driver, ...). Raises RayVersionError (before Ray starts) on a
    Ray outside the pinned series whose embedded instance would listen beyond 127.0.0.1."""
    import ray

    from trajflow.pipelines.ray import patches as ray_patches

    quiet_ray(verbose)
    if ray.is_initialized():
        return
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    init_kwargs.setdefault("configure_logging", False)
    log_to_driver = init_kwargs.get("log_to_driver", True)
    with _single_node():  # first: it refuses a Ray that would listen beyond 127.0.0.1
        marker = uuid.uuid4().hex
        _start_watchdog(marker)
        loader = _import_in_background(imports)
        with _env(**{MARKER_ENV: marker}), ray_patches.lean_head(log_monitor=log_to_driver):
            # address="local": a new Ray even if `ray start` left a cluster address file in /tmp/ray
            ray.init(address="local", include_dashboard=dashboard, dashboard_host="127.0.0.1", **init_kwargs)
    ray_patches.data_services.apply(dashboard=dashboard)  # no cluster-wide Ray Data helper actors on one node
    if loader is not None:
        loader.join()
