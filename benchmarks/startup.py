"""Benchmark: where `trajflow run quickstart` spends the time to the end of its first step, in wall
and CPU seconds, and what its whole process tree costs in memory.

The run is the real command line (`trajflow.jobs.cli.main(["run", "quickstart", ...])`) in a fresh
Python process (cold: nothing imported, no Ray running). Inside it, a few wrappers around the
driver's own functions timestamp its phases with its CPU seconds (`resource.getrusage`): imports
before Ray, `ray.init`, importing the pipeline (Ray Data; the driver imports no torch), building the
pipeline and the run's recorder, the policy store with the initial publish (version 0 from the
model's files), and Ray Data's first execution to the first metrics row. From outside, this process
samples every process of the run's tree every SAMPLE_SECONDS: its role (Ray's services, idle
workers, the pipeline's actors), its CPU seconds at the end of step 1, and its PSS. Each actor
also reports, in the first metrics row, the seconds from its process's creation to its stage
group's constructor (worker start, unpickling) and its stages' constructors (an operator named by
reference imports its module there: torch, transformers; model loads).

On 2 cores, the sum of every process's CPU seconds to the end of step 1, divided by 2, is a floor
on the wall time that no scheduling can beat: it is what bounds start-up once the critical path
is overlapped.

What the user waits for, several cold runs of the whole quickstart (30 steps), the median:

    python -m benchmarks.startup --runs 5          # about 1 min a run on an idle 2-core machine

prints per run the seconds from enter to the first step's status line and to exit, the process
tree's peak PSS and each process's share of it at that peak, then the medians (and the CPU
seconds per process of the median run). Times are only meaningful on a quiet machine (the load
average is printed with each run); PSS does not depend on the load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SAMPLE_SECONDS = 0.2
ROOT = Path(__file__).resolve().parent.parent

# The driver: the real CLI, with its phases timestamped (time.time(), CPU seconds of this process).
DRIVER = r'''
import json, os, resource, sys, time

EVENTS = open(os.environ["TRAJFLOW_BENCH_EVENTS"], "a", buffering=1)


def mark(name, **extra):
    r = resource.getrusage(resource.RUSAGE_SELF)
    EVENTS.write(json.dumps({"event": name, "t": time.time(), "cpu": r.ru_utime + r.ru_stime, **extra}) + "\n")


mark("interpreter ready")
from trajflow.jobs import cli, run
mark("CLI imported")

start_ray, status_line = run.start_ray, run.status_line
calls = {"start_ray": 0, "status_line": 0}


def timed_start_ray(*args, **kwargs):
    calls["start_ray"] += 1
    if calls["start_ray"] > 1:  # a later call (older versions call it again in _execute): Ray is up
        return start_ray(*args, **kwargs)
    mark("ray.init start")
    start_ray(*args, **kwargs)
    mark("ray.init end")
    from trajflow.pipelines import rl_loop
    mark("pipeline imported")
    store = rl_loop.RLPipeline.start_store

    def timed_store(self, *a, **k):
        mark("store start")
        out = store(self, *a, **k)
        mark("store end")
        return out

    rl_loop.RLPipeline.start_store = timed_store


def timed_status_line(row, *args, **kwargs):
    calls["status_line"] += 1
    if calls["status_line"] == 1:
        mark("step 1 row", startup={k: v for k, v in row.items() if k.startswith("seconds/startup/")},
             stages={k: v for k, v in row.items() if k.startswith("seconds/stage/")})
    return status_line(row, *args, **kwargs)


run.start_ray, run.status_line = timed_start_ray, timed_status_line
code = cli.main(sys.argv[1:])
mark("done")
sys.exit(code)
'''

# (role, how to recognise it in a process's command line): first match wins
ROLES = (
    ("watchdog", "ray/watchdog.py"),
    ("gcs_server", "gcs_server"),
    ("raylet", "/raylet"),
    ("dashboard agent", "dashboard/agent.py"),
    ("runtime-env agent", "runtime_env/agent/main.py"),
    ("log monitor", "log_monitor.py"),
    ("dashboard", "dashboard/dashboard.py"),
    ("policy store", "PolicyStoreActor"),
    ("Ray Data coordinator", "ray::_StatsActor"),
    ("Ray Data coordinator", "ray::AutoscalingRequester"),
    ("actor", "ray::MapWorker"),
    ("idle worker", "ray::IDLE"),
    ("idle worker", "default_worker.py"),
)


def role_of(cmdline: list[str], is_driver: bool) -> str:
    if is_driver:
        return "driver"
    line = " ".join(cmdline)
    for role, needle in ROLES:
        if needle in line:
            if role == "actor":  # ray::MapWorker(MapBatches(Generate+Reward)).submit -> Generate+Reward
                return line.split("MapBatches(")[-1].split(")")[0]
            return role
    return line[:40] or "?"


class Tree:
    """Samples a process and its descendants: per pid its role (the latest title that names one),
    start time, CPU seconds over time and peak PSS; the tree's peak PSS, processes and threads."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.procs: dict[int, dict] = {}
        self.peak_pss = self.peak_processes = self.peak_threads = 0
        self.pss_series: list[tuple[float, int]] = []
        self.peak_shares: dict[int, int] = {}  # pid -> its PSS in the sample of the tree's peak

    def sample(self) -> None:
        now = time.time()
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        pss = threads = count = 0
        shares: dict[int, int] = {}
        for proc in procs:
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    info = self.procs.setdefault(proc.pid, {"start": proc.create_time(), "cpu": [], "pss": 0,
                                                            "role": None})
                    role = role_of(proc.cmdline(), proc.pid == self.root.pid)
                    if info["role"] in (None, "idle worker") or role not in ("idle worker",):
                        info["role"] = role  # an idle worker that becomes an actor is the actor
                    info["cpu"].append((now, cpu.user + cpu.system))
                    mem = proc.memory_full_info().pss
                    info["pss"] = max(info["pss"], mem)
                    threads += proc.num_threads()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            pss += mem
            shares[proc.pid] = mem
            count += 1
        self.pss_series.append((now, pss))
        if pss > self.peak_pss:
            self.peak_shares = shares
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_processes = max(self.peak_processes, count)
        self.peak_threads = max(self.peak_threads, threads)

    def cpu_at(self, pid: int, t: float) -> float:
        """CPU seconds of `pid` at time t (the last sample at or before t)."""
        before = [c for ts, c in self.procs[pid]["cpu"] if ts <= t]
        return before[-1] if before else 0.0

    def pss_at(self, t: float) -> int:
        return max((p for ts, p in self.pss_series if ts <= t), default=0)


def measure(steps: int = 20, extra: tuple[str, ...] = (), config: str = "quickstart",
            python: str = sys.executable) -> dict:
    """One cold `trajflow run CONFIG` (steps as given) with the trajflow `python` has installed:
    phases, per-process CPU, memory."""
    with tempfile.TemporaryDirectory() as tmp:
        events_path = Path(tmp) / "events.jsonl"
        argv = ["run", config, "--no-progress", "--run-dir", str(Path(tmp) / "run"),
                "--set", f"steps={steps}", *extra]
        env = {**os.environ, "TRAJFLOW_BENCH_EVENTS": str(events_path)}
        load_before = os.getloadavg()[0]
        proc = subprocess.Popen([python, "-c", DRIVER, *argv], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tree = Tree(psutil.Process(proc.pid))
        output: list[str] = []
        import threading

        first_line: list[float] = []  # when the first step's status line reached the terminal

        def read() -> None:
            for line in proc.stdout:
                if not first_line and line.split()[:2] == ["step", "0"]:
                    first_line.append(time.time())
                output.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while proc.poll() is None:
            tree.sample()
            time.sleep(SAMPLE_SECONDS)
        ended = time.time()
        reader.join(timeout=10)
        if proc.returncode != 0:
            raise RuntimeError("trajflow run failed:\n" + "".join(output)[-4000:])
        events = {e["event"]: e for e in map(json.loads, events_path.read_text().splitlines())}
    result = summarise(tree, events, load_before, os.getloadavg()[0])
    t0 = tree.procs[tree.root.pid]["start"]
    result["enter to first step line s"] = first_line[0] - t0 if first_line else None
    result["enter to exit s"] = ended - t0
    result["peak shares"] = [{"process": tree.procs[pid]["role"], "PSS MiB at the tree's peak": pss / 2**20}
                             for pid, pss in sorted(tree.peak_shares.items(), key=lambda kv: -kv[1])]
    return result


def summarise(tree: Tree, events: dict, load_before: float, load_after: float) -> dict:
    t0 = tree.procs[tree.root.pid]["start"]
    step1 = events["step 1 row"]
    order = ["interpreter ready", "CLI imported", "ray.init start", "ray.init end", "pipeline imported",
             "store start", "store end", "step 1 row"]
    labels = {
        "interpreter ready": "interpreter start",
        "CLI imported": "CLI + jobs.run imports",
        "ray.init start": "config checks, run dir",
        "ray.init end": "ray.init (the pipeline's modules import alongside, in a thread)",
        "pipeline imported": "pipeline imports (Ray Data, the stages' settings; no torch)",
        "store start": "pipeline + recorder construction",
        "store end": "policy store + initial publish (version 0 from the model's files)",
        "step 1 row": "Ray Data start, actors start + imports + model loads, step 1",
    }
    phases, previous_t, previous_cpu = [], t0, 0.0
    for name in order:
        e = events[name]
        phases.append({"phase": labels[name], "wall s": e["t"] - previous_t, "driver CPU s": e["cpu"] - previous_cpu})
        previous_t, previous_cpu = e["t"], e["cpu"]
    total_wall = step1["t"] - t0
    processes = []
    for pid, info in tree.procs.items():
        if info["start"] > step1["t"]:
            continue
        processes.append({
            "process": info["role"],
            "started at s": info["start"] - t0,
            "CPU s to step 1": tree.cpu_at(pid, step1["t"]),
            "peak PSS MiB": info["pss"] / 2**20,
        })
    processes.sort(key=lambda p: p["started at s"])
    total_cpu = sum(p["CPU s to step 1"] for p in processes)
    return {
        "phases": phases,
        "processes": processes,
        "actors": step1["startup"],
        "step 1 stages": step1["stages"],
        "wall to end of step 1 s": total_wall,
        "CPU s, all processes, to end of step 1": total_cpu,
        "CPU floor on 2 cores s": total_cpu / 2,
        "processes in the tree (peak)": tree.peak_processes,
        "threads (peak)": tree.peak_threads,
        "tree PSS at end of step 1 GiB": tree.pss_at(step1["t"]) / 2**30,
        "tree peak PSS GiB (whole run)": tree.peak_pss / 2**30,
        "load before / after": f"{load_before:.1f} / {load_after:.1f}",
    }


# (label, extra `trajflow run` arguments): the quickstart as shipped (async: two actor processes
# below 4 CPUs, three from 4 on; pipelines/colocation.py) and the same job synchronous (one)
CONFIGS = (
    ("quickstart (max_staleness 1)", ()),
    ("quickstart --set max_staleness=0 (1 actor process)", ("--set", "max_staleness=0")),
)


def run(steps: int = 20) -> str:
    """Markdown: one row per configuration, then each one's driver phases and process tree."""
    from benchmarks.common import table

    results = [(label, measure(steps, extra)) for label, extra in CONFIGS]
    summary = [{"run": label, **{k: v for k, v in r.items() if not isinstance(v, (list, dict))}}
               for label, r in results]
    return "\n\n".join([table(summary), *(f"### {label}\n\n{details(r)}" for label, r in results)])


def details(result: dict) -> str:
    """Markdown: the driver's phases, every process of the tree, what the actors report."""
    from benchmarks.common import table

    actors = "; ".join(f"{k.removeprefix('seconds/startup/')} {v:.2f}" for k, v in result["actors"].items())
    stages = "; ".join(f"{k.removeprefix('seconds/stage/')} {v:.2f}" for k, v in result["step 1 stages"].items())
    return "\n\n".join([
        "Driver phases (wall from the interpreter's start; the driver's own CPU seconds):\n\n"
        + table(result["phases"]),
        "Every process started before the end of step 1 (role, start relative to the driver's, CPU seconds "
        "used by the end of step 1, peak PSS over the run):\n\n" + table(result["processes"]),
        f"Inside the actors (first metrics row), seconds: {actors}  \nStep 1 compute, seconds: {stages}",
    ])


def repeated(runs: int, steps: int = 30, extra: tuple[str, ...] = ()) -> str:
    """Markdown: `runs` cold quickstarts (enter to first step line, enter to exit, tree peak PSS),
    their medians, then the median run's process shares at its PSS peak and its processes' CPU."""
    import statistics

    from benchmarks.common import table

    results = [measure(steps, extra) for _ in range(runs)]
    rows = [{"run": i + 1, "enter to first step line s": r["enter to first step line s"],
             "enter to exit s": r["enter to exit s"], "tree peak PSS GiB": r["tree peak PSS GiB (whole run)"],
             "processes (peak)": r["processes in the tree (peak)"], "load before / after": r["load before / after"]}
            for i, r in enumerate(results)]
    keys = ("enter to first step line s", "enter to exit s", "tree peak PSS GiB")
    rows.append({"run": "median", **{k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys}})
    median_run = sorted(results, key=lambda r: r["enter to first step line s"] or 0)[len(results) // 2]
    return "\n\n".join([
        table(rows),
        "The median run's processes at the tree's PSS peak:\n\n" + table(median_run["peak shares"]),
        details(median_run),
    ])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help="cold quickstarts of `--steps` steps, enter to exit, the median")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 30 with --runs, else 20)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more `trajflow run --set`")
    args = parser.parse_args()
    extra = tuple(x for kv in args.set for x in ("--set", kv))
    if args.runs:
        print(repeated(args.runs, args.steps or 30, extra))
    else:
        print(run(args.steps or 20))
