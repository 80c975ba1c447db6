"""`m2po` (baseline, arXiv 2510.01161): behaviour log-probs as old, a second-moment trust region.

Per optimizer update, M2 = mean over the loss tokens of (log pi_theta - log mu)^2; if M2 > tau
(config `strategy_options: {m2_threshold: 0.04}`) the tokens with the largest squared log-ratio
are masked until M2 <= tau (algorithms/m2po.py).
Kept tokens get no PPO clip; masked ones carry no gradient but stay in the loss denominator.
Reported per step: m2po/m2_before, m2po/m2_after (token-weighted over the step's updates),
m2po/masked_tokens and m2po/masked_frac.

With one minibatch per step (the default) the update's batch is the whole step. With
data-parallel training the cutoff is one value for the whole update: gather the squared
log-ratios, `m2_cutoff` once, mask locally.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from trajflow.algorithms.m2po import m2po_mask
from trajflow.algorithms.objective import CorrectionConfig
from trajflow.algorithms.proximal import behavior_logprobs
from trajflow.operators.strategies.base import Strategy, Trainer


class M2po(Strategy):
    name = "m2po"
    kind = "baseline"
    meaning = "old := inference log-probs; mask the largest (log pi_theta/mu)^2 until their mean M2 <= tau, no PPO clip"

    def __init__(self, m2_threshold: float = 0.04) -> None:  # config: strategy_options.m2_threshold
        if not (isinstance(m2_threshold, (int, float)) and m2_threshold >= 0):
            raise ValueError(f"m2_threshold must be a number >= 0, got {m2_threshold!r}")
        self.m2_threshold = float(m2_threshold)
        self._sums = dict.fromkeys(("before", "after", "tokens", "kept"), 0.0)

    def check(self, config) -> None:
        # The mask's cutoff is a statistic of the whole update; split over workers or
        # micro-batches it would need every shard's log-ratios before any backward pass.
        if config.trainer.num_workers > 1:
            raise ValueError("trainer.num_workers: m2po's second-moment mask needs the whole update's log-ratios; "
                             "it runs with one trainer worker (num_workers: 1) for now")
        if config.trainer.max_tokens_per_microbatch is not None:
            raise ValueError("trainer.max_tokens_per_microbatch: m2po's second-moment mask needs the whole "
                             "update's log-ratios; it runs without micro-batches for now")

    def correction(self, base: CorrectionConfig) -> CorrectionConfig:
        return dataclasses.replace(base, clip_level="none", dual_clip_c=None)

    def before_step(self, batch, trainer: Trainer) -> None:
        self._sums = dict.fromkeys(self._sums, 0.0)

    def proximal(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        return behavior_logprobs(batch.inference)

    def trust_mask(self, batch, current: Tensor, old: Tensor, loss_mask: Tensor) -> Tensor:
        mask = m2po_mask(current - old, loss_mask, self.m2_threshold)
        kept = mask.loss_tokens - mask.masked_tokens
        self._sums["before"] += mask.m2_before * mask.loss_tokens
        self._sums["after"] += mask.m2_after * kept
        self._sums["tokens"] += mask.loss_tokens
        self._sums["kept"] += kept
        return mask.keep

    def after_step(self, trainer: Trainer, diagnostics: dict[str, float]) -> dict[str, float]:
        s = self._sums
        tokens = max(s["tokens"], 1.0)
        return {"m2po/m2_before": s["before"] / tokens, "m2po/m2_after": s["after"] / max(s["kept"], 1.0),
                "m2po/masked_tokens": s["tokens"] - s["kept"], "m2po/masked_frac": (s["tokens"] - s["kept"]) / tokens}
