"""One config contract from YAML to the loss: every setting declared once (trajflow/settings.py),
the YAML sections built from those declarations, every key documented where it is declared (and
docs/configuration.md generated from those descriptions), operators built from typed settings
only, booleans refused where numbers are meant in settings (in functions:
tests/test_public_booleans.py)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig, KLConfig, OptimizerConfig
from trajflow.algorithms.objective import decoupled_loss
from trajflow.engines.factory import VllmConfig
from trajflow.engines.lora import LoraConfig
from trajflow.engines.sampling import SamplingConfig
from trajflow.jobs.config import JobConfig, JobConfigError, build_job_config
from trajflow.jobs.config_reference import REFERENCE, keys, render, undocumented
from trajflow.operators.contracts.stage import ResourceConfig
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.recovery import RecoveryConfig
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.pipelines.config import SECTIONS, PipelineConfig
from trajflow.pipelines.config.team import TeamConfig
from trajflow.settings import SettingError, check_settings, setting
from trajflow.operators.trainer.critic_config import CriticConfig
from trajflow.tasks.dataset import DataConfig

REPO = Path(__file__).resolve().parent.parent
# every section of a config and the settings dataclass it is declared by, with its default
DEFAULTS = {"sampling": SamplingConfig(), "correction": CorrectionConfig(), "advantage": AdvantageConfig(),
            "kl": KLConfig(), "distill": DistillConfig(), "optimizer": OptimizerConfig(), "lora": LoraConfig(), "vllm": VllmConfig(),
            "generator": ResourceConfig(), "scorer": ResourceConfig(num_cpus=0.25), "trainer": TrainerConfig(),
            "recovery": RecoveryConfig(), "weight_sync": WeightSyncConfig(), "data": None, "critic": None,
            "team": None}
# the settings dataclass of a section that is absent by default
OPTIONAL_SECTIONS = {"data": DataConfig, "critic": CriticConfig, "team": TeamConfig}


def test_every_section_is_a_settings_dataclass_and_yaml_defaults_are_the_library_defaults():
    config = PipelineConfig()
    assert set(DEFAULTS) == set(SECTIONS) == {k.name for k in keys(PipelineConfig)
                                              if k.section is not None and "." not in k.name}
    for key, default in DEFAULTS.items():
        section = getattr(config, key)
        assert (section.spec() if section is not None else None) == default, key
        declared = type(default) if default is not None else OPTIONAL_SECTIONS[key]
        model = PipelineConfig.model_fields[key].annotation
        model = typing.get_args(model)[0] if typing.get_args(model) else model
        assert model.settings is declared
        yaml_fields = model.model_fields
        assert list(yaml_fields) == [f.name for f in dataclasses.fields(declared)]
        for f in dataclasses.fields(declared):  # documented where declared, the same text in YAML
            assert f.metadata["doc"] and yaml_fields[f.name].description == f.metadata["doc"], f"{key}.{f.name}"


def test_every_key_of_every_section_and_of_the_top_level_is_documented():
    """The walk covers every field (the top level, run options, every section's), and none is
    declared without a description."""
    names = {k.name for k in keys(JobConfig)}
    assert set(JobConfig.model_fields) <= names
    for key in SECTIONS:
        model = _section_model(key)
        assert {f"{key}.{info.alias or name}" for name, info in model.model_fields.items()} <= names, key
    assert len(names) > 120
    assert undocumented(JobConfig) == []


def test_the_contract_check_fails_on_an_undocumented_key():
    """A key declared without a description, in a section or at the top level, is named."""
    from pydantic import Field

    from trajflow.pipelines.config.sections import settings_section

    @dataclasses.dataclass(frozen=True)
    class Knobs:
        documented: int = setting(1, "what it does")
        bare: int = setting(2)

        def __post_init__(self) -> None:
            check_settings(self)

    class Extended(PipelineConfig):
        knobs: settings_section(Knobs, "KnobsSection") = Field(default_factory=settings_section(Knobs, "KnobsSection"),
                                                              description="a section")
        quiet: int = 3

    assert undocumented(Extended) == ["knobs.bare", "quiet"]


def test_the_configuration_reference_is_generated_from_the_declarations():
    """docs/configuration.md is `python -m trajflow.jobs.config_reference`'s output: it lists every
    key with its declared description, and is current (regenerate it when a setting changes)."""
    text = render()
    for key in keys(JobConfig):
        top_section = key.section is not None and "." not in key.name  # a nested one is rows of its section's table
        name = f"## `{key.name}:`" if top_section else f"`{key.name.rsplit('.', 1)[-1]}`"
        assert name in text and key.description.replace("|", "\\|") in text, key.name
    assert REFERENCE.read_text() == text, "docs/configuration.md is stale: python -m trajflow.jobs.config_reference"


def _section_model(key: str):
    model = PipelineConfig.model_fields[key].annotation
    return typing.get_args(model)[0] if typing.get_args(model) else model


def test_a_notebook_user_and_a_yaml_user_get_the_same_objective():
    g = torch.Generator().manual_seed(0)
    current, old, inference = (torch.randn(4, 6, generator=g) * 0.05 - 1.0 for _ in range(3))
    advantages = torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    library = decoupled_loss(current, old, inference, advantages, mask, CorrectionConfig())
    default = decoupled_loss(current, old, inference, advantages, mask)  # the function's own default
    job = build_job_config({"steps": 1}).settings.correction
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
        # top_k_logprobs: dist_mask needs the top-k (a cross-key rule, not the value's)
        build_job_config({"steps": 1, "top_k_logprobs": 8, "correction": {field: value}})
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
    lambda: SamplingConfig(top_k=False),
    lambda: VllmConfig(tensor_parallel_size=True),
    lambda: PipelineConfig(strategy={"name": "ewma", "window": True}),
    lambda: PipelineConfig(strategy={"name": "loglinear", "alpha": True}),
    lambda: PipelineConfig(strategy={"name": "m2po", "m2_threshold": True}),
    lambda: __import__("trajflow.operators.strategies.m2po", fromlist=["M2po"]).M2po(m2_threshold=True),
])
def test_a_boolean_is_never_a_number_in_the_library(build):
    with pytest.raises(ValueError, match="boolean|true|True|must be"):
        build()


def test_renamed_keys_work_for_one_release_with_one_line_notice():
    with pytest.warns(FutureWarning) as caught:
        config = build_job_config({"strategy": "ewma", "ewma": {"window": 3, "reset_threshold": 0.5}})
    assert config.strategy_options == {"window": 3, "reset_threshold": 0.5}
    assert config.build_strategy().window == 3 and config.build_strategy().reset_threshold == 0.5
    assert [str(w.message) for w in caught] == [f"ewma.{key}: use strategy.{key}; the old key goes in the next release"
                                                for key in ("window", "reset_threshold")]
    with pytest.warns(FutureWarning, match="loglinear_alpha: use strategy.alpha"):
        assert build_job_config({"strategy": "loglinear", "loglinear_alpha": 0.25}).build_strategy().alpha == 0.25
    with pytest.warns(FutureWarning, match="loglinear_alpha: ignored"):  # an option the strategy does not take
        assert build_job_config({"strategy": "snapshot", "loglinear_alpha": 0.25}).strategy_options == {}


def test_an_actor_stage_is_checked_when_it_is_built():
    """Typed arguments, checked against the operator's constructor when the stage is built (in
    RLPipeline, before Ray starts), not when Ray Data constructs the actor."""
    from trajflow.operators.contracts.stage import Stage
    from trajflow.operators.generate import Generate
    from trajflow.pipelines.rl_loop import RLPipeline

    kwargs = dict(RLPipeline(PipelineConfig()).stage("generate").kwargs)
    with pytest.raises(TypeError, match=r"stage 'generate': Generate\(rollout=\.\.\.\): expected RolloutConfig, got dict"):
        Stage("generate", Generate, {**kwargs, "rollout": {"group_size": 2}})
    with pytest.raises(TypeError, match="stage 'generate': Generate: got an unexpected keyword argument 'group_size'"):
        Stage("generate", Generate, {**kwargs, "group_size": 2})
    with pytest.raises(TypeError, match="stage 'generate': Generate: missing a required argument: 'engine'"):
        Stage("generate", Generate, {k: v for k, v in kwargs.items() if k != "engine"})
    with pytest.raises(TypeError, match=r"Generate\(torch_threads=\.\.\.\): expected int, got bool"):
        Stage("generate", Generate, {**kwargs, "torch_threads": True})


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
        "trajflow: deprecated: ewma.window: use strategy.window; the old key goes in the next release",
        "trajflow: config error: steps: Input should be greater than or equal to 1 (got 0)",
    ]
