"""Property tests: extreme log-probs never give NaN/inf; masked tokens get exactly zero gradient."""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import CorrectionConfig, correction_diagnostics, decoupled_loss

# log-probs: ordinary values plus the extremes the brief names (-1e4 and exactly 0)
logprob = st.one_of(
    st.sampled_from([-1e4, -1e4 + 1.0, -50.0, 0.0, -1e-7]),
    st.floats(-30.0, 0.0, allow_nan=False, allow_subnormal=False),
)
advantage = st.one_of(st.just(0.0), st.floats(-10.0, 10.0, allow_nan=False, allow_subnormal=False))

CONFIGS = [
    CorrectionConfig(),
    CorrectionConfig(mask_level="sequence", mask_c_seq=1.5, clip_level="sequence"),
    CorrectionConfig(mask_level="none", tis_cap=2.0, dual_clip_c=3.0, aggregation="seq-mean-token-mean"),
    CorrectionConfig(mask_level="token", mask_c_token=1.2, tis_cap=5.0, aggregation="token-sum-norm",
                     loss_norm_tokens=8, eps_low=0.1, eps_high=0.28),
    CorrectionConfig(mask_level="none", clip_level="sequence", dual_clip_c=2.0),
    CorrectionConfig.paper(),
]


@st.composite
def batches(draw, logprob=logprob):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    grid = lambda elem: np.array(draw(st.lists(elem, min_size=b * t, max_size=b * t)), dtype=np.float32).reshape(b, t)
    cur, old, inf = grid(logprob), grid(logprob), grid(logprob)
    per_token = draw(st.booleans())
    adv = grid(advantage) if per_token else np.array(draw(st.lists(advantage, min_size=b, max_size=b)), dtype=np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    garbage = draw(st.sampled_from([0.0, math.nan, -math.inf, math.inf]))  # what padding holds
    for x in (cur, old, inf):
        x[~mask] = garbage
    if per_token:
        adv[~mask] = garbage
    cfg = draw(st.sampled_from(CONFIGS))
    return cur, old, inf, adv, mask, cfg


@settings(max_examples=300, deadline=None)
@given(batches())
def test_finite_loss_and_gradient_and_exact_zero_gradient_off_active_tokens(batch):
    cur_np, old_np, inf_np, adv_np, mask_np, cfg = batch
    cur = torch.from_numpy(cur_np).requires_grad_(True)
    mask = torch.from_numpy(mask_np)
    out = decoupled_loss(cur, torch.from_numpy(old_np), torch.from_numpy(inf_np), torch.from_numpy(adv_np), mask, cfg)
    out.loss.backward()
    grad = cur.grad

    assert torch.isfinite(out.loss), out.loss
    assert torch.isfinite(grad).all(), grad
    # exactly zero, not merely small: padding, discrepancy-masked, clipped tokens
    assert (grad[~mask] == 0.0).all()
    assert (grad[~out.discrepancy_mask] == 0.0).all()
    assert (grad[~out.active] == 0.0).all()
    # bookkeeping is consistent
    assert not (out.discrepancy_mask & ~mask).any()
    assert not (out.active & ~out.discrepancy_mask).any()
    assert torch.isfinite(out.log_rd).all() and torch.isfinite(out.is_weights).all()

    diag = correction_diagnostics(out)
    assert all(math.isfinite(v) for v in diag.values()), diag
    for key in ("mask/token_kept_frac", "clip/frac", "active_frac", "is/ess"):
        assert 0.0 <= diag[key] <= 1.0
    assert diag["mismatch/k3"] >= 0.0


@settings(max_examples=100, deadline=None)
@given(batches(logprob=st.floats(-3.0, 0.0, allow_subnormal=False)))
def test_loss_matches_float64_reference_on_ordinary_values(batch):
    """Away from the extremes, the safe implementation equals the textbook formula."""
    cur_np, old_np, inf_np, adv_np, mask_np, _ = batch
    cur_np, old_np, inf_np, adv_np = (np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
                                      for x in (cur_np, old_np, inf_np, adv_np))
    cfg = CorrectionConfig(mask_level="token", mask_c_token=1.5, tis_cap=2.0, eps_high=0.2, dual_clip_c=3.0)
    out = decoupled_loss(*(torch.from_numpy(x) for x in (cur_np, old_np, inf_np, adv_np, mask_np)), cfg)

    c, o, i = (x.astype(np.float64) for x in (cur_np, old_np, inf_np))
    a = np.broadcast_to(adv_np[:, None] if adv_np.ndim == 1 else adv_np, c.shape).astype(np.float64)
    r_d, r_s = np.exp(o - i), np.exp(c - o)
    keep = mask_np & (r_d >= 1 / 1.5) & (r_d <= 1.5)
    pg = np.minimum(r_s * a, np.clip(r_s, 0.8, 1.2) * a)
    pg = np.where(a < 0, np.maximum(pg, 3.0 * a), pg)
    per_token = -np.minimum(r_d, 2.0) * pg
    expected = per_token[keep].sum() / max(keep.sum(), 1)
    assert np.isclose(out.loss.item(), expected, rtol=1e-4, atol=1e-5)
