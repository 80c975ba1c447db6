"""Correction diagnostics on a hand-built batch."""

import math

import pytest
import torch

from trajflow.algorithms import CorrectionConfig, correction_diagnostics, decoupled_loss

ln = math.log

# 2 sequences, 5 loss tokens (the last token of seq 0 is padding).
MASK = torch.tensor([[True, True, False], [True, True, True]])
INF = torch.zeros(2, 3)
# log r_d on loss tokens: [ln 2, 0 | 0, ln 3, 0]; with c = 2.5 the ln 3 token is dropped
OLD = torch.tensor([[ln(2), 0.0, 9.0], [0.0, ln(3), 0.0]])
# r_s: seq 0 [1, 1.5] with A = +1 -> token 1 clipped high; seq 1 [1.5, 1, 0.5] with A = -1 -> token 2 clipped low
CUR = OLD + torch.tensor([[0.0, ln(1.5), 0.0], [ln(1.5), 0.0, ln(0.5)]])
ADV = torch.tensor([1.0, -1.0])
VERSIONS = torch.tensor([[5, 4, 0], [3, 3, 2]])


def batch_output(**cfg):
    return decoupled_loss(CUR, OLD, INF, ADV, MASK, CorrectionConfig(mask_level="token", mask_c_token=2.5, eps_high=0.2, **cfg))


def test_fractions_kl_ess_staleness_by_hand():
    d = correction_diagnostics(batch_output(), versions=VERSIONS, trainer_version=5,
                               ewma_age=1.5, ewma_reset_count=2)
    assert d["loss_tokens"] == 5
    assert d["mask/token_kept_frac"] == pytest.approx(4 / 5)
    assert d["mask/seq_kept_frac"] == 1.0
    assert d["clip/high_frac"] == pytest.approx(1 / 5)
    assert d["clip/low_frac"] == pytest.approx(1 / 5)
    assert d["clip/dual_frac"] == 0.0
    assert d["clip/frac"] == pytest.approx(2 / 5)
    # active: seq 0 token 0, seq 1 token 0 (token 1 masked, token 2 clipped)
    assert d["active_frac"] == pytest.approx(2 / 5)
    # k1 = mean(log mu - log pi_old) = -(ln 2 + ln 3) / 5;  k3 = mean(rho - 1 - ln rho), rho = [2, 1, 1, 3, 1]
    assert d["mismatch/k1"] == pytest.approx(-(ln(2) + ln(3)) / 5, abs=1e-6)
    assert d["mismatch/k3"] == pytest.approx(((1 - ln(2)) + (2 - ln(3))) / 5, abs=1e-6)
    # ESS of w = [2, 1, 1, 3, 1]: 8^2 / (5 * 16) = 0.8
    assert d["is/ess"] == pytest.approx(0.8)
    # lags over loss tokens: [0, 1 | 2, 2, 3] (the padded version 0 is ignored)
    assert d["staleness/mean"] == pytest.approx(1.6) and d["staleness/max"] == 3
    assert [d[f"staleness/lag_{k}"] for k in range(4)] == [1, 1, 2, 1]
    assert "staleness/lag_4" not in d and "staleness/lag_5" not in d
    assert d["ewma/age"] == 1.5 and d["ewma/reset_count"] == 2
    assert all(isinstance(v, float) for v in d.values())


def test_sequence_mask_fraction():
    # sequence level, c = 1.5: seq 0 mean log r_d = ln2/2 = 0.35 <= ln 1.5 = 0.405 kept;
    # seq 1 mean = ln3/3 = 0.366 kept too; with c = 1.4 (ln = 0.336) both dropped; with c = 1.42 (0.351) seq 0 kept only
    out = decoupled_loss(CUR, OLD, INF, ADV, MASK, CorrectionConfig(mask_level="sequence", mask_c_seq=1.42))
    d = correction_diagnostics(out)
    assert d["mask/seq_kept_frac"] == 0.5
    assert d["mask/token_kept_frac"] == pytest.approx(2 / 5)


def test_kept_fraction_by_advantage_sign():
    # token mask (c = 2.5): seq 0 (A = +1) keeps both loss tokens; seq 1 (A = -1) loses its ln 3 token
    d = correction_diagnostics(batch_output(), advantages=ADV)
    assert d["mask/kept_frac_pos_adv"] == 1.0
    assert d["mask/kept_frac_neg_adv"] == pytest.approx(2 / 3)
    # sequence level, c = 1.42: only seq 0 survives -> the mask kept every A > 0 token, no A < 0 token
    out = decoupled_loss(CUR, OLD, INF, ADV, MASK, CorrectionConfig(mask_level="sequence", mask_c_seq=1.42))
    d = correction_diagnostics(out, advantages=ADV)
    assert (d["mask/kept_frac_pos_adv"], d["mask/kept_frac_neg_adv"]) == (1.0, 0.0)
    assert "mask/kept_frac_pos_adv" not in correction_diagnostics(out)


def test_dual_clip_fraction():
    cur = OLD + torch.tensor([[0.0, 0.0, 0.0], [ln(5.0), 0.0, 0.0]])
    out = decoupled_loss(cur, OLD, INF, ADV, MASK, CorrectionConfig(mask_level="none", dual_clip_c=3.0))
    d = correction_diagnostics(out)
    assert d["clip/dual_frac"] == pytest.approx(1 / 5) and d["clip/frac"] == pytest.approx(1 / 5)


def test_behavior_strategy_and_diagnose_pass_are_trivial():
    # old := inference: r_d = 1 everywhere; current := old (a diagnose pass): nothing clipped
    with torch.no_grad():
        out = decoupled_loss(INF, INF, INF, ADV, MASK, CorrectionConfig())
    d = correction_diagnostics(out)
    assert d["mask/token_kept_frac"] == 1.0 and d["active_frac"] == 1.0 and d["clip/frac"] == 0.0
    assert d["mismatch/k1"] == 0.0 and d["mismatch/k3"] == 0.0 and d["is/ess"] == 1.0


def test_empty_batch_and_errors():
    empty = torch.zeros(1, 2, dtype=torch.bool)
    out = decoupled_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), empty)
    d = correction_diagnostics(out, versions=torch.zeros(1, 2, dtype=torch.int32), trainer_version=0)
    assert all(math.isfinite(v) for v in d.values()) and d["active_frac"] == 0.0
    with pytest.raises(ValueError, match="trainer_version"):
        correction_diagnostics(out, versions=torch.zeros(1, 2, dtype=torch.int32))


def test_negative_lag_is_counted():
    d = correction_diagnostics(batch_output(), versions=VERSIONS, trainer_version=4)
    assert d["staleness/negative_count"] == 1.0


def test_split_variances_by_hand():
    from statistics import pvariance

    d = correction_diagnostics(batch_output())
    # loss tokens: log r_d = [ln 2, 0 | 0, ln 3, 0], log r_s = [0, ln 1.5 | ln 1.5, 0, ln 0.5]
    rd, rs = [ln(2), 0.0, 0.0, ln(3), 0.0], [0.0, ln(1.5), ln(1.5), 0.0, ln(0.5)]
    assert d["split/var_log_rd"] == pytest.approx(pvariance(rd), rel=1e-6)
    assert d["split/var_log_rs"] == pytest.approx(pvariance(rs), rel=1e-6)
    assert d["split/var_log_total"] == pytest.approx(pvariance([a + b for a, b in zip(rd, rs)]), rel=1e-6)


def test_gradient_agreement_by_hand():
    from trajflow.algorithms.diagnostics import gradient_agreement

    exact = torch.tensor([3.0, 4.0])  # norm 5
    same = gradient_agreement(exact.clone(), exact)
    assert same["grad/cos_vs_exact"] == 1.0 and same["grad/rel_err_vs_exact"] == 0.0  # identical old log-probs
    assert same["grad/norm"] == 5.0
    half = gradient_agreement(exact / 2, exact)  # same direction, half the length
    assert half["grad/cos_vs_exact"] == pytest.approx(1.0) and half["grad/rel_err_vs_exact"] == pytest.approx(0.5)
    turned = gradient_agreement(torch.tensor([-4.0, 3.0]), exact)  # orthogonal, same length
    assert turned["grad/cos_vs_exact"] == pytest.approx(0.0, abs=1e-12)
    assert turned["grad/rel_err_vs_exact"] == pytest.approx(math.sqrt(2))
    assert math.isnan(gradient_agreement(torch.zeros(2), exact)["grad/cos_vs_exact"])
    assert math.isnan(gradient_agreement(exact, torch.zeros(2))["grad/rel_err_vs_exact"])
