"""vLLM-only tests: skipped with a reason when vLLM is not importable, failed instead under
TRAJFLOW_REQUIRE_VLLM=1 (.ci/vllm-tests), so CI never skips them silently."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _require_vllm():
    try:
        from vllm import LLM  # noqa: F401
    except ImportError as e:
        reason = f"vllm is not importable ({e}); the vLLM tests run in .venv-vllm via .ci/vllm-tests"
        if os.environ.get("TRAJFLOW_REQUIRE_VLLM") == "1":
            pytest.fail(f"TRAJFLOW_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
