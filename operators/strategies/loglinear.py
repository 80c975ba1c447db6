"""`loglinear` (baseline, A-3PO): log pi_prox = log mu + alpha (log pi_theta - log mu).

alpha per token from versions (v_prox = v_theta - 1) unless fixed (`strategy: {name: loglinear, alpha: A}`). The
paper's Proposition 1: any such interpolation only re-parameterises bounds on the single total
ratio pi_theta / mu; it recovers nothing about pi_old.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor


@dataclass(frozen=True)
class LoglinearSettings:
    """`loglinear`'s settings."""

    alpha: float | None = setting(
        None, "the interpolation weight; null: per token from versions (A-3PO: v_prox = v_theta - 1)", ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        check_settings(self)


@STRATEGIES.register("loglinear")
class Loglinear(Strategy):
    kind = "baseline"
    meaning = ("log mu + alpha (log pi_theta - log mu), alpha from versions (A-3PO); "
               "Prop. 1: only rescales a bound on pi_theta/mu")

    Settings = LoglinearSettings

    def __init__(self, alpha: float | None = LoglinearSettings.alpha) -> None:
        self.alpha = LoglinearSettings(alpha=alpha).alpha  # checked (SettingError)

    def old_logprobs(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        from trajflow.algorithms.old_logprobs import loglinear_alpha, loglinear_logprobs

        alpha = self.alpha
        if alpha is None:  # the trainer holds version k and produces k + 1
            alpha = loglinear_alpha(batch.versions, theta_version=trainer.version + 1)
        return loglinear_logprobs(current, batch.inference, alpha)
