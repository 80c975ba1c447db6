"""`trajflow run` resolves every name before Ray starts without importing torch or transformers,
so it can import them while Ray starts (jobs/run.py, pipelines/ray/embedded.py;
benchmarks/results/startup.md). A built-in strategy that imports torch at module level, or a
check before Ray that loads weights with torch, puts those seconds back on the start-up path."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
from trajflow.jobs.config import load_job_config
from trajflow.jobs.run import plan_new_run
from trajflow.operators.strategies import strategy_names
for name in strategy_names():
    config = load_job_config("quickstart", [f"strategy={name}", "top_k_logprobs=8",
                                            "run_dir=/nonexistent/trajflow-startup-test"])
    config.build_strategy()
    plan_new_run(config)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.timeout(120)
def test_validating_a_run_of_every_builtin_strategy_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
