"""Event-driven wake-ups for Ray Data's streaming executor: one contained patch, applied by
`RLPipeline.build()`.

Why. Each turn of the executor's scheduling loop (Ray 2.60,
`ray/data/_internal/execution/streaming_executor_state.py::process_completed_tasks`) calls

    ray.wait(every active task, num_returns=len(all of them), timeout=0.1)

so while any task stays active — a generator blocked on its admission permit, the trainer in the
middle of a step — the loop wakes only every 100 ms, and every hand-over between two operators
waits for that tick. Ray Data's default threaded metadata fetcher adds one more tick per block
(a block is emitted on the loop turn *after* its metadata arrived). In trajflow's synchronous mode
every stage waits for the previous one, so each hop is on the critical path: measured here, a
step of 0.2 s compute took 0.53 s (`python -m benchmarks.run_all --only orchestration`). Upstream:
ray-project/ray#42377 and #45934 (100 ms gaps between tasks, open).

What. Inside that one module only, `ray.wait` with `num_returns == len(refs)` becomes "return as
soon as *one* task has news, with every task that has news", bounded by the same timeout; and the
metadata of a block is read inline (`RAY_DATA_METADATA_PREFETCH_ON_THREAD=0` semantics), so a
block is handed on in the loop turn that saw it. The loop then sleeps in `ray.wait` until something
happens instead of ticking, so the driver's CPU cost goes *down* when idle. One guard: a task whose
output is ready but left unread (Ray Data's output backpressure) would wake the loop at once on
every turn; when the ready set repeats, the loop waits for *new* news at most `REPEAT_PACE_S`.

Scope. Only the driver process runs the executor, so patching the driver is enough; once applied
it holds for every Ray Data execution in that process (it changes when the loop wakes, never what
it does). The patch is
applied only to Ray versions whose executor was read (`VERIFIED_RAY`); on others it logs once and
leaves Ray Data alone (the pipeline stays correct, only slower). `revert()` restores Ray Data, for
side-by-side measurements; `TRAJFLOW_EXECUTOR_PATCH=0` turns it off for a run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

log = logging.getLogger("trajflow")

VERIFIED_RAY = ("2.60.",)  # Ray versions whose streaming executor source this patch was checked against
REPEAT_PACE_S = 0.005  # how long the loop waits for new news while an already-seen task stays ready


class EventDrivenWait:
    """Stands in for the `ray` module inside `streaming_executor_state` (every other attribute is
    Ray's own). Its `wait` changes only the executor's "wait for all, up to a timeout" call."""

    def __init__(self, real: Any = ray) -> None:
        self._real = real
        self._seen_ready: frozenset = frozenset()
        self.wakeups = 0  # loop turns that returned with news (for measurements)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True):
        real_wait = self._real.wait
        if num_returns != len(refs) or timeout is None or timeout == 0:
            return real_wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
        everything = dict(num_returns=len(refs), timeout=0, fetch_local=fetch_local)
        ready, rest = real_wait(refs, **everything)
        if not ready or set(ready) <= self._seen_ready:
            # Nothing new: sleep until some other task has news (or, if an already-seen task is
            # still ready and unread, for at most the pace), then collect everything ready.
            if rest:
                real_wait(rest, num_returns=1, timeout=min(timeout, REPEAT_PACE_S) if ready else timeout,
                          fetch_local=fetch_local)
                ready, rest = real_wait(refs, **everything)
        self._seen_ready = frozenset(ready)
        self.wakeups += bool(ready)
        return ready, rest


_saved: dict[str, Any] = {}


def ray_version_verified(version: str | None = None) -> bool:
    return (version or ray.__version__).startswith(VERIFIED_RAY)


def apply() -> bool:
    """Patch the driver's Ray Data executor (idempotent). Returns whether the patch is active."""
    if _saved:
        return True
    if os.environ.get("TRAJFLOW_EXECUTOR_PATCH", "1") == "0":
        return False
    if not ray_version_verified():
        log.info("trajflow: Ray %s is not in %s: Ray Data's executor is left unpatched "
                 "(expect up to 0.1 s per operator hop)", ray.__version__, VERIFIED_RAY)
        return False
    from ray.data._internal.execution import metadata_fetcher, streaming_executor_state

    _saved["ray"] = streaming_executor_state.ray
    _saved["prefetch_on_thread"] = metadata_fetcher._PREFETCH_ON_THREAD
    streaming_executor_state.ray = EventDrivenWait(ray)
    metadata_fetcher._PREFETCH_ON_THREAD = False
    return True


def revert() -> None:
    """Restore Ray Data's own executor behaviour (for side-by-side measurements)."""
    if not _saved:
        return
    from ray.data._internal.execution import metadata_fetcher, streaming_executor_state

    streaming_executor_state.ray = _saved.pop("ray")
    metadata_fetcher._PREFETCH_ON_THREAD = _saved.pop("prefetch_on_thread")


def active() -> bool:
    return bool(_saved)
