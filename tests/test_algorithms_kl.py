"""KL estimators to a reference model, the KL in the reward, and the metric."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import KL_ESTIMATORS, kl_estimate, kl_metrics, kl_penalized_rewards

# x = log pi - log pi_ref = [0.5, -1, 0, 30 (clamped to 20)]
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
REF = torch.tensor([[-1.5, -1.0, -0.5, -31.0]])
X = [0.5, -1.0, 0.0, 20.0]


@pytest.mark.parametrize("estimator, value", [
    ("k1", lambda x: x),
    ("k2", lambda x: 0.5 * x * x),
    ("k3", lambda x: math.exp(-x) - 1 + x),
    ("low_var", lambda x: min(math.exp(-x) - 1 + x, 10.0)),
    ("abs", abs),
])
def test_estimators_by_hand(estimator, value):
    assert torch.allclose(kl_estimate(LOGP, REF, estimator), torch.tensor([[value(x) for x in X]]), rtol=1e-6)


def test_low_var_is_verls_clamped_k3():
    # x = -3: k3 = e^3 - 1 - 3 = 16.09 -> 10 (veRL's low_var_kl clamps to [-10, 10])
    logp = torch.tensor([-3.0])
    assert kl_estimate(logp, torch.zeros(1), "k3").item() == pytest.approx(math.exp(3) - 4, rel=1e-6)
    assert kl_estimate(logp, torch.zeros(1), "low_var").item() == 10.0


def test_gradients_by_hand_and_none_through_the_reference():
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_estimate(logp, ref, "k3").sum().backward()
    # d/dx (e^-x - 1 + x) = 1 - e^-x; the clamped token (x = 30 -> 20) gets none
    assert torch.allclose(logp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e, 0.0, 0.0]]), rtol=1e-6)
    assert ref.grad is None
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(LOGP, REF, "k4")


def test_kl_in_the_reward_is_verls_summed_token_penalty():
    # row 0: k1 over its 2 loss tokens = 0.5 - 1 = -0.5 -> 1 - 0.1 * -0.5; row 1: no loss tokens
    kl = kl_estimate(LOGP, REF, "k1").expand(2, 4)
    mask = torch.tensor([[True, True, False, False], [False] * 4])
    out = kl_penalized_rewards(torch.tensor([1.0, 0.0]), kl, mask, beta=0.1)
    assert torch.allclose(out, torch.tensor([1.05, 0.0]))
    assert kl_metrics(kl, mask) == {"kl/mean": pytest.approx(-0.25)}
    assert kl_metrics(kl, torch.zeros_like(mask)) == {"kl/mean": 0.0}
    with pytest.raises(ValueError, match="do not line up"):
        kl_penalized_rewards(torch.tensor([1.0]), kl, mask, beta=0.1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e4, 0.0, allow_subnormal=False), st.floats(-1e4, 0.0, allow_subnormal=False)),
                min_size=1, max_size=20), st.sampled_from(KL_ESTIMATORS))
def test_estimator_properties(pairs, estimator):
    logp = torch.tensor([p for p, _ in pairs]).requires_grad_(True)
    ref = torch.tensor([r for _, r in pairs])
    kl = kl_estimate(logp, ref, estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    if estimator not in ("k1", "k1+"):  # the others are non-negative, zero exactly where pi = pi_ref
        assert (kl >= 0).all()
    assert (kl[logp.detach() == ref] == 0).all()
    if estimator in ("low_var", "low_var+"):
        assert (kl <= 10.0).all()
