"""`ewma` (approximate): a bias-corrected EWMA of the trainer's weights as pi_prox (revised PPO-EWMA).

The EWMA folds in the weights after every optimizer update, with beta set for a window of W
versions counted in updates (W x minibatches_per_step, algorithms/ewma.py), and resets to the
current weights when the step's active-token fraction falls below tau. It scores in the
trainer's numerics with its own model copy. `ewma/age` is reported in versions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from trajflow.operators.strategies.base import Strategy, Trainer

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor

    from trajflow.algorithms.ewma import EwmaProximal


class Ewma(Strategy):
    name = "ewma"
    kind = "approximate"
    meaning = "score with an EWMA of the trainer's weights (window W versions), reset when active fraction < tau"
    follows_updates = True

    def __init__(self, window: int = 1, reset_threshold: float = 0.9) -> None:
        self.window = window
        self.reset_threshold = reset_threshold
        self.ewma: EwmaProximal | None = None
        self.updates_per_version = 1
        self._model = None
        self._stale_model = True

    @classmethod
    def from_config(cls, config: Any) -> "Ewma":
        return cls(window=config.ewma_window, reset_threshold=config.ewma.reset_threshold, **config.strategy_options)

    def bind(self, trainer: Trainer) -> None:
        self.updates_per_version = trainer.updates_per_version
        from trajflow.algorithms.ewma import EwmaProximal, ewma_beta

        beta = ewma_beta(self.window, self.updates_per_version)
        self.ewma = EwmaProximal(trainer.policy_state_dict(), beta, tau=self.reset_threshold)
        self._model = trainer.numerics.prepare(copy.deepcopy(trainer.policy())).requires_grad_(False)
        self._stale_model = True

    def proximal(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        if self._stale_model:
            self._model.load_state_dict(self.ewma.prox_state_dict())
            self._stale_model = False
        return trainer.score(self._model, batch)

    def after_update(self, trainer: Trainer) -> None:
        self.ewma.update(trainer.policy_state_dict())
        self._stale_model = True

    def after_step(self, trainer: Trainer, diagnostics: dict[str, float]) -> dict[str, float]:
        fired = self.ewma.maybe_reset(diagnostics["active_frac"], trainer.policy_state_dict())
        self._stale_model = True
        return {"ewma/reset": float(fired), "ewma/reset_count": float(self.ewma.reset_count),
                "ewma/age": self.ewma.age / self.updates_per_version}

    def state_dict(self) -> dict:
        return self.ewma.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ewma.load_state_dict(state)
        self._stale_model = True
