"""Which address the trainer's links listen on and bind to (the trainer group's rendezvous,
operators/trainer/collective.py, and the weight server's, operators/trainer/weight_server.py).

The rule: nothing wider than needed. Every member on one node: 127.0.0.1, so nothing off the
machine can reach a trainer's sockets. Members on several nodes: the serving end listens on its
node's address as Ray reports it (the one the other nodes reach it at, never 0.0.0.0), and each
other member binds its own sockets (gloo's pairs connect both ways) to the address of its
interface on the route to the server. Torch-free and Ray-free: Ray is asked only when a Ray is
already running in this process (an operator run in one process never starts one).
"""

from __future__ import annotations

import socket
import sys

LOOPBACK = "127.0.0.1"


def _ray():
    """The Ray module when this process is connected to a Ray cluster, else None (never starts one)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_ip() -> str:
    """This node's address as Ray reports it (the one other nodes reach it at); loopback outside Ray."""
    ray = _ray()
    return ray.util.get_node_ip_address() if ray is not None else LOOPBACK


def single_node() -> bool:
    """Whether every node of this process's Ray cluster is this one (outside Ray: yes)."""
    ray = _ray()
    return ray is None or sum(1 for node in ray.nodes() if node.get("Alive")) <= 1


def serving_host() -> str:
    """Where a server that any process of the run may join listens (the weight server: its
    readers are placed by Ray Data, anywhere in the cluster): loopback on a one-node cluster, else
    this node's address as Ray reports it."""
    return LOOPBACK if single_node() else node_ip()


def local_address(peer: str) -> str:
    """The address of this node's interface on the route to `peer` (what a member that joins
    `peer`'s rendezvous binds its own sockets to): loopback for a loopback peer. Asks the kernel's
    routing table (a UDP socket's connect sends nothing)."""
    if peer == LOOPBACK or peer == "localhost":
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def reachable(host: str, port: int, timeout: float = 5.0) -> bool:
    """Whether something accepts TCP connections at (host, port): a server whose process died
    refuses them at once (its node gone: no answer within `timeout`)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
