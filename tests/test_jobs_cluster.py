"""`trajflow submit` to a real two-node Ray cluster on 127.0.0.1 (Ray Jobs API).

The head node offers the custom resource `gen_node`, the second node (a second raylet on the same
machine, its own ports) offers `train_node`. The quickstart is submitted with
`generator.resources={gen_node: 0.1}` and `trainer.resources={train_node: 0.1}`; the test checks
the job SUCCEEDED and that generation and training ran on different nodes — from the run dir's
placement.json (Ray state API, per stage) and the trainer's own node id in every metrics row.
A second job trains with `trainer.num_workers: 2` and `trainer.placement: spread`: its two
data-parallel workers (one gloo group across the nodes) report two different nodes. The two jobs
run at the same time.

The cluster gets its own temp dir, ports and auth token; at the end (also on failure) exactly
its processes are killed, by pid. (`ray stop` is not used: it would stop every Ray on the
machine, including other sessions'.)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl
import pytest
from ray_cluster import free_port, kill_cluster, node_ports

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

pytest.importorskip("aiohttp", reason="the Ray Jobs API needs ray[default] (the `dev`/`cluster` extras)")


@pytest.fixture(scope="module")
def two_node_cluster():
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("no `ray` executable beside the test's Python")
    temp_dir = tempfile.mkdtemp(prefix="tfray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = free_port(), free_port()
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    head = [str(ray_bin), "start", "--head", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}", '--resources={"gen_node": 1}',
            f"--ray-client-server-port={free_port()}", *common, *node_ports()]
    worker = [str(ray_bin), "start", f"--address=127.0.0.1:{gcs_port}", '--resources={"train_node": 1}',
              *common, *node_ports()]
    try:
        for cmd in (head, worker):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        yield {"address": f"http://127.0.0.1:{dashboard_port}", "env": env}
    finally:
        kill_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def start_submit(cluster: dict, run_dir: Path, submission_id: str, settings: list[str]) -> subprocess.Popen:
    """`trajflow submit quickstart --set S...` to the cluster, running; its output goes to files
    beside the run dir (two jobs at once: neither waits on a full pipe)."""
    cmd = [sys.executable, "-m", "trajflow.jobs.cli", "submit", "quickstart", "--address", cluster["address"],
           "--run-dir", str(run_dir), "--python", sys.executable, "--submission-id", submission_id]
    small = ["prompts_per_step=8", "group_size=4", "eval_every=0"]  # these tests are about placement
    cmd += [arg for setting in small + settings for arg in ("--set", setting)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.out", "w") as out, open(f"{run_dir}.err", "w") as err:
        return subprocess.Popen(cmd, env=cluster["env"], stdout=out, stderr=err, text=True)


def succeeded(proc: subprocess.Popen, run_dir: Path, submission_id: str) -> str:
    """Waits for a `start_submit`; asserts the job SUCCEEDED; its stdout."""
    proc.wait(timeout=400)
    out, err = (Path(f"{run_dir}.{name}").read_text() for name in ("out", "err"))
    explain = f"exit {proc.returncode}\n{out[-6000:]}\n{err[-3000:]}"
    assert proc.returncode == 0, explain
    assert f"trajflow: job {submission_id} SUCCEEDED" in out, explain
    return out


@pytest.fixture(scope="module")
def jobs(two_node_cluster, tmp_path_factory) -> dict:
    """Both tests' jobs, submitted at once (the two fit on the cluster's 4 CPUs together, and
    side by side they share the wait for submission and start-up): submission id -> (run dir,
    the submit command's stdout)."""
    tmp = tmp_path_factory.mktemp("jobs")
    settings = {
        "trajflow-two-nodes": ["steps=4", "checkpoint_every=2", "save_all_versions=false",
                               "generator.resources={gen_node: 0.1}", "trainer.resources={train_node: 0.1}"],
        "trajflow-two-workers": ["steps=3", "save_all_versions=false", "tensorboard=false",
                                 "generator.resources={gen_node: 0.1}", "trainer.num_workers=2",
                                 "trainer.placement=spread"]}
    procs = {sid: start_submit(two_node_cluster, tmp / sid, sid, s) for sid, s in settings.items()}
    try:
        return {sid: (tmp / sid, succeeded(proc, tmp / sid, sid)) for sid, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_submit_places_generation_and_training_on_different_nodes(two_node_cluster, jobs):
    address, env = two_node_cluster["address"], two_node_cluster["env"]
    run_dir, out = jobs["trajflow-two-nodes"]
    assert re.search(r"^step 3 \(100%\) \| reward ", out, re.M)  # the job's logs were streamed back

    status = subprocess.run([sys.executable, "-m", "trajflow.jobs.cli", "status", "trajflow-two-nodes",
                             "--address", address], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and status.stdout.startswith("trajflow-two-nodes: SUCCEEDED"), status.stdout
    # the cluster is token-protected: a wrong token, or a job it does not have, is one line and exit 2
    for command, job, token, says in (("status", "trajflow-two-nodes", "0" * 32, "authentication token"),
                                      ("stop", "trajflow-two-nodes", "0" * 32, "authentication token"),
                                      ("status", "no-such-job", env["RAY_AUTH_TOKEN"], "no such job")):
        proc = subprocess.run([sys.executable, "-m", "trajflow.jobs.cli", command, job, "--address", address],
                              env=dict(env, RAY_AUTH_TOKEN=token), capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (command, proc.stdout, proc.stderr)
        assert lines[0].startswith(f"trajflow: {command}: ") and "Traceback" not in proc.stderr

    placement = json.loads((run_dir / "placement.json").read_text())
    stages, nodes = placement["stages"], placement["nodes"]
    assert len(nodes) == 2
    (gen_node,) = stages["Generate"]
    (train_node,) = stages["TrainStep"]
    assert gen_node != train_node
    assert nodes[gen_node]["resources"].get("gen_node") == 1
    assert nodes[train_node]["resources"].get("train_node") == 1
    # the trainer reports its own node in every metrics row
    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == [0, 1, 2, 3]
    assert set(metrics["trainer_node"].to_list()) == {train_node}


def test_two_trainer_workers_spread_over_the_two_nodes(jobs):
    run_dir, _ = jobs["trajflow-two-workers"]
    metrics = pl.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].to_list() == [0, 1, 2]
    assert (metrics["trainer/num_workers"] == 2).all()
    nodes = {tuple(row.split(",")) for row in metrics["trainer/nodes"].to_list()}
    assert len(nodes) == 1, nodes  # the same two workers for the whole run
    (worker_nodes,) = nodes
    assert len(worker_nodes) == 2 and worker_nodes[0] != worker_nodes[1], worker_nodes
    assert set(worker_nodes) == set(json.loads((run_dir / "placement.json").read_text())["nodes"])
