"""Group-relative advantages, hand-computed, plus invariants on random groups."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import dr_grpo, group_advantages, grpo, leave_one_out, zero_variance_groups

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
    assert np.allclose(group_advantages("leave_one_out", REWARDS, GROUPS), leave_one_out(REWARDS, GROUPS))
    assert np.allclose(group_advantages("grpo", REWARDS, GROUPS, normalize_std=False), dr_grpo(REWARDS, GROUPS))
    with pytest.raises(ValueError, match="estimator"):
        group_advantages("ppo", REWARDS, GROUPS)
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
