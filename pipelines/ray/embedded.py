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
- No leftovers. Ray leaves each session's directory (logs, sockets; /tmp/ray/session_*) behind
  for good. At exit, once Ray has shut down, the sessions this process started are removed
  (`end_sessions`); when a run that started it failed (`keep_session_logs()`), the session's
  logs/ first move to the place `session_logs_to(dest)` named (RUN/ray-logs/). If the driver
  dies without exiting (SIGKILL), the watchdog moves the logs there after ending the processes.
- Quiet. The token-authentication notice and Ray Data's "progress bars disabled" warning are
  logged below the shown level unless `verbose`.
- Lean. No autoscaler monitor, no log monitor when nobody reads worker output
  (`log_to_driver=False`), no usage-stats-only API server without the dashboard, and Ray Data's
  cluster-wide helper actors answered in the driver (pipelines/ray/patches.py, patches 2 and 3,
  with what each buys). Without the dashboard the state API (`ray.util.state`) is unavailable.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
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
_sessions: list[Path] = []  # session dirs of the embedded Rays this process started, to remove at exit
_logs_dest: Path | None = None  # where a kept session's logs go (session_logs_to)
_keep_logs = False  # the run failed: keep its session's logs (keep_session_logs)
_at_exit = False  # end_sessions registered
SESSION_EXIT_WAIT_SECONDS = 5.0  # at exit, how long the session's processes get to end before removal


class RayStartError(RuntimeError):
    """The embedded Ray did not come up; the message is one line."""


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


def _tell_watchdog(line: str) -> None:
    """One line to the watchdog (watchdog.py reads `session`, `logs` and `clean`)."""
    if _watchdog_write_fd is not None:
        try:
            os.write(_watchdog_write_fd, (line + "\n").encode())
        except OSError:
            pass


def session_logs_to(dest: str | os.PathLike) -> None:
    """Where this process's embedded Ray session logs go if they are kept: by `keep_session_logs`
    (at exit), or by the watchdog when the process dies without exiting (SIGKILL)."""
    global _logs_dest
    _logs_dest = Path(dest)
    _tell_watchdog(f"logs {_logs_dest}")


def keep_session_logs() -> None:
    """The run failed: at exit keep its Ray session's logs in `session_logs_to`'s place (without
    one, e.g. a run on a Ray someone else started, nothing is kept)."""
    global _keep_logs
    _keep_logs = True


def _session_processes(session: Path) -> list[int]:
    """Pids whose command line names `session` (Ray's processes of that session; Linux /proc)."""
    needle = session.name.encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def end_sessions(wait: float = SESSION_EXIT_WAIT_SECONDS) -> list[Path]:
    """Remove the session dirs of the embedded Rays this process started (Ray shut down): after
    their processes ended (at most `wait` s), the kept one's logs moved first (keep_session_logs).
    Runs at exit; returns what it removed or moved. Safe to call again."""
    import time

    import ray

    if ray.is_initialized():
        return []  # still in use: at exit, after Ray's own shutdown
    _tell_watchdog("clean")  # the driver ends normally: the session dirs are dealt with here
    try:  # also a session a ray.init of this process left when it failed to start (named by our pid)
        from ray._common.utils import get_default_ray_temp_dir

        started = Path(get_default_ray_temp_dir()).glob(f"session_*_{os.getpid()}")
    except ImportError:
        started = ()
    _sessions[:0] = [p for p in started if p.is_dir() and p not in _sessions]
    done = []
    deadline = time.monotonic() + wait
    latest_started = _sessions[-1] if _sessions else None  # a failed run's is the latest
    while _sessions:
        session = _sessions.pop()
        while _session_processes(session) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _keep_logs and _logs_dest is not None and session == latest_started:
            if (session / "logs").is_dir() and not _logs_dest.exists():
                shutil.copytree(session / "logs", _logs_dest, symlinks=True, ignore_dangling_symlinks=True)
        shutil.rmtree(session, ignore_errors=True)
        latest = session.parent / "session_latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink(missing_ok=True)
        done.append(session)
    return done


def _end_at_exit() -> None:
    """At exit: Ray shut down (Ray's own exit hook, registered when ray is imported, would run
    only after this one; a second shutdown does nothing), then the session dirs removed."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    end_sessions()


def _import_in_background(modules: Sequence[str]) -> threading.Thread | None:
    """Import `modules` in a thread: `ray.init` mostly waits for Ray's processes to come up, so a
    driver that needs the pipeline's modules next (Ray Data, the stages' settings) can import them
    meanwhile (benchmarks/results/startup.md). An import error is left to the caller's own
    import, which raises it where it belongs."""
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


def cluster_cpus() -> float:
    """The CPUs of the Ray cluster this process is connected to; before Ray starts, this machine's
    (what an embedded Ray gets). Ray is not imported for it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0.0))
    return float(os.cpu_count() or 1)


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
    global _at_exit
    if not _at_exit:
        atexit.register(_end_at_exit)
        _at_exit = True
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
            try:
                context = ray.init(address="local", include_dashboard=dashboard, dashboard_host="127.0.0.1",
                                   **init_kwargs)
            except Exception as e:  # Ray raises a bare Exception when its raylet never registers
                if "timed out during startup" not in str(e):
                    raise
                waited = ray_patches.raylet_register_seconds()
                raise RayStartError(f"the embedded Ray did not start: its raylet did not register within "
                                    f"{waited:.0f} s (is the machine overloaded?)") from e
    session = Path(context.address_info["session_dir"])
    _sessions.append(session)
    _tell_watchdog(f"session {session}")
    ray_patches.data_services.apply(dashboard=dashboard)  # no cluster-wide Ray Data helper actors on one node
    if loader is not None:
        loader.join()


def remove_placement_group_named(name: str) -> None:
    """Remove this job's placement group `name` if it exists (the workers in it end with it).

    Worker 0 creates the group; a placement group outlives the actor that made it (it belongs
    to the job), so the pipeline that started the train step removes it by name at the end —
    also when the train step was killed and never got to `close()`."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    if not name:
        return
    try:
        group = get_placement_group(name)
    except ValueError:  # none by that name: never created, or already removed
        return
    remove_placement_group(group)
