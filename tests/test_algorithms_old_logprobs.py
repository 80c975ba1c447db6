"""Train-time old log-probs (pi_old), hand-computed (the strategies that use them: test_strategies.py)."""

import math

import torch

from trajflow.algorithms import (
    behavior_logprobs,
    linear_logprobs,
    loglinear_alpha,
    loglinear_logprobs,
    recompute_logprobs,
)

CUR = torch.tensor([[-1.0, -2.0]], requires_grad=True)
INF = torch.tensor([[-2.0, -2.5]])


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
