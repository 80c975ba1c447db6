"""A correction strategy: one object that says where pi_old comes from, and everything else the
system asks about it. Subclass `Strategy`, set the class attributes, override what differs.

What the rest of trajflow asks a strategy (and nothing else: no other file compares its name):

  name, kind, meaning       the catalogue (`trajflow configs`, the run log, metrics' `strategy`);
                            `@STRATEGIES.register("name")` (registry.py) sets the name
  Settings                  its settings, a frozen settings dataclass: `strategy: {name: NAME,
                            <settings>}` in a config, the constructor's keyword arguments
  keep_history              the policy store keeps the weights of every version still inside the
                            staleness window (an operator scores old log-probs after generation)
  scores_at_switch          generation scores the prefix sampled so far with the still-resident
                            weights before taking new ones (implies mid-generation weight updates)
  old_from_column           pi_old is the `old_logprobs` column, filled upstream (exact strategies)
  follows_updates           the strategy's state follows the weights after each optimizer update
                            (EWMA); a --diagnose replay then also needs version k + 1 per step
  old_distribution          old_top_k gives pi_old on the sampler's top-k ids (the
                            distribution-level mismatch and its mask, `correction.dist_mask`)
  uses_current_top_k        the loss needs pi_theta on the top-k ids too (Score Centering)
  stages(ctx)               operator stages the strategy inserts, placed relative to named stages
  check(config)             strategy-specific config checks (raise ValueError naming the key)
  correction(base)          override of the objective's settings (M2PO: no PPO clip)

and, inside the process that trains (TrainStep) or diagnoses (Diagnose), per train step:

  bind(trainer)             once, when that process starts (EWMA copies the weights here)
  before_step(batch, trainer)            before the first update of the step (whole step batch)
  old_logprobs(batch, current, trainer)  pi_old for a (mini)batch, [B, T], detached (`proximal`
                            before this release: still read, with a notice)
  old_top_k(batch)          pi_old on the batch's top-k ids [B, T, K], or None (old_distribution)
  begin_update(log_ratios, gather)       if `needs_update_pass`: before each optimizer update,
                            log pi_theta - pi_old over this worker's loss tokens of the whole
                            update (1-D, no grad); `gather(t)` concatenates a 1-D tensor over all
                            data-parallel workers (M2PO's cutoff is a statistic of the update)
  trust_mask(batch, current, old, loss_mask)  tokens allowed to carry gradient (None: all)
  extra_loss(batch, current_top_k, out, advantages, config)  a term added to the loss in sum form
                            (with out.token_weights), or None; current_top_k [B, T, K] with
                            gradient, advantages as the loss used them, config as corrected
  after_update(trainer)     after each optimizer update
  after_step(trainer, diagnostics) -> metrics   after the step's updates
  state_dict() / load_state_dict(state)  what a checkpoint keeps (tensors, numbers, strings)

`trainer` gives the models and the numerics (see `Trainer`); `batch` is a StepBatch
(operators/trainer/correction.py); `current` is pi_theta [B, T]. The pure math stays in algorithms/.
Under a sharded trainer (`trainer.sharding: fsdp`) `policy_state_dict()` holds this worker's
shards, and every forward pass of `policy()` or a `policy_copy()` is a collective: a strategy
runs the same passes on every worker (the train step calls each hook on every worker, with a
dummy batch where a worker has no rows), and keeps state that follows the weights per shard.
Objects travel to Ray actors by Ray's in-memory pickling (never to disk): keep them plain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from trajflow.operators.contracts.stage import ClassRef, Placement, ResourceConfig, Stage
from trajflow.operators.trainer.weight_sync import WeightSyncConfig

if TYPE_CHECKING:  # torch-free at import: `trajflow run` resolves the strategy before Ray starts,
    # and its driver never imports torch (tests/test_jobs_run.py)
    import torch
    from torch import Tensor

    from trajflow.algorithms.objective import CorrectionConfig, LossOutput
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.engines.training_numerics import TrainingNumerics
    from trajflow.operators.trainer.correction import StepBatch

StrategyKind = Literal["exact", "approximate", "baseline"]
KINDS: tuple[str, ...] = ("exact", "approximate", "baseline")


@dataclass(frozen=True)
class StageContext:
    """What a strategy's operator stages are built from (the pipeline's settings)."""

    model_path: str
    sampling: SamplingConfig
    numerics: TrainingNumerics
    scorer: ResourceConfig  # resources of old log-prob scoring actors
    weight_sync: WeightSyncConfig = WeightSyncConfig()  # how scorers receive versions
    # the inference log-probs are the old ones in the same numerics (PipelineConfig.old_is_inference):
    # the old log-prob stage copies them instead of a forward pass
    old_is_inference: bool = False


class Trainer(Protocol):
    """What a strategy may use of the process that trains (TrainStep) or diagnoses (Diagnose)."""

    version: int              # the trainer's version k: it trains step k and then holds k + 1
    minibatches_per_step: int  # optimizer updates per version (1 in diagnose: one set of weights per version)
    numerics: TrainingNumerics
    sampling: SamplingConfig

    def policy(self) -> torch.nn.Module: ...  # the policy with the current weights

    def policy_state_dict(self) -> dict[str, Tensor]: ...  # its weights as it holds them (shards if sharded)

    def policy_copy(self) -> torch.nn.Module: ...  # a frozen copy of it (sharded like it), loads policy_state_dict()

    def score(self, model: torch.nn.Module, batch: "StepBatch") -> Tensor: ...  # no-grad [B, T]


class Strategy:
    name: ClassVar[str]
    kind: ClassVar[StrategyKind]
    meaning: ClassVar[str]
    keep_history: ClassVar[bool] = False
    scores_at_switch: ClassVar[bool] = False
    old_from_column: ClassVar[bool] = False
    follows_updates: ClassVar[bool] = False
    needs_update_pass: ClassVar[bool] = False
    old_distribution: ClassVar[bool] = False
    uses_current_top_k: ClassVar[bool] = False

    Settings: ClassVar[type | None] = None  # its settings: a frozen settings dataclass (trajflow/settings.py)

    # hooks renamed in this release: a subclass that still defines the old name works, with a notice
    RENAMED_HOOKS: ClassVar[dict[str, str]] = {"proximal": "old_logprobs", "proximal_top_k": "old_top_k"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in Strategy.RENAMED_HOOKS.items():
            if old in vars(cls) and new not in vars(cls):
                from trajflow.deprecations import notice

                notice(f"{cls.__qualname__}.{old}()", f"{new}()")
                setattr(cls, new, vars(cls)[old])

    @classmethod
    def from_config(cls, config: Any, options: dict[str, Any] | None = None) -> "Strategy":
        """An instance with its settings from the PipelineConfig (`strategy: {name: NAME,
        <settings>}`, held as `config.strategy_options`) or from `options`; the constructor takes
        the fields of `Settings` as keyword arguments. A subclass may fill in defaults that depend
        on the config (EWMA's window from max_staleness). A key the strategy does not declare, a
        wrong type or a value out of bounds is one ValueError line naming `strategy.<key>`."""
        from trajflow.operators.strategies.registry import STRATEGIES

        settings = STRATEGIES.settings(cls, dict(config.strategy_options if options is None else options))
        if settings is None:
            return cls()
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})

    def check(self, config: Any) -> None:
        """Raise ValueError("key: why") if the PipelineConfig cannot run this strategy."""

    def stages(self, ctx: StageContext) -> list[Placement]:
        return []

    def replay_stages(self, ctx: StageContext) -> list[Placement]:
        """Stages of an offline replay, where generation is the logged data. A strategy whose
        old log-probs come from the column but that inserts no stage (they were scored during
        generation) gets them from the old log-prob operator, right before training."""
        own = self.stages(ctx)
        if own or not self.old_from_column:
            return own
        return [Placement(old_logprob_stage(ctx, skip_filtered=True), before="train")]

    def replay_versions(self, step: int, token_versions: set[int], mode: str) -> set[int]:
        """Weights a replay of train step `step` needs beyond the trainer's own (diagnose: version
        `step`; train: the first step's version)."""
        needed = set(token_versions) if self.old_from_column else set()
        if mode == "diagnose" and self.follows_updates:
            needed.add(step + 1)
        return needed

    def correction(self, base: CorrectionConfig) -> CorrectionConfig:
        return base

    # -- inside the trainer -------------------------------------------------------------------
    def bind(self, trainer: Trainer) -> None:
        pass

    def before_step(self, batch: "StepBatch", trainer: Trainer) -> None:
        pass

    def old_logprobs(self, batch: "StepBatch", current: Tensor, trainer: Trainer) -> Tensor:
        raise NotImplementedError(f"strategy {self.name!r} does not define old_logprobs()")

    def old_top_k(self, batch: "StepBatch") -> Tensor | None:
        return None

    def begin_update(self, log_ratios: Tensor, gather: Callable[[Tensor], Tensor]) -> None:
        pass

    def trust_mask(self, batch: "StepBatch", current: Tensor, old: Tensor, loss_mask: Tensor) -> Tensor | None:
        return None

    def extra_loss(self, batch: "StepBatch", current_top_k: Tensor | None, out: "LossOutput",
                   advantages: Tensor, config: "CorrectionConfig") -> Tensor | None:
        return None

    def after_update(self, trainer: Trainer) -> None:
        pass

    def after_step(self, trainer: Trainer, diagnostics: dict[str, float]) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r})"


class OldLogprobsColumn(Strategy):
    """Base of the exact strategies: pi_old is the `old_logprobs` column, filled upstream at each
    token's own behavior version under training numerics."""

    old_from_column = True
    old_distribution = True

    def old_logprobs(self, batch: "StepBatch", current: Tensor, trainer: Trainer) -> Tensor:
        if batch.old is None:
            raise RuntimeError(f"strategy {self.name}: rows reached the trainer without old_logprobs")
        return batch.old

    def old_top_k(self, batch: "StepBatch") -> Tensor | None:
        return batch.top_k_old  # scored with old_logprobs, at each token's own version


def old_logprob_stage(ctx: StageContext, skip_filtered: bool, own_process: bool = False) -> Stage:
    """The operator that scores every token under its own version's weights (operators/old_logprobs.py),
    or, where that would repeat the inference log-probs in the same numerics, the light stage that
    copies them. `own_process`: the scoring actor runs alone (dedicated's own CPU/GPU share)."""
    from trajflow.operators.inference_as_old import InferenceAsOld

    if ctx.old_is_inference:
        return Stage("old_logprobs", InferenceAsOld())
    kwargs = dict(model_path=ctx.model_path, sampling=ctx.sampling, numerics=ctx.numerics,
                  skip_filtered=skip_filtered, torch_threads=ctx.scorer.torch_threads, weight_sync=ctx.weight_sync)
    return Stage("old_logprobs", ClassRef("trajflow.operators.old_logprobs", "OldLogprobsAtBehaviorVersion"), kwargs,
                 ctx.scorer, own_process=own_process)
