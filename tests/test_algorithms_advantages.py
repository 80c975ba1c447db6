"""Advantages, hand-computed and against veRL's formula, plus invariants on random groups; DAPO's
overlong shaping; the Advantage operator."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import (ESTIMATORS, AdvantageConfig, compute_advantages, dr_grpo, grpo, leave_one_out,
                                 overlong_penalty, reinforce_plus_plus, reinforce_plus_plus_baseline,
                                 zero_variance_groups)
from trajflow.operators.advantage import Advantage

# group a: [1, 0, 0, 1] (mean 0.5, population std 0.5); b: [1, 1] (no variance); c: [0.5] (alone).
# Rows interleaved on purpose: grouping is by label, not by position.
REWARDS = np.array([1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
GROUPS = np.array(["a", "b", "a", "c", "a", "b", "a"])


def test_grpo_population_std():
    adv = grpo(REWARDS, GROUPS, std="population", eps=0.0)
    assert adv.dtype == np.float32
    assert np.allclose(adv, [1, 0, -1, 0, -1, 0, 1])


def test_grpo_sample_std_is_the_default_and_matches_torch_std():
    # sample std of group a: sqrt(4 * 0.25 / 3) = 1/sqrt(3): advantages ±0.5 sqrt(3)
    adv = grpo(REWARDS, GROUPS, eps=0.0)
    h = 0.5 * np.sqrt(3)
    assert np.allclose(adv, [h, 0, -h, 0, -h, 0, h])
    # veRL and TRL: (r - mean) / (torch.std(r) + eps), torch.std being the sample std
    a = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(adv[[0, 2, 4, 6]], ((a - a.mean()) / a.std()).numpy())
    # at G = 4 the two conventions differ by sqrt(G / (G - 1)) = 1.155
    pop = grpo(REWARDS, GROUPS, std="population", eps=0.0)
    assert np.allclose(pop[0] / adv[0], np.sqrt(4 / 3))
    with pytest.raises(ValueError, match="std must be one of"):
        grpo(REWARDS, GROUPS, std="unbiased")


def test_dr_grpo_no_std():
    assert np.allclose(dr_grpo(REWARDS, GROUPS), [0.5, 0, -0.5, 0, -0.5, 0, 0.5])


def test_leave_one_out():
    # a: 1 - mean(1, 0, 0)... each 1 is compared with the other three: 1 - 1/3 = 2/3; each 0: 0 - 2/3
    assert np.allclose(leave_one_out(REWARDS, GROUPS), [2 / 3, 0, -2 / 3, 0, -2 / 3, 0, 2 / 3])


def test_zero_variance_groups():
    assert zero_variance_groups(REWARDS, GROUPS).tolist() == [False, True, False, True, False, True, False]


def test_integer_codes_need_not_be_contiguous_and_torch_round_trips():
    r = torch.tensor([3.0, 1.0, 5.0, 2.0])
    g = torch.tensor([7, 3, 7, 3])
    adv = dr_grpo(r, g)
    assert isinstance(adv, torch.Tensor) and adv.dtype == torch.float32
    assert torch.allclose(adv, torch.tensor([-1.0, -0.5, 1.0, 0.5]))
    assert zero_variance_groups(r, g).tolist() == [False] * 4


def test_dispatch_and_errors():
    """compute_advantages goes through the estimators' registry by name."""
    leave = compute_advantages(AdvantageConfig(estimator="leave_one_out"), REWARDS, GROUPS)
    assert np.allclose(leave, leave_one_out(REWARDS, GROUPS))
    assert np.allclose(grpo(REWARDS, GROUPS, normalize_std=False), dr_grpo(REWARDS, GROUPS))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered: grpo, dr_grpo"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="rows"):
        grpo(REWARDS, GROUPS[:3])


groups_and_rewards = st.integers(1, 30).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
    )
)


@settings(max_examples=100, deadline=None)
@given(groups_and_rewards)
def test_invariants_on_random_groups(data):
    r, g = np.array(data[0]), np.array(data[1])
    centred, loo, normed = dr_grpo(r, g), leave_one_out(r, g), grpo(r, g)
    zero_var = zero_variance_groups(r, g)
    for code in np.unique(g):
        sel = g == code
        n = sel.sum()
        assert abs(centred[sel].sum()) < 1e-3                         # centred within each group
        if n > 1:                                                     # RLOO = n/(n-1) * centred
            assert np.allclose(loo[sel], n / (n - 1) * centred[sel], atol=1e-4)
        else:
            assert loo[sel][0] == 0.0 and normed[sel][0] == 0.0
        if zero_var[sel].all():
            assert np.all(normed[sel] == 0.0)
        assert zero_var[sel].all() == (np.ptp(r[sel]) == 0)


# ---- REINFORCE++ and its baseline variant ---------------------------------------------------------

def verl_masked_whiten(scores: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """veRL's outcome estimators in float64: each row's score repeated over its response tokens
    (gamma 1), then (x - mean) / sqrt(var + 1e-8) over all tokens, var with Bessel's N / (N - 1)."""
    tokens = np.repeat(scores, lengths)
    mean = tokens.mean()
    var = ((tokens - mean) ** 2).mean() * len(tokens) / (len(tokens) - 1)
    return (scores - mean) / np.sqrt(var + 1e-8)


def test_reinforce_plus_plus_by_hand():
    # rewards [1, 0, 1], one token each: mean 2/3, sample var 1/3 -> [1/3, -2/3, 1/3] / sqrt(1/3)
    adv = reinforce_plus_plus(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]))
    assert np.allclose(adv, np.array([1, -2, 1]) / 3 / np.sqrt(1 / 3 + 1e-8), atol=1e-6)
    # token weights [2, 1, 0]: mean (2 + 0) / 3, var (2/9 + 4/9) / 2; the empty row does not count
    adv = reinforce_plus_plus(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]), token_counts=np.array([2, 1, 0]))
    assert np.allclose(adv, np.array([1, -2, 1]) / 3 / np.sqrt(1 / 3 + 1e-8), atol=1e-6)
    assert np.all(reinforce_plus_plus(np.array([3.0]), np.array([0])) == 0.0)  # nothing to compare with


def test_reinforce_plus_plus_baseline_matches_verl():
    # REWARDS/GROUPS above; veRL: a group of one keeps its score (baseline 0), then token whitening
    lengths = np.array([3, 1, 2, 5, 4, 1, 2])
    scores = REWARDS - np.array([0.5, 1.0, 0.5, 0.0, 0.5, 1.0, 0.5])  # group means; c alone: 0
    adv = reinforce_plus_plus_baseline(REWARDS, GROUPS, token_counts=lengths)
    assert np.allclose(adv, verl_masked_whiten(scores, lengths), atol=1e-6)
    adv = reinforce_plus_plus(REWARDS, GROUPS, token_counts=lengths)
    assert np.allclose(adv, verl_masked_whiten(REWARDS, lengths), atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(groups_and_rewards, st.data())
def test_reinforce_plus_plus_is_whitened(data, draw):
    r, g = np.array(data[0]), np.array(data[1])
    counts = np.array(draw.draw(st.lists(st.integers(1, 5), min_size=len(r), max_size=len(r))))
    adv = reinforce_plus_plus(r, g, token_counts=counts).astype(np.float64)
    assert abs((counts * adv).sum()) < 1e-3 * counts.sum()  # token-weighted mean 0
    if counts.sum() > 1 and np.ptp(r) > 1e-2:  # unit token-weighted sample variance
        var = (counts * adv**2).sum() / (counts.sum() - 1)
        assert var == pytest.approx(1.0, rel=1e-3)


# ---- DAPO's overlong shaping and the config-driven entry ------------------------------------------

def test_overlong_penalty_is_dapos_soft_punishment():
    # L_max 10, L_cache 4: no penalty up to 6, linear to -1 at 10, -1 beyond
    assert np.allclose(overlong_penalty([3, 6, 7, 8, 10, 12], 10, 4), [0, 0, -0.25, -0.5, -1, -1])
    assert np.allclose(overlong_penalty([8], 10, 4, penalty=0.5), [-0.25])  # veRL's penalty_factor
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty([1], 10, 0)


def test_compute_advantages_follows_the_config():
    rewards, groups, lengths = np.array([1.0, 1.0, 0.0, 0.0]), np.array([0, 0, 1, 1]), np.array([2, 9, 2, 2])
    cfg = AdvantageConfig(estimator="dr_grpo", overlong_buffer=4, overlong_max_tokens=10)
    # shaped rewards [1, 1 - 0.75, 0, 0]: group 0 mean 0.625
    assert np.allclose(compute_advantages(cfg, rewards, groups, lengths=lengths), [0.375, -0.375, 0, 0])
    assert np.allclose(compute_advantages(AdvantageConfig(std="population"), REWARDS, GROUPS),
                       grpo(REWARDS, GROUPS, std="population"))
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(cfg, rewards, groups)


@pytest.mark.parametrize("fields, name", [
    (dict(estimator="ppo"), "estimator"),
    (dict(overlong_buffer=11, overlong_max_tokens=10), "overlong_buffer"),
    (dict(overlong_penalty=0.0), "overlong_penalty"),
    (dict(overlong_buffer=True, overlong_max_tokens=10), "overlong_buffer"),
])
def test_advantage_config_checks(fields, name):
    with pytest.raises(ValueError, match=f"AdvantageConfig.{name}"):
        AdvantageConfig(**fields)


def test_overlong_shaping_without_a_budget_is_refused_where_it_is_used():
    """A job fills the budget from sampling.max_new_tokens; a library call must give it."""
    cfg = AdvantageConfig(overlong_buffer=4)
    with pytest.raises(ValueError, match="overlong_max_tokens"):
        compute_advantages(cfg, REWARDS, GROUPS, lengths=np.full(len(REWARDS), 3))


def test_every_registered_estimator_is_implemented():
    """Each built-in computes advantages from rewards, except gae (per token, on a critic's values:
    algorithms/gae.py), which compute_advantages refuses; the group-relative ones need groups of 2."""
    names = list(ESTIMATORS.builtins())
    assert names == ["grpo", "dr_grpo", "leave_one_out", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
    for name in names:
        config = AdvantageConfig(estimator=name)
        if ESTIMATORS.resolve(name).needs_values:
            with pytest.raises(ValueError, match="gae: its advantages are per token from a critic's values"):
                compute_advantages(config, REWARDS, GROUPS)
        else:
            assert np.isfinite(compute_advantages(config, REWARDS, GROUPS)).all(), name
    assert {n for n, c in ESTIMATORS.builtins().items() if c.min_group_size == 2} == {
        "grpo", "dr_grpo", "leave_one_out", "reinforce_plus_plus_baseline"}


# ---- the Advantage operator ----------------------------------------------------------------------

def test_advantage_operator_reads_lengths_and_loss_tokens_and_skips_failed_rewards():
    table = pa.table({
        "reward": pa.array([1.0, 0.0, None, 1.0], pa.float32()),
        "group_id": ["a", "a", "a", "b"],
        "response_tokens": pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32())),
        "loss_mask": pa.array([[True, True], [True], [True, False, True], [False]], pa.list_(pa.bool_())),
    })
    out = Advantage(AdvantageConfig(estimator="reinforce_plus_plus"))(table)["advantage"]
    # rows 0, 1, 3 with 2, 1, 0 loss tokens: test_reinforce_plus_plus_by_hand's second case
    expected = np.array([1, -2, 1]) / 3 / np.sqrt(1 / 3 + 1e-8)
    assert out.null_count == 1 and out[2].as_py() is None
    assert np.allclose([out[i].as_py() for i in (0, 1, 3)], expected, atol=1e-6)
    # shaping from response lengths: budget 2, buffer 1 -> row 0 (2 tokens) loses 1: group a [0, 0]
    out = Advantage(AdvantageConfig(estimator="dr_grpo", overlong_buffer=1, overlong_max_tokens=2))(table)
    assert out["advantage"].to_pylist() == [0.0, 0.0, None, 0.0]
    assert out["reward"].to_pylist() == table["reward"].to_pylist()  # the task's reward is kept
    with pytest.raises(TypeError, match="AdvantageConfig"):
        Advantage("grpo")
