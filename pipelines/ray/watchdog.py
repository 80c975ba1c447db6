"""Ends an embedded Ray's processes when the process that started it dies, however it dies.

Ray stops its GCS, raylet and workers soon after the driver dies, but its dashboard agent and
runtime-env agent outlive a SIGKILLed driver for minutes (measured with Ray 2.60). The driver
therefore starts this watchdog (stdlib only, started as a file so no package import slows it):

    python -S watchdog.py PARENT_PID READ_FD MARKER

Every process of the embedded Ray inherits the environment variable `TRAJFLOW_RAY_RUN=MARKER`
from the driver (the driver sets it just before `ray.init`). The watchdog holds the read end of
a pipe whose only write end is the driver's; when the pipe reaches end of file (the driver
exited: cleanly, by an exception or by SIGKILL), or the watchdog is re-parented, it sends
SIGTERM to every process of the run, then SIGKILL to those left after a grace period. The run's
processes are those carrying the marker, plus their children seen while the driver lived: the
raylet starts the dashboard and runtime-env agents with an environment of its own, without the
marker (Ray 2.60), so the watchdog records the raylet's children (pid and start time, so a reused
pid is never touched) once a second. Nothing else on the machine is touched. The
watchdog runs in its own session: Ray's own reaper kills the driver's whole process group when the
driver dies, and would otherwise take the watchdog with it.

The driver also tells it, one line each through the pipe, its Ray's session dir (`session PATH`),
where that session's logs go if the driver dies (`logs PATH`: a run's RUN/ray-logs) and, as it
exits normally and deals with the session dir itself, `clean`. A driver that died without `clean`
(SIGKILL) failed: once its processes are ended, the session's logs/ move to the `logs` place and
the session dir is removed (without a `logs` place it stays, for a post-mortem).
Linux only (it reads /proc); elsewhere the driver does not start it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time

MARKER_ENV = "TRAJFLOW_RAY_RUN"
GRACE_SECONDS = 3.0


def marked_processes(marker: str) -> list[int]:
    """Pids whose initial environment holds MARKER_ENV=marker (this watchdog excluded)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat fields after the command name (state is [0], ppid [1], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split() or None
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != b"Z"  # a zombie has already exited


def track(marker: str, members: dict[int, bytes]) -> None:
    """Add to `members` (pid -> start time) the marked processes and the children of members."""
    for pid in marked_processes(marker):
        fields = _stat(pid)
        if fields is not None:
            members.setdefault(pid, fields[19])
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in members:
            fields = _stat(int(name))
            if fields is not None and int(fields[1]) in members:
                members[int(name)] = fields[19]


def _still_members(members: dict[int, bytes]) -> list[int]:
    """Members alive with the start time they were recorded with (not a reused pid)."""
    out = []
    for pid, started in members.items():
        fields = _stat(pid)
        if fields is not None and fields[0] != b"Z" and fields[19] == started:
            out.append(pid)
    return out


def _log(message: str) -> None:
    """What the watchdog did, appended to $TRAJFLOW_WATCHDOG_LOG when set (tests read it)."""
    path = os.environ.get("TRAJFLOW_WATCHDOG_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {message}\n")


def reap(marker: str, members: dict[int, bytes] | None = None, grace: float = GRACE_SECONDS) -> list[int]:
    """SIGTERM every process of the run (marked, or recorded in `members`), SIGKILL what is left
    after `grace` seconds; a few passes, since a dying raylet may still start a worker. Returns
    the pids signalled."""
    members = {} if members is None else members
    signalled: list[int] = []
    for _ in range(3):
        track(marker, members)
        pids = _still_members(members)
        if not pids:
            break
        signalled.extend(pids)
        _log(f"ending {sorted(pids)}")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)
            pids = [p for p in pids if _alive(p)]
            if not pids:
                break
    return signalled


def keep_logs(session: str, dest: str) -> None:
    """A dead driver's session: its logs/ to `dest`, then the session dir removed."""
    logs = os.path.join(session, "logs")
    if os.path.isdir(logs) and not os.path.exists(dest):
        shutil.copytree(logs, dest, symlinks=True, ignore_dangling_symlinks=True)
    shutil.rmtree(session, ignore_errors=True)
    _log(f"session {session}: logs kept in {dest}")


def watch(parent: int, read_fd: int, marker: str) -> None:
    _log(f"watching driver {parent} for marker {marker}")
    members: dict[int, bytes] = {}
    said: dict[str, str] = {}  # the driver's lines: session, logs, clean
    pending = b""
    while os.getppid() == parent:
        ready, _, _ = select.select([read_fd], [], [], 1.0)
        if ready:
            data = os.read(read_fd, 4096)
            if not data:
                break  # end of file: the driver's write end is closed, so the driver is gone
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                key, _, value = line.decode(errors="replace").partition(" ")
                said[key] = value
        track(marker, members)
    _log(f"driver gone (parent now {os.getppid()}); run: {sorted(_still_members(members))}")
    reap(marker, members)
    if "clean" not in said and said.get("session") and said.get("logs"):
        keep_logs(said["session"], said["logs"])
    _log("done")


if __name__ == "__main__":
    # Ctrl-C in the terminal, or a SIGTERM to the whole process group, is the driver's to handle;
    # the watchdog ends when the driver does (and only SIGKILL ends it earlier).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
