r"""The policy term of each loss (`CorrectionConfig.loss`): what decoupled_loss puts in place of
PPO's min(r_s A, clip(r_s) A). Every term is a function of the staleness ratio r_s = pi_theta /
pi_old only; the discrepancy factor r_d = pi_old / mu is handled outside (mask, TIS weight) by
algorithms/objective.py, so the r_d / r_s split holds under every loss and every strategy's pi_old.

Per loss token, with A the advantage and r = r_s (token level, or the sequence value of the
GSPO-style geometric mean when clip_level = sequence; see objective.py). J is the surrogate the
loss maximises: the per-token loss is -w_d J. `sg` is stop-gradient; `u = exp(x - sg(x))` with
x = log r is 1 in value and carries d log pi_theta in gradient, so `sg(w) A u` has the value w A
(on the PPO surrogate's scale: -A on-policy) and the gradient w A d log pi_theta.

  ppo       J = min(r A, clip(r, 1-eps_low, 1+eps_high) A), optional dual clip max(J, c A) for A < 0.
            PPO (Schulman et al. 2017); dual clip (Ye et al. 2019); clip-higher (DAPO, Yu et al. 2025).
            veRL `vanilla` (clip_ratio_low/high, clip_ratio_c), TRL grpo/dapo (epsilon, epsilon_high),
            SkyRL `regular` / `dual_clip` (eps_clip_low/high, clip_ratio_c).
  cispo     J = sg(clip(r, 1-eps_low, 1+eps_high)) A u. Every token keeps its gradient; only the IS
            weight is truncated. MiniMax-M1 (arXiv 2506.13585). veRL `cispo` uses the same two bounds
            (loss value -sg(w) A log pi); TRL `cispo` truncates above only, at epsilon_high itself
            (ε_max = 5: eps_high 4, eps_low 1 here); SkyRL cispo_eps_clip_low/high = 1.0 / 4.0
            (bounds [0, 5]). The values of their losses carry log pi; the gradients equal this one.
  sapo      J = (4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg. A soft gate in
            place of the hard clip (gradient weight 4 s (1 - s) r, 1 at r = 1). SAPO (arXiv
            2511.20347). veRL tau_pos / tau_neg, TRL sapo_temperature_pos / _neg, SkyRL sapo.tau_*:
            all 1.0 / 1.05; same formula, so on-policy its value is -2 A / tau, not -A.
  dppo_tv   J = sg(min(r, C)) A u on tokens inside the trust region, 0 (no gradient) outside:
            A > 0: p - p_old <= delta_high;   A < 0: p_old - p <= delta_low,
            with p = pi_theta(token), p_old = pi_old(token) (probabilities, not ratios).
  dppo_kl   the same with the binary KL  p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p)):
            A > 0: KL <= delta_high or p <= p_old;   A < 0: KL <= delta_low or p >= p_old.
            DPPO-Binary-TV / -KL (arXiv 2602.04879). veRL dppo_tv / dppo_kl (thresholds in
            clip_ratio_low/high, ratio truncated at clip_ratio_c), SkyRL dppo (delta_low/high 0.2,
            untruncated), prime-rl's default loss (dppo_mask_low/high). SkyRL anchors on the rollout
            log-probs (pi_theta / mu); here, as in veRL, on pi_old, r_d being handled by the mask.
  clip_cov  the ppo term, and a covariance-selected fraction of the tokens is detached: they add 0
            and carry no gradient (`covariance_selection`).
  kl_cov    J = r A - k |log r| on the selected tokens, r A elsewhere (no clip).
            Clip-Cov / KL-Cov, "The Entropy Mechanism of RL for Reasoning LMs" (Cui et al., arXiv
            2505.22617). veRL policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio,
            ppo_kl_coef}; SkyRL clip_cov.{clip_ratio, clip_cov_lb, clip_cov_ub}, kl_cov.{kl_cov_frac,
            ppo_kl_coef} (SkyRL multiplies by kl_cov_frac itself: 0.2 selects 20 % of the tokens).

clip_level none removes each loss's bound on r: no PPO clip, no CISPO truncation, no SAPO gate
(J = r A), no DPPO trust region. What `PolicyTerm`'s flags mean under each loss (they become
LossOutput's `clipped_*` / `dual_clipped`, and `no_grad` is taken out of LossOutput.active):

  ppo, clip_cov   clipped_low: A < 0, r < 1-eps_low; clipped_high: A > 0, r > 1+eps_high;
                  dual_clipped: A < 0, r > c. All three carry no gradient.
  cispo           clipped_low / clipped_high: the weight was truncated at that bound (any A); the
                  token still carries gradient (CISPO's point), so none is in no_grad.
  sapo, kl_cov    no hard bound: every flag is false, every kept token carries gradient.
  dppo_*          clipped_low: A < 0 outside the trust region; clipped_high: A > 0 outside; no
                  gradient. dual_clipped: false.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import CorrectionConfig
from .masked import masked_mean


@dataclass
class PolicyTerm:
    """J per token [B, T] (with gradient) and its bookkeeping (bool [B, T], on loss tokens)."""

    value: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor
    no_grad: Tensor  # tokens whose J carries no gradient (clipped, outside the trust region)


def _unit(log_r: Tensor) -> Tensor:
    """1 in value, d log_r in gradient."""
    return torch.exp(log_r - log_r.detach())


def _flags(m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    none = torch.zeros_like(m)
    return none, none.clone(), none.clone()


def ppo_term(log_r: Tensor, adv: Tensor, m: Tensor, config: CorrectionConfig) -> PolicyTerm:
    """PPO's clipped surrogate (module docstring). `log_r` [B, T] with gradient, `adv` [B, T]."""
    r = log_r.exp()
    # min(r A, clip(r) A) picks the clipped constant exactly when A > 0, r > 1 + eps_high or
    # A < 0, r < 1 - eps_low. Selecting those cases explicitly gives the same value and makes the
    # gradient-carrying set exact (no split gradient at a floating-point tie).
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    r_val = r.detach()
    clipping = config.clip_level != "none"
    clipped_high = m & (adv > 0) & (r_val > hi) & clipping
    clipped_low = m & (adv < 0) & (r_val < lo) & clipping
    value = torch.where(clipped_low | clipped_high, r_val.clamp(lo, hi) * adv, r * adv)
    if config.dual_clip_c is not None:  # A < 0 and r > c: r A < c A, so max(., c A) = c A
        dual_clipped = m & (adv < 0) & (r_val > config.dual_clip_c)
        value = torch.where(dual_clipped, config.dual_clip_c * adv, value)
    else:
        dual_clipped = torch.zeros_like(m)
    return PolicyTerm(value, clipped_low, clipped_high, dual_clipped, clipped_low | clipped_high | dual_clipped)


def cispo_term(log_r: Tensor, adv: Tensor, m: Tensor, config: CorrectionConfig) -> PolicyTerm:
    """CISPO: a truncated, detached IS weight times A, every token's gradient kept."""
    r_val = log_r.detach().exp()
    if config.clip_level == "none":
        weight = r_val
        clipped_low, clipped_high, _ = _flags(m)
    else:
        lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
        weight = r_val.clamp(lo, hi)
        clipped_low, clipped_high = m & (r_val < lo), m & (r_val > hi)
    none = torch.zeros_like(m)
    return PolicyTerm(weight * adv * _unit(log_r), clipped_low, clipped_high, none, none.clone())


def sapo_term(log_r: Tensor, adv: Tensor, m: Tensor, config: CorrectionConfig) -> PolicyTerm:
    """SAPO's soft gate (4 / tau) sigmoid(tau (r - 1)) in place of r."""
    r = log_r.exp()
    if config.clip_level == "none":
        value = r * adv
    else:
        tau = torch.where(adv > 0, config.sapo_tau_pos, config.sapo_tau_neg).to(r.dtype)
        value = torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
    low, high, dual = _flags(m)
    return PolicyTerm(value, low, high, dual, torch.zeros_like(m))


def dppo_trust_region(current: Tensor, old: Tensor, adv: Tensor, config: CorrectionConfig) -> Tensor:
    """bool [B, T]: the token is inside DPPO's trust region (dppo_tv or dppo_kl, module docstring).
    `current` / `old`: log-probs of the sampled token (finite); computed detached in float64."""
    cur, prev = current.detach().double(), old.detach().double()
    p, p_old = cur.exp(), prev.exp()
    if config.loss == "dppo_tv":
        inside_pos = p - p_old <= config.dppo_delta_high
        inside_neg = p_old - p <= config.dppo_delta_low
    else:  # binary KL between Bernoulli(p_old) and Bernoulli(p); 1e-8 as veRL and SkyRL
        eps = 1e-8
        kl = p_old * (prev - cur) + (1.0 - p_old) * (torch.log(1.0 - p_old + eps) - torch.log(1.0 - p + eps))
        inside_pos = (kl <= config.dppo_delta_high) | (p <= p_old)
        inside_neg = (kl <= config.dppo_delta_low) | (p >= p_old)
    return torch.where(adv > 0, inside_pos, torch.where(adv < 0, inside_neg, True))


def dppo_term(log_r: Tensor, adv: Tensor, m: Tensor, config: CorrectionConfig, inside: Tensor) -> PolicyTerm:
    """DPPO: sg(min(r, C)) A u inside the trust region `inside` (dppo_trust_region), 0 outside."""
    r_val = log_r.detach().exp()
    weight = r_val if config.dppo_ratio_cap is None else r_val.clamp(max=config.dppo_ratio_cap)
    if config.clip_level == "none":
        inside = torch.ones_like(inside)
    clipped_high = m & (adv > 0) & ~inside
    clipped_low = m & (adv < 0) & ~inside
    value = torch.where(inside, weight * adv * _unit(log_r), torch.zeros_like(r_val))
    return PolicyTerm(value, clipped_low, clipped_high, torch.zeros_like(m), clipped_low | clipped_high)


def kl_cov_term(log_r: Tensor, adv: Tensor, m: Tensor, config: CorrectionConfig, selected: Tensor) -> PolicyTerm:
    """KL-Cov: r A, minus kl_cov_coef |log r| on the covariance-selected tokens."""
    value = log_r.exp() * adv - torch.where(selected, config.kl_cov_coef * log_r.abs(), torch.zeros_like(log_r))
    low, high, dual = _flags(m)
    return PolicyTerm(value, low, high, dual, torch.zeros_like(m))


def token_covariance(advantages: Tensor, current: Tensor, mask: Tensor) -> Tensor:
    """(A_t - mean A) (log pi_t - mean log pi) per token, means over `mask`; float64 [B, T], 0 off
    `mask`, detached. The centred product whose large values the entropy paper selects."""
    a = torch.where(mask, advantages.detach().double(), 0.0)
    lp = torch.where(mask, current.detach().double(), 0.0)
    cov = (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))
    return torch.where(mask, cov, 0.0)


def covariance_selection(current: Tensor, advantages: Tensor, mask: Tensor, config: CorrectionConfig,
                         eligible: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """bool [B, T]: the tokens Clip-Cov detaches or KL-Cov penalises, k = max(1, int(cov_fraction N))
    of the N `mask` tokens (the covariance's means are over `mask` too).

    clip_cov: k drawn uniformly among the `eligible` tokens (PPO-unclipped) whose covariance is in
              (clip_cov_low, clip_cov_high), as veRL and SkyRL draw them (randperm); `generator`
              None = a generator seeded 0, so the choice is a function of the batch.
    kl_cov:   the k largest covariances among `mask` tokens (torch.topk).

    A statistic of the whole batch: when rows are trained in shards, compute it once on the
    whole update and hand each shard its rows (decoupled_loss(whole=WholeUpdate(cov_selected=...)))."""
    n = int(mask.sum())
    selected = torch.zeros_like(mask)
    if n == 0:
        return selected
    k = max(1, int(config.cov_fraction * n))
    cov = token_covariance(advantages, current, mask).reshape(-1)
    flat = selected.reshape(-1)
    if config.loss == "kl_cov":
        candidates = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        flat[candidates[torch.topk(cov[candidates], min(k, candidates.numel())).indices]] = True
    elif config.loss == "clip_cov":
        ok = mask if eligible is None else mask & eligible
        candidates = torch.nonzero((ok.reshape(-1) & (cov > config.clip_cov_low) & (cov < config.clip_cov_high)),
                                   as_tuple=True)[0]
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        order = torch.randperm(candidates.numel(), generator=generator)
        flat[candidates[order[:k]]] = True
    else:
        raise ValueError(f"covariance_selection: loss {config.loss!r} selects no tokens (clip_cov or kl_cov)")
    return flat.reshape(mask.shape)
