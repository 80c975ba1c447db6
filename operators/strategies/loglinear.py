"""`loglinear` (baseline, A-3PO): log pi_prox = log mu + alpha (log pi_theta - log mu).

alpha per token from versions (v_prox = v_theta - 1) unless fixed (`strategy_options: {alpha: A}`). The
paper's Proposition 1: any such interpolation only re-parameterises bounds on the single total
ratio pi_theta / mu; it recovers nothing about pi_old.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.settings import check_number

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor


class Loglinear(Strategy):
    name = "loglinear"
    kind = "baseline"
    meaning = ("log mu + alpha (log pi_theta - log mu), alpha from versions (A-3PO); "
               "Prop. 1: only rescales a bound on pi_theta/mu")

    def __init__(self, alpha: float | None = None) -> None:
        check_number("loglinear", alpha=alpha)
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be null (from versions) or a number in [0, 1], got {alpha!r}")
        self.alpha = None if alpha is None else float(alpha)

    def proximal(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        from trajflow.algorithms.proximal import loglinear_alpha, loglinear_logprobs

        alpha = self.alpha
        if alpha is None:  # the trainer holds version k and produces k + 1
            alpha = loglinear_alpha(batch.versions, theta_version=trainer.version + 1)
        return loglinear_logprobs(current, batch.inference, alpha)
