"""Distributions on a captured top-k support, against hand-computed values: TV and KL with the tail
bucket, the mask on them, Score Centering's estimator, the reverse-KL and forward-KL gradients of
distillation (autograd against the hand derivation), and the record's top-k columns (schema,
Parquet)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.algorithms.config import CorrectionConfig
from trajflow.algorithms.distillation import distillation_advantages, forward_kl_tokens
from trajflow.algorithms.distributions import (
    distribution_diagnostics,
    distribution_keep,
    support_kl,
    support_tv,
)
from trajflow.algorithms.objective import decoupled_loss
from trajflow.algorithms.score_centering import centering_coefficients, centering_term
from trajflow.operators.strategies.score_centering import ScoreCentering
from trajflow.schemas import (
    SchemaError,
    TopKSemantics,
    conform,
    from_rows,
    nonfinite_rows,
    read_parquet,
    top_k_semantics,
    validate,
    write_parquet,
)
from trajflow.schemas.columns import nested_array, nested_rows, padded_nested

LOG = math.log


def _lp(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float64))


# -- TV and KL on the support plus the tail ------------------------------------------------------
def test_tv_and_kl_on_a_small_support_by_hand():
    # equal tails (0.2 each): only the head differs
    p, q = _lp(0.5, 0.3), _lp(0.4, 0.4)
    assert float(support_tv(p, q)) == pytest.approx(0.5 * (0.1 + 0.1 + 0.0), abs=1e-12)
    assert float(support_kl(p, q)) == pytest.approx(0.5 * LOG(0.5 / 0.4) + 0.3 * LOG(0.3 / 0.4), abs=1e-12)
    # different tails: 0.1 against 0.3 is one bucket
    p, q = _lp(0.6, 0.3), _lp(0.5, 0.2)
    assert float(support_tv(p, q)) == pytest.approx(0.5 * (0.1 + 0.1 + 0.2), abs=1e-12)
    kl = 0.6 * LOG(0.6 / 0.5) + 0.3 * LOG(0.3 / 0.2) + 0.1 * LOG(0.1 / 0.3)
    assert float(support_kl(p, q)) == pytest.approx(kl, abs=1e-12)  # 0.1211712
    # lower bounds of the full-vocabulary values (the tail 0.1 = 0.05 + 0.05, 0.3 = 0.25 + 0.05)
    full_p, full_q = np.array([0.6, 0.3, 0.05, 0.05]), np.array([0.5, 0.2, 0.25, 0.05])
    full_kl = float((full_p * np.log(full_p / full_q)).sum())
    assert full_kl == pytest.approx(0.150561, abs=1e-6) and float(support_kl(p, q)) < full_kl
    assert float(support_tv(p, q)) <= 0.5 * np.abs(full_p - full_q).sum() + 1e-12
    # exact when the support holds every id (K = V): no tail
    assert float(support_kl(_lp(*full_p), _lp(*full_q))) == pytest.approx(full_kl, abs=1e-9)
    assert float(support_tv(p, p)) == 0.0 and float(support_kl(p, p)) == 0.0


def test_ids_outside_a_support_give_finite_values_and_gradients():
    inf = float("-inf")
    p = torch.tensor([LOG(0.5), LOG(0.3), inf], dtype=torch.float64)
    q = torch.tensor([LOG(0.5), inf, inf], dtype=torch.float64, requires_grad=True)
    kl = support_kl(p, q)
    # q cannot produce id 1: its share is the clamped log-ratio, large and finite, never inf/NaN
    assert math.isfinite(kl.item()) and kl.item() > 0.3 * 19
    assert float(support_tv(p, q.detach())) == pytest.approx(0.5 * (0.3 + abs(0.2 - 0.5)), abs=1e-12)
    kl.backward()
    assert torch.isfinite(q.grad).all()


def test_the_mask_on_distributions_by_token_and_by_sequence():
    distance = torch.tensor([[0.01, 0.20, 0.03], [0.02, 0.02, 0.00]])
    loss_mask = torch.tensor([[True, True, True], [True, True, False]])
    token = distribution_keep(distance, loss_mask, 0.1, "token")
    assert token.tolist() == [[True, False, True], [True, True, False]]
    sequence = distribution_keep(distance, loss_mask, 0.07, "sequence")  # means 0.08 and 0.02
    assert sequence.tolist() == [[False, False, False], [True, True, False]]
    # in the objective it joins the r_d mask: a dropped token leaves the kept set and the count
    current = torch.zeros(2, 3, requires_grad=True)
    out = decoupled_loss(current, current.detach(), current.detach(), torch.ones(2), loss_mask,
                         CorrectionConfig(mask_level="none"), distribution_keep=token)
    assert out.discrepancy_mask.tolist() == token.tolist() and float(out.count) == 4.0


def test_diagnostics_report_tv_kl_and_the_support_mass():
    sampler = _lp(0.6, 0.3)[None, None].float().expand(1, 2, 2)
    old = _lp(0.5, 0.2)[None, None].float().expand(1, 2, 2)
    d = distribution_diagnostics(sampler, old, torch.tensor([[True, True]]))
    assert d["mismatch/tv"] == pytest.approx(0.2, abs=1e-6) and d["mismatch/tv_max"] == pytest.approx(0.2, abs=1e-6)
    assert d["mismatch/kl_support"] == pytest.approx(0.1211712, abs=1e-6)
    assert d["mismatch/support_mass"] == pytest.approx(0.9, abs=1e-6)
    assert set(distribution_diagnostics(sampler, None, torch.tensor([[True, True]]))) == {"mismatch/support_mass"}


# -- Score Centering ----------------------------------------------------------------------------
def _c(current, old, sampler, **kw):
    as_k = lambda x: _lp(*x)[None, None]  # noqa: E731 - [1, 1, K]
    return centering_coefficients(as_k(current), as_k(old), as_k(sampler), **kw)[0, 0].tolist()


def test_score_centering_coefficients_by_hand():
    # on-policy, no TIS: c = q - alpha p on the head, alpha = q_tail / p_tail = 0.1 / 0.2
    assert _c((0.5, 0.3), (0.5, 0.3), (0.5, 0.4)) == pytest.approx([0.25, 0.25], abs=1e-12)
    # the whole vocabulary recorded (the paper's logit check): both tails empty (floored alike), alpha
    # = 1 and c = q - p; its gradient on the logits, sum_v c_v (e_v - p), is the uncentred mean q - p
    full = _c((0.6, 0.4), (0.6, 0.4), (0.5, 0.5))
    assert full == pytest.approx([-0.1, 0.1], abs=1e-9)
    p = torch.tensor([0.6, 0.4], dtype=torch.float64)
    assert (torch.tensor(full, dtype=torch.float64) - sum(full) * p).tolist() == pytest.approx([-0.1, 0.1], abs=1e-9)
    # token TIS, cap 1.1: W = min(p/q, C) = (1, 0.75) on the head, min(1/alpha, C) = 1.1 on the tail
    tis = _c((0.5, 0.3), (0.5, 0.3), (0.5, 0.4), tis_cap=1.1)
    assert tis == pytest.approx([0.5 * 1.0 - 0.5 * 1.1 * 0.5, 0.4 * 0.75 - 0.5 * 1.1 * 0.3], abs=1e-12)
    # off-policy (exact pi_old != pi_theta): W = r_s = p / o per candidate, the tail's (1-P)/(1-O)
    off = _c((0.5, 0.3), (0.4, 0.4), (0.5, 0.4))
    assert off == pytest.approx([0.5 * 1.25 - 0.5 * 1.0 * 0.5, 0.4 * 0.75 - 0.5 * 1.0 * 0.3], abs=1e-12)


def test_score_centering_gradient_is_the_centred_score():
    """One token, V = 3, the head = ids 0 and 1 (one tail id, so the tail model is exact):
    the objective's gradient must be -A (s_a - E_q[s]) = -A (e_a - q) on the logits."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.5, 0.4, 0.1])
    z = torch.log(p).clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    a, advantage = 1, 0.7
    current = logp[a].reshape(1, 1)
    current_top_k = logp[:2].reshape(1, 1, 2)
    mask = torch.ones(1, 1, dtype=torch.bool)
    strategy = ScoreCentering()
    config = strategy.correction(CorrectionConfig(mask_level="none"))
    out = decoupled_loss(current, current.detach(), torch.log(q[a]).reshape(1, 1), torch.tensor([advantage]), mask,
                         config)
    batch = SimpleNamespace(top_k_old=current_top_k.detach(), top_k_inference=torch.log(q[:2]).reshape(1, 1, 2))
    loss = out.loss_sum + strategy.extra_loss(batch, current_top_k, out, torch.tensor([advantage]), config)
    loss.backward()
    expected = -advantage * (torch.eye(3)[a] - q)
    assert torch.allclose(z.grad, expected, atol=1e-6), (z.grad, expected)
    # without the centering term the gradient is the uncentred -A (e_a - p)
    z.grad = None
    out = decoupled_loss(torch.log_softmax(z, -1)[a].reshape(1, 1), current.detach(), torch.log(q[a]).reshape(1, 1),
                         torch.tensor([advantage]), mask, config)
    out.loss_sum.backward()
    assert torch.allclose(z.grad, -advantage * (torch.eye(3)[a] - p), atol=1e-6)


def test_centering_term_ignores_ids_the_policy_cannot_produce():
    current = torch.tensor([[[LOG(0.5), float("-inf")]]], requires_grad=True)
    term = centering_term(current, torch.tensor([[[0.3, 0.2]]], dtype=torch.float64))
    assert term.item() == pytest.approx(0.3 * LOG(0.5))
    term.backward()
    assert current.grad.tolist() == [[[pytest.approx(0.3), 0.0]]]


# -- distillation's gradients -------------------------------------------------------------------
def test_reverse_kl_gradient_per_sampled_token_and_in_expectation():
    """The reverse-KL advantage A = -(log pi(x) - log T(x)) through the policy term: its gradient
    on the logits is (log pi(x) - log T(x)) (e_x - pi) per token (hand derivation), and its
    expectation over x ~ pi is the gradient of the exact KL(pi || T)."""
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    expected_total = torch.zeros(5, dtype=torch.float64)
    pi = torch.softmax(z, -1).detach()
    for x in range(5):
        logp = torch.log_softmax(z, -1)
        current = logp[x].reshape(1, 1)
        advantages = distillation_advantages(current.detach(), teacher[x].reshape(1, 1), torch.zeros(1), 1.0, 0.0)
        out = decoupled_loss(current, current.detach(), current.detach(), advantages, mask,
                             CorrectionConfig(mask_level="none"))
        (grad,) = torch.autograd.grad(out.loss_sum, z)
        hand = (float(logp[x] - teacher[x])) * (torch.eye(5, dtype=torch.float64)[x] - pi)
        assert torch.allclose(grad, hand, atol=1e-12)
        expected_total += pi[x] * grad
    exact = torch.autograd.grad((torch.softmax(z, -1) * (torch.log_softmax(z, -1) - teacher)).sum(), z)[0]
    assert torch.allclose(expected_total, exact, atol=1e-12)


def test_reverse_kl_student_current_or_old_and_the_task_advantage():
    student, old, teacher = torch.tensor([[-1.0]]), torch.tensor([[-0.5]]), torch.tensor([[-2.0]])
    assert distillation_advantages(student, teacher, torch.tensor([0.4]), 2.0, 0.0).item() == pytest.approx(-2.0)
    assert distillation_advantages(old, teacher, torch.tensor([0.4]), 2.0, 0.0).item() == pytest.approx(-3.0)
    assert distillation_advantages(student, teacher, torch.tensor([0.4]), 2.0, 0.5).item() == pytest.approx(-1.8)
    # a token the teacher cannot produce: no advantage (it leaves the loss anyway)
    assert distillation_advantages(student, torch.tensor([[float("-inf")]]), torch.zeros(1), 1.0, 0.0).item() == 0.0


def test_forward_kl_gradient_on_the_top_k_support():
    """KL(T || pi) on S = ids {0, 1, 2} of V = 5 plus the tail: d/dz_j = pi_j - T_j [j in S]
    - T_tail pi_j / pi_tail [j not in S] (hand derivation), and its value by hand."""
    torch.manual_seed(1)
    z = torch.randn(5, dtype=torch.float64, requires_grad=True)
    t = torch.softmax(torch.randn(5, dtype=torch.float64), -1)
    support = [0, 1, 2]
    logp = torch.log_softmax(z, -1)
    kl = forward_kl_tokens(torch.log(t[support]).reshape(1, 1, 3), logp[support].reshape(1, 1, 3))
    pi = torch.softmax(z, -1).detach()
    t_tail, pi_tail = t[3:].sum(), pi[3:].sum()
    by_hand = float((t[support] * torch.log(t[support] / pi[support])).sum() + t_tail * torch.log(t_tail / pi_tail))
    assert float(kl) == pytest.approx(by_hand, abs=1e-12)
    kl.sum().backward()
    in_support = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    hand = pi - t * in_support - t_tail * pi / pi_tail * (1 - in_support)
    assert torch.allclose(z.grad, hand, atol=1e-12)


# -- the record ---------------------------------------------------------------------------------
def _row(k: int = 2, **overrides) -> dict:
    row = {
        "trajectory_id": "s0-p0-n0", "group_id": "s0-p0", "prompt_id": "p0", "prompt_tokens": [1, 5],
        "response_tokens": [7, 8, 2], "loss_mask": [True] * 3, "inference_logprobs": [-0.5, -0.25, -0.1],
        "versions": [0, 0, 0], "old_logprobs": None, "finish_reason": "stop", "reward": 1.0, "advantage": 0.0,
        "top_k_ids": [[7, 3], [8, 1], [2, 4]][: 3] if k == 2 else [[7, 3, 9]] * 3,
        "top_k_inference_logprobs": [[-0.5, -1.5], [-0.25, -2.0], [-0.1, float("-inf")]] if k == 2
        else [[-0.5, -1.5, -3.0]] * 3,
    }
    row.update(overrides)
    return row


def _table(rows: list[dict], vocab: int = 64, k: int = 2) -> pa.Table:
    types = {"top_k_ids": pa.list_(pa.list_(pa.int32())), "teacher_logprobs": pa.list_(pa.float32())}
    names = [c for c in rows[0] if c.startswith("top_k_") or c == "teacher_logprobs"]
    base = from_rows([{c: v for c, v in r.items() if c not in names} for r in rows], check=False)
    for name in names:
        base = base.append_column(name, pa.array([r[name] for r in rows],
                                                 types.get(name, pa.list_(pa.list_(pa.float32())))))
    return conform(base, top_k=TopKSemantics(k, vocab))


def test_top_k_columns_validate_and_read_back_from_parquet(tmp_path):
    table = _table([_row(), _row(top_k_old_logprobs=None), _row(top_k_old_logprobs=[[-0.5, -1.4], [-0.3, float("-inf")],
                                                                                     [-0.1, -3.0]],
                                                                teacher_logprobs=[-1.0, float("-inf"), -0.2])])
    validate(table)  # -inf allowed on every distribution column, null rows allowed
    path = write_parquet(table, tmp_path / "t.parquet")
    back = read_parquet(path)
    assert top_k_semantics(back) == TopKSemantics(2, 64)
    assert back["top_k_ids"].to_pylist() == table["top_k_ids"].to_pylist()
    assert back["top_k_old_logprobs"].to_pylist()[1] is None
    rows = nested_rows(back["top_k_inference_logprobs"])
    assert rows[0].shape == (3, 2) and rows[0][2, 1] == float("-inf")
    assert padded_nested(back["top_k_ids"], 4, 0, np.int64).shape == (3, 4, 2)
    again = nested_array(nested_rows(back["top_k_old_logprobs"]), pa.float32(), 2)
    assert again.to_pylist() == back["top_k_old_logprobs"].to_pylist()


@pytest.mark.parametrize("change, column, fragment", [
    (dict(top_k_ids=[[7, 3], [8, 1]]), "top_k_ids", "length 2 != len(response_tokens) 3"),
    (dict(top_k_ids=[[7, 3], [8, 1, 5], [2, 4]]), "top_k_ids", "3 entries at token 1, expected K = 2"),
    (dict(top_k_ids=[[7, 3], [8, 64], [2, 4]]), "top_k_ids", "id 64 outside the vocabulary [0, 64)"),
    (dict(top_k_inference_logprobs=[[-0.5, -1.5], [float("nan"), -2.0], [-0.1, -3.0]]),
     "top_k_inference_logprobs", "non-finite value nan at token 1"),
    (dict(top_k_old_logprobs=[[-0.5, float("inf")], [-0.3, -1.0], [-0.1, -3.0]]), "top_k_old_logprobs",
     "non-finite value inf at token 0"),
    (dict(teacher_logprobs=[-1.0, float("nan"), -0.2]), "teacher_logprobs", "non-finite value nan at token 1"),
    (dict(teacher_logprobs=[-1.0]), "teacher_logprobs", "length 1 != len(response_tokens) 3"),
])
def test_a_bad_top_k_column_is_an_error_naming_it(change, column, fragment):
    table = _table([_row(), _row(**change)])
    with pytest.raises(SchemaError, match=f"column '{column}' row 1") as e:
        validate(table)
    assert fragment in str(e.value) and e.value.column == column
    if "non-finite" in fragment:
        assert nonfinite_rows(table).tolist() == [False, True]  # quarantinable, like the other log-probs


def test_log_probs_need_their_ids():
    table = _table([_row()]).drop_columns(["top_k_ids"])
    with pytest.raises(SchemaError, match="column 'top_k_inference_logprobs'.*needs the column top_k_ids"):
        validate(table)
    table = _table([_row(), _row()])
    table = table.set_column(table.schema.get_field_index("top_k_ids"), "top_k_ids",
                             pa.array([None, [[7, 3], [8, 1], [2, 4]]], pa.list_(pa.list_(pa.int32()))))
    with pytest.raises(SchemaError, match="column 'top_k_inference_logprobs' row 0: log-probs on a row without"):
        validate(table)
