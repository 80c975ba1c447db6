"""The embedded Ray of a run is local and ends with its driver (pipelines/ray/embedded.py).

- a real `trajflow run` subprocess: once it has trained a step, every listening socket of every
  process of its Ray (the driver's descendants: GCS, raylet, agents, workers) is on 127.0.0.1;
- SIGKILL of that driver leaves none of those processes alive 30 s later (Ray alone leaves its
  dashboard and runtime-env agents running for minutes);
- the watchdog on its own, with plain processes carrying a run's marker: only they are ended;
- what a run prints to stderr passes through the noise filter (jobs/console.py).
(The test session's own Ray, started the same way, is checked at the end of test_jobs_run.py.)
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

psutil = pytest.importorskip("psutil")

CLI = [sys.executable, "-m", "trajflow.jobs.cli"]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc (Linux)")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _alive(procs) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def running_run(tmp_path_factory):
    """A quickstart run long enough to still be training while the tests look at it. Its decode
    steps sleep (simulate_decode_seconds): it stays alive for the module without taking the CPU
    the other test worker needs."""
    tmp = tmp_path_factory.mktemp("local_ray")
    log = open(tmp / "run.log", "w")
    args = ["run", "quickstart", "--run-dir", tmp / "run", "--no-progress", "--set", "steps=500",
            "--set", "checkpoint_every=0", "--set", "save_all_versions=false", "--set", "report_to=[]",
            "--set", "trajectory_log=false", "--set", "prompts_per_step=8", "--set", "group_size=4",
            "--set", "eval_every=0", "--set", "simulate_decode_seconds=0.2"]
    env = dict(_env(), TRAJFLOW_WATCHDOG_LOG=str(tmp / "watchdog.log"))
    proc = subprocess.Popen(CLI + [str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not re.search(r"^step +0 \(", (tmp / "run.log").read_text(), re.M):
            assert proc.poll() is None, (tmp / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step trained in 400 s"
            time.sleep(0.5)
        driver = psutil.Process(proc.pid)
        yield proc, driver, driver.children(recursive=True), tmp / "run.log"
    finally:
        if proc.poll() is None:  # a failed test: end what is left, by pid
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
        proc.wait(timeout=60)
        log.close()


@pytest.mark.timeout(600)
def test_every_listening_socket_of_the_embedded_ray_is_on_loopback(running_run):
    _, driver, children, _ = running_run
    names = {p.name() for p in _alive(children)}
    assert {"gcs_server", "raylet"} <= names, names
    listening = []
    for p in [driver, *_alive(children)]:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.append((p.name(), " ".join(p.cmdline()[:2])[-60:], c.laddr.ip, c.laddr.port))
        except psutil.NoSuchProcess:
            continue
    owners = {name for name, _, _, _ in listening}
    assert {"gcs_server", "raylet"} <= owners and len(listening) >= 6, listening  # and the agents, the workers
    exposed = [s for s in listening if not _is_loopback(s[2])]
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"


@pytest.mark.timeout(600)
def test_sigkill_of_the_driver_ends_every_ray_process_of_the_run_within_30s(running_run):
    proc, driver, children, log = running_run
    session = next(arg.split("=", 1)[1] for p in _alive(children) if p.name() == "gcs_server"
                   for arg in p.cmdline() if arg.startswith("--session-dir="))
    (watchdog,) = [p for p in _alive(children) if "watchdog.py" in " ".join(p.cmdline())]
    # outside the driver's process group, which a group kill (`kill -9 -PGID`, Ray's own reaper
    # where the kernel cannot fate-share) would end together with the driver
    assert os.getpgid(watchdog.pid) != os.getpgid(proc.pid)
    children = _alive(children) + _alive(driver.children(recursive=True))  # workers started meanwhile
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = time.monotonic()

    def of_the_run():
        found = set(_alive(children))
        for p in psutil.process_iter(["cmdline"]):
            if any(session in arg for arg in (p.info["cmdline"] or [])):
                found.add(p)
        return _alive(found)

    while of_the_run() and time.monotonic() - killed < 30:
        time.sleep(0.5)
    left = [(p.pid, p.name()) for p in of_the_run()]
    watchdog = log.with_name("watchdog.log")
    assert not left, (f"alive 30 s after SIGKILL of the driver: {left}\n{log.read_text()[-2000:]}\n"
                      f"watchdog: {watchdog.read_text() if watchdog.exists() else 'no log'}")


def test_the_watchdog_ends_exactly_the_marked_processes_when_its_parent_dies(tmp_path):
    """A parent starts the watchdog and two marked `sleep`s (plus one unmarked), then is SIGKILLed."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        from trajflow.pipelines.ray import embedded as local_ray
        from trajflow.pipelines.ray.watchdog import MARKER_ENV
        local_ray._start_watchdog("m-test")
        marked = dict(os.environ, **{MARKER_ENV: "m-test"})
        pids = [subprocess.Popen(["sleep", "300"], env=marked).pid for _ in range(2)]
        pids.append(subprocess.Popen(["sleep", "300"], env=dict(os.environ)).pid)
        print(" ".join(map(str, pids)), flush=True)
        time.sleep(300)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_env())
    marked_a, marked_b, unmarked = (psutil.Process(int(p)) for p in parent.stdout.readline().split())
    try:
        time.sleep(0.5)
        assert _alive([marked_a, marked_b, unmarked]) == [marked_a, marked_b, unmarked]
        parent.kill()
        parent.wait()
        gone, _ = psutil.wait_procs([marked_a, marked_b], timeout=20)
        assert len(gone) == 2
        assert _alive([unmarked]) == [unmarked], "an unmarked process was touched"
    finally:
        for p in _alive([marked_a, marked_b, unmarked]):
            p.kill()


RAYLET_NEVER_REGISTERS = """
import sys

import ray

def init(*args, **kwargs):  # what Ray 2.60 raises once its raylet has not registered in time
    raise Exception("The current node timed out during startup. This could happen because some of the "
                    "raylet failed to startup or the GCS has become overloaded.")

ray.init = init
from trajflow.jobs.cli import main

sys.exit(main(["run", "quickstart", "--run-dir", sys.argv[1], "--no-progress"]))
"""


@pytest.mark.timeout(120)
def test_an_embedded_ray_that_does_not_start_is_one_line_exit_1_and_nothing_written(tmp_path):
    """Ray's startup timeout (a bare Exception and its traceback) becomes one line naming the wait;
    not the user's input, so exit 1; the run dir is not created."""
    proc = subprocess.run([sys.executable, "-c", RAYLET_NEVER_REGISTERS, str(tmp_path / "run")], env=_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["trajflow: the embedded Ray did not start: its raylet did not register "
                                        "within 120 s (is the machine overloaded?)"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
