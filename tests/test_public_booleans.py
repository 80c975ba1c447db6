"""A boolean is refused wherever the public API means a number: `discounted_returns(gamma=True)`
is a typo that would otherwise compute with 1 (True == 1). The public API is walked, not listed:
every name in `trajflow.__all__` and every public function and class of trajflow.algorithms (a
class by its constructor and its public class and static methods), so a new one is covered, or
this test says it lacks valid arguments in ARGS. A parameter means a number when its annotation
is int or float (or a union with one: `float | None`, `float | Tensor`) or its default is one.

The refusal, naming the argument: NotANumber from trajflow.settings.check_number (a function), a
SettingError (a settings dataclass), a pydantic validation error (a YAML section's model)."""

from __future__ import annotations

import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

import trajflow
from trajflow.settings import NotANumber, SettingError

# results a function returns, not arguments a caller passes: they check nothing
RECORDS = {"trajflow.algorithms.m2po.M2Mask", "trajflow.algorithms.objective.LossSum"}


def _lp() -> torch.Tensor:  # log-probs [B, T] = [2, 3]
    return torch.full((2, 3), -1.0)


def _mask() -> torch.Tensor:
    return torch.ones(2, 3, dtype=torch.bool)


def _top_k() -> torch.Tensor:  # log-probs on a top-2 support [B, T, K], half the mass in the tail
    return torch.full((2, 3, 2), 0.25).log()


@functools.cache
def _pipeline() -> Any:
    return trajflow.RLPipeline(trajflow.PipelineConfig())


def _addition() -> Any:
    from trajflow.tasks.addition import AdditionTask

    return AdditionTask()


def _team() -> Any:
    return trajflow.TeamPipeline.of(trajflow.PipelineConfig(), trajflow.RelayEnv(_addition()))


# valid values of each walked callable's required arguments (all others keep their defaults)
ARGS: dict[str, Callable[[], dict[str, Any]]] = {
    "trajflow.algorithms.advantages.grpo": lambda: dict(rewards=[1.0, 0.0], group_ids=[0, 0]),
    "trajflow.algorithms.advantages.overlong_penalty": lambda: dict(lengths=[3], max_tokens=4, buffer=1),
    "trajflow.algorithms.config.RejectionRule": lambda: dict(statistic="token_k1", upper=2.0),
    "trajflow.algorithms.diagnostics.staleness_stats": lambda: dict(
        versions=torch.zeros(2, 3, dtype=torch.long), trainer_version=1, mask=_mask()),
    "trajflow.algorithms.diagnostics.correction_diagnostics": lambda: dict(
        out=trajflow.decoupled_loss(_lp(), _lp(), _lp(), torch.ones(2), _mask())),
    "trajflow.algorithms.discounted.discounted_returns": lambda: dict(
        token_rewards=np.zeros((2, 3)), loss_mask=np.ones((2, 3), bool), gamma=0.9),
    "trajflow.algorithms.discounted.masked_whiten": lambda: dict(
        values=np.arange(6.0).reshape(2, 3), mask=np.ones((2, 3), bool)),
    "trajflow.algorithms.discounted.reinforce_plus_plus_discounted": lambda: dict(
        rewards=[1.0, 0.0], loss_mask=np.ones((2, 3), bool), gamma=0.9),
    "trajflow.algorithms.distillation.reverse_kl_advantages": lambda: dict(student=_lp(), teacher=_lp(), coef=1.0),
    "trajflow.algorithms.distillation.distillation_advantages": lambda: dict(
        student=_lp(), teacher=_lp(), task=torch.ones(2), reverse_kl_coef=1.0, task_advantage_coef=0.5),
    "trajflow.algorithms.distributions.distribution_keep": lambda: dict(
        distance=torch.zeros(2, 3), loss_mask=_mask(), threshold=0.1, level="token"),
    "trajflow.algorithms.ewma.ewma_beta": lambda: dict(window=4),
    "trajflow.algorithms.ewma.ewma_mean_age": lambda: dict(beta=0.5),
    "trajflow.algorithms.ewma.EwmaProximal": lambda: dict(state_dict={}, beta=0.5, reset_threshold=0.5),
    "trajflow.algorithms.gae.gae": lambda: dict(
        rewards=torch.zeros(2, 3), values=torch.zeros(2, 3), mask=_mask(), gamma=1.0, lam=0.95),
    "trajflow.algorithms.gae.token_rewards": lambda: dict(rewards=torch.ones(2), mask=_mask()),
    "trajflow.algorithms.gae.whiten": lambda: dict(x=torch.arange(6.0).reshape(2, 3), mask=_mask()),
    "trajflow.algorithms.gae.value_loss": lambda: dict(
        values=torch.zeros(2, 3), returns=torch.ones(2, 3), anchor=torch.zeros(2, 3), mask=_mask(), clip=0.2),
    "trajflow.algorithms.kl.kl_penalized_rewards": lambda: dict(
        rewards=torch.ones(2), kl=_lp(), loss_mask=_mask(), beta=0.1),
    "trajflow.algorithms.m2po.m2_cutoff": lambda: dict(squared=torch.ones(6), tau=0.04),
    "trajflow.algorithms.m2po.m2po_mask": lambda: dict(log_ratio=_lp(), loss_mask=_mask(), tau=0.04),
    "trajflow.algorithms.masked.masked_sum": lambda: dict(x=_lp(), mask=_mask()),
    "trajflow.algorithms.masked.masked_count": lambda: dict(mask=_mask()),
    "trajflow.algorithms.masked.masked_mean": lambda: dict(x=_lp(), mask=_mask()),
    "trajflow.algorithms.objective.off_policy_sequence_mask": lambda: dict(
        log_rd=torch.zeros(2, 3), log_rs=torch.zeros(2, 3), advantages=-torch.ones(2, 3), loss_mask=_mask(),
        delta=1e-4),
    "trajflow.algorithms.old_logprobs.loglinear_alpha": lambda: dict(
        versions=torch.zeros(2, 3, dtype=torch.long), theta_version=2),
    "trajflow.algorithms.old_logprobs.loglinear_logprobs": lambda: dict(
        current_logprobs=_lp(), inference_logprobs=_lp(), alpha=0.5),
    "trajflow.algorithms.old_logprobs.linear_logprobs": lambda: dict(
        current_logprobs=_lp(), inference_logprobs=_lp(), alpha=0.5),
    "trajflow.algorithms.schedules.lr_multiplier": lambda: dict(
        update=0, total_updates=10, config=trajflow.OptimizerConfig()),
    "trajflow.algorithms.score_centering.centering_coefficients": lambda: dict(
        current=_top_k(), old=_top_k(), sampler=_top_k()),
    "trajflow.operators.contracts.stage.Stage": lambda: dict(name="identity", fn=lambda batch: batch),
    "trajflow.pipelines.policy_store.InProcessStore": lambda: dict(max_staleness=1, keep_history=False),
    "trajflow.pipelines.local.run_in_process": lambda: dict(pipe=_pipeline()),
    "trajflow.pipelines.team.run_team_in_process": lambda: dict(team=_team()),
    "trajflow.tasks.team.RelayEnv": lambda: dict(task=_addition()),
}


def _public(obj: Any) -> list[Callable]:
    """A function; a class's constructor (unless a record) and its public class and static methods."""
    if inspect.isfunction(obj):
        return [obj]
    if not inspect.isclass(obj):
        return []
    methods = [getattr(obj, name) for name, attr in vars(obj).items()
               if isinstance(attr, (classmethod, staticmethod)) and not name.startswith("_")]
    return methods if _qualname(obj) in RECORDS else [obj, *methods]


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def walk() -> dict[str, Callable]:
    """Qualified name -> callable, over `trajflow.__all__` and the modules of trajflow.algorithms."""
    package = importlib.import_module("trajflow.algorithms")
    modules = [importlib.import_module(f"trajflow.algorithms.{path.stem}")
               for path in sorted(Path(package.__file__).parent.glob("*.py")) if not path.stem.startswith("_")]
    objects = [getattr(trajflow, name) for name in trajflow.__all__]
    objects += [value for module in modules for name, value in vars(module).items()
                if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__]
    return {_qualname(fn): fn for obj in objects for fn in _public(obj)}


def _means_a_number(annotation: Any, default: Any) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:  # a pydantic field's bounds
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_means_a_number(a, None) for a in typing.get_args(annotation))
    return annotation in (int, float) or (isinstance(default, (int, float)) and not isinstance(default, bool))


def numeric_parameters(fn: Callable) -> list[str]:
    parameters = inspect.signature(fn).parameters
    if isinstance(fn, type) and issubclass(fn, pydantic.BaseModel):
        hints = {name: p.annotation for name, p in parameters.items()}  # resolved by pydantic
    else:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    return [name for name, p in parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and _means_a_number(hints.get(name), p.default)]


WALKED = {name: fn for name, fn in walk().items() if numeric_parameters(fn)}


def _cases() -> list:
    return [pytest.param(name, parameter, id=f"{name.removeprefix('trajflow.')}({parameter})")
            for name, fn in sorted(WALKED.items()) for parameter in numeric_parameters(fn)]


def test_the_walk_finds_the_public_api_and_the_table_is_current():
    """The walk reaches what the old hand list named (and the settings and YAML models); every
    entry of ARGS is a walked callable its arguments bind to."""
    cases = {(case.values[0], case.values[1]) for case in _cases()}
    assert {("trajflow.algorithms.objective.WholeUpdate", "denominator"),
            ("trajflow.algorithms.config.CorrectionConfig.paper", "c_ti"),
            ("trajflow.algorithms.ewma.EwmaProximal", "reset_threshold"),
            ("trajflow.algorithms.old_logprobs.loglinear_logprobs", "alpha"),
            ("trajflow.algorithms.masked.masked_mean", "dim"),
            ("trajflow.algorithms.schedules.lr_multiplier", "total_updates"),
            ("trajflow.algorithms.score_centering.centering_coefficients", "tis_cap"),
            ("trajflow.algorithms.config.CorrectionConfig", "tis_cap"),
            ("trajflow.pipelines.config.pipeline.PipelineConfig", "steps")} <= cases
    assert not any(name in WALKED for name in RECORDS)
    assert set(ARGS) <= set(WALKED), f"entries of no walked callable: {sorted(set(ARGS) - set(WALKED))}"
    for name, args in ARGS.items():
        inspect.signature(WALKED[name]).bind(**args())


@pytest.mark.parametrize(("name", "parameter"), _cases())
def test_a_boolean_is_refused_where_a_number_is_meant(name, parameter):
    fn = WALKED[name]
    required = [p for p, spec in inspect.signature(fn).parameters.items()
                if spec.default is spec.empty and spec.kind not in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD)]
    if required and name not in ARGS:
        pytest.fail(f"{name}: no valid arguments in ARGS for its required {required}")
    with pytest.raises((NotANumber, SettingError, pydantic.ValidationError)) as caught:
        fn(**{**ARGS.get(name, dict)(), parameter: True})
    error = caught.value
    if isinstance(error, NotANumber):
        assert f"({parameter}=...): expected a number, got the boolean True" in str(error)
    elif isinstance(error, SettingError):
        assert error.field == parameter and "the boolean true" in str(error)
    else:
        assert [e["loc"] for e in error.errors()] == [(parameter,)] and "boolean" in str(error)
