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
    """Peak RSS per Ray actor role, sampled from the process titles (`ray::MapWorker(MapBatches(X))`)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peaks_mb: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in psutil.process_iter(["cmdline", "memory_info"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if not cmd.startswith("ray::"):
                    continue
                role = cmd.split()[0].removeprefix("ray::").removeprefix("MapWorker(MapBatches(").rstrip(")")
                rss = proc.info["memory_info"].rss / 2**20 if proc.info["memory_info"] else 0.0
                self.peaks_mb[role] = max(self.peaks_mb.get(role, 0.0), rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "ActorMemory":
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


def mean_std(values: list[float]) -> str:
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"
