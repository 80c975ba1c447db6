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


class ActorMemory:
    """Peak RSS of the pipeline's own actors (the Ray Data operator actors and the policy store).

    Only this driver's descendants count (not other Ray sessions on the machine), minus processes
    that already held a pipeline role at `__enter__` (a previous run's lingering actors); Ray's
    internal actors and idle workers are skipped. Process titles
    change with the running method (`ray::MapWorker(MapBatches(Generate)).submit`), so peaks are
    kept per PID and summed per role (`Generate`, `PolicyStore`, ...).
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def role(title: str) -> str | None:
        name = title.split()[0].removeprefix("ray::") if title.startswith("ray::") else ""
        if name.startswith("MapWorker(MapBatches("):
            return name.removeprefix("MapWorker(MapBatches(").split(")")[0]
        if name.split(".")[0] == "PolicyStore":
            return "PolicyStore"
        return None

    def _role_of(self, proc: psutil.Process) -> str | None:
        try:
            return self.role(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for proc in me.children(recursive=True):
                if proc.pid in self._before:
                    continue
                role = self._role_of(proc)
                try:
                    rss = proc.memory_info().rss / 2**20
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if role is not None:
                    self._peaks[proc.pid] = (role, max(rss, self._peaks.get(proc.pid, (role, 0.0))[1]))
            self._stop.wait(self.interval)

    @property
    def peaks_mb(self) -> dict[str, float]:
        per_role: dict[str, float] = {}
        for role, rss in self._peaks.values():
            per_role[role] = per_role.get(role, 0.0) + rss
        return per_role

    def __enter__(self) -> "ActorMemory":
        self._before = {p.pid for p in psutil.Process().children(recursive=True) if self._role_of(p)}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class RunResult:
    metrics: pl.DataFrame
    wall_seconds: float
    memory_mb: dict[str, float] = field(default_factory=dict)

    def seconds_per_step(self, skip: int = 3) -> float:
        """Steady-state wall seconds per step: from the end of step `skip` to the end (no startup)."""
        t = self.metrics["finished_at"].to_list()
        return (t[-1] - t[skip]) / max(1, len(t) - 1 - skip)


def run_pipeline(**config) -> RunResult:
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(**config))
    rows = []
    started = time.perf_counter()
    with ActorMemory() as memory:
        for row in pipe.iter_metrics():
            row["finished_at"] = time.perf_counter() - started
            rows.append(row)
    return RunResult(pl.DataFrame(rows), time.perf_counter() - started, memory.peaks_mb)


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
