"""`behavior` (baseline): old := the inference log-probs mu (bypass; prime-rl, TRL AsyncGRPO).

r_d = 1 by construction, so one asymmetric clip has to absorb both numerics and staleness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.operators.strategies.registry import STRATEGIES

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor


@STRATEGIES.register("behavior")
class Behavior(Strategy):
    kind = "baseline"
    meaning = "old := inference log-probs (r_d = 1): one clip absorbs both numerics and staleness"
    old_distribution = True

    def old_logprobs(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        from trajflow.algorithms.old_logprobs import behavior_logprobs

        return behavior_logprobs(batch.inference)

    def old_top_k(self, batch) -> Tensor | None:
        return batch.top_k_inference  # the sampler's own distribution: no mismatch by definition
