"""Terminal output of the CLI: lines within WIDTH columns, tables, and Ray's C++ notices kept out
of a run's output (`--verbose` shows them).

Ray's core worker inside the driver logs through its own C++ logger straight to file descriptor
2, e.g. an error-level line for every Ray Data actor pool:

    [... E 17036 17036] core_worker.cc:2465: Actor with class name: 'MapWorker(...)' ... has
    constructor arguments in the object store and max_restarts > 0 ...

which is about Ray Data's own defaults, not the user's job. `filtered_stderr()` routes fd 2
through a pipe and a thread that drops the lines matching NOISE and passes everything else on
unchanged; Python's `sys.stderr` (tracebacks, warnings, the progress bar) keeps writing to the
terminal directly. The same lines stay in Ray's own log files (python-core-driver-*.log).
"""

from __future__ import annotations

import io
import os
import re
import sys
import textwrap
import threading
from contextlib import contextmanager

WIDTH = 100  # every line the CLI prints fits this many columns (paths excepted)


def wrap(text: str) -> str:
    """Lines longer than WIDTH wrapped, continuation lines indented."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ") if len(line) > WIDTH else line
                     for line in text.splitlines())


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain right-aligned table of `rows` (dicts); columns are (header, key, format), e.g.
    ("reward", "reward_mean", "{:.3f}"). Columns no row has are left out; a missing value is '-';
    columns that would pass WIDTH are left out from the right."""
    columns = [c for c in columns if any(r.get(c[1]) is not None for r in rows)]
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, (header, _, _) in enumerate(columns)]
    keep, used = 0, -2
    while keep < len(columns) and used + 2 + widths[keep] <= WIDTH:
        used += 2 + widths[keep]
        keep += 1
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns[:keep], widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row[:keep], widths)) for row in cells]
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if fmt.endswith("d}"):
        value = int(value)
    return fmt.format(value)

NOISE = (
    re.compile(rb"core_worker\.cc:\d+: Actor with class name: .* max_restarts > 0"),
)


def is_noise(line: bytes) -> bool:
    return any(pattern.search(line) for pattern in NOISE)


def _pump(read_fd: int, out_fd: int) -> None:
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
        kept = b"".join(line + b"\n" for line in lines if not is_noise(line))
        if kept:
            os.write(out_fd, kept)
    if pending and not is_noise(pending):
        os.write(out_fd, pending)
    os.close(read_fd)


@contextmanager
def filtered_stderr(enabled: bool = True):
    """Within the block, C-level writes to fd 2 pass through the NOISE filter. Only when Python's
    stderr is fd 2 itself (a terminal, a file, a pipe): not in a notebook kernel, whose fd 2 is
    not what the user sees."""
    try:
        own_fd = isinstance(sys.stderr, io.TextIOWrapper) and sys.stderr.fileno() == 2
    except (OSError, ValueError):
        own_fd = False
    if not enabled or not own_fd:
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(2)  # the real stderr
    read_fd, write_fd = os.pipe()
    python_stderr = sys.stderr
    sys.stderr = open(os.dup(terminal), "w", buffering=1, encoding=python_stderr.encoding,
                      errors=python_stderr.errors)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, terminal), name="trajflow-stderr", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = python_stderr
        os.dup2(terminal, 2)  # the pipe's last write end closes (unless a child inherited fd 2)
        pump.join(timeout=2.0)
        if not pump.is_alive():  # else a child process still holds the pipe: the pump keeps writing
            os.close(terminal)
