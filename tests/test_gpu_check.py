"""The GPU check (scripts/gpu_check.sh, benchmarks/gpu_check.py), ready before a GPU is (issue #35).

- Without CUDA the script says what it would run and exits 0 (what CI runs).
- Its in-process core, the same code with device `cpu` and tiny shapes, runs here the way the
  lent machine runs it: with Ray, polars and vLLM unimportable and trajflow not installed
  (imported from this tree), every check passing. So a run on a GPU can fail only on what is
  CUDA's (or on that machine's package versions, which its first row reports).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["environment", "model", "exact: snapshot", "exact: dedicated", "exact: interrupt",
          "scored at each token's version", "bf16 generate + bf16 autocast train", "fsdp2 (world size 1)", "lora (r 8)"]

# what the lent machine lacks, made unimportable; and trajflow's installed (editable) finder
# removed, so trajflow comes from the source tree as it does there
AS_ON_THE_GPU_MACHINE = """
import importlib.abc, runpy, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "polars", "vllm"):
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path = [Absent()] + [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.argv = ["gpu_check", *sys.argv[1:]]
try:
    runpy.run_module("benchmarks.gpu_check", run_name="__main__", alter_sys=True)
finally:
    import trajflow.pipelines.local
    print("trajflow from", trajflow.pipelines.local.__file__)
    print("loaded:", sorted(m for m in ("ray", "polars", "vllm") if m in sys.modules))
"""


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
               PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    return env


def test_without_a_gpu_the_script_says_what_it_would_run_and_exits_0():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "gpu_check: no CUDA device here; on a GPU machine this runs, in one process:"
    assert len(lines) == 1 + len(CHECKS) and all(line.startswith("  - ") for line in lines[1:])
    assert "Llama 30 layers x 576 (heads 9/3, mlp 1536, vocab 49152)" in proc.stdout  # SmolLM2-135M's shape


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_in_process_core_runs_on_the_cpu_as_on_the_gpu_machine(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, "-c", AS_ON_THE_GPU_MACHINE, "--device", "cpu", "--small", "--out",
                           str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"trajflow from {ROOT / 'pipelines' / 'local.py'}" in proc.stdout
    assert "loaded: []" in proc.stdout  # neither Ray nor polars nor vLLM was needed
    rows = [line.split(" | ") for line in out.read_text().splitlines()[2:]]
    print("\n" + out.read_text())
    assert [r[0].removeprefix("| ") for r in rows] == CHECKS
    assert all(r[1] == "ok" for r in rows), rows
    assert "backend trajflow_gloo" in out.read_text()  # FSDP's group on the CPU (NCCL on CUDA)
