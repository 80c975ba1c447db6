"""The ablation notebook runs clean (small config) and saves its plot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "ablations.ipynb"


@pytest.mark.slow
def test_ablation_notebook_executes(tmp_path, monkeypatch):
    # the multi-turn environment: the default task's runs are covered by the pipeline tests, and
    # each notebook execution costs about two minutes of the suite
    config = "calc"
    monkeypatch.setenv("TRAJFLOW_NOTEBOOK_CONFIG", config)
    monkeypatch.setenv("TRAJFLOW_NOTEBOOK_STEPS", "4")
    monkeypatch.setenv("TRAJFLOW_NOTEBOOK_PROMPTS", "4")
    # sized for CI: two strategies of the ablation (each run starts its own actors); the rest of the
    # notebook (a custom stage, a logged run and its replay, a user strategy) runs as written
    monkeypatch.setenv("TRAJFLOW_NOTEBOOK_STRATEGIES", "recompute,snapshot")
    monkeypatch.setenv("TRAJFLOW_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # what Ray, Ray Data and transformers print of their own stays out (pipelines/ray/quiet.py): no cell
    # writes to stderr (without the filter: Ray Data's start/plan/finished lines, the core worker's
    # max_restarts notice and a "Loading weights" bar per run)
    stderr = [o.text for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "stream" and o.name == "stderr" and o.text.strip()]
    assert not stderr, stderr[:3]
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    assert (tmp_path / "evidence_regime.png").stat().st_size > 10_000  # the evidence's headline figure
    assert (tmp_path / "evidence_outcome.png").stat().st_size > 10_000  # and its outcome study
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "recompute" in text and "snapshot" in text
    assert f"task {config}" in text
