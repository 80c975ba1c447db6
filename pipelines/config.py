"""The typed, validated configuration of one RL pipeline (the job config nests it).

Every field has a default that runs the built-in task on a 2-core CPU machine. Validation happens
here, before Ray starts: unknown keys, wrong types, names that do not resolve (the strategy: a
built-in name or an import path) and impossible combinations fail with a message that names the
key.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from trajflow.tasks.dataset import DataConfig
from trajflow.tasks.workload import Workload


# A sane ceiling: beyond it a typo (steps: 1000000000000) would otherwise start a job that never ends.
MAX_STEPS = 1_000_000
# Every built-in advantage estimator is group-relative: a group of one sample is its own baseline,
# so its advantage is 0 and nothing is trained. An estimator with another baseline may allow 1.
MIN_GROUP_SIZE = {"grpo": 2, "dr_grpo": 2, "leave_one_out": 2}


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


def check_model_dir(path: Path) -> None:
    """A local Hugging Face model dir: config.json (a JSON object) and a tokenizer. ValueError if not."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} is not a local model directory (no config.json)")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{config} is not a JSON object") from None
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def check_task(name: str) -> str:
    """A registered task name. ValueError naming the registered ones if not."""
    from trajflow.tasks.registry import registered_tasks

    if name not in registered_tasks():
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(registered_tasks())}")
    return name


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(6, ge=1)
    stop: list[str] = Field(default_factory=list, description="strings that end a response (besides eos)")


class CorrectionSettings(_Strict):
    """The decoupled objective's knobs (see algorithms/objective.py)."""

    mask_level: Literal["token", "sequence", "none"] = "sequence"
    mask_c_token: float = Field(2.0, gt=1.0)
    mask_c_seq: float = Field(1.05, gt=1.0)
    tis_cap: float | None = Field(None, gt=0.0)
    clip_level: Literal["token", "sequence", "none"] = "token"
    eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    eps_high: float = Field(0.28, gt=0.0)
    dual_clip_c: float | None = Field(None, gt=1.0)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "token-sum-norm"] = "token-mean"


class OptimizerConfig(_Strict):
    lr: float = Field(1.5e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = Field(1.0, gt=0.0)
    minibatches_per_step: int = Field(1, ge=1)
    mixed_precision: Literal["no", "bf16"] = "no"


class AdvantageSettings(_Strict):
    """Group-relative advantages (algorithms/advantages.py). `std` applies to grpo: "sample"
    (ddof 1; veRL and TRL divide by it, so it is the default) or "population" (ddof 0); at group
    size G they differ by sqrt(G / (G - 1)). The YAML may also give just the estimator's name."""

    estimator: Literal["grpo", "dr_grpo", "leave_one_out"] = "grpo"
    std: Literal["sample", "population"] = "sample"


class EwmaConfig(_Strict):
    window: int | None = Field(None, ge=1, description="staleness window W in versions (counted in optimizer "
                               "updates: W x minibatches_per_step); default max(1, max_staleness)")
    reset_threshold: float = Field(0.9, ge=0.0, le=1.0, description="tau: reset when active fraction < tau")


class ResourceConfig(_Strict):
    """Ray resources of one actor stage (fractional CPUs so that 2 cores do not deadlock)."""

    num_cpus: float = Field(0.5, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    resources: dict[str, float] = Field(default_factory=dict)
    torch_threads: int = Field(1, ge=1)


class TrainerConfig(ResourceConfig):
    """The train step: resources of each worker (num_cpus, num_gpus, resources, torch_threads,
    as for any stage) and its data-parallel group (operators/data_parallel.py).

    Each worker trains on CUDA when its resources include a GPU (Ray then makes one visible to
    it), else on the CPU; bf16 autocast comes from `optimizer.mixed_precision`."""

    num_workers: int = Field(1, ge=1, description="data-parallel workers (one torch.distributed group: gloo on "
                             "CPU, NCCL on CUDA); losses are normalised over all of them")
    max_tokens_per_microbatch: int | None = Field(
        None, ge=1, description="padded tokens (rows x longest prompt+response) per forward/backward; gradients "
        "accumulate over the micro-batches of an update (None: one micro-batch per minibatch and worker)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    placement: Literal["pack", "spread"] = Field(
        "pack", description="workers 1..N-1: pack (fewest nodes) or spread (each on a node other than worker 0's)")
    collective_timeout_seconds: float = Field(
        300.0, gt=0.0, description="a worker that does not join a gradient all-reduce within this fails the step")


    def data_parallel(self):
        """The train step's view of this section (operators/data_parallel.py)."""
        from trajflow.operators.data_parallel import DataParallel

        return DataParallel(num_workers=self.num_workers, max_tokens_per_microbatch=self.max_tokens_per_microbatch,
                            gradient_checkpointing=self.gradient_checkpointing, placement=self.placement,
                            timeout_seconds=self.collective_timeout_seconds, num_cpus=self.num_cpus,
                            num_gpus=self.num_gpus, resources=dict(self.resources))


class VllmSettings(_Strict):
    """Knobs of the vLLM engine (`engine: vllm`); see engines/vllm_engine.py. None = vLLM's default
    (on CPU, a 512 MiB KV cache)."""

    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    enable_prefix_caching: bool = True


class PipelineConfig(_Strict):
    model: Path | None = Field(None, description="local HF model dir (a relative path that is not under the "
                               "working directory is tried under the repository root, where the built-in warm "
                               "starts live); default: the built-in warm start")
    task: str | None = Field(None, description="a registered task (addition, reverse, calc); default addition "
                             "unless data or env is given")
    data: DataConfig | None = Field(None, description="train on a dataset (Parquet/JSONL/JSON); see tasks/dataset.py")
    reward: str | None = Field(None, description="exact, math, package.module:function or path/to/file.py:function "
                               "(default: the task's own verifier)")
    reward_timeout_seconds: float = Field(30.0, gt=0.0, description="per item; over it the row is a reward_error")
    env: str | None = Field(None, description="package.module:Class (or file.py:Class) of a multi-turn Environment")
    strategy: str = Field("snapshot", description="a built-in name (operators/strategies/registry.py) or an "
                          "import path module:Class / file.py:Class")
    strategy_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the strategy's constructor, e.g. "
        "{m2_threshold: 0.04} for m2po, or a user strategy's own settings")
    steps: int = Field(100, ge=1, le=MAX_STEPS)
    prompts_per_step: int = Field(64, ge=1)
    group_size: int = Field(8, ge=1)
    max_staleness: int = Field(0, ge=0)
    inference_dtype: Literal["float32", "bfloat16", "fp8"] = "float32"
    engine: Literal["torch", "vllm"] = Field("torch", description="generation engine (vllm: optional extra)")
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    partial_rollout: bool = Field(
        False, description="take new weights between decode steps (always on for `interrupt`)"
    )
    simulate_decode_seconds: float = Field(
        0.0, ge=0.0, description="sleep per decode step: emulate a slower inference engine (staleness studies)"
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    correction: CorrectionSettings = Field(default_factory=CorrectionSettings)
    advantage: AdvantageSettings = Field(default_factory=AdvantageSettings)
    drop_zero_variance_groups: bool = True
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    ewma: EwmaConfig = Field(default_factory=EwmaConfig)
    loglinear_alpha: float | None = Field(
        None, ge=0.0, le=1.0, description="fixed alpha; default: from versions (A-3PO)"
    )
    eval_every: int = Field(0, ge=0, description="held-out greedy accuracy every k steps (0: off)")
    eval_prompts: int = Field(200, ge=1)
    seed: int = 0
    num_generators: int = Field(1, ge=1)
    generator: ResourceConfig = Field(default_factory=ResourceConfig)
    scorer: ResourceConfig = Field(default_factory=lambda: ResourceConfig(num_cpus=0.25))
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    light_stage_cpus: float = Field(0.1, gt=0.0, description="CPUs of reward/advantage/filter tasks")
    colocate: Literal["auto", "off"] = Field(
        "auto", description="auto: consecutive stages share an actor process where that does not serialise "
        "work that overlaps (sync: one process; async: rollout side and train step); off: one process per "
        "operator stage (see pipelines/colocation.py)")

    @field_validator("strategy")
    @classmethod
    def _resolve_strategy(cls, spec: str) -> str:
        from trajflow.operators.strategies.registry import resolve_strategy

        where, sep, attr = spec.rpartition(":")
        if sep and where.endswith(".py"):  # a file: absolute, so the run's saved config works from anywhere
            spec = f"{Path(where).resolve()}:{attr}"
        resolve_strategy(spec)  # ValueError (one line) if it does not resolve
        return spec

    @field_validator("advantage", mode="before")
    @classmethod
    def _advantage_by_name(cls, value: Any) -> Any:
        return {"estimator": value} if isinstance(value, str) else value

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, model: Path | None) -> Path | None:
        if model is None or model.is_absolute() or model.exists():
            return model
        from trajflow.engines.paths import REPO_ROOT

        return REPO_ROOT / model if (REPO_ROOT / model).exists() else model

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str | None) -> str | None:
        return None if task is None else check_task(task)

    @model_validator(mode="after")
    def _check_combinations(self) -> "PipelineConfig":
        if self.model is not None:
            try:
                check_model_dir(self.model)
            except ValueError as e:
                raise ValueError(f"model: {e}") from None
        min_group = MIN_GROUP_SIZE.get(self.advantage.estimator, 1)
        if self.group_size < min_group:
            raise ValueError(
                f"group_size: {self.group_size} sample per prompt gives every trajectory advantage 0 under "
                f"advantage {self.advantage.estimator!r} (a group is its own baseline), so nothing would be trained; "
                f"use group_size >= {min_group}"
            )
        self._check_workload()
        if self.engine != "vllm" and self.vllm != VllmSettings():
            raise ValueError("vllm: settings given but engine is not vllm")
        try:
            strategy = self.build_strategy()
        except (TypeError, ValueError) as e:  # the constructor refused strategy_options
            raise ValueError(f"strategy_options: {self.strategy}: {e}") from None
        strategy.check(self)
        rows = self.rows_per_step
        if rows % self.optimizer.minibatches_per_step:
            raise ValueError(
                f"optimizer.minibatches_per_step: {self.optimizer.minibatches_per_step} does not divide "
                f"the {rows} rows of a step"
            )
        if self.correction.eps_low >= 1.0:
            raise ValueError("correction.eps_low must be < 1")
        return self

    def _check_workload(self) -> None:
        """Every name of the workload resolved before Ray starts: task, env, reward (importable,
        callable, TRL signature), dataset files and columns, the chat template; `data.epochs`
        sets `steps` when steps is not given."""
        if self.task is not None and (self.data is not None or self.env is not None):
            raise ValueError("task: give either task, or data / env (a config with data and no task runs on the data)")
        if self.task is None and self.data is None and self.env is None:
            self.__dict__["task"] = "addition"  # the default workload (no re-validation)
        workload = self.workload()
        workload.check()
        if self.data is None:
            return
        from trajflow.engines.models import load_tokenizer
        from trajflow.engines.tokenizer import encode_prompt
        from trajflow.tasks.dataset import first_record

        tokenizer = load_tokenizer(self.model_path)
        for path in workload.train_files() + workload.test_files():
            prompt = first_record(path)[self.data.prompt_key]
            try:
                encode_prompt(tokenizer, prompt, self.data.apply_chat_template)
            except (TypeError, ValueError) as e:
                raise ValueError(f"data.prompt_key: {path.name}: {e}") from None
        if self.data.epochs is not None:
            from trajflow.tasks.dataset import PromptDataset

            epoch = PromptDataset.load(self.data, workload.train_files(), tokenizer, with_ray=False).epoch_size
            available = self.data.epochs * epoch // self.prompts_per_step
            if available < 1:
                raise ValueError(f"data.epochs: {self.data.epochs} epoch(s) of {epoch} prompts are fewer than one "
                                 f"step of {self.prompts_per_step}")
            if "steps" not in self.model_fields_set:
                self.__dict__["steps"] = available  # derived (no re-validation): the run's length
                self.model_fields_set.add("steps")
            elif self.steps > available:
                raise ValueError(f"steps: {self.steps} steps of {self.prompts_per_step} prompts need more than "
                                 f"data.epochs={self.data.epochs} epochs of {epoch} prompts ({available} steps)")

    def workload(self) -> Workload:
        """What the run trains on (tasks.workload.Workload), from task / data / env / reward."""
        from trajflow.engines.paths import REPO_ROOT

        return Workload(task=self.task, data=self.data,
                        env=self.env, reward=self.reward, reward_timeout_seconds=self.reward_timeout_seconds,
                        repo_root=REPO_ROOT)

    @property
    def model_path(self) -> Path:
        """The model directory (the built-in warm start when `model` is not given)."""
        from trajflow.engines.paths import WARM_START_DIR

        return Path(self.model or WARM_START_DIR).resolve()

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def ewma_window(self) -> int:
        return self.ewma.window or max(1, self.max_staleness)

    def build_strategy(self):
        """A fresh instance of the configured strategy, with its settings from this config."""
        from trajflow.operators.strategies.registry import resolve_strategy

        return resolve_strategy(self.strategy).from_config(self)

    def training_numerics(self):
        """The numerics pi_theta and every pi_old are computed in (engines/training_numerics.py)."""
        from trajflow.engines.training_numerics import TrainingNumerics

        return TrainingNumerics(mixed_precision=self.optimizer.mixed_precision)

    def correction_config(self):
        """The objective's settings (algorithms/objective.py); token-sum-norm normalises by max_new_tokens."""
        from trajflow.algorithms.objective import CorrectionConfig

        return CorrectionConfig(**self.correction.model_dump(), loss_norm_tokens=self.sampling.max_new_tokens)
