"""How a YAML section is declared: once, as a frozen settings dataclass beside the code that uses
it (trajflow/settings.py: each key with its default, its documentation and its bounds); the YAML
section is the pydantic model built from that dataclass (`settings_section`), so a YAML key and a
library argument share one declaration. Every section of the config is built this way:

    sampling     SamplingConfig      engines/sampling.py
    correction   CorrectionConfig    algorithms/config.py
    advantage    AdvantageConfig     algorithms/config.py
    kl           KLConfig            algorithms/config.py
    distill      DistillConfig       algorithms/config.py
    optimizer    OptimizerConfig     algorithms/config.py
    lora         LoraConfig          engines/lora.py
    vllm         VllmConfig          engines/factory.py
    data         DataConfig          tasks/dataset.py
    generator, scorer  ResourceConfig  operators/contracts/stage.py
    trainer      TrainerConfig       operators/trainer/plan.py
    recovery     RecoveryConfig      operators/trainer/recovery.py
    weight_sync  WeightSyncConfig    operators/trainer/weight_sync.py
    critic       CriticConfig        operators/trainer/critic_config.py
    team         TeamConfig          pipelines/config/team.py

A section reads back as its dataclass (`section.spec()`); the pipeline reads them all through
`PipelineConfig.settings` (derived defaults filled in).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig, KLConfig, OptimizerConfig
from trajflow.engines.factory import VllmConfig
from trajflow.engines.lora import LoraConfig
from trajflow.engines.sampling import SamplingConfig
from trajflow.operators.contracts.stage import ResourceConfig
from trajflow.operators.trainer.critic_config import CriticConfig
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.operators.trainer.recovery import RecoveryConfig
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.pipelines.config.team import TeamConfig
from trajflow.settings import MAPPING, check_setting, described, field_types
from trajflow.tasks.dataset import DataConfig


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts_bool(a) for a in args)
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in args)
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """`steps: true` is a typo, not 1, and `tensorboard: 1` is not a yes/no answer (pydantic
        would otherwise coerce booleans to numbers and numbers or strings to booleans)."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and not _accepts_bool(annotation):
            raise ValueError(f"expected {_kind(annotation)}, got the boolean {str(value).lower()}")
        if annotation is bool and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value


def _kind(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", Path: "a path"}
    for a in (annotation, *typing.get_args(annotation)):
        if a in names:
            return names[a]
        if typing.get_origin(a) is dict or (isinstance(a, type) and issubclass(a, BaseModel)):
            return MAPPING
    return "a value of another type"


class _Section(_Strict):
    """A YAML section built from a settings dataclass (trajflow/settings.py): the same fields,
    defaults, documentation and checks; `spec()` is the dataclass the operators receive."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    settings: ClassVar[type]

    @model_validator(mode="before")
    @classmethod
    def _from_settings(cls, data: Any) -> Any:
        """A section given as its settings dataclass (`correction=CorrectionConfig(...)`)."""
        if isinstance(data, cls.settings):
            return {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _checked(cls, value: Any, info: ValidationInfo) -> Any:
        if dataclasses.is_dataclass(field_types(cls.settings)[info.field_name]):  # a nested section
            if isinstance(value, (dict, BaseModel)) or dataclasses.is_dataclass(value):
                return value  # its own model checks each of its keys
            raise ValueError(f"expected {MAPPING}, got {described(value)}")
        if isinstance(value, str) and _accepts_float(field_types(cls.settings)[info.field_name]):
            try:  # YAML 1.1 reads `1e-3` (no dot) as a string; any other string stays one
                value = float(value)
            except ValueError:
                pass
        return check_setting(cls.settings, info.field_name, value)

    @model_validator(mode="after")
    def _cross_checks(self) -> "_Section":
        self.spec()  # the dataclass's own cross-field checks (SettingError names the field)
        return self

    def spec(self) -> Any:
        values = {name: getattr(self, name) for name in type(self).model_fields}
        return self.settings(**{k: v.spec() if isinstance(v, _Section) else v for k, v in values.items()})


def _section_of(section: type[_Section], factory: Any) -> Any:
    """A factory of `section` holding what the settings dataclass factory `factory` makes."""
    def make() -> _Section:
        made = factory()
        return section(**{f.name: getattr(made, f.name) for f in dataclasses.fields(made)})

    return make


def _accepts_float(annotation: Any) -> bool:
    return annotation is float or float in typing.get_args(annotation)


def settings_section(settings: type, name: str) -> type[_Section]:
    """The pydantic model of a YAML section whose keys are the fields of `settings`; a field that
    is a settings dataclass itself (the critic's `optimizer`) is a section nested in it."""
    hints = field_types(settings)
    fields = {}
    for f in dataclasses.fields(settings):
        key = f.metadata.get("key")  # a field named like a Python keyword (`in_`) is `in` in YAML
        hint = hints[f.name]
        default = ({"default_factory": f.default_factory} if f.default_factory is not dataclasses.MISSING
                   else {"default": ...} if f.default is dataclasses.MISSING else {"default": f.default})
        if dataclasses.is_dataclass(hint):
            hint = settings_section(hint, hint.__name__.removesuffix("Config") + "Section")
            default = {"default_factory": _section_of(hint, f.default_factory)}
        fields[f.name] = (hint, Field(**default, description=f.metadata.get("doc") or None,
                                      **({"alias": key} if key else {})))
    model = create_model(name, __base__=_Section, __doc__=settings.__doc__, **fields)
    model.settings = settings
    return model


# the YAML model of each section, named after its dataclass (CorrectionConfig -> CorrectionSection)
(SamplingSection, CorrectionSection, AdvantageSection, KLSection, DistillSection, OptimizerSection, VllmSection,
 RecoverySection, LoraSection, WeightSyncSection, DataSection, ResourceSection, TrainerSection, CriticSection,
 TeamSection) = (
    settings_section(settings, settings.__name__.removesuffix("Config") + "Section")
    for settings in (SamplingConfig, CorrectionConfig, AdvantageConfig, KLConfig, DistillConfig, OptimizerConfig,
                     VllmConfig, RecoveryConfig, LoraConfig, WeightSyncConfig, DataConfig, ResourceConfig,
                     TrainerConfig, CriticConfig, TeamConfig))
