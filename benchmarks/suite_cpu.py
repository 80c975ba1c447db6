"""Benchmark: where the test suite's CPU goes, by kind of process.

Runs the README's test command (`python -m pytest -q`, from the repository root, in this
interpreter) and samples every process of the machine every 0.3 s from /proc: CPU seconds
(user + system) used while the suite ran, each process named by its command line (a Ray
worker by the title Ray gives it once it hosts an actor: `ray::MapWorker(MapBatches(TrainStep))`,
`ray::PolicyStoreActor`, ...). A process that lives under 0.3 s may be missed; kernel threads and
processes older than the suite count only what they used during it. The machine should be
otherwise quiet: other work lands in the table under its own name.

    python -m benchmarks.suite_cpu [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import Sampler

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def kind(cmdline: str) -> str:
    """The process's kind, from its command line."""
    if not cmdline:
        return "(no command line: kernel threads, exited processes)"
    if "ray::" in cmdline:
        return "ray::" + re.split(r"[ .]", cmdline.split("ray::", 1)[1])[0][:60]
    for name in ("gcs_server", "raylet", "log_monitor", "watchdog.py", "ipykernel", "jupyter"):
        if name in cmdline:
            return name
    if "trajflow.jobs.cli" in cmdline or re.search(r"/trajflow (run|replay|submit|eval)", cmdline):
        return "trajflow command (driver)"
    if "pytest" in cmdline or "xdist" in cmdline or "exec(eval(sys.stdin.readline()))" in cmdline:
        return "pytest and its xdist workers"
    return cmdline.split()[0].rsplit("/", 1)[-1][:40]


class ProcessCPU(Sampler):
    """CPU seconds per process over the sampling window: (pid, start time) -> [kind, first, last]."""

    def __init__(self, interval: float = 0.3) -> None:
        super().__init__(interval)
        self.seen: dict[tuple[str, str], list] = {}
        self._first = True  # processes already running count from the first sample on

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            entry = self.seen.setdefault((pid, fields[19]), [kind(cmdline), cpu if self._first else 0.0, cpu])
            if cmdline and (entry[0].startswith("(") or "ray::" in cmdline):  # Ray retitles its workers
                entry[0] = kind(cmdline)
            entry[2] = max(entry[2], cpu)
        self._first = False

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.sample()  # what the last processes used since the previous sample

    def by_kind(self) -> tuple[Counter, Counter]:
        seconds, count = Counter(), Counter()
        for name, first, last in self.seen.values():
            seconds[name] += last - first
            count[name] += 1
        return seconds, count


def report(pytest_args: list[str]) -> str:
    started = time.monotonic()
    with ProcessCPU() as sampler:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                              cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    seconds, count = sampler.by_kind()
    total = sum(seconds.values())
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line and "passed" in line),
                   f"pytest exited {proc.returncode}")
    lines = [f"`python -m pytest -q {' '.join(pytest_args)}`: {summary.strip('= ')}; wall {wall:.0f} s, "
             f"{total:.0f} CPU s sampled ({total / wall / (os.cpu_count() or 1):.0%} of {os.cpu_count()} cores)",
             "", "| process kind | processes | CPU s | share |", "|---|---|---|---|"]
    for name, cpu in seconds.most_common():
        if cpu >= 1.0:
            lines.append(f"| {name} | {count[name]} | {cpu:.1f} | {cpu / total:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    print(report(parser.parse_args().pytest_args))


if __name__ == "__main__":
    main()
