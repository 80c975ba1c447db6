"""What the tests that start a Ray cluster of their own share (tests/test_jobs_cluster.py,
tests/test_cross_node.py): free ports, and killing exactly that cluster's processes (`ray stop`
would stop every Ray on the machine, including other sessions')."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports() -> list[str]:
    names = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
    return [f"--{name}={free_port()}" for name in names]


def cluster_processes(temp_dir: str):
    """The processes whose command line names the cluster's temp dir, and their children."""
    import psutil

    me = os.getpid()
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != me and any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
                found.add(p)
                found.update(p.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def kill_cluster(temp_dir: str) -> None:
    import psutil

    for _ in range(3):  # workers started while we kill get a second pass
        procs = cluster_processes(temp_dir)
        if not procs:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(procs), timeout=15)
