"""The typed, validated configuration of one RL pipeline (the job config nests it).

Every field has a default that runs the built-in task on a 2-core CPU machine. Validation happens
here, before Ray starts: unknown keys, wrong types, names that do not resolve (the strategy: a
built-in name or an import path) and impossible combinations fail with a message that names the
key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig
from trajflow.engines.factory import VLLM_LORA_RANKS, VLLM_LORA_REFUSED_MODULES
from trajflow.pipelines.config.deprecations import migrate_deprecated_keys
from trajflow.pipelines.config.model_dir import check_model_dir, checked_tokenizer, model_vocab_size, ties_embeddings
from trajflow.pipelines.config.sections import (
    AdvantageSection,
    CorrectionSection,
    DistillSection,
    KLSection,
    LoraSection,
    OptimizerSection,
    RecoverySection,
    ResourceConfig,
    SamplingSection,
    TrainerConfig,
    VllmSection,
    WeightSyncSection,
    _Strict,
)
from trajflow.tasks.dataset import DataConfig
from trajflow.tasks.workload import Workload

# A sane ceiling: beyond it a typo (steps: 1000000000000) would otherwise start a job that never ends.
MAX_STEPS = 1_000_000
# Every built-in advantage estimator is group-relative: a group of one sample is its own baseline,
# so its advantage is 0 and nothing is trained. An estimator with another baseline may allow 1.
MIN_GROUP_SIZE = {"grpo": 2, "dr_grpo": 2, "leave_one_out": 2, "reinforce_plus_plus_baseline": 2}



def check_task(name: str) -> str:
    """A registered task name. ValueError naming the registered ones if not."""
    from trajflow.tasks.registry import registered_tasks

    if name not in registered_tasks():
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(registered_tasks())}")
    return name


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
    top_k_logprobs: int = Field(
        0, ge=0, description="record per response token the K most likely ids of the distribution it was sampled "
        "from and their log-probs (mu), and on them pi_old at the token's version (exact strategies) and the "
        "teacher's; the distribution-level mismatch, Score Centering and the forward KL read them "
        "(schemas/trajectory.py); 0 = off: the record without them")
    teacher: Path | None = Field(
        None, description="on-policy distillation: a local HF model dir (the model's tokenizer) that scores the "
        "student's tokens before the train step (operators/teacher.py); null = no distillation")
    distill: DistillSection = Field(default_factory=DistillSection)
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
    colocate: Literal["auto", "off"] = Field(
        "auto", description="auto: consecutive stages share an actor process where that does not serialise "
        "work that overlaps (sync: one process; async: rollout side and train step); off: one process per "
        "operator stage (see pipelines/colocation.py)")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Keys renamed in 0.2 still work for one release, with a one-line notice (TRL's path)."""
        return migrate_deprecated_keys(data, cls.model_fields["strategy"].default) if isinstance(data, dict) else data

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

    @field_validator("model", "teacher")
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
        if self.lora.r > 0 and "lm_head" in self.lora.target_modules and ties_embeddings(self.model_path):
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
        self._check_distributions()
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

    def _check_distributions(self) -> None:
        """What the top-k record, the distribution-level mask and distillation need, refused by key."""
        k = self.top_k_logprobs
        if k and self.env is not None:
            raise ValueError("top_k_logprobs: the top-k of multi-turn episodes (env) is not recorded yet; use 0")
        if k:
            vocab = model_vocab_size(self.model_path)
            if vocab is not None and k > vocab:
                raise ValueError(f"top_k_logprobs: {k} is more than the model's vocabulary of {vocab} ids")
        if self.correction.dist_mask is not None:
            if not k:
                raise ValueError("correction.dist_mask: the distribution-level mask needs top_k_logprobs > 0")
            if not self.build_strategy().old_distribution:
                raise ValueError(f"correction.dist_mask: strategy {self.strategy} supplies no pi_old distribution on the "
                                 "top-k ids (an exact strategy or behavior does)")
        if self.teacher is None:
            if self.distill != DistillSection():
                raise ValueError("distill: settings given but no teacher (teacher: a model directory)")
            return
        try:
            check_model_dir(self.teacher)
        except ValueError as e:
            raise ValueError(f"teacher: {e}") from None
        if model_vocab_size(self.teacher) != model_vocab_size(self.model_path):
            raise ValueError(f"teacher: {self.teacher} has {model_vocab_size(self.teacher)} ids, the model "
                             f"{model_vocab_size(self.model_path)}: the teacher scores the student's token ids")
        if self.distill.forward_kl_coef > 0 and not k:
            raise ValueError("distill.forward_kl_coef: the forward KL is taken on the top-k support; set "
                             "top_k_logprobs > 0")

    def distill_config(self) -> DistillConfig | None:
        """The distillation's settings, or None without a teacher."""
        return None if self.teacher is None else self.distill.spec()

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
        train = checked_dataset(self.data, workload.train_files(), tokenizer)
        if self.data.test_files:
            checked_dataset(self.data, workload.test_files(), tokenizer, key="data.test_files")
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
        """The dtypes the trainer serves under `collective` (operators/trainer/weight_sync.py): the
        generators' (float32 when they score prefixes), and float32 for an old log-prob scorer."""
        from trajflow.operators.trainer.weight_sync import reader_dtype

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
