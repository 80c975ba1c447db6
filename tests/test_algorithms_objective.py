"""Hand-computed values for the decoupled objective: a few tokens, written out."""

import dataclasses
import math
import warnings

import pytest
import torch

from trajflow.algorithms import CorrectionConfig, KLConfig, ReferenceKL, WholeUpdate, decoupled_loss
from trajflow.deprecations import TrajflowDeprecation

ln = math.log


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# The hand-computed cases below assume a token-level mask and a symmetric 0.2 clip.
TOKEN_LEVEL = dict(mask_level="token", eps_high=0.2)


def run(cur, old, inf, adv, mask=None, **cfg):
    """Loss output and d loss / d current_logprobs."""
    cur = t(cur).requires_grad_(True)
    old, inf, adv = t(old), t(inf), t(adv)
    mask = torch.ones_like(cur, dtype=torch.bool) if mask is None else torch.tensor(mask)
    out = decoupled_loss(cur, old, inf, adv, mask, CorrectionConfig(**{**TOKEN_LEVEL, **cfg}))
    out.loss.backward()
    return out, cur.grad


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32), atol=tol)


# ---- discrepancy mask ---------------------------------------------------------------------------

def test_token_mask_keeps_inside_symmetric_interval():
    # log r_d = [0, ln 3, -ln 1.5, ln 1.9], c = 2: ln 3 > ln 2 is dropped, the others kept.
    log_rd = [[0.0, ln(3), -ln(1.5), ln(1.9)]]
    out, grad = run(cur=log_rd, old=log_rd, inf=[[0.0] * 4], adv=[1.0], mask_level="token", mask_c_token=2.0)
    assert out.discrepancy_mask.tolist() == [[True, False, True, True]]
    # r_s = 1, A = 1 on 3 kept tokens: loss = -(1 + 1 + 1) / 3
    assert close(out.loss, -1.0)
    assert grad.tolist()[0][1] == 0.0 and close(grad, [[-1 / 3, 0, -1 / 3, -1 / 3]])


def test_token_mask_respects_loss_mask():
    log_rd = [[0.0, ln(3), -ln(1.5), ln(1.9)]]
    out, grad = run(log_rd, log_rd, [[0.0] * 4], [1.0], mask=[[True, True, True, False]], mask_c_token=2.0)
    assert out.discrepancy_mask.tolist() == [[True, False, True, False]]
    assert close(out.loss, -1.0)
    assert close(grad, [[-0.5, 0, -0.5, 0]]) and grad[0, 3].item() == 0.0


def test_sequence_mask_uses_geometric_mean():
    # c_seq = 1.003 (log c = 0.0029955).
    # seq 0: log r_d = [0.01, -0.01], mean 0: kept although each token is outside [1/c, c]
    # seq 1: log r_d = [0.002, 0.006], mean 0.004 > 0.0029955: the whole sequence is dropped
    log_rd = [[0.01, -0.01], [0.002, 0.006]]
    out, grad = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="sequence", mask_c_seq=1.003)
    assert out.discrepancy_mask.tolist() == [[True, True], [False, False]]
    assert close(out.loss, -1.0)
    assert close(grad, [[-0.5, -0.5], [0, 0]])
    # the same data at token level with c = 1.003 keeps only the 0.002 token
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]] * 2, [1.0, 1.0], mask_level="token", mask_c_token=1.003)
    assert out.discrepancy_mask.tolist() == [[False, False], [True, False]]


def test_sequence_mask_ignores_non_loss_tokens():
    # the padded token's huge log r_d must not enter the geometric mean
    out, _ = run([[0.001, 5.0]], [[0.001, 5.0]], [[0.0, 0.0]], [1.0], mask=[[True, False]],
                 mask_level="sequence", mask_c_seq=1.003)
    assert out.discrepancy_mask.tolist() == [[True, False]]


def test_mask_none_keeps_every_loss_token():
    log_rd = [[ln(100.0), -ln(100.0)]]
    out, _ = run(log_rd, log_rd, [[0.0, 0.0]], [1.0], mask_level="none")
    assert out.discrepancy_mask.all()


def test_tis_weight_is_truncated_and_detached():
    # log r_d = [ln 3, ln 0.5], c = 4 keeps both; C = 2: w = [min(3, 2), 0.5] = [2, 0.5]
    log_rd = [[ln(3), ln(0.5)]]
    out, grad = run(log_rd, log_rd, [[0.0, 0.0]], [1.0], mask_c_token=4.0, tis_cap=2.0)
    assert close(out.is_weights, [[2.0, 0.5]])
    assert close(out.loss, -(2.0 + 0.5) / 2)
    # d/d cur of -w r_s A / 2 with r_s = 1: -w / 2 (w itself carries no gradient)
    assert close(grad, [[-1.0, -0.25]])


def test_tis_off_by_default():
    out, _ = run([[ln(3)]], [[ln(3)]], [[0.0]], [1.0], mask_c_token=4.0)
    assert out.is_weights.tolist() == [[1.0]]


# ---- staleness clip -------------------------------------------------------------------------------

def test_token_clip_is_sign_aware():
    # r_s = [1.5, 1.5, 0.5, 0.5], A = [+1, -1, +1, -1], eps = 0.2
    # min(rA, clip(r)A) = [1.2 (clipped high), -1.5, 0.5, -0.8 (clipped low)]
    cur = [[ln(1.5), ln(1.5), ln(0.5), ln(0.5)]]
    out, grad = run(cur, [[0.0] * 4], [[0.0] * 4], [[1.0, -1.0, 1.0, -1.0]])
    assert out.clipped_high.tolist() == [[True, False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, False, True]]
    assert out.active.tolist() == [[False, True, True, False]]
    assert close(out.loss, -(1.2 - 1.5 + 0.5 - 0.8) / 4)
    # unclipped tokens: d(-r A / 4)/d log pi = -r A / 4
    assert close(grad, [[0.0, 1.5 / 4, -0.5 / 4, 0.0]])
    assert grad[0, 0].item() == 0.0 and grad[0, 3].item() == 0.0


def test_token_clip_asymmetric_bounds():
    # eps_low = 0.1, eps_high = 0.3: clipped values become 1.3 and -0.9
    cur = [[ln(1.5), ln(0.5)]]
    out, _ = run(cur, [[0.0] * 2], [[0.0] * 2], [[1.0, -1.0]], eps_low=0.1, eps_high=0.3)
    assert close(out.loss, -(1.3 - 0.9) / 2)
    # r = 1.25 with eps_high = 0.3 is inside: not clipped
    out, _ = run([[ln(1.25)]], [[0.0]], [[0.0]], [1.0], eps_low=0.1, eps_high=0.3)
    assert not out.clipped_high.any() and close(out.loss, -1.25)


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -1, c = 3. r = 5: min(-5, -1.2) = -5, max(-5, -3) = -3 -> loss 3, no gradient.
    #               r = 2: min(-2, -1.2) = -2, max(-2, -3) = -2 -> loss 2, gradient -rA = 2.
    cur = [[ln(5.0), ln(2.0)]]
    out, grad = run(cur, [[0.0] * 2], [[0.0] * 2], [-1.0], dual_clip_c=3.0)
    assert out.dual_clipped.tolist() == [[True, False]]
    assert close(out.loss, (3.0 + 2.0) / 2)
    assert close(grad, [[0.0, 1.0]]) and grad[0, 0].item() == 0.0
    # without dual clip the r = 5 token costs 5
    out, _ = run(cur, [[0.0] * 2], [[0.0] * 2], [-1.0])
    assert close(out.loss, (5.0 + 2.0) / 2)


def test_sequence_clip_uses_geometric_mean_with_per_token_gradient():
    # seq 0: log r_s = [ln 2, 0] -> s = sqrt(2) = 1.414 > 1.2, A = +1: both tokens clipped to 1.2
    # seq 1: log r_s = [0.1, -0.1] -> s = 1, A = +2: unclipped, each token's grad = -s A / 4
    cur = [[ln(2.0), 0.0], [0.1, -0.1]]
    out, grad = run(cur, [[0.0] * 2] * 2, [[0.0] * 2] * 2, [1.0, 2.0], clip_level="sequence")
    assert close(out.log_rs, [[ln(2) / 2] * 2, [0.0, 0.0]])
    assert out.clipped_high.tolist() == [[True, True], [False, False]]
    assert close(out.loss, -(1.2 + 1.2 + 2.0 + 2.0) / 4)
    assert close(grad, [[0.0, 0.0], [-0.5, -0.5]])


def test_sequence_clip_gradient_is_gspo_token():
    # unclipped sequence with s = exp(mean(0.05, 0.15)) = e^0.1: d loss / d log pi_t = -s A / N
    cur = [[0.05, 0.15]]
    out, grad = run(cur, [[0.0, 0.0]], [[0.0, 0.0]], [1.0], clip_level="sequence")
    s = math.exp(0.1)
    assert close(out.loss, -s)
    assert close(grad, [[-s / 2, -s / 2]])


def test_paper_config_bounds_both_factors_at_sequence_level():
    cfg = CorrectionConfig.paper(c_ti=1.003, c_stale=1.004)
    assert cfg.mask_level == "sequence" and cfg.clip_level == "sequence"
    assert math.isclose(1 - cfg.eps_low, 1 / 1.004) and math.isclose(1 + cfg.eps_high, 1.004)
    zeros = [[0.0, 0.0]] * 4
    # r_d geometric means 1.0029 (kept), 1.0031 (dropped), 1/1.0029 (kept), 1/1.0031 (dropped)
    log_rd = [[ln(1.0029)] * 2, [ln(1.0031)] * 2, [-ln(1.0029)] * 2, [-ln(1.0031)] * 2]
    out = decoupled_loss(t(log_rd), t(log_rd), t(zeros), t([1.0] * 4), torch.ones(4, 2, dtype=torch.bool), cfg)
    assert out.discrepancy_mask[:, 0].tolist() == [True, False, True, False]
    # r_s geometric means 1.0039 / 1.0041 with A > 0; 1/1.0039 / 1/1.0041 with A < 0
    cur = [[ln(1.0039)] * 2, [ln(1.0041)] * 2, [-ln(1.0039)] * 2, [-ln(1.0041)] * 2]
    out = decoupled_loss(t(cur), t(zeros), t(zeros), t([1.0, 1.0, -1.0, -1.0]), torch.ones(4, 2, dtype=torch.bool), cfg)
    assert out.clipped_high[:, 0].tolist() == [False, True, False, False]
    assert out.clipped_low[:, 0].tolist() == [False, False, False, True]


# ---- aggregation ----------------------------------------------------------------------------------

AGG_MASK = [[True, False, False], [True, True, True]]
AGG_ADV = [[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]]  # per-token advantages, r_s = 1: per-token loss = -A


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (dict(aggregation="token-mean"), -(4 + 1 + 2 + 3) / 4),
        (dict(aggregation="seq-mean-token-mean"), -(4 + (1 + 2 + 3) / 3) / 2),
        (dict(aggregation="token-sum-norm", loss_norm_tokens=5), -(4 + 1 + 2 + 3) / (5 * 2)),
        (dict(aggregation="token-sum-norm"), -(4 + 1 + 2 + 3) / (3 * 2)),  # default: padded width T
    ],
)
def test_aggregations(cfg, expected):
    zeros = [[0.0] * 3] * 2
    out, grad = run(zeros, zeros, zeros, AGG_ADV, mask=AGG_MASK, **cfg)
    assert close(out.loss, expected)
    # the sum form and its count, divided once: token weights are the sum form's
    assert close(-(out.token_weights * t(AGG_ADV)).sum(), out.loss_sum)
    assert close(out.loss_sum / out.count, expected)
    assert (grad[~torch.tensor(AGG_MASK)] == 0).all()


def test_aggregation_skips_fully_masked_sequences():
    # seq 1 is dropped by the mask: seq-mean-token-mean averages over seq 0 only
    old = [[0.0, 0.0], [ln(10.0), ln(10.0)]]
    out, _ = run([[0.0] * 2] * 2, old, [[0.0] * 2] * 2, [[1.0, 3.0], [5.0, 5.0]],
                 aggregation="seq-mean-token-mean", mask_c_token=2.0, mask_level="token")
    # cur - old = -ln 10 on seq 1, but it is masked; seq 0: r_s = 1, loss = -(1 + 3) / 2
    assert close(out.loss, -2.0)


def test_clip_level_none_never_clips():
    # r_s = 3 with A > 0 and r_s = 0.1 with A < 0: both would be clipped at token level
    out, grad = run([[ln(3), ln(0.1)]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]], clip_level="none")
    assert not (out.clipped_low | out.clipped_high).any() and out.active.all()
    assert close(out.loss, -(3 * 1 + 0.1 * -1) / 2)                # -(r A) token-mean, unbounded
    assert close(grad, [[-3 / 2, 0.1 / 2]])                         # d(-r A / 2)/d log pi = -r A / 2


def test_trust_mask_keeps_masked_tokens_in_the_denominator_without_gradient():
    # M2PO-style: token 1 outside the trust mask contributes nothing, the loss still divides by 2
    cur = t([[0.0, ln(2)]]).requires_grad_(True)
    out = decoupled_loss(cur, t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([1.0]), torch.ones(1, 2, dtype=torch.bool),
                         CorrectionConfig(clip_level="none"), trust_mask=torch.tensor([[True, False]]))
    out.loss.backward()
    assert close(out.loss, -1 / 2) and close(cur.grad, [[-1 / 2, 0.0]])
    assert out.trust_masked.tolist() == [[False, True]] and out.active.tolist() == [[True, False]]
    assert close(out.log_rs_token, [[0.0, ln(2)]])
    with pytest.raises(TypeError, match="trust_mask"):
        decoupled_loss(cur, cur, cur, t([1.0]), torch.ones(1, 2, dtype=torch.bool), trust_mask=torch.ones(1, 2))


def test_everything_masked_gives_zero_loss_with_graph():
    cur = torch.zeros(1, 2, requires_grad=True)
    out = decoupled_loss(cur, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.zeros(1, 2, dtype=torch.bool))
    out.loss.backward()
    assert out.loss.item() == 0.0 and (cur.grad == 0).all()


# ---- config validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "field, value",
    [
        ("mask_level", "tokens"),
        ("clip_level", "nothing"),
        ("aggregation", "mean"),
        ("mask_c_token", 0.5),
        ("mask_c_seq", float("inf")),
        ("tis_cap", 0.0),
        ("eps_low", 1.5),  # 1.0 is allowed: no lower bound (CISPO as SkyRL and TRL)
        ("eps_low", -0.1),
        ("eps_high", -0.1),
        ("dual_clip_c", 1.0),
        ("loss_norm_tokens", 0),
        ("tis_cap", True),  # a boolean is never a number, in the library as in YAML
        ("mask_c_token", True),
        ("loss_norm_tokens", False),
        ("eps_high", "0.2"),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"CorrectionConfig.{field}"):
        CorrectionConfig(**{field: value})


def test_config_is_frozen():
    with pytest.raises(Exception):
        CorrectionConfig().eps_low = 0.3  # type: ignore[misc]


def test_shape_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        decoupled_loss(x, torch.zeros(2, 4), x, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="loss_mask"):
        decoupled_loss(x, x, x, torch.zeros(2), torch.ones(2, 3))


def test_the_old_arguments_give_the_same_loss_with_one_notice_each():
    """reference_logprobs/kl and denominator/groups/group_counts/cov_selected as keywords, trust_mask
    and denominator by position: the numbers of ReferenceKL and WholeUpdate, bit for bit, for one
    release (a TrajflowDeprecation per old name)."""
    torch.manual_seed(0)
    cur, old, inf, ref = (torch.randn(4, 5) * 0.3 for _ in range(4))
    adv, mask = torch.randn(4), torch.rand(4, 5) > 0.2
    trust, selected = torch.rand(4, 5) > 0.3, torch.rand(4, 5) > 0.7
    groups, counts, kl = torch.tensor([0, 0, 1, 1]), torch.tensor([9.0, 9.0, 6.0, 6.0]), KLConfig(beta=0.1)
    config = CorrectionConfig(loss="clip_cov", mask_level="token", aggregation="prompt-mean", entropy_coef=0.01)

    def loss(*args, **kwargs):
        current = cur.clone().requires_grad_(True)
        out = decoupled_loss(current, old, inf, adv, mask, config, *args, entropy=-cur, **kwargs)
        out.loss.backward()
        return out, current.grad

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form: no notice
        whole = WholeUpdate(denominator=7.0, groups=groups, group_counts=counts, cov_selected=selected)
        new, new_grad = loss(trust_mask=trust, reference=ReferenceKL(ref, kl), whole=whole)
    renamed = dict(reference_logprobs=ref, kl=kl, groups=groups, group_counts=counts, cov_selected=selected)
    for args, kwargs, by_position in [((), dict(trust_mask=trust, denominator=7.0, **renamed), []),
                                      ((trust, 7.0), renamed, ["trust_mask", "denominator"])]:
        with pytest.warns(TrajflowDeprecation) as caught:
            out, grad = loss(*args, **kwargs)
        expected = [f"decoupled_loss(): {name} by position" for name in by_position]
        expected += [f"decoupled_loss({name}=...)" for name in kwargs if name != "trust_mask"]
        assert [str(w.message).split(": use ")[0] for w in caught] == expected
        assert all(w.filename == __file__ for w in caught)  # the notice points at the caller
        for field in dataclasses.fields(new):
            assert torch.equal(getattr(out, field.name), getattr(new, field.name)), field.name
        assert torch.equal(grad, new_grad)
    # every group reached the loss: the count, the selection, the KL and the trust mask given
    assert new.count.item() == 7.0 and new.cov_selected.any() and not (new.cov_selected & ~selected).any()
    assert new.kl.any() and new.trust_masked.any()
    with pytest.raises(TypeError, match="unexpected keyword argument 'denominatr'"):
        loss(denominatr=7.0)
    with pytest.raises(TypeError, match=r"denominator is part of whole= \(WholeUpdate\)"):
        loss(denominator=7.0, whole=WholeUpdate(groups=groups))
    with pytest.raises(TypeError, match=r"kl is part of reference= \(ReferenceKL\)"):
        loss(kl=kl, reference=ReferenceKL(ref, kl))
    with pytest.raises(TypeError, match="multiple values for argument 'trust_mask'"):
        loss(trust, trust_mask=trust)
    with pytest.raises(TypeError, match="from 5 to 8 positional arguments but 9 were given"):
        loss(trust, 7.0, None)
