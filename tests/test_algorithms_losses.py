"""The loss family, the r_d variants, the denominators and the extra terms: hand-computed values,
peers' own test cases fed to trajflow's function, and a float64 numpy reference of the whole
objective checked on random batches.

One module on purpose: every loss of the family checked on the same small hand-computed tensors
and against the same float64 reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import (CorrectionConfig, KLConfig, ReferenceKL, WholeUpdate, correction_diagnostics,
                                 covariance_selection, decoupled_loss, loss_denominator, prompt_token_counts)

ln = math.log


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def run(cur, old, inf, adv, mask=None, *, kwargs=None, **cfg):
    """Loss output and d loss / d current_logprobs; `kwargs` go to decoupled_loss."""
    cur = t(cur).requires_grad_(True)
    mask = torch.ones_like(cur, dtype=torch.bool) if mask is None else torch.tensor(mask)
    out = decoupled_loss(cur, t(old), t(inf), t(adv), mask, CorrectionConfig(**cfg), **(kwargs or {}))
    out.loss.backward()
    return out, cur.grad


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32), atol=tol)


# ---- veRL's own IcePop case ------------------------------------------------------------------------

def test_icepop_case_of_verl_gives_verls_value_with_denominator_all():
    """verl-project/verl tests/trainer/ppo/test_rollout_corr_integration.py,
    test_exact_icepop_matches_filtered_weighted_ppo_loss: old = log_prob = -1 (r_s = 1), rollout
    [-0.5, -3.5, -0.8], A [1, -1, 2], rollout_is="token", rollout_is_threshold="0.5_5.0",
    loss_agg_mode token-mean -> -0.748 (mean over all 3 tokens of w * -A, w = [e^-0.5, 0, e^-0.2]).

    Mapping: veRL's old_log_prob -> old, rollout_log_prob -> inference, log_prob -> current;
    IcePop's band [0.5, 5] on r_d -> mask_level token, mask_low_token 0.5, mask_c_token 5; its
    weight r_d on kept tokens -> tis_cap 5 (min(r_d, 5) = r_d inside the band); veRL keeps the
    zero-weight token in response_mask -> denominator all. PPO clip at veRL's clip_ratio 0.2."""
    old = [[-1.0, -1.0, -1.0]]
    verl = dict(mask_level="token", mask_low_token=0.5, mask_c_token=5.0, tis_cap=5.0,
                eps_low=0.2, eps_high=0.2, aggregation="token-mean")
    out, _ = run(old, old, [[-0.5, -3.5, -0.8]], [[1.0, -1.0, 2.0]], denominator="all", **verl)
    expected = (math.exp(-0.5) * -1.0 + 0.0 + math.exp(-0.2) * -2.0) / 3
    assert out.loss.item() == pytest.approx(-0.748, abs=5e-4)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert close(out.is_weights * out.discrepancy_mask, [[0.60653067, 0.0, 0.81873075]])
    assert correction_diagnostics(out)["mask/token_kept_frac"] == pytest.approx(2 / 3)  # veRL oob 1/3
    # trajflow's default denominator counts kept tokens only: the same sum over 2 tokens
    kept, _ = run(old, old, [[-0.5, -3.5, -0.8]], [[1.0, -1.0, 2.0]], **verl)
    assert kept.loss.item() == pytest.approx(expected * 3 / 2, abs=1e-6)


# ---- the r_d factor: mask levels, asymmetric and lower-only bounds, sequence TIS ----------------------

def test_asymmetric_token_bounds():
    # [0.5, 5]: r_d = 4 kept, 0.4 dropped; the symmetric c = 2 drops 4 and keeps nothing else differently
    log_rd = [[ln(4.0), ln(0.4), 0.0]]
    out, _ = run(log_rd, log_rd, [[0.0] * 3], [1.0], mask_level="token", mask_low_token=0.5, mask_c_token=5.0)
    assert out.discrepancy_mask.tolist() == [[True, False, True]]
    out, _ = run(log_rd, log_rd, [[0.0] * 3], [1.0], mask_level="token", mask_c_token=2.0)
    assert out.discrepancy_mask.tolist() == [[False, False, True]]


def test_sequence_any_with_a_lower_only_bound_is_verls_veto():
    # no upper bound, lower 0.1: a sequence goes when any token has r_d < 0.1 (r_d = 50 is fine)
    log_rd = [[ln(50.0), 0.0], [ln(0.05), 0.0]]
    out, grad = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="sequence-any",
                    mask_c_token=None, mask_low_token=0.1)
    assert out.discrepancy_mask.tolist() == [[True, True], [False, False]]
    assert close(out.loss, -1.0) and close(grad, [[-0.5, -0.5], [0.0, 0.0]])
    # at token level only the offending token goes
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="token", mask_c_token=None,
                 mask_low_token=0.1)
    assert out.discrepancy_mask.tolist() == [[True, True], [False, True]]


def test_sequence_product_versus_geometric_mean():
    # row 0: log r_d [0.3, 0.3]: product e^0.6 = 1.82 > 1.5 (dropped), geometric mean e^0.3 = 1.35 (kept)
    # row 1: [0.3, -0.3]: product 1 (kept)
    log_rd = [[0.3, 0.3], [0.3, -0.3]]
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="sequence-product", mask_c_seq=1.5)
    assert out.discrepancy_mask.tolist() == [[False, False], [True, True]]
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="sequence", mask_c_seq=1.5)
    assert out.discrepancy_mask.all()


def test_asymmetric_sequence_bounds():
    # geometric means 0.6 (inside [0.5, 1.1]) and 1.2 (above 1.1)
    log_rd = [[ln(0.6)] * 2, [ln(1.2)] * 2]
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="sequence", mask_c_seq=1.1,
                 mask_low_seq=0.5)
    assert out.discrepancy_mask[:, 0].tolist() == [True, False]


def test_sequence_tis_weight_is_the_truncated_product():
    # row 0: r_d [1.2, 1.5], product 1.8 < C = 2; row 1: [2, 3], product 6 -> 2. r_s = 1, A = 1.
    log_rd = [[ln(1.2), ln(1.5)], [ln(2.0), ln(3.0)]]
    out, grad = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="none", tis_cap=2.0,
                    tis_level="sequence")
    assert close(out.is_weights, [[1.8, 1.8], [2.0, 2.0]])
    assert close(out.loss, -(1.8 * 2 + 2.0 * 2) / 4)
    assert close(grad, [[-0.45, -0.45], [-0.5, -0.5]])  # the weight carries no gradient


# ---- denominators and aggregations ------------------------------------------------------------------

def test_denominator_all_counts_masked_tokens_in_every_aggregation():
    # row 0: r_d [1, 10] (token 1 dropped at c = 2), A [1, 5]; row 1: r_d [1, 1], A [2, 2]; r_s = 1
    old = [[0.0, ln(10.0)], [0.0, 0.0]]
    common = dict(mask_level="token", mask_c_token=2.0)
    cases = {
        ("token-mean", "kept"): -(1 + 2 + 2) / 3, ("token-mean", "all"): -(1 + 2 + 2) / 4,
        ("seq-mean-token-mean", "kept"): -(1 / 1 + 4 / 2) / 2, ("seq-mean-token-mean", "all"): -(1 / 2 + 4 / 2) / 2,
    }
    for (aggregation, denominator), expected in cases.items():
        out, grad = run(old, old, [[0.0, 0.0]] * 2, [[1.0, 5.0], [2.0, 2.0]], aggregation=aggregation,
                        denominator=denominator, **common)
        assert close(out.loss, expected), (aggregation, denominator)
        assert grad[0, 1].item() == 0.0  # the dropped token is counted, never trained
        assert out.counted[0, 1].item() == (denominator == "all")


def test_prompt_mean_is_skyrls_mean_over_prompts_of_their_token_mean():
    # prompt 0: rows 0 and 1, tokens [4] and [1, 2, 3] -> mean 10 / 4; prompt 1: row 2, [5, 7] -> 6
    mask = [[True, False, False], [True, True, True], [True, True, False]]
    adv = [[4.0, 0.0, 0.0], [1.0, 2.0, 3.0], [5.0, 7.0, 0.0]]
    zeros = [[0.0] * 3] * 3
    groups = torch.tensor([0, 0, 1])
    out, grad = run(zeros, zeros, zeros, adv, mask, aggregation="prompt-mean",
                    kwargs=dict(whole=WholeUpdate(groups=groups)))
    assert close(out.loss, -(10 / 4 + 6) / 2)
    # -A / (prompts x its prompt's tokens)
    assert close(grad, [[-4 / 8, 0, 0], [-1 / 8, -2 / 8, -3 / 8], [-5 / 4, -7 / 4, 0]])
    counts = prompt_token_counts(out.counted, groups)
    assert counts.tolist() == [4.0, 4.0, 2.0]
    assert float(loss_denominator(out.counted, CorrectionConfig(aggregation="prompt-mean"), counts)) == 2.0
    with pytest.raises(ValueError, match="prompt-mean needs `groups`"):
        run(zeros, zeros, zeros, adv, mask, aggregation="prompt-mean")


# ---- the loss family ---------------------------------------------------------------------------------

R_S = [[ln(1.5), ln(1.5), ln(0.5), ln(0.5)]]
ZEROS4 = [[0.0] * 4]


def test_cispo_truncates_the_weight_and_keeps_every_tokens_gradient():
    # w = clip(r, 0.8, 1.2) = [1.2, 1.2, 0.8, 0.8]; A = [1, -1, 1, -2]: J = w A
    adv = [[1.0, -1.0, 1.0, -2.0]]
    out, grad = run(R_S, ZEROS4, ZEROS4, adv, loss="cispo", mask_level="token", eps_low=0.2, eps_high=0.2)
    assert close(out.loss, -(1.2 - 1.2 + 0.8 - 1.6) / 4)
    assert close(grad, [[-0.3, 0.3, -0.2, 0.4]])  # -w A / 4: no token loses its gradient
    assert out.clipped_high.tolist() == [[True, True, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True, True]]
    assert out.active.all()
    # veRL / SkyRL write the loss as -sg(w) A log pi: another value, the same gradient
    cur = t(R_S).requires_grad_(True)
    w = torch.exp(cur - t(ZEROS4)).clamp(0.8, 1.2).detach()
    (-(w * t(adv) * cur).mean()).backward()
    assert close(grad, cur.grad)
    # PPO on the same tokens trains only the two unclipped ones
    _, ppo_grad = run(R_S, ZEROS4, ZEROS4, adv, mask_level="token", eps_low=0.2, eps_high=0.2)
    assert ppo_grad[0, 0].item() == 0.0 and ppo_grad[0, 3].item() == 0.0


def test_cispo_upper_only_is_trls_epsilon_high():
    # TRL: clamp(r, max=epsilon_high) with epsilon_high = 5 (ScaleRL); SkyRL's default bounds [0, 5]
    out, grad = run([[ln(7.0), ln(0.1)]], [[0.0, 0.0]], [[0.0, 0.0]], [1.0], loss="cispo", mask_level="token",
                    eps_low=1.0, eps_high=4.0)
    assert close(out.loss, -(5.0 + 0.1) / 2) and close(grad, [[-2.5, -0.05]])
    assert out.clipped_high.tolist() == [[True, False]] and not out.clipped_low.any()


def test_sapo_gate_on_policy_and_off():
    # on-policy (r = 1): f = 2 / tau, gradient weight 1. A = [1, -1], tau = [1, 1.05]
    out, grad = run([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]], loss="sapo", mask_level="token")
    assert close(out.loss, -(2.0 / 1.0 - 2.0 / 1.05) / 2)
    assert close(grad, [[-0.5, 0.5]])
    # off-policy: r = 1.5 (A = 1, tau 1) and r = 0.5 (A = -1, tau 1.05)
    out, grad = run([[ln(1.5), ln(0.5)]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]], loss="sapo", mask_level="token")
    sig = lambda x: 1 / (1 + math.exp(-x))
    f_pos, f_neg = 4 * sig(0.5), 4 / 1.05 * sig(1.05 * -0.5)
    assert close(out.loss, -(f_pos - f_neg) / 2)
    # d(-f(r) A / 2)/d log r = -4 s (1 - s) r A / 2
    g_pos = -4 * sig(0.5) * (1 - sig(0.5)) * 1.5 / 2
    g_neg = 4 * sig(-0.525) * (1 - sig(-0.525)) * 0.5 / 2
    assert close(grad, [[g_pos, g_neg]])
    assert out.active.all() and not (out.clipped_low | out.clipped_high).any()


def test_dppo_tv_bounds_probabilities_not_ratios():
    # p_old = 0.5: A > 0 with p 0.8 (rose by 0.3 > 0.2: out) and p 0.6 (in, r = 1.2);
    # A < 0 with p 0.2 (fell by 0.3: out) and p 0.4 (in, r = 0.8); a rare token p_old 0.01 -> 0.05
    # (A > 0): r = 5, which PPO clips, but it rose by only 0.04: in.
    old = [[ln(0.5)] * 4 + [ln(0.01)]]
    cur = [[ln(0.8), ln(0.6), ln(0.2), ln(0.4), ln(0.05)]]
    adv = [[1.0, 1.0, -1.0, -1.0, 1.0]]
    out, grad = run(cur, old, old, adv, loss="dppo_tv", mask_level="token")
    assert out.clipped_high.tolist() == [[True, False, False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True, False, False]]
    assert close(out.loss, -(0 + 1.2 - 0 - 0.8 + 5.0) / 5)  # outside tokens stay in the denominator
    assert close(grad, [[0.0, -1.2 / 5, 0.0, -0.8 / 5 * -1, -5.0 / 5]])
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0
    # the bounds are per side: delta_low 0.35 lets the A < 0 token that fell by 0.3 in, not the A > 0 one
    out, _ = run(cur, old, old, adv, loss="dppo_tv", mask_level="token", dppo_delta_low=0.35)
    assert not out.clipped_low.any() and out.clipped_high[0, 0]
    # veRL's clip_ratio_c truncation: dppo_ratio_cap 3 caps the rare token's weight
    out, grad = run(cur, old, old, adv, loss="dppo_tv", mask_level="token", dppo_ratio_cap=3.0)
    assert close(grad[0, 4], -3.0 / 5)


def test_dppo_kl_uses_the_binary_kl():
    # p_old 0.5 -> p 0.8: KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231 > 0.2 (out); -> 0.6: 0.0204 (in);
    # A > 0 with a falling probability (0.5 -> 0.1) is always in.
    kl = lambda p_old, p: p_old * ln(p_old / p) + (1 - p_old) * ln((1 - p_old) / (1 - p))
    assert kl(0.5, 0.8) > 0.2 > kl(0.5, 0.6)
    old = [[ln(0.5)] * 3]
    out, grad = run([[ln(0.8), ln(0.6), ln(0.1)]], old, old, [[1.0, 1.0, 1.0]], loss="dppo_kl", mask_level="token")
    assert out.clipped_high.tolist() == [[True, False, False]]
    assert close(grad, [[0.0, -1.2 / 3, -0.2 / 3]])


# 2 rows x 2 tokens, per-token A [[2, -1], [3, -1]], log pi [[0, -2], [-2, 0]]:
# mean A 0.75, mean log pi -1: cov = [[1.25, 1.75], [-2.25, -1.75]]; candidates in (1, 5): tokens (0,0), (0,1)
COV_CUR = [[0.0, -2.0], [-2.0, 0.0]]
COV_ADV = [[2.0, -1.0], [3.0, -1.0]]


def test_clip_cov_detaches_the_selected_tokens():
    out, grad = run(COV_CUR, COV_CUR, COV_CUR, COV_ADV, loss="clip_cov", mask_level="token", cov_fraction=0.5)
    assert out.cov_selected.tolist() == [[True, True], [False, False]]  # k = 2 = both candidates
    assert close(out.loss, -(3.0 - 1.0) / 4)  # r_s = 1: J = A on the two others, still / 4
    assert close(grad, [[0.0, 0.0], [-0.75, 0.25]])
    assert not out.active[0].any() and out.active[1].all()
    assert correction_diagnostics(out)["cov/selected_frac"] == pytest.approx(2 / 4)
    # k = 1: one of the two candidates, the same one for the same batch (seeded)
    first, _ = run(COV_CUR, COV_CUR, COV_CUR, COV_ADV, loss="clip_cov", mask_level="token", cov_fraction=0.25)
    again, _ = run(COV_CUR, COV_CUR, COV_CUR, COV_ADV, loss="clip_cov", mask_level="token", cov_fraction=0.25)
    assert int(first.cov_selected.sum()) == 1 and first.cov_selected[0].any()
    assert torch.equal(first.cov_selected, again.cov_selected)


def test_clip_cov_never_selects_a_ppo_clipped_token():
    # token (0,0) now has r_s = 2 with A > 0: clipped by PPO, so only (0,1) is a candidate
    old = [[-ln(2.0), -2.0], [-2.0, 0.0]]
    out, _ = run(COV_CUR, old, old, COV_ADV, loss="clip_cov", mask_level="token", cov_fraction=0.5)
    assert out.clipped_high[0, 0] and out.cov_selected.tolist() == [[False, True], [False, False]]


def test_kl_cov_penalises_the_largest_covariance():
    # k = 1: token (0,1) (cov 1.75) gets -|log r|; its r_s = 1.5 (old shifted), the others r_s = 1
    old = [[0.0, -2.0 - ln(1.5)], [-2.0, 0.0]]
    out, grad = run(COV_CUR, old, old, COV_ADV, loss="kl_cov", mask_level="token", cov_fraction=0.25)
    assert out.cov_selected.tolist() == [[False, True], [False, False]]
    j = 1.5 * -1.0 - 1.0 * ln(1.5)
    assert close(out.loss, -(2.0 + j + 3.0 - 1.0) / 4)
    assert close(grad, [[-0.5, -(1.5 * -1.0 - 1.0) / 4], [-0.75, 0.25]])  # d|x|/dx = 1 at x = ln 1.5
    assert out.active.all()


def test_covariance_selection_by_hand():
    cur, adv, mask = t(COV_CUR), t(COV_ADV), torch.ones(2, 2, dtype=torch.bool)
    top = covariance_selection(cur, adv, mask, CorrectionConfig(loss="kl_cov", cov_fraction=0.5))
    assert top.tolist() == [[True, True], [False, False]]  # covariances 1.25 and 1.75
    with pytest.raises(ValueError, match="selects no tokens"):
        covariance_selection(cur, adv, mask, CorrectionConfig())


def test_off_policy_sequence_mask_drops_only_drifted_negative_sequences():
    # mu = 0 for every token; A = [-1, -1, +1]; pi_theta: seq 0 -0.3 (drift 0.3 > 0.25: dropped),
    # seq 1 -0.2 (0.2: kept), seq 2 -0.3 but A > 0 (kept). pi_old = -0.1, so the drift from pi_old
    # alone would keep seq 0 (0.2): TRL and DeepSeek measure from the sampler, mu.
    cur, old, inf = [[-0.3], [-0.2], [-0.3]], [[-0.1]] * 3, [[0.0]] * 3
    out, grad = run(cur, old, inf, [-1.0, -1.0, 1.0], off_policy_mask=0.25, mask_level="none", clip_level="none")
    assert out.off_policy_masked.tolist() == [[True], [False], [False]]
    r1, r2 = math.exp(-0.1), math.exp(-0.2)
    assert close(out.loss, -(0.0 - r1 + r2) / 3)  # the dropped sequence stays in the denominator
    assert close(grad, [[0.0], [r1 / 3], [-r2 / 3]])
    assert correction_diagnostics(out)["mask/off_policy_frac"] == pytest.approx(1 / 3)


# ---- the KL and entropy terms -------------------------------------------------------------------------

def test_kl_term_in_the_loss_by_hand():
    # x = log pi - log pi_ref = [0.5, -1]: k3 = e^-x - 1 + x = [0.10653, 0.71828]; A = 0: only the KL
    cur, ref = [[-1.0, -2.0]], t([[-1.5, -1.0]])
    out, grad = run(cur, cur, cur, [0.0], mask_level="none",
                    kwargs=dict(reference=ReferenceKL(ref, KLConfig(beta=0.1))))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1]
    assert close(out.kl, [k3]) and close(out.loss, 0.1 * sum(k3) / 2)
    assert close(grad, [[0.05 * (1 - math.exp(-0.5)), 0.05 * (1 - math.exp(1.0))]])
    assert correction_diagnostics(out, reference=True)["kl/mean"] == pytest.approx(sum(k3) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="in the reward"):
        run(cur, cur, cur, [0.0], kwargs=dict(reference=ReferenceKL(ref, KLConfig(beta=0.1, in_="reward"))))


def test_entropy_term_by_hand():
    entropy = torch.tensor([[2.0, 1.0]], requires_grad=True)
    out, grad = run([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [1.0], mask_level="none", entropy_coef=0.01,
                    kwargs=dict(entropy=entropy))
    assert close(out.loss, -1.0 - 0.01 * 1.5)
    assert close(entropy.grad, [[-0.005, -0.005]]) and close(grad, [[-0.5, -0.5]])
    with pytest.raises(ValueError, match="entropy_coef"):
        run([[0.0]], [[0.0]], [[0.0]], [1.0], entropy_coef=0.01)


# ---- settings --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(loss="ppo2"), "loss"),
        (dict(mask_level="seq"), "mask_level"),
        (dict(mask_low_token=1.5), "mask_low_token"),
        (dict(mask_low_token=0.0), "mask_low_token"),
        (dict(mask_c_token=None), "mask_c_token"),  # no bound left
        (dict(mask_c_seq=None), "mask_c_seq"),
        (dict(denominator="none"), "denominator"),
        (dict(tis_level="sequence"), "tis_level"),  # needs tis_cap
        (dict(loss="cispo", dual_clip_c=3.0), "dual_clip_c"),
        (dict(loss="dppo_tv", clip_level="sequence"), "clip_level"),
        (dict(clip_cov_low=5.0), "clip_cov_low"),
        (dict(off_policy_mask=-0.1), "off_policy_mask"),
        (dict(sapo_tau_pos=0.0), "sapo_tau_pos"),
        (dict(cov_fraction=0.0), "cov_fraction"),
        (dict(cov_fraction=1.5), "cov_fraction"),
        (dict(entropy_coef=-1.0), "entropy_coef"),
        (dict(kl_cov_coef=True), "kl_cov_coef"),
        (dict(dppo_ratio_cap=1.0), "dppo_ratio_cap"),
    ],
)
def test_new_settings_are_checked(fields, name):
    with pytest.raises(ValueError, match=f"CorrectionConfig.{name}"):
        CorrectionConfig(**fields)


def test_kl_config_key_and_checks():
    import dataclasses

    assert {f.name: f.metadata.get("key") for f in dataclasses.fields(KLConfig)}["in_"] == "in"
    for bad, name in ((dict(beta=-1.0), "beta"), (dict(estimator="k4"), "estimator"), (dict(in_="both"), "in_")):
        with pytest.raises(ValueError, match=f"KLConfig.{name}"):
            KLConfig(**bad)


# ---- a float64 numpy reference of the whole objective -------------------------------------------------

def reference_loss(cur, old, inf, adv, mask, cfg, groups, selected, ref=None, beta=0.0, entropy=None):
    """The module docstring's formula, textbook style, in float64 (token-level r_d quantities)."""
    c, o, i = (np.asarray(x, np.float64) for x in (cur, old, inf))
    a = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, c.shape).astype(np.float64)
    mask = np.asarray(mask)
    lrd, lrs = np.clip(o - i, -20, 20), np.clip(c - o, -20, 20)
    n = np.maximum(mask.sum(1), 1)
    # M_d
    lo_t = math.log(cfg.mask_low_token) if cfg.mask_low_token else -math.log(cfg.mask_c_token)
    hi_t = math.log(cfg.mask_c_token) if cfg.mask_c_token else math.inf
    tok_ok = (lrd >= lo_t) & (lrd <= hi_t)
    lo_s = math.log(cfg.mask_low_seq) if cfg.mask_low_seq else -math.log(cfg.mask_c_seq)
    hi_s = math.log(cfg.mask_c_seq) if cfg.mask_c_seq else math.inf
    seq_sum = (lrd * mask).sum(1)
    seq_val = {"sequence": seq_sum / n, "sequence-product": seq_sum}
    keep = {
        "none": np.ones_like(mask),
        "token": tok_ok,
        "sequence-any": np.broadcast_to((tok_ok | ~mask).all(1)[:, None], c.shape),
    }.get(cfg.mask_level)
    if keep is None:
        v = seq_val[cfg.mask_level]
        keep = np.broadcast_to(((v >= lo_s) & (v <= hi_s))[:, None], c.shape)
    keep = keep & mask
    # w_d
    if cfg.tis_cap is None:
        w = np.ones_like(c)
    elif cfg.tis_level == "token":
        w = np.minimum(np.exp(lrd), cfg.tis_cap)
    else:
        w = np.broadcast_to(np.minimum(np.exp(np.clip(seq_sum, -20, math.log(cfg.tis_cap))), cfg.tis_cap)[:, None],
                            c.shape)
    # r_s at its level
    lr = np.broadcast_to(((lrs * mask).sum(1) / n)[:, None], c.shape) if cfg.clip_level == "sequence" else lrs
    r = np.exp(lr)
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    bounded = cfg.clip_level != "none"
    if cfg.loss in ("ppo", "clip_cov"):
        j = np.minimum(r * a, np.clip(r, lo, hi) * a) if bounded else r * a
        if cfg.dual_clip_c is not None:
            j = np.where(a < 0, np.maximum(j, cfg.dual_clip_c * a), j)
    elif cfg.loss == "cispo":
        j = (np.clip(r, lo, hi) if bounded else r) * a
    elif cfg.loss == "sapo":
        tau = np.where(a > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        j = 4 / tau / (1 + np.exp(-tau * (r - 1))) * a if bounded else r * a
    elif cfg.loss in ("dppo_tv", "dppo_kl"):
        p, q = np.exp(c), np.exp(o)
        if cfg.loss == "dppo_tv":
            pos, neg = p - q <= cfg.dppo_delta_high, q - p <= cfg.dppo_delta_low
        else:
            kl = q * (o - c) + (1 - q) * (np.log(1 - q + 1e-8) - np.log(1 - p + 1e-8))
            pos, neg = (kl <= cfg.dppo_delta_high) | (p <= q), (kl <= cfg.dppo_delta_low) | (p >= q)
        inside = np.where(a > 0, pos, np.where(a < 0, neg, True)) | (not bounded)
        weight = r if cfg.dppo_ratio_cap is None else np.minimum(r, cfg.dppo_ratio_cap)
        j = np.where(inside, weight * a, 0.0)
    else:  # kl_cov
        j = r * a - np.where(selected, cfg.kl_cov_coef * np.abs(lrs), 0.0)
    # policy-side masks
    policy = keep.copy()
    if cfg.off_policy_mask is not None:
        drift = -((lrd + lrs) * mask).sum(1) / n
        policy &= ~((a < 0) & (drift > cfg.off_policy_mask)[:, None])
    if cfg.loss == "clip_cov":
        policy &= ~selected
    # aggregation
    counted = keep if cfg.denominator == "kept" else mask
    if cfg.aggregation == "token-mean":
        weights = counted / max(counted.sum(), 1)
    elif cfg.aggregation == "seq-mean-token-mean":
        per = counted.sum(1)
        weights = counted / np.maximum(per, 1)[:, None] / max((per > 0).sum(), 1)
    elif cfg.aggregation == "token-sum-norm":
        weights = counted / ((cfg.loss_norm_tokens or c.shape[1]) * c.shape[0])
    else:
        per = counted.sum(1)
        totals = {g: per[groups == g].sum() for g in np.unique(groups)}
        n_p = np.array([totals[g] for g in groups], np.float64)
        prompts = sum(1 for v in totals.values() if v > 0)
        weights = counted / np.maximum(n_p, 1)[:, None] / max(prompts, 1)
    loss = -(np.where(policy, w * j, 0.0) * weights).sum()
    if ref is not None:
        x = np.clip(c - np.asarray(ref, np.float64), -20, 20)
        loss += beta * (np.where(mask, np.expm1(-x) + x, 0.0) * weights).sum()
    if entropy is not None:
        loss -= cfg.entropy_coef * (np.where(mask, entropy, 0.0) * weights).sum()
    return loss


REFERENCE_CONFIGS = [
    dict(loss="ppo", mask_level="token", mask_c_token=1.5, tis_cap=2.0, dual_clip_c=3.0, eps_high=0.2),
    dict(loss="ppo", mask_level="sequence-any", mask_c_token=None, mask_low_token=0.3, denominator="all"),
    dict(loss="ppo", clip_level="sequence", mask_level="sequence-product", mask_c_seq=4.0, mask_low_seq=0.2,
         tis_cap=3.0, tis_level="sequence", aggregation="seq-mean-token-mean"),
    dict(loss="cispo", mask_level="token", mask_low_token=0.5, mask_c_token=3.0, eps_low=1.0, eps_high=4.0,
         denominator="all"),
    dict(loss="cispo", clip_level="sequence", mask_level="sequence", mask_c_seq=2.0, aggregation="prompt-mean"),
    dict(loss="sapo", mask_level="none", off_policy_mask=0.1, aggregation="token-sum-norm", loss_norm_tokens=7),
    dict(loss="sapo", clip_level="sequence", mask_level="token", tis_cap=1.5, aggregation="prompt-mean",
         denominator="all"),
    dict(loss="dppo_tv", mask_level="token", mask_c_token=2.0, dppo_ratio_cap=4.0, dppo_delta_low=0.1,
         dppo_delta_high=0.3),
    dict(loss="dppo_kl", mask_level="none", dppo_delta_low=0.05, dppo_delta_high=0.05, off_policy_mask=0.0),
    dict(loss="clip_cov", mask_level="token", mask_c_token=2.0, denominator="all", aggregation="seq-mean-token-mean"),
    dict(loss="kl_cov", mask_level="sequence", mask_c_seq=1.5, cov_fraction=0.3, kl_cov_coef=0.5),
    dict(loss="ppo", clip_level="none", mask_level="none", entropy_coef=0.01),
]

ordinary = st.floats(-3.0, 0.0, allow_nan=False, allow_subnormal=False)


@st.composite
def ordinary_batches(draw):
    b, width = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    cells = b * width
    grid = lambda: np.array(draw(st.lists(ordinary, min_size=cells, max_size=cells)), np.float32).reshape(b, width)
    cur, old, inf, ref = grid(), grid(), grid(), grid()
    advantage = st.floats(-3, 3, allow_subnormal=False)
    if draw(st.booleans()):  # per token [B, T]
        adv = np.array(draw(st.lists(advantage, min_size=cells, max_size=cells)), np.float32).reshape(b, width)
    else:
        adv = np.array(draw(st.lists(advantage, min_size=b, max_size=b)), np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=b * width, max_size=b * width))).reshape(b, width)
    groups = np.array(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b)))
    selected = np.array(draw(st.lists(st.booleans(), min_size=b * width, max_size=b * width))).reshape(b, width)
    return cur, old, inf, ref, adv, mask, groups, selected & mask, draw(st.sampled_from(REFERENCE_CONFIGS))


@settings(max_examples=300, deadline=None)
@given(ordinary_batches(), st.booleans())
def test_every_loss_matches_the_float64_reference(batch, with_kl):
    cur, old, inf, ref, adv, mask, groups, selected, fields = batch
    cfg = CorrectionConfig(**fields)
    entropy = -cur  # any per-token values
    kwargs = dict(whole=WholeUpdate(groups=torch.from_numpy(groups), cov_selected=torch.from_numpy(selected)),
                  entropy=torch.from_numpy(entropy) if cfg.entropy_coef else None)
    if with_kl:
        kwargs.update(reference=ReferenceKL(torch.from_numpy(ref), KLConfig(beta=0.2)))
    out = decoupled_loss(*(torch.from_numpy(x) for x in (cur, old, inf, adv, mask)), cfg, **kwargs)
    expected = reference_loss(cur, old, inf, adv, mask, cfg, groups, selected, ref if with_kl else None, 0.2,
                              entropy if cfg.entropy_coef else None)
    assert np.isclose(out.loss.item(), expected, rtol=1e-4, atol=1e-5), (out.loss.item(), expected, fields)


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_covariance_selection_is_a_whole_batch_statistic(loss):
    """Two shards (one row each): given the whole batch's selection they add up to its loss;
    selecting on each shard alone picks one token per shard instead of one in all, and does not.
    log pi [[0, -2], [0, -2]], A [[2, -1], [3, -1]]: every covariance is in (1, 5), k = 1."""
    cur = [[0.0, -2.0], [0.0, -2.0]]
    old = [[0.0 - ln(1.1), -2.0 - ln(1.2)], [0.0 - ln(1.15), -2.0 - ln(1.05)]]  # r_s unclipped
    cfg = dict(loss=loss, mask_level="token", cov_fraction=0.25)
    whole, _ = run(cur, old, old, COV_ADV, **cfg)
    assert int(whole.cov_selected.sum()) == 1
    total = loss_denominator(whole.counted, CorrectionConfig(**cfg))
    shard = lambda r, sel: run([cur[r]], [old[r]], [old[r]], [COV_ADV[r]], **cfg,
                               kwargs=dict(whole=WholeUpdate(denominator=total, cov_selected=sel)))[0].loss.item()
    given = sum(shard(r, whole.cov_selected[r: r + 1]) for r in (0, 1))
    alone = sum(shard(r, None) for r in (0, 1))
    assert given == pytest.approx(whole.loss.item(), abs=1e-6)
    assert alone != pytest.approx(whole.loss.item(), abs=1e-3)
