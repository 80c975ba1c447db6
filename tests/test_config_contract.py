"""One config contract from YAML to the loss: every setting declared once (trajflow/settings.py),
the YAML sections built from those declarations, operators built from typed settings only."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, OptimizerConfig
from trajflow.algorithms.objective import decoupled_loss
from trajflow.engines.factory import VllmOptions
from trajflow.engines.sampling import SamplingParams
from trajflow.jobs.config import JobConfigError, build_job_config
from trajflow.pipelines.config import PipelineConfig
from trajflow.settings import SettingError

REPO = Path(__file__).resolve().parent.parent
SECTIONS = {"correction": CorrectionConfig, "advantage": AdvantageConfig, "optimizer": OptimizerConfig,
            "sampling": SamplingParams, "vllm": VllmOptions}


@pytest.mark.parametrize("key, settings_class", SECTIONS.items())
def test_yaml_defaults_are_the_library_defaults(key, settings_class):
    section = getattr(PipelineConfig(), key)
    assert section.spec() == settings_class()
    yaml_fields = type(section).model_fields
    assert list(yaml_fields) == [f.name for f in dataclasses.fields(settings_class)]
    for f in dataclasses.fields(settings_class):  # documented where declared, the same text in YAML
        assert f.metadata["doc"] and yaml_fields[f.name].description == f.metadata["doc"], f.name


def test_a_notebook_user_and_a_yaml_user_get_the_same_objective():
    g = torch.Generator().manual_seed(0)
    current, old, inference = (torch.randn(4, 6, generator=g) * 0.05 - 1.0 for _ in range(3))
    advantages = torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    library = decoupled_loss(current, old, inference, advantages, mask, CorrectionConfig())
    default = decoupled_loss(current, old, inference, advantages, mask)  # the function's own default
    job = build_job_config({"steps": 1}).correction_config()
    from_yaml = decoupled_loss(current, old, inference, advantages, mask, job)
    for out in (default, from_yaml):
        assert torch.equal(out.loss, library.loss)
        assert torch.equal(out.discrepancy_mask, library.discrepancy_mask)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from([f.name for f in dataclasses.fields(CorrectionConfig)]),
       value=st.one_of(st.booleans(), st.floats(allow_nan=True), st.integers(-3, 3), st.none(),
                       st.sampled_from(["token", "sequence", "none", "token-mean", "1.5", "x"])))
def test_the_library_and_yaml_accept_and_refuse_the_same_values(field, value):
    try:
        CorrectionConfig(**{field: value})
        library_ok = True
    except SettingError:
        library_ok = False
    try:
        build_job_config({"steps": 1, "correction": {field: value}})
        yaml_ok = True
    except JobConfigError:
        yaml_ok = False
    # YAML 1.1 reads `1e-3` as a string, so a job config (only) accepts a number written as text
    yaml_only = isinstance(value, str) and _is_number(value)
    assert yaml_ok == (library_ok or (yaml_only and _ok_as_number(field, float(value)))), (field, value)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _ok_as_number(field: str, value: float) -> bool:
    try:
        CorrectionConfig(**{field: value})
        return True
    except SettingError:
        return False


@pytest.mark.parametrize("build", [
    lambda: CorrectionConfig(tis_cap=True),
    lambda: CorrectionConfig(eps_low=True),
    lambda: OptimizerConfig(lr=True),
    lambda: OptimizerConfig(minibatches_per_step=True),
    lambda: SamplingParams(top_k=False),
    lambda: VllmOptions(tensor_parallel_size=True),
    lambda: PipelineConfig(strategy="ewma", strategy_options={"window": True}).build_strategy(),
    lambda: PipelineConfig(strategy="loglinear", strategy_options={"alpha": True}).build_strategy(),
    lambda: PipelineConfig(strategy="m2po", strategy_options={"m2_threshold": True}).build_strategy(),
])
def test_a_boolean_is_never_a_number_in_the_library(build):
    with pytest.raises(ValueError, match="boolean|true|True|must be"):
        build()


def test_renamed_keys_work_for_one_release_with_one_line_notice():
    with pytest.warns(FutureWarning) as caught:
        config = build_job_config({"strategy": "ewma", "ewma": {"window": 3, "reset_threshold": 0.5}})
    assert config.strategy_options == {"window": 3, "reset_threshold": 0.5}
    assert config.build_strategy().window == 3 and config.build_strategy().reset_threshold == 0.5
    assert all("\n" not in str(w.message) and "strategy_options" in str(w.message) for w in caught)
    with pytest.warns(FutureWarning, match="loglinear_alpha: use strategy_options.alpha"):
        assert build_job_config({"strategy": "loglinear", "loglinear_alpha": 0.25}).build_strategy().alpha == 0.25
    with pytest.warns(FutureWarning, match="loglinear_alpha: ignored"):  # an option the strategy does not take
        assert build_job_config({"strategy": "snapshot", "loglinear_alpha": 0.25}).strategy_options == {}


def _constructors_with_var_keyword(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__" and item.args.kwarg is not None:
                    found.append(f"{path.relative_to(REPO)}:{node.name}.__init__(**{item.args.kwarg.arg})")
    return found


def test_no_operator_constructor_takes_kwargs_from_the_pipeline():
    """Operators get typed settings (frozen specs, dataclasses), never an untyped **kwargs dict."""
    files = sorted((REPO / "operators").rglob("*.py"))
    assert len(files) > 10
    offenders = [c for f in files for c in _constructors_with_var_keyword(f)]
    assert not offenders, offenders
    # and the pipeline hands no dict of settings through: every stage's kwargs are typed values
    from trajflow.pipelines.rl_loop import RLPipeline

    for strategy in ("snapshot", "dedicated", "interrupt", "ewma"):
        for stage in RLPipeline(PipelineConfig(strategy=strategy)).stages:
            assert not any(isinstance(v, dict) for v in stage.kwargs.values()), (strategy, stage.name)


def test_the_cli_shows_a_renamed_key_as_one_line(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "old.yaml"
    config.write_text("strategy: ewma\newma: {window: 2}\nsteps: 0\n")  # steps 0: stops before Ray
    proc = subprocess.run([sys.executable, "-m", "trajflow.jobs.cli", "run", str(config)], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "trajflow: deprecated: ewma.window: use strategy_options.window; the old key goes in the next release",
        "trajflow: config error: steps: Input should be greater than or equal to 1 (got 0)",
    ]
