"""Ray's leftovers: every embedded Ray removes its session directory (/tmp/ray/session_*) at exit;
a run that failed keeps its Ray logs in RUN/ray-logs instead, also when its driver is SIGKILLed
(the watchdog moves them).

- embedded starts of the suite's kind (`start_local_ray`, a Ray Data execution on it, exit), each
  in its own process: none of their session dirs is left. Each start goes through the same exit
  path, so the suite makes STARTS of them (a Ray start is seconds on 2 cores);
  `TRAJFLOW_TEST_RAY_STARTS=20` makes the issue's 20 (#36: 20 starts, none left, 271 s at load 13);
- a `trajflow run` whose reward fails on every row (exit 1): RUN/ray-logs holds its raylet's and
  workers' logs, its session dir is gone (a finished run's: tests/test_jobs_run.py
  test_status_lines_are_printed_as_their_steps_end, whose run ends normally);
- a `trajflow run` SIGKILLed mid-run: once the watchdog has ended its processes, RUN/ray-logs
  holds the logs and the session dir is gone.
A session dir is told apart from other processes' by the driver's pid in its name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from support import RAY_TMP, cli_env, sessions_of

pytestmark = pytest.mark.slow

STARTS = int(os.environ.get("TRAJFLOW_TEST_RAY_STARTS", "2"))
START = textwrap.dedent("""
    import sys
    from trajflow.pipelines.ray.embedded import start_local_ray
    start_local_ray(num_cpus=1)
    import ray
    from ray.data import DataContext
    DataContext.get_current().enable_progress_bars = False
    rows = ray.data.range(8).map_batches(lambda b: {"x": b["id"] * 2}, batch_size=4).take_all()
    assert sorted(r["x"] for r in rows) == list(range(0, 16, 2))
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
""")


@pytest.mark.timeout(900)
def test_embedded_starts_leave_no_session_dir():
    pids, named = set(), []
    for _ in range(STARTS):  # one at a time: two Rays starting at once on a loaded 2-core machine can time out
        proc = subprocess.Popen([sys.executable, "-c", START], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=cli_env())
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        pids.add(proc.pid)
        named.append(Path(out.strip().splitlines()[-1]))
    assert len(pids) == STARTS and all(str(p).startswith(str(RAY_TMP)) for p in named)
    assert [p for p in named if p.exists()] == []
    assert sessions_of(pids) == []


def _reward_job(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text("def broken(prompts, completions, **columns):\n"
                                         "    raise ValueError('no score')\n")
    job = {"name": "broken", "model": "artifacts/byo/model", "data": {"train_files": ["artifacts/byo/train.jsonl"]},
           "reward": f"{tmp_path / 'rewards.py'}:broken", "steps": 4, "prompts_per_step": 4, "group_size": 2,
           "sampling": {"max_new_tokens": 4}, "reward_max_failed_steps": 1, "report_to": [], "checkpoint_every": 0}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.mark.timeout(600)
def test_a_failed_run_keeps_its_ray_logs_in_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trajflow.jobs.cli", "run", str(_reward_job(tmp_path)),
                             "--run-dir", str(run_dir), "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=Path(__file__).resolve().parents[1])
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 1, f"{out[-2000:]}\n{err[-2000:]}"
    assert "failed on every row" in err
    logs = run_dir / "ray-logs"
    assert (logs / "raylet.out").is_file() and list(logs.glob("worker-*.out")), sorted(os.listdir(logs))
    assert sessions_of({proc.pid}) == []


@pytest.mark.timeout(600)
def test_a_sigkilled_run_has_its_ray_logs_moved_by_the_watchdog(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trajflow.jobs.cli", "run", "quickstart", "--run-dir", str(run_dir),
                             "--no-progress", "--set", "steps=200", "--set", "prompts_per_step=8", "--set",
                             "group_size=4", "--set", "eval_every=0", "--set", "report_to=[]"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=cli_env())
    for line in proc.stdout:  # the first step's status line: the run is under way
        if line.split()[:2] == ["step", "0"]:
            break
    session = next(iter(sessions_of({proc.pid})), None)
    assert session is not None and session.is_dir()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while session.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not session.exists()
    logs = run_dir / "ray-logs"
    assert (logs / "raylet.out").is_file() and list(logs.glob("worker-*.out")), sorted(os.listdir(logs))
