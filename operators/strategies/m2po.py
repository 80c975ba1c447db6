"""`m2po` (baseline, arXiv 2510.01161): behavior log-probs as old, a second-moment trust region.

Per optimizer update, M2 = mean over the loss tokens of (log pi_theta - log mu)^2; if M2 > tau
(config `strategy: {name: m2po, m2_threshold: 0.04}`) the tokens with the largest squared log-ratio
are masked until M2 <= tau (algorithms/m2po.py).
Kept tokens get no PPO clip; masked ones carry no gradient but stay in the loss denominator.
Reported per step: m2po/m2_before, m2po/m2_after (token-weighted over the step's updates),
m2po/masked_tokens and m2po/masked_frac.

The mask is a statistic of the whole update (one minibatch of the step, on every worker and
micro-batch): before the update's backward passes, the train step scores its rows once without
gradient and hands the log-ratios to `begin_update`, which gathers them from every worker and
computes the cutoff once; each micro-batch then masks its own tokens with it. So N workers and
micro-batches mask exactly the tokens one worker with one batch would (an extra forward pass
per update is the price). Diagnose (no update) masks each batch on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trajflow.operators.strategies.base import Strategy, Trainer
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from collections.abc import Callable

    from torch import Tensor

    from trajflow.algorithms.objective import CorrectionConfig


@dataclass(frozen=True)
class M2poSettings:
    """`m2po`'s settings."""

    m2_threshold: float = setting(
        0.04, "tau_M2: mask the tokens with the largest (log pi_theta / mu)^2 until their mean M2 is <= this",
        ge=0.0)

    def __post_init__(self) -> None:
        check_settings(self)


@STRATEGIES.register("m2po")
class M2po(Strategy):
    needs_update_pass = True
    kind = "baseline"
    meaning = "old := inference log-probs; mask the largest (log pi_theta/mu)^2 until their mean M2 <= tau, no PPO clip"

    Settings = M2poSettings

    def __init__(self, m2_threshold: float = M2poSettings.m2_threshold) -> None:
        self.m2_threshold = M2poSettings(m2_threshold=m2_threshold).m2_threshold  # checked (SettingError)
        self._sums = dict.fromkeys(("before", "after", "tokens", "kept"), 0.0)
        self._cutoff: float | None = None  # set per optimizer update by begin_update (train step)

    def correction(self, base: CorrectionConfig) -> CorrectionConfig:
        return dataclasses.replace(base, clip_level="none", dual_clip_c=None)

    def before_step(self, batch, trainer: Trainer) -> None:
        self._sums = dict.fromkeys(self._sums, 0.0)

    def old_logprobs(self, batch, current: Tensor, trainer: Trainer) -> Tensor:
        from trajflow.algorithms.old_logprobs import behavior_logprobs

        return behavior_logprobs(batch.inference)

    def begin_update(self, log_ratios: Tensor, gather: Callable[[Tensor], Tensor]) -> None:
        import torch

        from trajflow.algorithms.m2po import m2_cutoff

        squared = gather(log_ratios.detach().to(torch.float64) ** 2)  # every worker's loss tokens
        self._cutoff = m2_cutoff(squared, self.m2_threshold)
        kept = squared[squared < self._cutoff]
        self._sums["before"] += float(squared.sum())
        self._sums["after"] += float(kept.sum())
        self._sums["tokens"] += squared.numel()
        self._sums["kept"] += kept.numel()

    def trust_mask(self, batch, current: Tensor, old: Tensor, loss_mask: Tensor) -> Tensor:
        import torch

        if self._cutoff is not None:  # the train step's update: the cutoff of begin_update
            squared = torch.where(loss_mask, (current - old).detach().to(torch.float64) ** 2, 0.0)
            return loss_mask & (squared < self._cutoff)
        from trajflow.algorithms.m2po import m2po_mask

        mask = m2po_mask(current - old, loss_mask, self.m2_threshold)  # diagnose: this batch alone
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
