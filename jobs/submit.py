"""`trajflow submit / status / stop`: the same job on a running Ray cluster, via the Ray Jobs API.

The config is validated here, before anything is sent. Paths in it (run dir, model) are made
absolute, and the resolved config travels inline in the entrypoint
(`python -m trajflow.jobs.cli run --config-b64 ...`, zlib + base64), so the cluster needs trajflow installed in
its Python but no copy of the config file. The run dir must be on storage the cluster's nodes can
write (the trainer actor writes logs and checkpoints there); on one machine any local path works.

The job's driver runs `trajflow run` on the head node; it connects to the cluster (RAY_ADDRESS is
set by the job supervisor), and the stages' resources (`generator.resources`,
`trainer.resources`, ...) place the actors on nodes.
"""

from __future__ import annotations

import asyncio
import base64
import shlex
import sys
import time
import zlib
from pathlib import Path

from trajflow.jobs.config import JobConfig
from trajflow.jobs.run import default_run_dir
from trajflow.pipelines.ray.embedded import WORKER_ENV

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def entrypoint_for(config: JobConfig, python: str = "python") -> tuple[str, Path]:
    run_dir = Path(config.run_dir) if config.run_dir is not None else default_run_dir(config)
    update = {"run_dir": run_dir.resolve()}
    if config.model is not None:
        update["model"] = Path(config.model).resolve()
    resolved = config.model_copy(update=update)
    payload = base64.urlsafe_b64encode(zlib.compress(resolved.to_yaml().encode(), 9)).decode()
    cmd = f"{shlex.quote(python)} -m trajflow.jobs.cli run --no-progress --config-b64 {payload}"
    return cmd, run_dir.resolve()


async def _tail(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


def submit(config: JobConfig, address: str, *, wait: bool = True, python: str = "python",
           submission_id: str | None = None) -> int:
    client = _client(address)
    entrypoint, run_dir = entrypoint_for(config, python)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        submission_id=submission_id,
        runtime_env={"env_vars": dict(WORKER_ENV)},  # the driver then adds none of its own
        metadata={"trajflow_run_dir": str(run_dir), "trajflow_strategy": config.strategy},
    )
    print(f"trajflow: submitted job {job_id} to {address} (run dir {run_dir})", flush=True)
    if not wait:
        print(f"trajflow: follow it with `trajflow status {job_id} --address {address}`")
        return 0
    try:
        asyncio.run(_tail(client, job_id))
    except KeyboardInterrupt:
        print(f"\ntrajflow: stopped following; the job keeps running (`trajflow stop {job_id} --address {address}`)",
              file=sys.stderr)
        return 130
    status = _wait_terminal(client, job_id)
    info = client.get_job_info(job_id)
    print(f"trajflow: job {job_id} {status}" + (f": {info.message}" if info.message and status != "SUCCEEDED" else ""),
          flush=True)
    return 0 if status == "SUCCEEDED" else 1


def _wait_terminal(client, job_id: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def status(job_id: str, address: str) -> int:
    client = _client(address)
    info = client.get_job_info(job_id)
    status = str(info.status.value)
    parts = [f"{job_id}: {status}"]
    if info.message:
        parts.append(info.message.strip().splitlines()[0])
    if info.metadata and info.metadata.get("trajflow_run_dir"):
        parts.append(f"run dir {info.metadata['trajflow_run_dir']}")
    print(" | ".join(parts))
    return 0


def stop(job_id: str, address: str, wait: float = 30.0) -> int:
    client = _client(address)
    client.stop_job(job_id)
    status = _wait_terminal(client, job_id, timeout=wait)
    print(f"{job_id}: {status}")
    return 0 if status in TERMINAL else 1
