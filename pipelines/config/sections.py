"""How a YAML section is declared: strict pydantic models, and the sections built from settings
dataclasses (trajflow/settings.py) so the YAML and the library share one declaration per key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig, KLConfig, OptimizerConfig
from trajflow.engines.factory import VllmOptions
from trajflow.engines.lora import LoraSettings
from trajflow.engines.sampling import SamplingParams
from trajflow.operators.trainer.recovery import RecoveryConfig
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.settings import check_setting, field_types


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
    return "a value of another type"


class _Section(_Strict):
    """A YAML section built from a settings dataclass (trajflow/settings.py): the same fields,
    defaults, documentation and checks; `spec()` is the dataclass the operators receive."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    settings: ClassVar[type]

    @field_validator("*", mode="before")
    @classmethod
    def _checked(cls, value: Any, info: ValidationInfo) -> Any:
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
        return self.settings(**{name: getattr(self, name) for name in type(self).model_fields})


def _accepts_float(annotation: Any) -> bool:
    return annotation is float or float in typing.get_args(annotation)


def settings_section(settings: type, name: str) -> type[_Section]:
    """The pydantic model of a YAML section whose keys are the fields of `settings`."""
    hints = field_types(settings)
    fields = {}
    for f in dataclasses.fields(settings):
        key = f.metadata.get("key")  # a field named like a Python keyword (`in_`) is `in` in YAML
        fields[f.name] = (hints[f.name], Field(f.default, description=f.metadata.get("doc") or None,
                                              **({"alias": key} if key else {})))
    model = create_model(name, __base__=_Section, __doc__=settings.__doc__, **fields)
    model.settings = settings
    return model


SamplingSection = settings_section(SamplingParams, "SamplingSection")
CorrectionSection = settings_section(CorrectionConfig, "CorrectionSection")
AdvantageSection = settings_section(AdvantageConfig, "AdvantageSection")
KLSection = settings_section(KLConfig, "KLSection")
DistillSection = settings_section(DistillConfig, "DistillSection")
OptimizerSection = settings_section(OptimizerConfig, "OptimizerSection")
VllmSection = settings_section(VllmOptions, "VllmSection")
RecoverySection = settings_section(RecoveryConfig, "RecoverySection")
LoraSection = settings_section(LoraSettings, "LoraSection")
WeightSyncSection = settings_section(WeightSyncConfig, "WeightSyncSection")


class ResourceConfig(_Strict):
    """Ray resources of one actor stage (fractional CPUs so that 2 cores do not deadlock)."""

    num_cpus: float = Field(0.5, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    resources: dict[str, float] = Field(default_factory=dict)
    torch_threads: int = Field(1, ge=1)


class TrainerConfig(ResourceConfig):
    """The train step: resources of each worker (num_cpus, num_gpus, resources, torch_threads,
    as for any stage) and its data-parallel group (operators/trainer/plan.py).

    Each worker trains on CUDA when its resources include a GPU (Ray then makes one visible to
    it), else on the CPU; bf16 autocast comes from `optimizer.mixed_precision`."""

    num_workers: int = Field(1, ge=1, description="data-parallel workers (one torch.distributed group: gloo on "
                             "CPU, NCCL on CUDA); losses are normalised over all of them")
    max_tokens_per_microbatch: int | None = Field(
        None, ge=1, description="padded tokens (rows x longest prompt+response) per forward/backward; gradients "
        "accumulate over the micro-batches of an update (None: one micro-batch per minibatch and worker)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="none: a full replica per worker; fsdp: parameters, gradients and optimizer state "
        "sharded over the workers (torch FSDP2, operators/trainer/fsdp.py)")
    cpu_offload: bool = Field(False, description="fsdp on CUDA: shards, gradients and optimizer state in host "
                              "memory, each layer copied to the GPU to compute (no effect on CPU workers)")
    placement: Literal["pack", "spread"] = Field(
        "pack", description="workers 1..N-1: pack (fewest nodes) or spread (each on a node other than worker 0's)")
    collective_timeout_seconds: float = Field(
        300.0, gt=0.0, description="a worker that does not join a gradient all-reduce within this fails the step")

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> "TrainerConfig":
        if self.cpu_offload and self.sharding != "fsdp":
            raise ValueError("cpu_offload: needs sharding: fsdp (a replicated worker keeps its state on its device)")
        return self

    def data_parallel(self, group_name: str):
        """The train step's view of this section (operators/trainer/plan.py); `group_name`: the
        placement group of workers 1..N-1, which the pipeline removes when the run ends."""
        from trajflow.operators.trainer.plan import DataParallel

        return DataParallel(num_workers=self.num_workers, max_tokens_per_microbatch=self.max_tokens_per_microbatch,
                            gradient_checkpointing=self.gradient_checkpointing, sharding=self.sharding,
                            cpu_offload=self.cpu_offload, placement=self.placement,
                            collective_timeout_seconds=self.collective_timeout_seconds, num_cpus=self.num_cpus,
                            num_gpus=self.num_gpus, resources=dict(self.resources), group_name=group_name)
