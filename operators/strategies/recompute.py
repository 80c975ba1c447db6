"""`recompute` (baseline): old := the trainer's current weights before the update (pi_async).

The default of ROLL, SkyRL fully-async and slime/miles before their fix. In async training those
weights are newer than the tokens' versions: policy drift leaks into r_d and r_s ~ 1 at the start
of each step. With one update per step the pre-update log-probs are the update's own forward pass
(detached); with several minibatches the whole step is scored once before the first update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.operators.strategies.registry import STRATEGIES

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor


@STRATEGIES.register("recompute")
class Recompute(Strategy):
    kind = "baseline"
    meaning = "score with the trainer's current weights before the update (pi_async): drift leaks into r_d"

    def __init__(self) -> None:
        self._before_update: Tensor | None = None

    def before_step(self, batch, trainer: Trainer) -> None:
        self._before_update = None
        if trainer.minibatches_per_step > 1:
            import torch

            scores = trainer.score(trainer.policy(), batch)  # indexed by step row: a worker's rows are a subset
            self._before_update = torch.zeros((int(batch.rows.max()) + 1, scores.shape[1]), dtype=scores.dtype)
            self._before_update[batch.rows] = scores

    def old_logprobs(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        if self._before_update is not None:
            return self._before_update[batch.rows]
        from trajflow.algorithms.old_logprobs import recompute_logprobs

        return recompute_logprobs(current)
