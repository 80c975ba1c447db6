"""The paper's Proposition 1: an interpolated proxy only re-parameterises a bound on r = pi_theta / mu.

Log-linear proxy (A-3PO convention, alpha weights pi_theta):
    log pi_prox = log mu + alpha (log pi_theta - log mu)
    => r_d = pi_prox / mu = r^alpha,   r_s = pi_theta / pi_prox = r^(1 - alpha)
so the mask 1/c <= r_d <= c is  c^(-1/alpha) <= r <= c^(1/alpha)  and the clip bound r_s <= 1 + eps
is  r <= (1 + eps)^(1/(1 - alpha)).  In the paper notes' convention the weight sits on mu instead
(a = 1 - alpha): the mask reads c^(-1/(1-a)) <= r <= c^(1/(1-a)) and the clip (1 + eps)^(1/a).

We check on a dense grid of r that the tokens the decomposed objective keeps / leaves unclipped
are exactly the tokens whose r lies in the induced interval. The baseline log mu varies per token
to show only r matters.
"""

import math

import numpy as np
import pytest
import torch

from trajflow.algorithms import CorrectionConfig, decoupled_loss, linear_logprobs, loglinear_logprobs

C_TOK, EPS_LOW, EPS_HIGH = 1.05, 0.2, 0.28
N = 20001


def grid_tokens(log_r: np.ndarray, seed: int = 0):
    rng = np.random.default_rng(seed)
    log_mu = torch.from_numpy(rng.uniform(-8.0, -0.5, size=(1, log_r.size)))
    cur = log_mu + torch.from_numpy(log_r)[None]
    return cur, log_mu


def decomposed(cur, inf, old, sign: float, cfg: CorrectionConfig):
    out = decoupled_loss(cur, old, inf, torch.full((cur.shape[0],), sign, dtype=cur.dtype),
                         torch.ones_like(cur, dtype=torch.bool), cfg)
    return out.discrepancy_mask[0].numpy(), out


def away_from(log_r: np.ndarray, bounds: list[float], tol: float = 1e-9) -> np.ndarray:
    """Grid points not within rounding distance of a boundary (float64 arithmetic)."""
    ok = np.ones_like(log_r, dtype=bool)
    for b in bounds:
        ok &= np.abs(log_r - b) > tol
    return ok


@pytest.mark.parametrize("alpha_a3po", [0.25, 0.5, 0.8])
def test_loglinear_mask_and_clip_are_an_interval_on_the_total_ratio(alpha_a3po):
    a_paper = 1.0 - alpha_a3po  # the paper notes' convention: weight on mu
    # induced interval on log r (Proposition 1), written in the paper notes' convention
    mask_lo, mask_hi = -math.log(C_TOK) / (1 - a_paper), math.log(C_TOK) / (1 - a_paper)
    clip_lo, clip_hi = math.log(1 - EPS_LOW) / a_paper, math.log(1 + EPS_HIGH) / a_paper

    span = 1.5 * max(abs(mask_lo), mask_hi, abs(clip_lo), clip_hi)
    log_r = np.linspace(-span, span, N)
    cur, inf = grid_tokens(log_r)
    old = loglinear_logprobs(cur, inf, alpha_a3po)
    cfg = CorrectionConfig(mask_level="token", mask_c_token=C_TOK, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    ok = away_from(log_r, [mask_lo, mask_hi, clip_lo, clip_hi])

    kept, out_pos = decomposed(cur, inf, old, +1.0, cfg)
    _, out_neg = decomposed(cur, inf, old, -1.0, cfg)
    in_mask = (log_r >= mask_lo) & (log_r <= mask_hi)
    assert np.array_equal(kept[ok], in_mask[ok])
    # A > 0: unclipped iff r <= (1 + eps_high)^(1/a);  A < 0: unclipped iff r >= (1 - eps_low)^(1/a)
    assert np.array_equal(~out_pos.clipped_high[0].numpy()[ok], (log_r <= clip_hi)[ok])
    assert np.array_equal(~out_neg.clipped_low[0].numpy()[ok], (log_r >= clip_lo)[ok])
    # the active set is one interval on r: the intersection
    assert np.array_equal(out_pos.active[0].numpy()[ok], (in_mask & (log_r <= clip_hi))[ok])
    assert np.array_equal(out_neg.active[0].numpy()[ok], (in_mask & (log_r >= clip_lo))[ok])
    # and the interval is non-trivial on the grid (the test is not vacuous)
    assert 0 < kept.sum() < N and 0 < out_pos.active[0].sum() < N


@pytest.mark.parametrize("alpha_a3po", [0.3, 0.7])
def test_loglinear_sequence_level_is_an_interval_on_the_geometric_mean_of_r(alpha_a3po):
    """With alpha fixed within a sequence, the geometric-mean mask/clip bound the geometric mean of r."""
    c_seq, c_stale = 1.003, 1.004
    a = 1.0 - alpha_a3po
    mask_hi, clip_hi = math.log(c_seq) / (1 - a), math.log(c_stale) / a
    span = 1.5 * max(mask_hi, clip_hi)
    g = np.linspace(-span, span, 2001)                       # log of the geometric mean of r per sequence
    noise = np.array([0.3, -0.1, -0.2])                      # zero-mean spread within the sequence
    log_r = g[:, None] + noise[None, :]
    rng = np.random.default_rng(1)
    inf = torch.from_numpy(rng.uniform(-8.0, -0.5, size=log_r.shape))
    cur = inf + torch.from_numpy(log_r)
    old = loglinear_logprobs(cur, inf, alpha_a3po)
    cfg = CorrectionConfig.paper(c_ti=c_seq, c_stale=c_stale)
    out = decoupled_loss(cur, old, inf, torch.ones(g.size, dtype=cur.dtype), torch.ones_like(cur, dtype=torch.bool), cfg)
    ok = away_from(g, [-mask_hi, mask_hi, clip_hi])
    assert np.array_equal(out.discrepancy_mask[:, 0].numpy()[ok], (np.abs(g) <= mask_hi)[ok])
    assert np.array_equal(~out.clipped_high[:, 0].numpy()[ok], (g <= clip_hi)[ok])


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.9])
def test_linear_prox_factors_are_monotone_in_r_so_bounds_map_to_an_interval(alpha):
    """Arithmetic proxy pi_prox = (1 - alpha) mu + alpha pi_theta: r_d = (1 - alpha) + alpha r,
    r_s = r / ((1 - alpha) + alpha r) are both increasing in r, so each bound is a bound on r."""
    r = np.exp(np.linspace(-2.0, 2.0, N))
    cur, inf = grid_tokens(np.log(r))
    old = linear_logprobs(cur, inf, alpha)
    log_rd = (old - inf)[0].numpy()
    log_rs = (cur - old)[0].numpy()
    assert np.all(np.diff(log_rd) > 0) and np.all(np.diff(log_rs) >= -1e-12)
    assert np.allclose(np.exp(log_rd), (1 - alpha) + alpha * r)

    cfg = CorrectionConfig(mask_level="token", mask_c_token=C_TOK, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    kept, out = decomposed(cur, inf, old, +1.0, cfg)
    # inverse of the monotone maps: the induced interval on r
    r_lo, r_hi = (1 / C_TOK - (1 - alpha)) / alpha, (C_TOK - (1 - alpha)) / alpha
    h = 1 + EPS_HIGH
    r_clip = h * (1 - alpha) / (1 - alpha * h) if alpha * h < 1 else math.inf
    ok = away_from(np.log(r), [math.log(b) for b in (r_lo, r_hi, r_clip) if 0 < b < math.inf], tol=1e-7)
    assert np.array_equal(kept[ok], ((r >= r_lo) & (r <= r_hi))[ok])
    assert np.array_equal(~out.clipped_high[0].numpy()[ok], (r <= r_clip)[ok])
    # kept set is contiguous in r (one interval)
    idx = np.flatnonzero(kept)
    assert idx.size > 0 and np.all(np.diff(idx) == 1)
