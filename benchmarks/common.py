"""Shared helpers of the benchmarks: run a pipeline, sample actor memory, describe the machine."""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass, field

import polars as pl
import psutil


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return (f"{os.cpu_count()} CPUs ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


class Sampler:
    """Calls `sample()` every `interval` seconds on a thread of its own, from entering a `with`
    block to leaving it."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class ActorMemory(Sampler):
    """Peak RSS of the pipeline's own actors (the Ray Data operator actors and the policy store).

    Only this driver's descendants count (not other Ray sessions on the machine), minus processes
    that already held a pipeline role at `__enter__` (a previous run's lingering actors); Ray's
    internal actors and idle workers are skipped. Process titles
    change with the running method (`ray::MapWorker(MapBatches(Generate)).submit`), so peaks are
    kept per PID and summed per role (`Generate`, `PolicyStore`, ...).
    """

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(interval)
        self._peaks: dict[int, tuple[str, float]] = {}

    @staticmethod
    def role(title: str) -> str | None:
        name = title.split()[0].removeprefix("ray::") if title.startswith("ray::") else ""
        if name.startswith("MapWorker(MapBatches("):
            return name.removeprefix("MapWorker(MapBatches(").split(")")[0]
        if name.split(".")[0] == "PolicyStoreActor":
            return "PolicyStore"
        return None

    def _role_of(self, proc: psutil.Process) -> str | None:
        try:
            return self.role(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def sample(self) -> None:
        for proc in psutil.Process().children(recursive=True):
            if proc.pid in self._before:
                continue
            role = self._role_of(proc)
            try:
                rss = proc.memory_info().rss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if role is not None:
                self._peaks[proc.pid] = (role, max(rss, self._peaks.get(proc.pid, (role, 0.0))[1]))

    @property
    def peaks_mb(self) -> dict[str, float]:
        per_role: dict[str, float] = {}
        for role, rss in self._peaks.values():
            per_role[role] = per_role.get(role, 0.0) + rss
        return per_role

    def __enter__(self) -> "ActorMemory":
        self._before = {p.pid for p in psutil.Process().children(recursive=True) if self._role_of(p)}
        return super().__enter__()


class ProcessTree(Sampler):
    """Peak PSS, process count and thread count of a process (default: this one) and all its
    descendants — with an embedded Ray, that is the whole run: driver, Ray's own services, idle
    workers and actors."""

    def __init__(self, interval: float = 1.0, pid: int | None = None) -> None:
        super().__init__(interval)
        self.pid = pid  # the tree's root (default: this process)
        self.peak_pss_bytes = 0
        self.peak_processes = 0
        self.peak_threads = 0

    def sample(self) -> None:
        try:
            me = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # the root has exited
            return
        pss = threads = processes = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                pss += proc.memory_full_info().pss
                threads += proc.num_threads()
                processes += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
        self.peak_processes = max(self.peak_processes, processes)
        self.peak_threads = max(self.peak_threads, threads)



@dataclass
class RunResult:
    metrics: pl.DataFrame
    wall_seconds: float
    memory_mb: dict[str, float] = field(default_factory=dict)
    layout: list[list[str]] = field(default_factory=list)  # stage names per actor process
    tree: ProcessTree | None = None

    # Steady state: the steps after `skip` (start-up) and before the last one (which copies the
    # final version into the store's ownership, and has no generation left to overlap with).
    def _per_step(self, column: str, skip: int) -> float:
        values = self.metrics[column].to_list()
        return (values[-2] - values[skip]) / max(1, len(values) - 2 - skip)

    def seconds_per_step(self, skip: int = 3) -> float:
        """Steady-state wall seconds per step, measured by the driver as metrics rows arrive —
        from outside the stages."""
        return self._per_step("finished_at", skip)

    def driver_cpu_per_step(self, skip: int = 3) -> float:
        """CPU seconds of the driver process (Ray Data's executor, the source, all its threads)."""
        return self._per_step("driver_cpu", skip)

    @staticmethod
    def _stage_columns(m: pl.DataFrame) -> dict[str, pl.Series]:
        """Compute seconds of each stage in each row: the time the stage's process spent in it
        (`seconds/stage/<stage>`), except that generation counts without its wait for an
        admission permit (the generator's own `generate_seconds`)."""
        out = {c.removeprefix("seconds/stage/"): m[c] for c in m.columns if c.startswith("seconds/stage/")}
        if "generate" in out and "seconds/generate" in m.columns:
            out["generate"] = m["seconds/generate"].fill_null(0.0)
        return out

    def stage_seconds(self, skip: int = 3) -> dict[str, float]:
        """Compute seconds per step of each stage, steady state (see _stage_columns)."""
        return {name: float(values.mean()) for name, values in self._stage_columns(self.metrics[skip + 1:-1]).items()}

    def _critical(self, stages: dict[str, float], synchronous: bool, cores: int) -> float:
        if synchronous:
            return sum(stages.values())
        per_process = [sum(stages.get(name, 0.0) for name in group) for group in self.layout]
        return max(max(per_process, default=0.0), sum(stages.values()) / cores)

    def critical_path(self, synchronous: bool, cores: int = 2, skip: int = 3) -> float:
        """The compute a step cannot go below. Sync: every stage in turn, so their sum. Async: the
        busiest process (its stages run one after another), or all compute spread over the cores
        if that is more."""
        return self._critical(self.stage_seconds(skip), synchronous, cores)

    def compute_seconds(self, synchronous: bool, cores: int = 2, first: int = 1) -> tuple[float, float]:
        """(the critical path of each step from `first` on, summed: what those steps cannot go
        below; all their stages' compute, summed)."""
        columns = self._stage_columns(self.metrics[first:])
        rows = [{name: float(values[i]) for name, values in columns.items()} for i in range(self.metrics.height - first)]
        return (sum(self._critical(r, synchronous, cores) for r in rows), sum(sum(r.values()) for r in rows))

    def trainer_busy(self, skip: int = 3) -> float:
        """Steady-state fraction of wall time the train stage computes."""
        return self.stage_seconds(skip).get("train", 0.0) / self.seconds_per_step(skip)


def top_k_for(strategy: str, k: int = 8) -> dict:
    """The record's top-k a strategy needs to run (Score Centering: the sampler's top-k), else none."""
    from trajflow.operators.strategies import resolve_strategy

    return {"top_k_logprobs": k} if resolve_strategy(strategy).uses_current_top_k else {}


def run_pipeline(*, executor_patch: bool = True, **config) -> RunResult:
    """Run one pipeline to the end on the current Ray; `executor_patch=False` runs Ray Data's
    executor as shipped (pipelines/ray/patches.py, patch 4), for side-by-side comparisons."""
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.ray.patches import executor as patch
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(**config))
    layout = [[s.name for s in group] for group in pipe.process_groups()]
    previous = os.environ.get("TRAJFLOW_EXECUTOR_PATCH")
    os.environ["TRAJFLOW_EXECUTOR_PATCH"] = "1" if executor_patch else "0"
    patch.revert()
    rows = []
    started = time.perf_counter()
    try:
        with ActorMemory() as memory, ProcessTree() as tree:
            for row in pipe.iter_metrics():
                row["finished_at"] = time.perf_counter() - started
                row["driver_cpu"] = time.process_time()
                rows.append(row)
    finally:
        if previous is None:
            os.environ.pop("TRAJFLOW_EXECUTOR_PATCH")
        else:
            os.environ["TRAJFLOW_EXECUTOR_PATCH"] = previous
        patch.revert()
    return RunResult(pl.DataFrame(rows), time.perf_counter() - started, memory.peaks_mb, layout, tree)


def run_script(script: str, *argv: str, timeout: float = 1800) -> dict:
    """Run `script` in a fresh Python process (cold: nothing imported, no Ray) from the repository
    root; it reports by printing one line `RESULT <json>`."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"benchmark process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def ensure_ray() -> None:
    import ray
    from ray.data import DataContext

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    DataContext.get_current().enable_progress_bars = False


def mean_std(values: list[float], digits: int = 3) -> str:
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}"


def table(rows: list[dict]) -> str:
    """Rows of the same keys as a markdown table (floats to 3 decimals)."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:,.3f}" if isinstance(v, float) else "" if v is None else str(v)
