"""Weight sync and the trainer group across two Ray nodes that do not share 127.0.0.1 (issue #35).

The test makes a network namespace and a veth pair (10.213.N.1 here, 10.213.N.2 inside the
namespace), starts a Ray head node on 10.213.N.1 and a worker node inside the namespace on
10.213.N.2: the second node has its own loopback, so nothing bound to 127.0.0.1 on one node can
be reached from the other. tests/two_nodes.py (the driver, a subprocess connected to that
cluster) puts a trainer's weight server on the head node and a reader on the other, sends a
version, then joins the two in a trainer group and all-reduces. The test asserts the addresses
each side listens on: the trainer node's address as Ray reports it (not 0.0.0.0, not 127.0.0.1)
and the reader's own, and that the version arrived bitwise.

It needs root (network namespaces); where the namespace cannot be made, it is skipped with the
command that failed and its error. The cluster gets its own temp dir, ports and auth token, and
exactly its processes are killed at the end (tests/ray_cluster.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray_cluster import free_port, kill_cluster, node_ports

from trajflow.operators.trainer.addresses import LOOPBACK, local_address, serving_host

DRIVER = Path(__file__).with_name("two_nodes.py")


def test_one_node_is_loopback_only(ray_session):
    """The embedded Ray is one node: the weight server listens on 127.0.0.1 and so do its links."""
    assert serving_host() == LOOPBACK and local_address(LOOPBACK) == LOOPBACK


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}`: {proc.stderr.strip() or proc.stdout.strip()}")


@pytest.fixture(scope="module")
def network_namespace():
    """(host address, namespace address, namespace name): a veth pair into a fresh namespace."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add` as uid 0)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make a network namespace")
    tag = os.getpid() % 10000
    ns, outside, inside = f"tfns{tag}", f"tfh{tag}", f"tfw{tag}"
    subnet = f"10.213.{tag % 250}"
    host, guest = f"{subnet}.1", f"{subnet}.2"
    steps = [("ip", "netns", "add", ns),
             ("ip", "link", "add", outside, "type", "veth", "peer", "name", inside),
             ("ip", "link", "set", inside, "netns", ns),
             ("ip", "addr", "add", f"{host}/24", "dev", outside),
             ("ip", "link", "set", outside, "up"),
             ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{guest}/24", "dev", inside),
             ("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up"),
             ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")]
    try:
        for step in steps:
            try:
                _sh(*step)
            except RuntimeError as e:
                pytest.skip(f"cannot make a second network namespace here: {e}")
        yield host, guest, ns
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)  # its peer goes with it
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def netns_cluster(network_namespace):
    """A Ray head node on the host side (resource `trainer_node`) and a worker node inside the
    namespace (`reader_node`): (GCS address, env, host address, namespace address)."""
    host, guest, ns = network_namespace
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="tfxn", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    gcs_port = free_port()
    common = ["--num-cpus=1", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    head = [str(ray_bin), "start", "--head", "--include-dashboard=false", f"--node-ip-address={host}", f"--port={gcs_port}",
            '--resources={"trainer_node": 1}', f"--ray-client-server-port={free_port()}", *common, *node_ports()]
    worker = ["ip", "netns", "exec", ns, str(ray_bin), "start", f"--address={host}:{gcs_port}",
              f"--node-ip-address={guest}", '--resources={"reader_node": 1}', *common, *node_ports()]
    try:
        for cmd in (head, worker):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        yield f"{host}:{gcs_port}", env, host, guest
    finally:
        kill_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_weight_sync_and_the_trainer_group_across_nodes_that_do_not_share_loopback(netns_cluster):
    address, env, host, guest = netns_cluster
    proc = subprocess.run([sys.executable, str(DRIVER), address], env=env, capture_output=True, text=True,
                          timeout=400, cwd=DRIVER.parent)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{json.dumps(out)}")
    assert out["nodes"] == sorted([host, guest]) and out["reader_ip"] == guest
    # the trainer's server: on its node's address as Ray reports it, and every socket it listens
    # on (its TCP store, its gloo link to the reader) bound there, nothing wider or loopback
    assert out["server_host"] == host
    assert out["server_sockets"] and {ip for ip, _ in out["server_sockets"]} == {host}, out
    # the reader's end of the link: bound to its own node's address (its interface toward the trainer)
    assert out["reader_sockets"] and {ip for ip, _ in out["reader_sockets"]} == {guest}, out
    assert out["bitwise"] and out["version"] == 1
    # a trainer group of one worker per node (operators/trainer/collective.py): each binds its own address
    (trainer, reader) = out["group"]
    assert trainer["sum"] == reader["sum"] == 3.0
    assert {ip for ip, _ in trainer["sockets"]} == {host} and {ip for ip, _ in reader["sockets"]} == {guest}, out
