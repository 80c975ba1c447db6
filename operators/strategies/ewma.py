"""`ewma` (approximate): a bias-corrected EWMA of the trainer's weights as pi_prox (revised PPO-EWMA).

The EWMA folds in the weights after every optimizer update, with beta set for a window of W
versions counted in updates (W x minibatches_per_step, algorithms/ewma.py), and resets to the
current weights when the step's active-token fraction falls below `reset_threshold` (the
paper's tau). It scores in the trainer's numerics with its own model copy. `ewma/age` is
reported in versions. Under a sharded trainer each worker keeps the EWMA of its own shards (the
update is elementwise) and scores with a sharded copy of the policy: the proximal model is
all-gathered layer by layer like the policy itself.

Settings (`strategy: {name: ewma, window: W, reset_threshold: tau}`, `EwmaSettings`): `window`
(W in versions; null: max(1, max_staleness), the reference sits mid-window), `reset_threshold`
(tau).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor

    from trajflow.algorithms.ewma import EwmaProximal


@dataclass(frozen=True)
class EwmaSettings:
    """`ewma`'s settings."""

    window: int | None = setting(
        None, "W: the EWMA's window in versions (counted in optimizer updates: W x minibatches_per_step); "
        "null: max(1, max_staleness), so the reference sits mid-window", ge=1)
    reset_threshold: float = setting(
        0.9, "tau: reset the EWMA to the current weights when the step's active-token fraction falls below it",
        ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        check_settings(self)


@STRATEGIES.register("ewma")
class Ewma(Strategy):
    kind = "approximate"
    meaning = "score with an EWMA of the trainer's weights (window W versions), reset when active fraction < tau"
    follows_updates = True
    Settings = EwmaSettings

    def __init__(self, window: int, reset_threshold: float = EwmaSettings.reset_threshold) -> None:
        settings = EwmaSettings(window=window, reset_threshold=reset_threshold)  # checked (SettingError)
        if settings.window is None:
            raise ValueError("ewma: window is required here (a job config derives it from max_staleness)")
        self.window = settings.window
        self.reset_threshold = settings.reset_threshold
        self.ewma: EwmaProximal | None = None
        self.minibatches_per_step = 1
        self._model = None
        self._stale_model = True

    @classmethod
    def from_config(cls, config: Any, options: dict[str, Any] | None = None) -> "Ewma":
        options = dict(config.strategy_options if options is None else options)
        if options.get("window") is None:  # null: derived from the staleness bound
            options["window"] = max(1, config.max_staleness)
        return super().from_config(config, options)

    def bind(self, trainer: Trainer) -> None:
        self.minibatches_per_step = trainer.minibatches_per_step
        from trajflow.algorithms.ewma import EwmaProximal, ewma_beta

        beta = ewma_beta(self.window, self.minibatches_per_step)
        self.ewma = EwmaProximal(trainer.policy_state_dict(), beta, reset_threshold=self.reset_threshold)
        self._model = trainer.policy_copy()
        self._stale_model = True

    def old_logprobs(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
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
