"""GAE and the value loss (algorithms/gae.py) against hand computations and veRL's semantics."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trajflow.algorithms.gae import explained_variance, gae, token_rewards, value_loss, whiten

# veRL's own unit test of compute_gae_advantage_return (tests/trainer/ppo/test_core_algos_on_cpu.py,
# test_multi_turn_compute_gae_advantage_return): these rewards and loss mask, these values on the
# loss tokens; the values of the masked tokens are drawn at random there and must not matter
VERL_REWARDS = [0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 1.0, 0.0, 0.0]
VERL_MASK = [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]
VERL_VALUES = [55.0, 0.3, 4.0, 5.0, 6.0, -20.0, 0.7, 7.0, 9.0, 0.0, 0.0]


def reference_scan(rewards, values, mask, gamma, lam):
    """veRL's published recursion, written out as a plain loop over one row (the reference)."""
    next_value, last, advantages = 0.0, 0.0, [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        new = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        if mask[t]:
            next_value, last = values[t], new
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_gae_equals_the_hand_computation_on_verls_unit_test_input():
    # by hand, gamma 0.9, lam 0.8, from the last loss token back (t = 8, 7, 4, 3, 2):
    # delta_8 = 1 - 9 = -8                      A_8 = -8
    # delta_7 = 0.1 + 0.9 * 9 - 7 = 1.2         A_7 = 1.2 + 0.72 * -8 = -4.56
    # delta_4 = 0.1 + 0.9 * 7 - 6 = 0.4         A_4 = 0.4 + 0.72 * -4.56 = -2.8832
    # delta_3 = 0.1 + 0.9 * 6 - 5 = 0.5         A_3 = 0.5 + 0.72 * -2.8832 = -1.575904
    # delta_2 = 0.1 + 0.9 * 5 - 4 = 0.6         A_2 = 0.6 + 0.72 * -1.575904 = -0.53465088
    # masked tokens carry the next loss token's advantage; after the last one: 0
    expected = [-0.53465088, -0.53465088, -0.53465088, -1.575904, -2.8832, -4.56, -4.56, -4.56, -8.0, 0.0, 0.0]
    adv, ret = gae(torch.tensor([VERL_REWARDS], dtype=torch.float64), torch.tensor([VERL_VALUES], dtype=torch.float64),
                   torch.tensor([VERL_MASK]).bool(), 0.9, 0.8)
    np.testing.assert_allclose(adv[0].numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(ret[0].numpy(), np.array(expected) + np.array(VERL_VALUES), atol=1e-12)
    ref_adv, ref_ret = reference_scan(VERL_REWARDS, VERL_VALUES, VERL_MASK, 0.9, 0.8)
    np.testing.assert_allclose(adv[0].numpy(), ref_adv, atol=1e-12)
    np.testing.assert_allclose(ret[0].numpy(), ref_ret, atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_values_of_masked_tokens_do_not_matter_as_in_verls_test(seed):
    rng = random.Random(seed)
    gamma, lam = rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
    mask = torch.tensor([VERL_MASK]).bool()
    rewards = torch.tensor([VERL_REWARDS])
    results = []
    for _ in range(2):
        values = [v if m else rng.uniform(-100.0, 100.0) for v, m in zip(VERL_VALUES, VERL_MASK)]
        adv, ret = gae(rewards, torch.tensor([values]), mask, gamma, lam)
        results.append((adv, ret * mask))
        ref_adv, ref_ret = reference_scan(VERL_REWARDS, values, VERL_MASK, gamma, lam)
        np.testing.assert_allclose(adv[0].numpy(), ref_adv, atol=1e-5)
        np.testing.assert_allclose(ret[0].numpy(), ref_ret, atol=1e-4)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_ragged_batch_equals_each_row_alone_within_1e6():
    rng = np.random.default_rng(3)
    lengths = [1, 7, 3, 12]
    width = max(lengths)
    rewards = torch.zeros(4, width, dtype=torch.float64)
    values = torch.from_numpy(rng.normal(size=(4, width)))
    mask = torch.zeros(4, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = torch.from_numpy(rng.random(n) < 0.8)
        mask[i, n - 1] = True
        rewards[i, :n] = torch.from_numpy(rng.normal(size=n))
    adv, ret = gae(rewards, values, mask, 0.95, 0.9)
    for i, n in enumerate(lengths):
        ref_adv, ref_ret = reference_scan(rewards[i, :n].tolist(), values[i, :n].tolist(), mask[i, :n].tolist(), 0.95, 0.9)
        np.testing.assert_allclose(adv[i, :n].numpy(), ref_adv, atol=1e-6)
        np.testing.assert_allclose(ret[i, :n].numpy(), ref_ret, atol=1e-6)
        assert torch.all(adv[i, n:] == 0)  # right padding: past the last loss token


def test_lambda_one_is_the_discounted_return_minus_the_value_over_loss_tokens():
    rewards = torch.tensor([[0.5, 9.0, 0.0, 1.0, 2.0]], dtype=torch.float64)  # 9.0 sits on a masked token: not a step
    mask = torch.tensor([[1, 0, 1, 1, 1]]).bool()
    values = torch.tensor([[0.3, 4.0, -0.2, 0.1, 0.6]], dtype=torch.float64)
    gamma = 0.5
    adv, ret = gae(rewards, values, mask, gamma, 1.0)
    steps = [0, 2, 3, 4]  # the loss tokens: the discount counts them only
    for j, t in enumerate(steps):
        discounted = sum(gamma ** k * rewards[0, s].item() for k, s in enumerate(steps[j:]))
        assert adv[0, t].item() == pytest.approx(discounted - values[0, t].item(), abs=1e-12)
        assert ret[0, t].item() == pytest.approx(discounted, abs=1e-12)


def test_gamma_one_lambda_one_terminal_reward_makes_every_return_the_reward():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]).bool()
    r = token_rewards(torch.tensor([0.7, -1.0], dtype=torch.float64), mask)
    assert r.tolist() == [[0.0, 0.0, 0.0, 0.7, 0.0], [0.0, 0.0, -1.0, 0.0, 0.0]]  # on the last loss token
    values = torch.randn(2, 5, dtype=torch.float64)
    _, ret = gae(r, values, mask, 1.0, 1.0)
    assert torch.allclose(ret[mask], torch.tensor([0.7, 0.7, 0.7, -1.0, -1.0, -1.0], dtype=torch.float64))


def test_token_rewards_subtract_the_kl_penalty_on_loss_tokens_only():
    mask = torch.tensor([[1, 0, 1]]).bool()
    kl = torch.tensor([[0.1, 5.0, 0.3]])
    r = token_rewards(torch.tensor([1.0]), mask, kl, beta=0.5)
    assert r[0].tolist() == pytest.approx([-0.05, 0.0, 1.0 - 0.15])


def test_whiten_is_verls_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]]).bool()
    out = whiten(x, mask)
    # mean 2.5, unbiased variance of (1, 2, 3, 4) = 5/3
    assert out[mask].tolist() == pytest.approx([(v - 2.5) / np.sqrt(5 / 3 + 1e-8) for v in (1, 2, 3, 4)])
    assert out[0, 2].item() == pytest.approx((100 - 2.5) / np.sqrt(5 / 3 + 1e-8))


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 1.0, 2.5]])
    anchor = torch.tensor([[0.5, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1]]).bool()
    out = value_loss(values, returns, anchor, mask, clip=0.2)
    # token 0: plain 1.0; clipped V = 0.5 + 0.2 = 0.7 -> 0.49; max 1.0 (not clipped)
    # token 1: plain 1.0; clipped V = 0.5 - 0.2 = 0.3 -> 0.49; max 1.0
    # token 2: plain 0.25; clipped V = 0 + 0.2 = 0.2 -> 5.29; max 5.29 (clipped)
    assert out.loss_sum.item() == pytest.approx(0.5 * (1.0 + 1.0 + 5.29))
    assert out.count.item() == 3 and out.clipped.tolist() == [[False, False, True]]
    out.loss_sum.backward()
    assert values.grad[0].tolist() == pytest.approx([1.0, -1.0, 0.0])  # the clipped token passes no gradient
    plain = value_loss(values, returns, anchor, mask, clip=None)
    assert plain.loss_sum.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.25)) and not plain.clipped.any()


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[1.0, 2.0, 3.0, 5.0]]), returns, mask) == pytest.approx(1 - 0.25 / (5 / 3))
    assert np.isnan(explained_variance(returns, torch.ones(1, 4), mask))


def test_gae_refuses_booleans_and_out_of_range():
    t = torch.zeros(1, 2)
    with pytest.raises(TypeError):
        gae(t, t, t.bool(), True, 0.9)
    with pytest.raises(ValueError):
        gae(t, t, t.bool(), 1.5, 0.9)
