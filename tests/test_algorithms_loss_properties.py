"""Properties of every loss, denominator and aggregation: shards add up, r_d-only settings are
inert when old == inference, extreme log-probs (-1e4, exactly 0, garbage in the padding) never give
a NaN or a gradient off the active tokens. (The float64 reference of every loss is in
test_algorithms_losses.py.)"""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import (AGGREGATIONS, LOSSES, CorrectionConfig, KLConfig, ReferenceKL, WholeUpdate,
                                 correction_diagnostics, decoupled_loss, loss_denominator, prompt_token_counts)

DENOMINATORS = ("kept", "all")


@st.composite
def policy_settings(draw):
    """The r_s side of a config: a loss and what it reads."""
    loss = draw(st.sampled_from(LOSSES))
    levels = ("token", "none") if loss in ("dppo_tv", "dppo_kl", "kl_cov") else ("token", "sequence", "none")
    fields = dict(loss=loss, clip_level=draw(st.sampled_from(levels)),
                  eps_low=draw(st.sampled_from([0.2, 1.0])), eps_high=draw(st.sampled_from([0.05, 0.28, 4.0])),
                  cov_fraction=draw(st.sampled_from([0.0002, 0.3, 1.0])),
                  off_policy_mask=draw(st.sampled_from([None, 0.0, 0.5])))
    if loss in ("ppo", "clip_cov"):
        fields["dual_clip_c"] = draw(st.sampled_from([None, 3.0]))
    if loss.startswith("dppo"):
        fields["dppo_ratio_cap"] = draw(st.sampled_from([None, 5.0]))
    return fields


@st.composite
def discrepancy_settings(draw):
    """The r_d side of a config: mask level and bounds, TIS, denominator."""
    c_tok = draw(st.sampled_from([None, 1.2, 2.0]))
    return dict(mask_level=draw(st.sampled_from(["token", "sequence", "sequence-product", "sequence-any", "none"])),
                mask_c_token=c_tok, mask_low_token=0.5 if c_tok is None else draw(st.sampled_from([None, 0.3])),
                mask_c_seq=draw(st.sampled_from([1.05, 3.0])), mask_low_seq=draw(st.sampled_from([None, 0.2])),
                tis_cap=draw(st.sampled_from([None, 1.0, 2.0])), denominator=draw(st.sampled_from(DENOMINATORS)))


@st.composite
def batches(draw, logprob, per_token_advantages: bool = False):
    b, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    grid = lambda elem: torch.tensor(draw(st.lists(elem, min_size=b * width, max_size=b * width)),
                                     dtype=torch.float32).reshape(b, width)
    cur, old, inf, ref = grid(logprob), grid(logprob), grid(logprob), grid(logprob)
    advantage = st.one_of(st.just(0.0), st.floats(-5, 5, allow_subnormal=False))
    if per_token_advantages and draw(st.booleans()):  # [B, T] advantages (their padding gets garbage too)
        adv = grid(advantage)
    else:
        adv = torch.tensor(draw(st.lists(advantage, min_size=b, max_size=b)))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * width, max_size=b * width))).reshape(b, width)
    groups = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b)))
    return cur, old, inf, ref, adv, mask, groups


ordinary = st.floats(-5.0, 0.0, allow_nan=False, allow_subnormal=False)


def loss_and_grad(cur, *args, **kwargs):
    cur = cur.clone().requires_grad_(True)
    out = decoupled_loss(cur, *args, **kwargs)
    out.loss.backward()
    return out, cur.grad


@settings(max_examples=300, deadline=None)
@given(batches(ordinary), policy_settings(), discrepancy_settings(), st.sampled_from(AGGREGATIONS),
       st.booleans(), st.data())
def test_shards_with_the_global_counts_add_up_to_the_whole_batch(batch, policy, discrepancy, aggregation, extra, data):
    """For every loss, denominator and aggregation: the shards' losses and gradients, each given
    the whole batch's count (and prompt counts, covariance selection), sum to the whole's."""
    cur, old, inf, ref, adv, mask, groups = batch
    cfg = CorrectionConfig(**policy, **discrepancy, aggregation=aggregation, loss_norm_tokens=4,
                           entropy_coef=0.01 if extra else 0.0)

    def terms(rows: torch.Tensor | slice = slice(None)) -> dict:
        return dict(reference=ReferenceKL(ref[rows], KLConfig(beta=0.1)), entropy=-cur[rows]) if extra else {}

    whole, whole_grad = loss_and_grad(cur, old, inf, adv, mask, cfg, whole=WholeUpdate(groups=groups), **terms())
    counts = prompt_token_counts(whole.counted, groups) if aggregation == "prompt-mean" else None
    total = loss_denominator(whole.counted, cfg, counts)

    order = torch.tensor(data.draw(st.permutations(range(len(cur)))))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(cur) - 1)), max_size=2)))
    shards = [s for s in torch.tensor_split(order, [c for c in cuts if c < len(cur)]) if len(s)]
    loss_sum, grad, count = 0.0, torch.zeros_like(cur), 0.0
    for rows in shards:
        shard_whole = WholeUpdate(denominator=total, groups=groups[rows],
                                  group_counts=None if counts is None else counts[rows],
                                  cov_selected=whole.cov_selected[rows])
        out, g = loss_and_grad(cur[rows], old[rows], inf[rows], adv[rows], mask[rows], cfg, whole=shard_whole,
                               **terms(rows))
        loss_sum += float(out.loss.detach())
        grad[rows] += g
        count += float(loss_denominator(out.counted, cfg, None if counts is None else counts[rows]))
    assert math.isclose(count, float(total), rel_tol=1e-6, abs_tol=1e-6)
    whole_loss = float(whole.loss.detach())
    assert math.isclose(loss_sum, whole_loss, rel_tol=1e-4, abs_tol=1e-5), (loss_sum, whole_loss)
    assert torch.allclose(grad, whole_grad, rtol=1e-4, atol=1e-6)


@settings(max_examples=300, deadline=None)
@given(batches(ordinary), policy_settings(), discrepancy_settings(), st.sampled_from(AGGREGATIONS))
def test_discrepancy_settings_are_inert_when_old_equals_inference(batch, policy, discrepancy, aggregation):
    """r_d = 1 exactly: every r_d mask keeps, every TIS weight (C >= 1) is 1, both denominators
    count the same tokens. The loss and its gradient are bit-identical to no r_d handling."""
    cur, old, _, _, adv, mask, groups = batch
    base = CorrectionConfig(**policy, mask_level="none", aggregation=aggregation)
    varied = CorrectionConfig(**policy, **discrepancy, aggregation=aggregation)
    plain, plain_grad = loss_and_grad(cur, old, old, adv, mask, base, whole=WholeUpdate(groups=groups))
    out, grad = loss_and_grad(cur, old, old, adv, mask, varied, whole=WholeUpdate(groups=groups))
    assert torch.equal(out.loss, plain.loss) and torch.equal(grad, plain_grad)
    assert torch.equal(out.discrepancy_mask, mask) and torch.equal(out.counted, mask)


extreme = st.one_of(st.sampled_from([-1e4, -1e4 + 1.0, -50.0, 0.0, -1e-7]),
                    st.floats(-30.0, 0.0, allow_nan=False, allow_subnormal=False))


@settings(max_examples=400, deadline=None)
@given(batches(extreme, per_token_advantages=True), policy_settings(), discrepancy_settings(),
       st.sampled_from(AGGREGATIONS), st.sampled_from([0.0, math.nan, -math.inf, math.inf]))
def test_extreme_logprobs_give_finite_values_and_exact_zero_gradient_off_active(batch, policy, discrepancy,
                                                                                 aggregation, garbage):
    cur, old, inf, ref, adv, mask, groups = batch
    for x in (cur, old, inf, ref, *([adv] if adv.dim() == 2 else [])):
        x[~mask] = garbage  # what padding holds
    cfg = CorrectionConfig(**policy, **discrepancy, aggregation=aggregation)
    out, grad = loss_and_grad(cur, old, inf, adv, mask, cfg, whole=WholeUpdate(groups=groups))
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    # exactly zero, not merely small: padding, discrepancy-masked, clipped, outside a trust region
    assert (grad[~mask] == 0.0).all() and (grad[~out.discrepancy_mask] == 0.0).all()
    assert (grad[~out.active] == 0.0).all()
    assert not (out.discrepancy_mask & ~mask).any() and not (out.active & ~out.discrepancy_mask).any()
    assert not (out.counted & ~mask).any()
    assert torch.isfinite(out.log_rd).all() and torch.isfinite(out.is_weights).all()
    diag = correction_diagnostics(out)
    assert all(math.isfinite(v) for v in diag.values())
    for key in ("mask/token_kept_frac", "clip/frac", "active_frac", "is/ess"):
        assert 0.0 <= diag[key] <= 1.0, key
    assert diag["mismatch/k3"] >= 0.0
    # the KL and entropy terms at the same extremes
    with_terms = CorrectionConfig(**policy, **discrepancy, aggregation=aggregation, entropy_coef=0.1)
    out, grad = loss_and_grad(cur, old, inf, adv, mask, with_terms, whole=WholeUpdate(groups=groups),
                              reference=ReferenceKL(ref, KLConfig(beta=1.0, estimator="k3")),
                              entropy=torch.where(mask, -cur, garbage))
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and torch.isfinite(out.kl).all()
    assert (grad[~out.counted] == 0.0).all()
    assert np.isfinite(correction_diagnostics(out, reference=True)["kl/mean"])
