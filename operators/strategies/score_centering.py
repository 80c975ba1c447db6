"""`score_centering` (exact, arXiv 2609.20807): snapshot's exact pi_old, and the score centred under
the sampler's recorded top-k distribution (algorithms/score_centering.py).

pi_old is scored at each token's own version as by `snapshot` (its stage, its store), so the r_d
mask (`correction.mask_*`) and the distribution-level mask (`correction.dist_mask`) compose with it
as with any exact strategy. The policy term is REINFORCE with a ratio (PPO's at clip_level none,
as the paper requires: a clipped token would not carry the score the centering subtracts), and
every loss token's gradient A (W_a s_a - mu_W) has the sampler-expected weighted score removed;
W is the objective's own weight (w_d(r_d) r_s, TIS included when `tis_cap` is set). Needs
`top_k_logprobs` K > 0 (the sampler's K ids and mu on them) and a stochastic sampler. Reported per
step: `sc/alpha` (the mean tail ratio alpha, 1 when the tails agree) and `sc/center_norm` (the mean
over loss tokens of sum_v |c_v|: how much is subtracted).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.operators.strategies.snapshot import Snapshot

if TYPE_CHECKING:  # torch-free at import (see base.py)
    from torch import Tensor

    from trajflow.algorithms.objective import CorrectionConfig, LossOutput


@STRATEGIES.register("score_centering")
class ScoreCentering(Snapshot):
    meaning = ("snapshot's exact pi_old; REINFORCE with the score centred under the sampler's top-k "
               "distribution (Score Centering, arXiv 2609.20807)")
    uses_current_top_k = True

    def __init__(self) -> None:
        self._sums = {"alpha": 0.0, "center": 0.0, "tokens": 0.0}

    def check(self, config: Any) -> None:
        if config.top_k_logprobs < 1:
            raise ValueError("top_k_logprobs: score_centering centres the score under the sampler's top-k "
                             "distribution; set top_k_logprobs > 0")
        if config.sampling.temperature == 0:
            raise ValueError("sampling.temperature: score_centering needs a stochastic sampler (temperature > 0)")
        if config.correction.loss != "ppo":
            raise ValueError(f"correction.loss: score_centering centres REINFORCE's score (loss ppo at clip_level "
                             f"none), got {config.correction.loss}")

    def correction(self, base: CorrectionConfig) -> CorrectionConfig:
        return dataclasses.replace(base, clip_level="none", dual_clip_c=None)

    def before_step(self, batch, trainer) -> None:
        self._sums = dict.fromkeys(self._sums, 0.0)

    def extra_loss(self, batch, current_top_k: Tensor | None, out: LossOutput, advantages: Tensor,
                   config: CorrectionConfig) -> Tensor:
        import torch

        from trajflow.algorithms.distributions import TAIL_FLOOR, tail_mass
        from trajflow.algorithms.masked import broadcast_to_tokens
        from trajflow.algorithms.score_centering import centering_coefficients, centering_term

        if current_top_k is None or batch.top_k_old is None:
            raise RuntimeError("score_centering: rows reached the trainer without top-k log-probs")
        sequence = config.tis_cap is not None and config.tis_level == "sequence"
        coefficients = centering_coefficients(current_top_k, batch.top_k_old, batch.top_k_inference,
                                              tis_cap=None if sequence else config.tis_cap,
                                              sequence_weight=out.is_weights if sequence else None)
        # only the tokens that carry the policy term: elsewhere 0, so not even 0 x NaN reaches the gradient
        coefficients = torch.where(out.active[..., None], coefficients, 0.0)
        adv = broadcast_to_tokens(advantages.detach().to(current_top_k.dtype), out.active)
        term = torch.where(out.active, adv * centering_term(current_top_k, coefficients) * out.token_weights, 0.0)
        with torch.no_grad():  # the step's report
            tails = [tail_mass(x.detach().double()).clamp(min=TAIL_FLOOR) for x in (batch.top_k_inference, current_top_k)]
            active = out.active
            self._sums["alpha"] += float((tails[0] / tails[1])[active].sum())
            self._sums["center"] += float(coefficients.abs().sum(-1)[active].sum())
            self._sums["tokens"] += float(active.sum())
        return term.sum()

    def after_step(self, trainer, diagnostics: dict[str, float]) -> dict[str, float]:
        tokens = max(self._sums["tokens"], 1.0)
        return {"sc/alpha": self._sums["alpha"] / tokens, "sc/center_norm": self._sums["center"] / tokens}
