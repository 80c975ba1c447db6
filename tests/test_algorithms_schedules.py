"""Learning-rate multipliers per optimizer update, by hand and as properties."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajflow.algorithms import SCHEDULES, OptimizerConfig, lr_multiplier


def lrs(total, **cfg):
    config = OptimizerConfig(**cfg)
    return [lr_multiplier(u, total, config) for u in range(total + 1)]


def test_warmup_then_constant():
    # W = 4: updates 0..3 get 1/4, 2/4, 3/4, 1; then 1
    assert lrs(6, warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert lrs(3) == [1.0] * 4  # the default: today's constant lr


def test_linear_decay_by_hand():
    # W = 2, N = 6, m = 0.2: p = (u - 2) / 4 -> 1 - 0.8 p
    assert lrs(6, schedule="linear", warmup_steps=2, min_lr_ratio=0.2) == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_cosine_decay_by_hand():
    # no warm-up, N = 4: m + (1 - m)(1 + cos(pi u / 4)) / 2 with m = 0
    expected = [(1 + math.cos(math.pi * u / 4)) / 2 for u in range(5)]
    assert lrs(4, schedule="cosine") == pytest.approx(expected)
    assert lr_multiplier(10, 4, OptimizerConfig(schedule="cosine", min_lr_ratio=0.1)) == pytest.approx(0.1)


def test_bad_input():
    with pytest.raises(ValueError, match="total_updates"):
        lr_multiplier(0, None, OptimizerConfig(schedule="linear"))
    with pytest.raises(ValueError, match="update"):
        lr_multiplier(True, 3, OptimizerConfig())
    for bad, name in ((dict(schedule="step"), "schedule"), (dict(warmup_steps=-1), "warmup_steps"),
                      (dict(min_lr_ratio=1.5), "min_lr_ratio"), (dict(warmup_steps=2.0), "warmup_steps")):
        with pytest.raises(ValueError, match=f"OptimizerConfig.{name}"):
            OptimizerConfig(**bad)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(0, 20), st.integers(1, 60), st.floats(0.0, 1.0))
def test_schedule_properties(schedule, warmup, total, floor):
    values = lrs(total, schedule=schedule, warmup_steps=warmup, min_lr_ratio=floor)
    warm, rest = values[:warmup], values[warmup:]
    assert all(0 < v <= 1 for v in warm) and all(a < b for a, b in zip(warm, warm[1:]))
    assert all(floor - 1e-12 <= v <= 1 + 1e-12 for v in rest)
    assert all(b <= a + 1e-12 for a, b in zip(rest, rest[1:]))  # never rises after the warm-up
    if rest:
        assert rest[0] == 1.0  # the first update after the warm-up has the full lr
    if schedule != "constant" and total > warmup:
        assert values[total] == pytest.approx(floor)  # one past the last update: lr x min_lr_ratio
