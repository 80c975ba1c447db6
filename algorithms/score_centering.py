r"""Score Centering (arXiv 2609.20807, eq. 14 with its top-k estimator), in the decoupled objective.

At one token, with the score s_v = grad log pi_theta(v), a policy-gradient estimate on samples
of the sampler mu carries the prefix-conditional mean sum_v mu_v W_v s_v of the (weighted) score,
which is not 0 once mu differs from pi_theta (numerics, staleness), even on the same weights.
Score Centering subtracts it: token t's gradient becomes A_t (W_a s_a - mu_W), with
mu_W = sum_v mu_v W_v s_v, whose expectation under mu is 0 at every prefix.

W is the weight the objective puts on a token's score. In trajflow's decoupled objective with the
PPO term at clip_level "none" (REINFORCE with a ratio, which Score Centering requires), the sampled
token's loss is -w_d(r_d) r_s A, whose gradient is A w_d(r_d) r_s s_a, so W_v = w_d(r_d,v) r_s,v
with r_d,v = pi_old(v) / mu(v) and r_s,v = pi_theta(v) / pi_old(v), evaluated at every candidate v
(w_d: 1, or TIS min(r_d, C) per token; at sequence level the sequence's weight, the same for all v).

The top-k estimator: only the sampler's K most likely ids H are recorded. With full-vocabulary
masses P = sum_H pi_theta, O = sum_H pi_old, Q = sum_H mu and tails floored at TAIL_FLOOR, the
sampler's tail is modelled as alpha pi_theta with alpha = (1 - Q) / (1 - P), and the tail's ratios
as the tail masses' (r_d,tail = (1-O)/(1-Q), r_s,tail = (1-P)/(1-O)). Since sum_v pi_theta s_v = 0,
the tail's share of mu_W moves onto the head ids:

    mu_W = sum_{v in H} c_v s_v,   c_v = mu_v W_v - alpha W_tail pi_theta(v)

and the loss adds, per loss token, + A_t sum_{v in H} sg(c_v) log pi_theta(v) (its gradient is
A_t mu_W). On-policy (pi_old = pi_theta) without TIS, W = 1 and c_v = mu_v - alpha pi_theta(v): the
paper's plain estimator; with TIS, c_v = mu_v min(pi_theta/mu, C) - alpha min(1/alpha, C) pi_theta(v):
its TIS mode. With K covering the whole support (or a one-id tail) the estimate is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number

from .distributions import TAIL_FLOOR, tail_mass


def centering_coefficients(current: Tensor, old: Tensor, sampler: Tensor, tis_cap: float | None = None,
                           sequence_weight: Tensor | None = None) -> Tensor:
    """c_v [B, T, K] (detached, float64) from the log-probs on the sampler's top-k ids of the current
    policy, pi_old and the sampler (each [B, T, K], full-vocabulary normalised; -inf: an id outside
    that side's support). `tis_cap`: the token-level TIS cap C on r_d (None: w_d = 1);
    `sequence_weight` [B, T]: the sequence-level TIS weight instead (the same for every candidate)."""
    check_number("centering_coefficients", tis_cap=tis_cap)
    p_log, o_log, q_log = (x.detach().double() for x in (current, old, sampler))
    p, o, q = p_log.exp(), o_log.exp(), q_log.exp()
    p_tail, o_tail, q_tail = (tail_mass(x).clamp(min=TAIL_FLOOR) for x in (p_log, o_log, q_log))
    alpha = q_tail / p_tail
    present = o > 0  # an id pi_old cannot produce carries no weight (its sampled tokens leave the loss)
    r_s = torch.where(present, p / torch.where(present, o, 1.0), 0.0)
    r_s_tail = p_tail / o_tail
    if sequence_weight is not None:
        w_d = w_d_tail = sequence_weight.detach().double()
        w_d = w_d[..., None]
    elif tis_cap is not None:
        w_d = torch.where(q > 0, o / torch.where(q > 0, q, 1.0), 0.0).clamp(max=tis_cap)
        w_d_tail = (o_tail / q_tail).clamp(max=tis_cap)
    else:
        w_d, w_d_tail = 1.0, torch.ones_like(alpha)
    weight, weight_tail = w_d * r_s, w_d_tail * r_s_tail
    return q * weight - (alpha * weight_tail)[..., None] * p


def centering_term(current: Tensor, coefficients: Tensor) -> Tensor:
    """sum_v sg(c_v) log pi_theta(v) per token [B, T], differentiable in `current` [B, T, K]; an id
    the policy cannot produce (-inf) contributes 0."""
    finite = torch.isfinite(current)
    safe = torch.where(finite, current, 0.0)
    return torch.where(finite, coefficients.to(current.dtype) * safe, 0.0).sum(dim=-1)
