r"""KL to a frozen reference model: per-token estimators and the two places the KL enters.

On tokens sampled by the behavior policy, with x = log pi_theta - log pi_ref per token
(Schulman, "Approximating KL divergence", 2020):

    k1       x                               unbiased for KL(pi_theta || pi_ref), can be < 0
    k2       x^2 / 2                         >= 0; its gradient is the KL's (veRL "mse")
    k3       exp(-x) - 1 + x                 >= 0, unbiased, low variance (veRL "low_var_kl" clamps it)
    low_var  k3 clamped to [-10, 10]         veRL's low_var_kl (its default kl_loss_type)
    abs      |x|                             veRL and SkyRL "abs"
    k1+, k3+, low_var+, abs+                 veRL's straight-through "+" types: the value of the
                                             estimator, the gradient of k2 (whose gradient is the
                                             KL's in expectation): k2 - sg(k2) + sg(value)

x is clamped to ±LOG_RATIO_CLAMP first (as every log-ratio in trajflow), so extreme log-probs give
finite values and gradients. Names across peers: TRL's GRPO loss uses k3 (`beta`); veRL
`actor_rollout_ref.actor.kl_loss_type` (kl/k1, abs, mse/k2, low_var_kl/k3, and the "+" variants)
and `algorithm.kl_penalty` for the reward; SkyRL
`kl_estimator_type` k1, k2, k3 (clamped as low_var), abs.

Where it enters (KLConfig.in_):
    loss    decoupled_loss(..., reference=ReferenceKL(logprobs, config)) adds beta x the aggregate
            of KL_t over the counted tokens, with the policy term's weights (TRL beta, veRL
            use_kl_loss)
    reward  kl_penalized_rewards: r_i - beta x sum_t KL_t over the trajectory's loss tokens, before
            the advantage (veRL use_kl_in_reward: its token-level penalty summed by the outcome
            estimators). The KL is then a constant of the loss (no gradient path).
The metric either way: kl_metrics -> {"kl/mean": mean of KL_t over loss tokens}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trajflow.settings import check_number

from .config import KL_ESTIMATORS, KLConfig, KLEstimator
from .masked import log_ratio, masked_mean, masked_sum


@dataclass(frozen=True)
class ReferenceKL:
    """The KL term of the loss, one argument of decoupled_loss (`reference=`): pi_ref's log-probs
    of the sampled tokens [B, T] and the KLConfig that weighs them (beta, estimator; its `in_`
    must be "loss": a KL in the reward is kl_penalized_rewards')."""

    logprobs: Tensor
    config: KLConfig = KLConfig()


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token KL estimate [B, T] (module docstring). Gradient flows through `logprobs` only;
    both must be finite where it is used (select padding away first)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimate: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if estimator.endswith("+"):  # straight-through: the base value, k2's gradient
        k2 = kl_estimate(logprobs, ref_logprobs, "k2")
        return k2 - k2.detach() + kl_estimate(logprobs, ref_logprobs, estimator[:-1]).detach()
    x = log_ratio(logprobs, ref_logprobs.detach())
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "abs":
        return x.abs()
    k3 = torch.expm1(-x) + x  # exp(-x) - 1 + x; expm1 keeps it >= 0 near x = 0
    return k3 if estimator == "k3" else k3.clamp(-10.0, 10.0)


def kl_penalized_rewards(rewards: Tensor, kl: Tensor, loss_mask: Tensor, beta: float) -> Tensor:
    """r_i - beta x sum_t KL_t over row i's loss tokens: [N] rewards, [N, T] per-token KL, [N, T]
    bool mask -> [N] (detached; the reward carries no gradient)."""
    check_number("kl_penalized_rewards", beta=beta)
    if loss_mask.dtype != torch.bool:
        raise TypeError(f"loss_mask must be bool, got {loss_mask.dtype}")
    if kl.shape != loss_mask.shape or rewards.shape != loss_mask.shape[:1]:
        raise ValueError(f"kl_penalized_rewards: rewards {tuple(rewards.shape)}, kl {tuple(kl.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} do not line up")
    return (rewards - beta * masked_sum(kl.detach().to(rewards.dtype), loss_mask, dim=-1)).detach()


def kl_metrics(kl: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """{"kl/mean": mean per-token KL over loss tokens} (0 without loss tokens)."""
    return {"kl/mean": float(masked_mean(kl.detach().double(), loss_mask))}
