"""The typed, validated configuration of one RL pipeline (the job config nests it).

Every field has a default that runs the built-in task on a 2-core CPU machine. Validation happens
here, without reading a file: unknown keys, wrong types, names that do not resolve (a strategy,
an engine, an advantage estimator: a registered name or an import path, trajflow/registry.py)
and impossible combinations fail with a message that names the key. What needs the disk is the
preflight (preflight.py), run before Ray starts.

A part with settings is selected as `KEY: {name: NAME, <its settings>}` (`strategy`, `engine`):
the config holds the name under KEY and the settings beside it (the strategy's in
`strategy_options`, an engine's in its section, e.g. `vllm:`, or privately), and writes the
mapping back when dumped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, DistillConfig
from trajflow.algorithms.estimators import ESTIMATORS
from trajflow.engines.factory import ENGINES
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.operators.contracts.stage import ResourceConfig
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.pipelines.config.auto import AUTO, Machine, ModelShape, auto_microbatch_tokens, auto_threads
from trajflow.pipelines.config.deprecations import migrate_deprecated_keys
from trajflow.pipelines.config.team import SHARED
from trajflow.pipelines.config.sections import (
    AdvantageSection,
    CorrectionSection,
    CriticSection,
    DataSection,
    DistillSection,
    KLSection,
    LoraSection,
    OptimizerSection,
    RecoverySection,
    ResourceSection,
    SamplingSection,
    TeamSection,
    TrainerSection,
    VllmSection,
    WeightSyncSection,
    _Strict,
)
from trajflow.tasks.dataset import DataConfig
from trajflow.tasks.workload import Workload

# A sane ceiling: beyond it a typo (steps: 1000000000000) would otherwise start a job that never ends.
MAX_STEPS = 1_000_000

def check_task(name: str) -> str:
    """A registered task name. ValueError naming the registered ones if not."""
    from trajflow.tasks.registry import registered_tasks

    if name not in registered_tasks():
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(registered_tasks())}")
    return name


class PipelineConfig(_Strict):
    """One RL pipeline: what it trains (model, workload), how (strategy, sampling, the loss, the
    optimizer) and where its stages run. Every key is documented here or in its section's
    settings dataclass (sections.py); docs/configuration.md lists them all, generated from these
    declarations (`python -m trajflow.jobs.config_reference`).

    Validation checks what can be checked without reading a file (types, bounds, names that
    resolve, combinations); what needs the disk — the model directory, the tokenizer, every row of
    a dataset — is `preflight()` (preflight.py), which the job and RLPipeline run before Ray starts."""

    model: Path | None = Field(None, description="local HF model dir (a relative path that is not under the "
                               "working directory is tried under the repository root, where the built-in warm "
                               "starts live), or a model trajflow prepares once into its cache "
                               "(engines/prepared.py: smollm2-135m-instruct-q4_1); default: the built-in warm start")
    task: str | None = Field(None, description="a registered task (addition, reverse, calc); default addition "
                             "unless data or env is given")
    data: DataSection | None = Field(None, description="train on a dataset (Parquet/JSONL/JSON); see "
                                     "docs/workload.md")
    reward: str | None = Field(None, description="exact, math, package.module:function or path/to/file.py:function "
                               "(default: the task's own verifier)")
    reward_timeout_seconds: float = Field(30.0, gt=0.0, description="per item; over it the row is a reward_error")
    reward_max_failed_steps: int = Field(
        3, ge=0, description="stop the run after this many consecutive steps whose reward failed on every row "
        "(or returned the wrong number of values); 0: never")
    env: str | None = Field(None, description="package.module:Class (or file.py:Class) of a multi-turn Environment")
    strategy: str = Field("snapshot", description="where pi_old comes from: a registered strategy (listed under "
                          "'Strategies' below; `trajflow configs`) or an import path module:Class / file.py:Class; "
                          "with settings: {name: NAME, <its settings>}, e.g. {name: ewma, window: 4}")
    strategy_options: dict[str, Any] = Field(
        default_factory=dict, description="deprecated (one release): the strategy's settings; write "
        "strategy: {name: NAME, <its settings>}")
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="train steps, each one weight version (with "
                       "data.epochs and no steps: as many as the epochs hold)")
    prompts_per_step: int = Field(64, ge=1, description="prompts sampled per train step")
    group_size: int = Field(8, ge=1, description="responses sampled per prompt: the group its advantage is "
                            "relative to")
    max_staleness: int = Field(0, ge=0, description="how many versions a token may lag the trainer: generation "
                               "of step b waits for version b - max_staleness, and older tokens are dropped from the "
                               "loss; 0: synchronous, on-policy")
    inference_dtype: Literal["float32", "bfloat16", "fp8"] = Field(
        "float32", description="the numerics generation samples in (fp8: simulated); the training-inference "
        "discrepancy r_d comes from the difference to training numerics")
    engine: str = Field("torch", description="the generation engine: a registered engine (listed under 'Generation "
                        "engines' below; vllm: the optional extra) or an import path module:Class / file.py:Class; "
                        "with settings of its own: {name: NAME, <its settings>}")
    vllm: VllmSection = Field(default_factory=VllmSection, description="the vLLM engine's settings "
                              "(engine: vllm only)")
    partial_rollout: bool = Field(
        False, description="take new weights between decode steps (always on for `interrupt`)")
    old_logprob_forward: Literal["auto", "always"] = Field(
        "auto", description="auto: an exact strategy reuses the inference log-probs as old log-probs where its "
        "forward pass would repeat them in the same numerics (torch engine, float32 inference and training, no "
        "weight change inside a rollout, no sampling filter, no top-k record, no LoRA, no environment), and the "
        "run's header says so; always: the forward pass in every case")
    simulate_decode_seconds: float = Field(
        0.0, ge=0.0, description="sleep per decode step: emulate a slower inference engine (staleness studies)")
    sampling: SamplingSection = Field(default_factory=SamplingSection, description="how responses are sampled")
    correction: CorrectionSection = Field(default_factory=CorrectionSection, description="the decoupled loss: the "
                                          "r_d mask, the policy term on r_s, the aggregation")
    advantage: AdvantageSection = Field(default_factory=AdvantageSection, description="the advantage estimator "
                                        "(a name alone is accepted: `advantage: rloo`)")
    kl: KLSection = Field(default_factory=KLSection, description="a KL penalty to a frozen reference model")
    critic: CriticSection | None = Field(
        None, description="PPO with a learned value function: a second learner trained beside the policy, whose "
        "values GAE turns into per-token advantages (with `advantage: gae`); null = no critic")
    team: TeamSection | None = Field(
        None, description="several agents, each its own policy (or one shared), playing a team environment's "
        "episodes (docs/multi-agent.md); in one process, without Ray, for now; null = one policy")
    top_k_logprobs: int = Field(
        0, ge=0, description="record per response token the K most likely ids of the distribution it was sampled "
        "from and their log-probs (mu), and on them pi_old at the token's version (exact strategies) and the "
        "teacher's; the distribution-level mismatch, Score Centering and the forward KL read them "
        "(docs/distributions.md); 0 = off: the record without them")
    teacher: Path | None = Field(
        None, description="on-policy distillation: a local HF model dir (the model's tokenizer) that scores the "
        "student's tokens before the train step (operators/teacher.py); null = no distillation")
    distill: DistillSection = Field(default_factory=DistillSection, description="on-policy distillation's loss "
                                    "terms (read only with a teacher)")
    drop_zero_variance_groups: bool = Field(True, description="leave groups whose rewards are all equal out of "
                                            "training (their advantage is 0 everywhere)")
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection, description="AdamW, its schedule and "
                                        "the updates per step")
    lora: LoraSection = Field(default_factory=LoraSection, description="train a LoRA adapter instead of the full "
                              "model (lora.r > 0)")
    eval_every: int = Field(0, ge=0, description="held-out greedy mean reward (accuracy for a 0/1 reward) every "
                            "k steps (0: off)")
    eval_prompts: int = Field(200, ge=1, description="held-out prompts each evaluation scores")
    seed: int = Field(0, ge=0, description="seeds sampling, shuffling and initialisation (numpy needs >= 0)")
    num_generators: int = Field(1, ge=1, description="generator actors sampling in parallel")
    generator: ResourceSection = Field(default_factory=ResourceSection, description="Ray resources of each "
                                       "generator actor")
    scorer: ResourceSection = Field(default_factory=lambda: ResourceSection(num_cpus=0.25),
                                    description="Ray resources of each old log-prob / reference scorer actor")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="the train step: resources of "
                                    "each worker and its data-parallel group")
    recovery: RecoverySection = Field(default_factory=RecoverySection, description="how a run heals a lost "
                                      "trainer or policy store")
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection, description="how each new version "
                                           "reaches the generators and scorers")
    light_stage_cpus: float = Field(0.1, gt=0.0, description="CPUs of reward/advantage/filter tasks")
    colocate: Literal["auto", "split", "rollout", "off"] = Field(
        "auto", description="auto: consecutive stages share an actor process where that does not serialise "
        "work that overlaps (sync: one process; async: `split` from 4 CPUs on, else `rollout`); split: async "
        "in three processes, the generator, the stages between, the train step; rollout: async in two, the "
        "generator and the stages up to the train step in one (one torch process fewer; a slow reward then "
        "delays sampling); off: one process per operator stage (see pipelines/colocation.py)")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Keys renamed in 0.2 still work for one release, with a one-line notice (TRL's path);
        with none of task, data and env, the workload is the built-in addition task."""
        if not isinstance(data, dict):
            return data
        data = migrate_deprecated_keys(data, cls.model_fields["strategy"].default)
        if all(data.get(key) is None for key in ("task", "data", "env")):
            data["task"] = "addition"
        return data

    # an engine's own settings (`engine: {name: NAME, <settings>}`) when no section holds them
    _engine_settings: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _engine_with_settings(cls, data: Any, handler: ModelWrapValidatorHandler) -> "PipelineConfig":
        """`engine: {name: NAME, <settings>}`: the name under `engine`, the settings in the
        engine's section (vllm: `vllm:`) or kept beside it. Declared before `_check_combinations`,
        which thus runs on the settings (a wrap validator wraps those declared before it)."""
        settings: dict[str, Any] = {}
        if isinstance(data, dict) and isinstance(data.get("engine"), dict):
            data = dict(data)
            data["engine"], settings = ENGINES.split(data["engine"])
            section = _engine_section(data["engine"])
            if section is not None and settings:
                if section in data:
                    raise ValueError(f"engine: {data['engine']}'s settings go in one place, the `{section}:` "
                                     "section or engine: {name: NAME, <settings>}")
                data[section], settings = settings, {}
        config = handler(data)
        config._engine_settings = settings
        return config

    @model_serializer(mode="wrap")
    def _parts_with_their_settings(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A strategy's or an engine's settings dumped as `KEY: {name: NAME, <settings>}` (the
        form a config is written in; `strategy_options` is not written back)."""
        data = handler(self)
        options = data.pop("strategy_options", None)
        if options and "strategy" in data:
            data["strategy"] = {"name": data["strategy"], **options}
        if self._engine_settings and "engine" in data:
            data["engine"] = {"name": data["engine"], **self._engine_settings}
        return data

    @field_validator("strategy", "engine")
    @classmethod
    def _registered(cls, spec: str, info: ValidationInfo) -> str:
        registry = STRATEGIES if info.field_name == "strategy" else ENGINES
        registry.resolve(spec)  # ValueError (one line) if it does not resolve
        return registry.canonical(spec)  # a file absolute, so the run's saved config works from anywhere

    @field_validator("advantage", mode="before")
    @classmethod
    def _advantage_by_name(cls, value: Any) -> Any:
        """`advantage: NAME` is `{estimator: NAME}`; the estimator as the config stores it
        (trajflow/registry.py `canonical`: a file absolute, a user's registered name its import path)."""
        value = {"estimator": value} if isinstance(value, str) else value
        if isinstance(value, dict) and isinstance(value.get("estimator"), str):
            value = {**value, "estimator": ESTIMATORS.canonical(value["estimator"])}
        return value

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
        if self.task is not None and (self.data is not None or self.env is not None):
            raise ValueError("task: give either task, or data / env (a config with data and no task runs on the data)")
        self._check_engine()
        if self.weight_sync.method == "collective":
            self._check_collective()
        min_group = ESTIMATORS.resolve(self.advantage.estimator).min_group_size
        if self.group_size < min_group:
            raise ValueError(
                f"group_size: {self.group_size} sample per prompt gives every trajectory advantage 0 under "
                f"advantage {self.advantage.estimator!r} (a group is its own baseline), so nothing would be trained; "
                f"use group_size >= {min_group}"
            )
        try:
            self.settings.advantage  # the overlong shaping's buffer within the job's max_new_tokens
        except ValueError as e:
            raise ValueError(f"advantage: {e}") from None
        self._check_distributions()
        self._check_critic()
        self._check_team()
        self.build_strategy().check(self)  # its settings: a ValueError naming `strategy.<key>`
        rows = self.rows_per_step
        if rows % self.optimizer.minibatches_per_step:
            raise ValueError(
                f"optimizer.minibatches_per_step: {self.optimizer.minibatches_per_step} does not divide "
                f"the {rows} rows of a step"
            )
        return self

    def _check_engine(self) -> None:
        """The engine's settings and its own refusals (`GenerationEngine.check`); the section of
        another engine given is refused by key."""
        engine = ENGINES.resolve(self.engine)
        self.settings.engine  # noqa: B018 - its settings: a ValueError naming `engine.<key>`
        engine.check(self)
        for other in ENGINES.parts().values():
            if other.section and other is not engine and getattr(self, other.section) != \
                    type(self).model_fields[other.section].default_factory():
                raise ValueError(f"{other.section}: settings given but engine is {engine.name}, not {other.name}")

    def _check_team(self) -> None:
        """What a team run does not cover (yet) is refused by key."""
        team = self.team
        if team is None:
            return
        if team.environment != "relay" and ":" not in team.environment:
            raise ValueError(f"team.environment: {team.environment!r} is neither relay nor module:Class / "
                             "file.py:Class of a TeamEnvironment")
        refused = {"task": self.task is None, "partial_rollout": self.partial_rollout,
                   "top_k_logprobs": self.top_k_logprobs > 0, "critic": self.critic is not None,
                   "engine": self.engine != "torch", "weight_sync": self.weight_sync.method != "object_store",
                   "strategy": self.build_strategy().scores_at_switch}
        what = next((key for key, bad in refused.items() if bad), None)
        if what is not None:
            raise ValueError(f"{what}: not with team: a team plays a built-in task's prompts (task:) with the torch "
                             "engine, whole turns of each learner's newest version, no critic and no collective "
                             "weight sync, for now")
        if team.share_policy and set(team.lags) - {SHARED}:
            raise ValueError(f"team.lags: with share_policy the one learner is `{SHARED}`, got {sorted(team.lags)}")
        for name, lag in team.lags.items():
            bound = team.agents.get(name, {}).get("max_staleness", self.max_staleness)
            if lag > bound:
                raise ValueError(f"team.lags.{name}: {lag} exceeds that learner's max_staleness ({bound})")

    def _check_critic(self) -> None:
        """A critic and an estimator on its values (GAE) go together; what the critic does not
        cover (yet) is refused by key."""
        estimator = ESTIMATORS.resolve(self.advantage.estimator)
        if estimator.needs_values and self.critic is None:
            raise ValueError(f"advantage.estimator: {estimator.name} needs a critic's values; add a `critic:` "
                             "section (e.g. critic: {} for the policy's model with a value head)")
        if self.critic is None:
            return
        if not estimator.needs_values:
            raise ValueError(f"critic: its values are GAE's (advantage.estimator: gae), advantage is "
                             f"{estimator.name}")
        if self.weight_sync.method == "collective":
            raise ValueError("critic: its versions travel through the policy store; use weight_sync.method: "
                             "object_store")
        if self.env is not None:
            raise ValueError("critic: multi-turn episodes (env) are not scored by the values stage yet; use a task or "
                             "data")

    def _check_distributions(self) -> None:
        """What the top-k record, the distribution-level mask and distillation need, refused by key
        (what needs the model directories, the vocabulary sizes, is the preflight's)."""
        k = self.top_k_logprobs
        if k and self.env is not None:
            raise ValueError("top_k_logprobs: the top-k of multi-turn episodes (env) is not recorded yet; use 0")
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
        if self.distill.forward_kl_coef > 0 and not k:
            raise ValueError("distill.forward_kl_coef: the forward KL is taken on the top-k support; set "
                             "top_k_logprobs > 0")

    @property
    def settings(self) -> RunSettings:
        """The typed settings the pipeline builds its operators from: every section as its settings
        dataclass, the derived defaults filled in (a view of this config, never a copy of it)."""
        return RunSettings(self)

    def workload(self) -> Workload:
        """What the run trains on (tasks.workload.Workload), from task / data / env / reward."""
        from trajflow.engines.paths import REPO_ROOT

        return Workload(task=self.task, data=self.settings.data,
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
        return STRATEGIES.resolve(self.strategy).from_config(self)

    def engine_lora_slots(self) -> int:
        """Adapters an engine that serves them (vLLM) keeps resident in a LoRA run: the staleness
        window's max_staleness + 1 versions (0: no LoRA in the engine; the torch engine merges each one)."""
        return self.max_staleness + 1 if ENGINES.resolve(self.engine).serves_adapters and self.lora.r > 0 else 0

    def _check_collective(self) -> None:
        """What `weight_sync.method: collective` does not cover (yet), refused rather than run otherwise."""
        if self.lora.r > 0:
            raise ValueError("weight_sync.method: collective sends full weights; a lora adapter version is small: "
                             "use object_store")

    def old_is_inference(self, strategy) -> bool:
        """Whether an exact strategy's old log-probs would be the inference ones recomputed in the
        same numerics (`old_logprob_forward: auto`): then they are reused, not recomputed. The
        forward pass stays wherever the two could differ beyond float summation order."""
        s = self.sampling
        return (self.old_logprob_forward == "auto" and strategy.old_from_column and not strategy.scores_at_switch
                and self.engine == "torch" and self.inference_dtype == "float32"
                and self.optimizer.mixed_precision == "no" and not self.partial_rollout
                and s.top_k == 0 and s.top_p == 1.0 and self.top_k_logprobs == 0 and self.lora.r == 0
                and self.env is None)

    def keeps_history(self, strategy) -> bool:
        """Whether the policy store keeps every version in the staleness window (old log-probs
        scored after generation, unless they are the inference ones)."""
        return strategy.keep_history and not self.old_is_inference(strategy)

    def reader_dtypes(self, strategy) -> tuple[str, ...]:
        """The dtypes the trainer serves under `collective` (operators/trainer/weight_sync.py): the
        generators' (float32 when they score prefixes), and float32 for an old log-prob scorer."""
        from trajflow.operators.trainer.weight_sync import reader_dtype

        dtypes = {reader_dtype(self.inference_dtype, exact=strategy.scores_at_switch)}
        if self.keeps_history(strategy):
            dtypes.add("float32")
        return tuple(sorted(dtypes))

class RunSettings:
    """`PipelineConfig.settings`: each section as the settings dataclass the operators take, read
    from the config when asked (so it can never drift from it). Derived defaults: the loss's
    token-sum-norm budget and DAPO's overlong budget are `sampling.max_new_tokens` unless given."""

    def __init__(self, config: PipelineConfig, machine: Machine | None = None) -> None:
        self._config = config
        self._machine = machine  # what `auto` chooses for (None: this machine)
        self._auto: tuple[ModelShape | None, Machine] | None = None

    # -- `auto`: threads per section and micro-batches, from the machine and the model (auto.py)
    def _model_and_machine(self) -> tuple[ModelShape | None, Machine]:
        if self._auto is None:
            self._auto = (ModelShape.of(self._config.model_path), self._machine or Machine.here())
        return self._auto

    def _threads(self, section: str) -> Any:
        spec = getattr(self._config, section).spec()
        if spec.torch_threads != AUTO:
            return spec
        model, machine = self._model_and_machine()
        threads = auto_threads(section, model, machine, synchronous=self._config.max_staleness == 0,
                               num_gpus=spec.num_gpus, num_cpus=spec.num_cpus)
        return dataclasses.replace(spec, torch_threads=threads)

    @property
    def generator(self) -> ResourceConfig:
        return self._threads("generator")

    @property
    def scorer(self) -> ResourceConfig:
        return self._threads("scorer")

    @property
    def trainer(self) -> TrainerConfig:
        """The trainer's section, its `auto` threads and micro-batch size resolved."""
        spec = self._threads("trainer")
        if spec.max_tokens_per_microbatch != AUTO:
            return spec
        c = self._config
        if spec.num_gpus > 0:  # its device's memory is not known before it starts: one micro-batch
            return dataclasses.replace(spec, max_tokens_per_microbatch=None)
        model, machine = self._model_and_machine()
        if model is None:  # no shape to size by: the whole update at once, as before `auto`
            return dataclasses.replace(spec, max_tokens_per_microbatch=None)
        rows = -(-c.rows_per_step // (c.optimizer.minibatches_per_step * spec.num_workers))
        prompt = (self.data.max_prompt_tokens if self.data is not None else None) or model.max_positions
        longest = min(model.max_positions, prompt + c.sampling.max_new_tokens)
        tokens = auto_microbatch_tokens(model, machine, rows * longest)
        return dataclasses.replace(spec, max_tokens_per_microbatch=tokens)

    def auto_choices(self) -> str:
        """What `auto` chose, one line for the run's header ("" when nothing is auto)."""
        c = self._config
        threads = [f"{name} {getattr(self, name).torch_threads}" for name in ("generator", "scorer", "trainer")
                   if getattr(c, name).spec().torch_threads == AUTO]
        chosen = [f"torch threads {', '.join(threads)}"] if threads else []
        if c.trainer.spec().max_tokens_per_microbatch == AUTO:
            tokens = self.trainer.max_tokens_per_microbatch
            chosen.append("the whole update per backward" if tokens is None else f"micro-batches of {tokens} tokens")
        if not chosen:
            return ""
        model, machine = self._model_and_machine()
        mode = "sync" if c.max_staleness == 0 else "async"
        size = f"{model.parameters / 1e6:.1f}M parameters" if model is not None else "no config.json shape"
        return f"auto: {'; '.join(chosen)} ({machine.cpus} CPUs, {machine.memory_bytes / 2**30:.0f} GiB, {size}, {mode})"

    def __getattr__(self, name: str) -> Any:  # a section without a derived default: as declared
        section = getattr(self._config, name)
        if name not in SECTIONS or section is None:
            raise AttributeError(f"PipelineConfig.settings has no section {name!r}")
        return section.spec()

    @property
    def correction(self) -> CorrectionConfig:
        return self._budget_default("correction", "loss_norm_tokens")  # token-sum-norm's tokens per sequence

    @property
    def advantage(self) -> AdvantageConfig:
        return self._budget_default("advantage", "overlong_max_tokens")  # DAPO's overlong shaping budget

    def _budget_default(self, section: str, key: str) -> Any:
        """The section's dataclass, its token budget `key` sampling.max_new_tokens unless given."""
        spec = getattr(self._config, section).spec()
        if getattr(spec, key) is None:
            spec = dataclasses.replace(spec, **{key: self._config.sampling.max_new_tokens})
        return spec

    @property
    def data(self) -> DataConfig | None:
        return self._config.data.spec() if self._config.data is not None else None

    @property
    def engine(self) -> Any:
        """The generation engine's settings (its `Settings`: from its section, e.g. `vllm:`, or
        from `engine: {name, ...}`), or None for an engine without."""
        config = self._config
        section = _engine_section(config.engine)
        if section is not None:
            return getattr(config, section).spec()
        return ENGINES.settings(config.engine, config._engine_settings)

    @property
    def distill(self) -> DistillConfig | None:
        """On-policy distillation's terms, or None without a teacher."""
        return self._config.distill.spec() if self._config.teacher is not None else None

    @property
    def team(self):
        """The team's settings (pipelines/config/team.py), or None for one policy."""
        return self._config.team.spec() if self._config.team is not None else None

    @property
    def critic(self):
        """The critic's settings (its model directory resolved as `model` is), or None without one."""
        if self._config.critic is None:
            return None
        spec = self._config.critic.spec()
        if spec.model is None:
            return spec
        model = PipelineConfig._resolve_model(Path(spec.model))
        return dataclasses.replace(spec, model=str(model.resolve()))

    @property
    def numerics(self):
        """The numerics pi_theta and every pi_old are computed in (engines/training_numerics.py)."""
        from trajflow.engines.training_numerics import TrainingNumerics

        return TrainingNumerics(mixed_precision=self._config.optimizer.mixed_precision)


def _engine_section(spec: str) -> str | None:
    """The config section holding the engine's settings (vllm: `vllm`), None when it has none or
    does not resolve (the `engine` field names that)."""
    try:
        return ENGINES.resolve(spec).section
    except ValueError:
        return None


# the sections `settings` reads back (the YAML keys whose value is a section)
SECTIONS = ("sampling", "correction", "advantage", "kl", "distill", "optimizer", "lora", "vllm", "data", "generator",
            "scorer", "trainer", "recovery", "weight_sync", "critic", "team")
