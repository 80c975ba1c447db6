"""Proximal ("old") log-probs per strategy, hand-computed."""

import math

import pytest
import torch

from trajflow.algorithms import (
    STRATEGIES,
    behavior_logprobs,
    format_strategies,
    linear_logprobs,
    loglinear_alpha,
    loglinear_logprobs,
    proximal_logprobs,
    recompute_logprobs,
)

CUR = torch.tensor([[-1.0, -2.0]], requires_grad=True)
INF = torch.tensor([[-2.0, -2.5]])


def test_strategy_table_names_all_seven():
    assert list(STRATEGIES) == ["snapshot", "dedicated", "interrupt", "ewma", "recompute", "behavior", "loglinear"]
    kinds = {name: s.kind for name, s in STRATEGIES.items()}
    assert [n for n, k in kinds.items() if k == "exact"] == ["snapshot", "dedicated", "interrupt"]
    assert kinds["ewma"] == "approximate"
    assert {kinds[n] for n in ("recompute", "behavior", "loglinear")} == {"baseline"}
    text = format_strategies()
    assert all(name in text for name in STRATEGIES) and len(text.splitlines()) == 7


def test_behavior_is_inference():
    out = behavior_logprobs(INF)
    assert torch.equal(out, INF)


def test_recompute_is_the_given_pre_update_scores_detached():
    out = recompute_logprobs(CUR)
    assert torch.equal(out, CUR.detach()) and not out.requires_grad


def test_loglinear_interpolates_in_log_space():
    # alpha = 0.5: -2 + 0.5 (-1 + 2) = -1.5 ; -2.5 + 0.5 (-2 + 2.5) = -2.25
    out = loglinear_logprobs(CUR, INF, 0.5)
    assert torch.allclose(out, torch.tensor([[-1.5, -2.25]])) and not out.requires_grad
    assert torch.equal(loglinear_logprobs(CUR, INF, 0.0), INF)          # alpha 0: prox = mu
    assert torch.equal(loglinear_logprobs(CUR, INF, 1.0), CUR.detach())  # alpha 1: prox = current


def test_loglinear_alpha_from_versions():
    # v_theta = 5, v_prox = 4: alpha = (4 - v) / (5 - v)
    # v = 4 (on-policy) -> 0; v = 3 -> 1/2; v = 1 -> 3/4; v = 5 (edge: v_theta == v_behav) -> 1
    alpha = loglinear_alpha(torch.tensor([[4, 3, 1, 5]]), theta_version=5)
    assert torch.allclose(alpha, torch.tensor([[0.0, 0.5, 0.75, 1.0]]))
    assert alpha.dtype == torch.float32
    # explicit v_prox = 2: (2 - 4)/(5 - 4) = -2 -> clamped 0; (2 - 1)/(5 - 1) = 1/4
    alpha = loglinear_alpha(torch.tensor([4, 1]), theta_version=5, prox_version=2)
    assert torch.allclose(alpha, torch.tensor([0.0, 0.25]))


def test_linear_interpolates_in_probability_space():
    cur, inf = torch.tensor([math.log(0.6)]), torch.tensor([math.log(0.2)])
    assert torch.allclose(linear_logprobs(cur, inf, 0.5), torch.tensor([math.log(0.4)]))
    assert torch.allclose(linear_logprobs(cur, inf, 0.0), inf)
    assert torch.allclose(linear_logprobs(cur, inf, 1.0), cur)


@pytest.mark.parametrize("name", ["snapshot", "dedicated", "interrupt", "ewma"])
def test_upstream_strategies_pass_old_through_and_require_it(name):
    old = torch.tensor([[-1.1, -2.2]])
    assert torch.equal(proximal_logprobs(name, current_logprobs=CUR, inference_logprobs=INF, old_logprobs=old), old)
    with pytest.raises(ValueError, match=name):
        proximal_logprobs(name, current_logprobs=CUR, inference_logprobs=INF)


def test_dispatch_train_time_baselines():
    kw = dict(current_logprobs=CUR, inference_logprobs=INF)
    assert torch.equal(proximal_logprobs("behavior", **kw), INF)
    assert torch.equal(proximal_logprobs("recompute", **kw), CUR.detach())
    pre = torch.tensor([[-0.9, -1.9]])
    assert torch.equal(proximal_logprobs("recompute", old_logprobs=pre, **kw), pre)
    # versions [4, 3] at theta 5: alpha [0, 1/2]
    ll = proximal_logprobs("loglinear", versions=torch.tensor([[4, 3]]), theta_version=5, **kw)
    assert torch.allclose(ll, torch.tensor([[-2.0, -2.25]]))
    with pytest.raises(ValueError, match="versions"):
        proximal_logprobs("loglinear", **kw)
    with pytest.raises(ValueError, match="unknown strategy"):
        proximal_logprobs("nope", **kw)
