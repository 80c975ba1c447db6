"""The typed, validated configuration of one RL pipeline (the job config nests it).

Every field has a default that runs the built-in task on a 2-core CPU machine. Validation happens
here, before Ray starts: unknown keys, wrong types, names that do not resolve (the strategy: a
built-in name or an import path) and impossible combinations fail with a message that names the
key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import types
import typing
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, KLConfig, OptimizerConfig
from trajflow.engines.factory import VLLM_LORA_RANKS, VLLM_LORA_REFUSED_MODULES, VllmOptions
from trajflow.engines.lora import LoraSettings
from trajflow.engines.sampling import SamplingParams
from trajflow.operators.recovery import RecoveryConfig
from trajflow.operators.weight_sync import WeightSyncConfig
from trajflow.settings import check_setting, field_types
from trajflow.tasks.dataset import DataConfig
from trajflow.tasks.workload import Workload


# A sane ceiling: beyond it a typo (steps: 1000000000000) would otherwise start a job that never ends.
MAX_STEPS = 1_000_000
# Every built-in advantage estimator is group-relative: a group of one sample is its own baseline,
# so its advantage is 0 and nothing is trained. An estimator with another baseline may allow 1.
MIN_GROUP_SIZE = {"grpo": 2, "dr_grpo": 2, "leave_one_out": 2, "reinforce_plus_plus_baseline": 2}


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
            return "a mapping of keys to values (e.g. {key: value})"
    return "a value of another type"


# files that hold a tokenizer (tokenizer_config.json only configures one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_dir(path: Path, architecture: bool = True) -> None:
    """A local Hugging Face model dir: config.json (a JSON object), a tokenizer, an architecture
    transformers knows as a causal LM (`architecture=False` skips it: it imports transformers)
    and weights. ValueError (one line) if not."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} is not a local model directory (no config.json)")
    try:
        data = json.loads(config.read_text())
        if not isinstance(data, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{config} is not a JSON object") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = " (tokenizer_config.json configures a tokenizer but does not hold one)" \
            if (path / "tokenizer_config.json").is_file() else ""
        raise ValueError(f"{path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)}{found}")
    if architecture:
        _check_architecture(config, data.get("model_type"))
    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()] or sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path} has no weights (none of {', '.join(WEIGHT_FILES)})")
    if weights[0].name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(weights[0].read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{weights[0]} is not a weight index (a JSON object with a weight_map)") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"{path} lacks the weight file {missing[0]} named in {weights[0].name}")


def _ties_embeddings(model: Path) -> bool:
    """Whether the model's output layer is its input embedding (one tensor): an lm_head adapter
    merged into it would change the embedding too, which PEFT's adapter does not."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False))


def _check_architecture(config: Path, model_type: object) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str):
        raise ValueError(f"{config} has no model_type (the architecture)")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"{config}: model_type {model_type!r} is an architecture transformers "
                         f"{transformers.__version__} does not know")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{config}: model_type {model_type!r} is not a causal language model")


_TOKENIZERS: dict[tuple, Any] = {}


def checked_tokenizer(path: Path):
    """The tokenizer of a checked model dir, loaded once per process while its files are unchanged
    (a config is validated more than once before a run starts). ValueError (one line) naming the
    file if it does not load."""
    from trajflow.engines.models import load_tokenizer

    path = Path(path).resolve()
    ident = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()) if f.is_file()
                  and f.suffix != ".safetensors")
    if (path, ident) in _TOKENIZERS:
        return _TOKENIZERS[(path, ident)]
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - a user's files: say which one
        for name in ("tokenizer.json", "tokenizer_config.json"):
            try:
                if (path / name).is_file():
                    json.loads((path / name).read_bytes())
            except ValueError as bad:
                raise ValueError(f"{path / name}: not valid JSON ({bad})") from None
        raise ValueError(f"{path}: the tokenizer does not load ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    _TOKENIZERS.clear()  # one model's tokenizer at a time
    _TOKENIZERS[(path, ident)] = tokenizer
    return tokenizer


def check_task(name: str) -> str:
    """A registered task name. ValueError naming the registered ones if not."""
    from trajflow.tasks.registry import registered_tasks

    if name not in registered_tasks():
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(registered_tasks())}")
    return name


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
    as for any stage) and its data-parallel group (operators/data_parallel.py).

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
        "sharded over the workers (torch FSDP2, operators/fsdp.py)")
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
        """The train step's view of this section (operators/data_parallel.py); `group_name`: the
        placement group of workers 1..N-1, which the pipeline removes when the run ends."""
        from trajflow.operators.data_parallel import DataParallel

        return DataParallel(num_workers=self.num_workers, max_tokens_per_microbatch=self.max_tokens_per_microbatch,
                            gradient_checkpointing=self.gradient_checkpointing, sharding=self.sharding,
                            cpu_offload=self.cpu_offload, placement=self.placement,
                            collective_timeout_seconds=self.collective_timeout_seconds, num_cpus=self.num_cpus,
                            num_gpus=self.num_gpus, resources=dict(self.resources), group_name=group_name)


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
    reward_max_failed_steps: int = Field(
        3, ge=0, description="stop the run after this many consecutive steps whose reward failed on every row "
        "(or returned the wrong number of values); 0: never")
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
    vllm: VllmSection = Field(default_factory=VllmSection)
    partial_rollout: bool = Field(
        False, description="take new weights between decode steps (always on for `interrupt`)"
    )
    simulate_decode_seconds: float = Field(
        0.0, ge=0.0, description="sleep per decode step: emulate a slower inference engine (staleness studies)"
    )
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    correction: CorrectionSection = Field(default_factory=CorrectionSection)
    advantage: AdvantageSection = Field(default_factory=AdvantageSection)
    kl: KLSection = Field(default_factory=KLSection)
    drop_zero_variance_groups: bool = True
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    eval_every: int = Field(0, ge=0, description="held-out greedy mean reward (accuracy for a 0/1 reward) every "
                            "k steps (0: off)")
    eval_prompts: int = Field(200, ge=1)
    seed: int = Field(0, ge=0, description="seeds sampling, shuffling and initialisation (numpy needs >= 0)")
    num_generators: int = Field(1, ge=1)
    generator: ResourceConfig = Field(default_factory=ResourceConfig)
    scorer: ResourceConfig = Field(default_factory=lambda: ResourceConfig(num_cpus=0.25))
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    recovery: RecoverySection = Field(default_factory=RecoverySection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    light_stage_cpus: float = Field(0.1, gt=0.0, description="CPUs of reward/advantage/filter tasks")
    colocate: Literal["auto", "rollout", "off"] = Field(
        "auto", description="auto: consecutive stages share an actor process where that does not serialise "
        "work that overlaps (sync: one process; async: the generator, the stages between, the train step); "
        "rollout: async too, the generator and the stages up to the train step in one process (one torch "
        "process fewer; a slow reward then delays sampling); off: one process per operator stage (see "
        "pipelines/colocation.py)")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Keys renamed in 0.2 still work for one release, with a one-line notice (TRL's path)."""
        return migrate_deprecated_keys(data) if isinstance(data, dict) else data

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
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("engine: vllm is not installed (pip install 'trajflow[vllm]'), or use engine: torch")
        if self.lora.r > 0 and self.trainer.sharding == "fsdp":
            raise ValueError("lora: an adapter is trained by a replicated trainer; use trainer.sharding: none")
        if self.lora.r > 0 and "lm_head" in self.lora.target_modules and _ties_embeddings(self.model_path):
            raise ValueError("lora.target_modules: lm_head on a model whose output layer is its input embedding "
                             "(tie_word_embeddings): the readers' merged weights would not be the trained model; "
                             "leave lm_head out")
        if self.lora.r > 0 and self.engine == "vllm":
            self._check_vllm_lora()
        if self.weight_sync.method == "collective":
            self._check_collective()
        min_group = MIN_GROUP_SIZE.get(self.advantage.estimator, 1)
        if self.group_size < min_group:
            raise ValueError(
                f"group_size: {self.group_size} sample per prompt gives every trajectory advantage 0 under "
                f"advantage {self.advantage.estimator!r} (a group is its own baseline), so nothing would be trained; "
                f"use group_size >= {min_group}"
            )
        self._check_workload()
        try:
            self.advantage_config()  # the overlong shaping's buffer within the job's max_new_tokens
        except ValueError as e:
            raise ValueError(f"advantage: {e}") from None
        if self.engine != "vllm" and self.vllm != VllmSection():
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
        if self.model is not None or self.data is not None:
            try:  # a tokenizer that does not load ends here, not in a Ray worker
                tokenizer = checked_tokenizer(self.model_path)
            except ValueError as e:
                raise ValueError(f"model: {e}") from None
        if self.data is None:
            return
        if self.eval_every and not self.data.test_files:
            raise ValueError("eval_every: held-out evaluation of a dataset needs data.test_files (or eval_every: 0)")
        from trajflow.tasks.dataset import checked_dataset

        # every row of every file, read and tokenized once (kept for the run's prompt source)
        required = workload.required_columns()  # the reward's; other columns may be null
        train = checked_dataset(self.data, workload.train_files(), tokenizer, required=required)
        if self.data.test_files:
            checked_dataset(self.data, workload.test_files(), tokenizer, key="data.test_files", required=required)
        if self.data.epochs is not None:
            epoch = train.epoch_size
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

    def build_strategy(self):
        """A fresh instance of the configured strategy, with its settings from this config."""
        from trajflow.operators.strategies.registry import resolve_strategy

        return resolve_strategy(self.strategy).from_config(self)

    def engine_lora_slots(self) -> int:
        """Adapters the vLLM engine keeps resident in a LoRA run: the staleness window's
        max_staleness + 1 versions (0: no LoRA in the engine; the torch engine merges each one)."""
        return self.max_staleness + 1 if self.engine == "vllm" and self.lora.r > 0 else 0

    def _check_vllm_lora(self) -> None:
        """What vLLM's LoRA (engines/vllm_engine.py) cannot take, refused by name."""
        if self.lora.r > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora.r: {self.lora.r} is above vLLM's largest adapter rank "
                             f"{VLLM_LORA_RANKS[-1]}; use engine: torch")
        refused = sorted(set(self.lora.target_modules) & set(VLLM_LORA_REFUSED_MODULES))
        if refused:
            raise ValueError(f"lora.target_modules: {', '.join(refused)} with engine: vllm: vLLM's own lm_head "
                             "adapter is not checked against the scorers' merge (old = inference); use engine: torch")

    def _check_collective(self) -> None:
        """What `weight_sync.method: collective` does not cover (yet), refused rather than run otherwise."""
        if self.lora.r > 0:
            raise ValueError("weight_sync.method: collective sends full weights; a lora adapter version is small: "
                             "use object_store")
        if self.recovery.max_restarts > 0:
            raise ValueError("weight_sync.method: collective keeps no trained version in the policy store, where a "
                             "rebuilt trainer would read its weights: set recovery.max_restarts: 0")

    def reader_dtypes(self, strategy) -> tuple[str, ...]:
        """The dtypes the trainer serves under `collective` (operators/weight_sync.py): the
        generators' (float32 when they score prefixes), and float32 for an old-logit scorer."""
        from trajflow.operators.weight_sync import reader_dtype

        dtypes = {reader_dtype(self.inference_dtype, exact=strategy.scores_at_switch)}
        if strategy.keep_history:
            dtypes.add("float32")
        return tuple(sorted(dtypes))

    def training_numerics(self):
        """The numerics pi_theta and every pi_old are computed in (engines/training_numerics.py)."""
        from trajflow.engines.training_numerics import TrainingNumerics

        return TrainingNumerics(mixed_precision=self.optimizer.mixed_precision)

    def advantage_config(self) -> AdvantageConfig:
        """The estimator's settings; DAPO's overlong shaping budgets max_new_tokens unless
        `advantage.overlong_max_tokens` is given."""
        spec = self.advantage.spec()
        if spec.overlong_max_tokens is None:
            spec = dataclasses.replace(spec, overlong_max_tokens=self.sampling.max_new_tokens)
        return spec

    def correction_config(self) -> CorrectionConfig:
        """The objective's settings; token-sum-norm normalises by max_new_tokens unless
        `correction.loss_norm_tokens` is given."""
        spec = self.correction.spec()
        if spec.loss_norm_tokens is None:
            spec = dataclasses.replace(spec, loss_norm_tokens=self.sampling.max_new_tokens)
        return spec


class TrajflowDeprecation(FutureWarning):
    """A config key renamed in this release; the old name goes in the next (one-line notice)."""


# old key (dotted) -> (new key (dotted), what to do with its value)
RENAMED_KEYS = {
    "ewma.window": "strategy_options.window",
    "ewma.reset_threshold": "strategy_options.reset_threshold",
    "loglinear_alpha": "strategy_options.alpha",
}


def migrate_deprecated_keys(data: dict) -> dict:
    """Move renamed keys to their new place (an explicitly given new key wins), saying so once
    per key. A strategy setting goes under `strategy_options` only if the configured strategy
    takes it (it used to be ignored by the others); else it is dropped, and the notice says so."""
    data = dict(data)
    given = data.get("strategy_options")
    if given is not None and not isinstance(given, dict):
        return data  # not a mapping: the field's own validation names the key
    options = dict(given or {})
    accepted = _strategy_parameters(data.get("strategy", PipelineConfig.model_fields["strategy"].default))
    for old, new in RENAMED_KEYS.items():
        section, _, key = old.rpartition(".")
        holder = data.get(section) if section else data
        if not isinstance(holder, dict) or key not in holder:
            continue
        value = holder.pop(key) if section else data.pop(key)
        if section and not holder:
            data.pop(section)
        option = new.rpartition(".")[2]
        if accepted is not None and option not in accepted:
            notice = f"{old}: ignored (strategy {data.get('strategy')} has no option {option})"
        else:
            notice = f"{old}: use {new}"
            if value is not None:
                options.setdefault(option, value)
        warnings.warn(f"{notice}; the old key goes in the next release", TrajflowDeprecation, stacklevel=2)
    if options:
        data["strategy_options"] = options
    return data


def _strategy_parameters(spec: Any) -> set[str] | None:
    """The keyword parameters of a strategy's constructor (None: it does not resolve yet, the
    strategy field's own validator reports that)."""
    from trajflow.operators.strategies.registry import resolve_strategy

    try:
        cls = resolve_strategy(str(spec))
    except ValueError:
        return None
    return set(inspect.signature(cls.__init__).parameters) - {"self"}
