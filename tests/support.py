"""What several test modules share: the CLI as a subprocess or in this process, a run killed at
a checkpoint, the Ray session dirs a process left, a run dir's trajectory log, and a synchronous
pipeline run with its final weights.
(Test modules import from here, never from each other.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import polars as pl
import torch

from trajflow.pipelines.config import PipelineConfig
from trajflow.schemas import read_parquet

CLI = [sys.executable, "-m", "trajflow.jobs.cli"]
# the synchronous pipeline that data-parallel, sharded, LoRA and resumed runs must reproduce
SYNC = dict(steps=5, prompts_per_step=4, group_size=4, drop_zero_variance_groups=False, seed=1, max_staleness=0,
            inference_dtype="float32", optimizer={"minibatches_per_step": 2})


RAY_TMP = Path("/tmp/ray")


def sessions_of(pids: set[int]) -> list[Path]:
    """Ray session dirs left by these driver pids (Ray names them session_<time>_<pid>)."""
    names = {str(pid) for pid in pids}
    return [p for p in RAY_TMP.glob("session_*") if p.name != "session_latest" and p.name.rsplit("_", 1)[-1] in names]


# -- the CLI ------------------------------------------------------------------------------------
def cli_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def run_cli(args: list, timeout: float = 300, modules: Path | None = None) -> subprocess.CompletedProcess:
    """`trajflow ARGS` in a subprocess; `modules`: a file that gets, as the process exits, the
    modules it imported (one per line), e.g. to check what the driver never imports."""
    command = CLI
    if modules is not None:  # the last exit hook to run: registered before any of trajflow's or Ray's
        command = [sys.executable, "-c", "import atexit, sys\n"
                   f"atexit.register(lambda: open({str(modules)!r}, 'w').write('\\n'.join(sorted(sys.modules))))\n"
                   "from trajflow.jobs.cli import main\nsys.exit(main(sys.argv[1:]))"]
    return subprocess.run(command + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env())


def cli_in_process(args: list, capfd) -> subprocess.CompletedProcess:
    """The entry point's `main` in this process, for commands that end before Ray starts (a
    refusal, report, compare) or that run on the session's Ray (the caller asks for `ray_session`):
    no interpreter and imports to pay per call. Output is captured at the file descriptors
    (pytest's `capfd`), so a library writing past `sys.stdout` shows too."""
    from trajflow.jobs.cli import main

    capfd.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


# -- kill and resume ----------------------------------------------------------------------------
def wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver (as a crash would), then make sure every process it started is gone
    before the resume starts — by pid, only this run's processes."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
    except (psutil.NoSuchProcess, ProcessLookupError):  # it ended by itself (the caller checks how far it got)
        children = []
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=15)  # Ray's reaper takes its processes down
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def run_until_checkpoint_then_kill(args: list, run_dir: Path, version: int, log_path: Path) -> None:
    """`trajflow ARGS` as a subprocess, SIGKILLed (with everything it started) once checkpoint
    `version` is complete."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(CLI + [str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, env=cli_env(),
                                start_new_session=True)
        try:
            wait_for(lambda: (run_dir / "checkpoints" / f"step-{version:06d}" / "meta.json").is_file(), proc, 300,
                      f"checkpoint {version}")
        finally:
            kill_tree(proc)


def logged(run_dir: Path) -> pa.Table:
    parts = sorted((run_dir / "trajectories").glob("step=*/part-0.parquet"))
    return pa.concat_tables([read_parquet(p) for p in parts], promote_options="permissive")


# -- pipelines run in this process ---------------------------------------------------------------
def run_with_final_weights(config: PipelineConfig, steps: range | None = None, recorder=None,
                           initial_weights: dict | None = None) -> tuple[pl.DataFrame, dict[str, torch.Tensor]]:
    """A synchronous pipeline's own stages run in this process (pipelines/local.py) on the
    session's Ray: the real policy store actor, the train step's workers 1..N-1 as Ray actors
    (the sharded ones need a process each), no Ray Data start-up per run. `steps` (default: all)
    may start later, from `initial_weights` (the policy's, or every learner's by name), with a
    job's `recorder` as the train step's hooks (a resumed run). Returns the metrics and the final
    version's policy weights."""
    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.ray.trainer_group import RayWorkerGroup
    from trajflow.pipelines.rl_loop import RLPipeline

    steps = steps if steps is not None else range(config.steps)
    pipe = RLPipeline(config)
    if recorder is not None:
        hooks = pipe.hooks
        hooks.on_start, hooks.on_rows, hooks.on_step = recorder.on_start, recorder.on_rows, recorder.on_step
    try:
        if initial_weights is not None and "policy" not in initial_weights:  # a policy's weights alone
            initial_weights = {"policy": initial_weights}
        store = pipe.start_store(initial_version=steps.start, initial_weights=initial_weights)
        return run_in_process(pipe, final_weights=True, steps=steps, store=store, workers=RayWorkerGroup)
    finally:
        pipe.shutdown()


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def step_rows(seed: int = 0, rows: int = 12):
    """A step's trained rows: random prompts/responses over the warm start's vocabulary, behavior
    log-probs far from the policy's (so clips and M2PO's mask act), one token outside the loss."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 40, rng.integers(4, 9)).tolist() for _ in range(rows)]
    responses = [rng.integers(4, 40, rng.integers(2, 7)).tolist() for _ in range(rows)]
    inference = [(-rng.uniform(0.5, 6.0, len(r))).astype(np.float32).tolist() for r in responses]
    loss_mask = [[i != 1 for i in range(len(r))] for r in responses]
    return pa.table({
        "prompt_tokens": pa.array(prompts, pa.list_(pa.int32())),
        "response_tokens": pa.array(responses, pa.list_(pa.int32())),
        "inference_logprobs": pa.array(inference, pa.list_(pa.float32())),
        "versions": pa.array([[0] * len(r) for r in responses], pa.list_(pa.int32())),
        "loss_mask": pa.array(loss_mask, pa.list_(pa.bool_())),
        "advantage": pa.array(rng.normal(size=rows).astype(np.float32)),
        "old_logprobs": pa.array([None] * rows, pa.list_(pa.float32())),
    })


def scored_step(pipe, prompts: int):
    """The pipeline's own operators for step 0 in one process, through old log-probs (no Ray):
    a store holding version 0, every stage's operator by name, and the batch the train step
    takes next."""
    from trajflow.engines.models import load_model, load_tokenizer
    from trajflow.pipelines.policy_store import InProcessStore

    store = InProcessStore(0, True)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    ops = {s.name: s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn for s in pipe.stages}
    batch = pipe.workload.prompt_source(load_tokenizer(pipe.model_path), 3, prompts).step_rows(0)
    for name in ("generate", "reward", "advantage", "filter", "old_logprobs"):
        batch = ops[name](batch)
    return store, ops, batch
