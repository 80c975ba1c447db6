"""The critic's settings (the `critic:` section): PPO's learned value function, the second learner
of the train step (operators/trainer/critic.py). Torch-free: a job config is validated before
torch loads."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from trajflow.algorithms.config import OptimizerConfig
from trajflow.settings import SettingError, check_settings, setting

ValuesAt = Literal["rollout", "train"]
VALUES_AT: tuple[str, ...] = typing.get_args(ValuesAt)


@dataclass(frozen=True)
class CriticConfig:
    """A learned value function V(s_t) per response token, trained beside the policy on the same
    rows (GAE's returns, `advantage: {estimator: gae}`). Its own weights (a second model, as
    veRL's critic), optimizer, checkpoints and versions; it runs on the trainer's workers (the
    `trainer:` section's resources, sharding and data-parallel group) and in the policy's
    training numerics."""

    model: str | None = setting(
        None, "a local Hugging Face causal LM directory whose trunk the critic starts from, with a zero-"
        "initialised scalar value head, or a critic directory written by a run; null: the policy's model")
    optimizer: OptimizerConfig = setting(
        doc="the critic's AdamW, lr schedule and updates per step (its own; mixed_precision is the policy's)",
        default_factory=lambda: OptimizerConfig(lr=1e-4))
    cliprange_value: float | None = setting(
        0.5, "PPO's value clip (veRL's and TRL's cliprange_value): the prediction moves at most this far from "
        "the clip's anchor (clip_anchor) before its squared error stops passing gradient; null = no clip", gt=0.0)
    warmup_steps: int = setting(
        0, "train steps at the start in which only the critic trains (veRL's critic_warmup): the policy's "
        "version advances with unchanged weights", ge=0)
    values_at: ValuesAt = setting(
        "rollout", "the values GAE uses: rollout (scored by the `values` stage right after generation, at behavior "
        "time, with the critic version the store holds then, recorded per token in `value_versions`) or train "
        "(recomputed by the trainer's current critic before the step's update, as NeMo-RL's asynchronous PPO)")
    clip_anchor: ValuesAt | None = setting(
        None, "what the value clip is anchored on: rollout (the values recorded at behavior time) or train (the "
        "current critic's before the update); null = the values GAE used (values_at)")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.optimizer.mixed_precision != "no":
            raise SettingError("optimizer", "CriticConfig.optimizer.mixed_precision: the policy's governs both "
                                            "learners (optimizer.mixed_precision: one training numerics)")

    @property
    def anchor(self) -> str:
        """Where the value clip is anchored: clip_anchor, else values_at."""
        return self.clip_anchor or self.values_at

    @property
    def needs_values_stage(self) -> bool:
        """Whether the pipeline scores values after generation (GAE's or the clip's behavior values)."""
        return "rollout" in (self.values_at, self.anchor)

