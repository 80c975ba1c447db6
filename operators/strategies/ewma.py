"""`ewma` (approximate): a bias-corrected EWMA of the trainer's weights as pi_prox (revised PPO-EWMA).

The EWMA folds in the weights after every optimizer update, with beta set for a window of W
versions counted in updates (W x minibatches_per_step, algorithms/ewma.py), and resets to the
current weights when the step's active-token fraction falls below `reset_threshold` (the
paper's tau). It scores in the trainer's numerics with its own model copy. `ewma/age` is
reported in versions. Under a sharded trainer each worker keeps the EWMA of its own shards (the
update is elementwise) and scores with a sharded copy of the policy: the proximal model is
all-gathered layer by layer like the policy itself.

Settings (`strategy_options`): `window` (W in versions; default max(1, max_staleness): the
reference sits mid-window), `reset_threshold` (tau, default 0.9).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.settings import check_number

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor

    from trajflow.algorithms.ewma import EwmaProximal


class Ewma(Strategy):
    name = "ewma"
    kind = "approximate"
    meaning = "score with an EWMA of the trainer's weights (window W versions), reset when active fraction < tau"
    follows_updates = True

    def __init__(self, window: int, reset_threshold: float = 0.9) -> None:
        check_number("ewma", window=window, reset_threshold=reset_threshold)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1 (versions), got {window!r}")
        if not 0.0 <= reset_threshold <= 1.0:
            raise ValueError(f"reset_threshold must be a number in [0, 1], got {reset_threshold!r}")
        self.window = window
        self.reset_threshold = float(reset_threshold)
        self.ewma: EwmaProximal | None = None
        self.minibatches_per_step = 1
        self._model = None
        self._stale_model = True

    @classmethod
    def from_config(cls, config: Any) -> "Ewma":
        options = {"window": max(1, config.max_staleness), **config.strategy_options}
        return super().from_config(config, options)

    def bind(self, trainer: Trainer) -> None:
        self.minibatches_per_step = trainer.minibatches_per_step
        from trajflow.algorithms.ewma import EwmaProximal, ewma_beta

        beta = ewma_beta(self.window, self.minibatches_per_step)
        self.ewma = EwmaProximal(trainer.policy_state_dict(), beta, reset_threshold=self.reset_threshold)
        self._model = trainer.policy_copy()
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
                "ewma/age": self.ewma.age / self.minibatches_per_step}

    def state_dict(self) -> dict:
        return self.ewma.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ewma.load_state_dict(state)
        self._stale_model = True
