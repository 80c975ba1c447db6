"""A run's output without Ray's, Ray Data's and transformers' own lines (`verbose=True` keeps them).

`RLPipeline.run`, `Replay.run` and the `trajflow` commands run inside `quiet_run(verbose)`: in a
terminal and in a notebook, what the user sees is trajflow's own lines. None of what it hides is
something a trajflow user can act on, and Ray keeps all of it in its log files:
- Ray's core worker in the driver logs through its C++ logger straight to file descriptor 2, e.g.
  an error-level line for every Ray Data actor pool:

      [... E 17036 17036] core_worker.cc:2465: Actor with class name: 'MapWorker(...)' ... has
      constructor arguments in the object store and max_restarts > 0 ...

  which is about Ray Data's own defaults. `filtered_stderr()` routes fd 2 through a pipe and a
  thread that drops the lines matching NOISE and passes everything else on unchanged. In a
  terminal, Python's `sys.stderr` (tracebacks, warnings, the progress bar) keeps writing there
  directly. A notebook kernel (ipykernel >= 6) shows what reaches fd 2 as the cell's stderr, so
  the filter runs there too.
- Ray Data's INFO lines on every execution (its start, its plan, "finished in N seconds"), its
  error line when a stage raises (the exception itself reaches the caller), its progress bars,
  and its issue detectors' advice about Ray's memory defaults.
- transformers' "Loading weights" bar for each model the driver loads (the workers' bars are off
  through `embedded.WORKER_ENV`).
All of it is put back as it was when the block ends. `quiet_ray()` is the part that stays for
the process: notices Ray logs once, while it starts.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

NOISE = (
    re.compile(rb"core_worker\.cc:\d+: Actor with class name: .* max_restarts > 0"),
)
# Ray notices that say nothing a trajflow user can act on: shown only with verbose.
NOISY_LOGGERS = (
    "ray._private.authentication.authentication_token_setup",  # "Token authentication is enabled ..."
    "ray.data._internal.progress",  # "Progress bars disabled. To enable, ..."
)
RAY_DATA_LOGGERS = ("ray.data", "ray.data._internal")  # per execution: start, plan, finished
# Ray Data's error line when a stage raises ("... Dataset execution will now abort. To ignore this
# exception and continue, set DataContext.max_errored_blocks"): the exception itself reaches the
# caller, where trajflow prints its one line or the traceback; the advice is not for its users.
ABORT_LOGGER = "ray.data._internal.execution.streaming_executor_state"

DRAINED = b"\x00trajflow: end of the filtered block\x00"  # the pump's cue: the block's output is out
_filtering = False  # fd 2 is the process's: one filter at a time, an inner block adds nothing


def quiet_ray(verbose: bool = False) -> None:
    level = logging.NOTSET if verbose else logging.ERROR
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def is_noise(line: bytes) -> bool:
    return any(pattern.search(line) for pattern in NOISE)


def _pump(read_fd: int, out_fd: int, drained: threading.Event) -> None:
    """Copy the pipe to `out_fd` line by line without NOISE until every write end is closed; set
    `drained` on DRAINED (the block's end: all it wrote is through)."""
    pending = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        kept = []
        for line in lines:
            if line.endswith(DRAINED):  # after a child's unfinished line, if any
                line = line[:-len(DRAINED)]
                drained.set()
                if not line:
                    continue
            if not is_noise(line):
                kept.append(line + b"\n")
        if kept:
            os.write(out_fd, b"".join(kept))
    if pending and not is_noise(pending):
        os.write(out_fd, pending)
    drained.set()
    os.close(read_fd)


@contextmanager
def filtered_stderr(enabled: bool = True) -> Iterator[None]:
    """Within the block, C-level writes to fd 2 pass through the NOISE filter."""
    global _filtering
    if not enabled or _filtering:
        yield
        return
    try:
        python_on_fd2 = isinstance(sys.stderr, io.TextIOWrapper) and sys.stderr.fileno() == 2
    except (OSError, ValueError):
        python_on_fd2 = False
    try:
        terminal = os.dup(2)  # what fd 2 was: the terminal, a file, a notebook kernel's pipe
    except OSError:  # no fd 2 (a daemon): nothing to filter
        yield
        return
    if sys.stderr is not None:
        sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    python_stderr = sys.stderr
    if python_on_fd2:  # Python's own writes go straight there, not through the pump
        sys.stderr = open(os.dup(terminal), "w", buffering=1, encoding=python_stderr.encoding,
                          errors=python_stderr.errors)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    drained = threading.Event()
    pump = threading.Thread(target=_pump, args=(read_fd, terminal, drained), name="trajflow-stderr", daemon=True)
    pump.start()
    _filtering = True
    try:
        yield
    finally:
        _filtering = False
        if python_on_fd2:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = python_stderr
        os.write(2, DRAINED + b"\n")
        os.dup2(terminal, 2)  # the pipe's last write end closes, unless a child inherited fd 2 (Ray's
        drained.wait(timeout=2.0)  # processes started in the block): then the pump goes on for them
        pump.join(timeout=0.1)
        if not pump.is_alive():
            os.close(terminal)


@contextmanager
def quiet_run(verbose: bool = False) -> Iterator[None]:
    """Ray's, Ray Data's and transformers' own output kept out of the block (module docstring);
    `verbose`: all of it shown. Put back as it was at the end."""
    if verbose:
        yield
        return
    import transformers.utils.logging as hf_logging
    from ray.data import DataContext

    context = DataContext.get_current()
    detectors = getattr(context, "issue_detectors_config", None)
    saved = (context.enable_progress_bars, list(detectors.detectors) if detectors is not None else None,
             [logging.getLogger(name).level for name in (*RAY_DATA_LOGGERS, ABORT_LOGGER)],
             hf_logging.is_progress_bar_enabled())
    context.enable_progress_bars = False
    if detectors is not None:
        detectors.detectors = []
    for name in RAY_DATA_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger(ABORT_LOGGER).setLevel(logging.CRITICAL)
    hf_logging.disable_progress_bar()
    try:
        with filtered_stderr():
            yield
    finally:
        bars, kept_detectors, levels, hf_bars = saved
        context.enable_progress_bars = bars
        if detectors is not None:
            detectors.detectors = kept_detectors
        for name, level in zip((*RAY_DATA_LOGGERS, ABORT_LOGGER), levels):
            logging.getLogger(name).setLevel(level)
        if hf_bars:
            hf_logging.enable_progress_bar()
