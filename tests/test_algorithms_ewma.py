"""Revised PPO-EWMA: closed form, mean age W/2, reset threshold, checkpointing."""

import pytest
import torch

from trajflow.algorithms import EwmaProximal, ewma_beta, ewma_mean_age


def weights_at(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {
        "w": torch.randn(3, 2, generator=g, dtype=torch.float64),  # float64 in: stored as float32
        "b": torch.randn(2, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(k),  # an int buffer: tracks the latest value
    }


def closed_form(seq: list[dict], beta: float, key: str) -> torch.Tensor:
    t = len(seq) - 1
    num = sum(beta ** (t - k) * seq[k][key].to(torch.float64) for k in range(t + 1))
    den = sum(beta ** (t - k) for k in range(t + 1))
    return num / den


def test_beta_from_window_and_mean_age():
    assert ewma_beta(2) == 0.5 and ewma_beta(4) == pytest.approx(2 / 3) and ewma_beta(8) == 0.8
    assert ewma_beta(0) == 0.0
    for window in (1, 2, 3, 4, 8, 16):
        assert ewma_mean_age(ewma_beta(window)) == pytest.approx(window / 2)


def test_window_is_counted_in_updates():
    # W = 2 versions with m = 3 optimizer updates per version: a window of 6 updates, beta = 6/8;
    # the mean age is 3 updates = W / 2 versions (beta = W/(W+2) would sit at W/(2m) = 1/3 version)
    assert ewma_beta(2, minibatches_per_step=3) == pytest.approx(0.75)
    for window, m in ((1, 2), (2, 2), (2, 4), (3, 5)):
        age_in_updates = ewma_mean_age(ewma_beta(window, m))
        assert age_in_updates / m == pytest.approx(window / 2)
    with pytest.raises(ValueError, match="minibatches_per_step"):
        ewma_beta(2, 0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8])
def test_ewma_equals_closed_form(beta):
    seq = [weights_at(k) for k in range(7)]
    ewma = EwmaProximal(seq[0], beta, reset_threshold=0.9)
    for k in range(1, len(seq)):
        ewma.update(seq[k])
        prox = ewma.prox_state_dict()
        for key in ("w", "b"):
            assert prox[key].dtype == torch.float32
            assert torch.allclose(prox[key].double(), closed_form(seq[: k + 1], beta, key), atol=1e-6)
        assert prox["steps"].item() == k
    assert ewma.steps_since_reset == 6 and ewma.reset_count == 0


def test_age_matches_weighted_mean_age_and_converges_to_half_window():
    for window in (2, 4, 8):
        beta = ewma_beta(window)
        ewma = EwmaProximal({"w": torch.zeros(1)}, beta, reset_threshold=0.9)
        for t in range(1, 6):
            ewma.update({"w": torch.zeros(1)})
            ages = torch.arange(t + 1, dtype=torch.float64)  # ages t - k for k = t..0
            wts = beta ** ages
            assert ewma.age == pytest.approx(float((ages * wts).sum() / wts.sum()))
        for _ in range(400):
            ewma.update({"w": torch.zeros(1)})
        assert ewma.age == pytest.approx(window / 2, rel=1e-6)


def test_reset_fires_exactly_below_the_threshold_and_prox_becomes_current():
    seq = [weights_at(k) for k in range(4)]
    ewma = EwmaProximal(seq[0], ewma_beta(4), reset_threshold=0.9)
    ewma.update(seq[1])
    ewma.update(seq[2])
    assert ewma.maybe_reset(0.9, seq[3]) is False  # at the threshold: no reset
    assert ewma.maybe_reset(0.95, seq[3]) is False
    assert ewma.reset_count == 0 and ewma.steps_since_reset == 2
    assert ewma.maybe_reset(0.8999, seq[3]) is True  # just below it: reset
    assert ewma.reset_count == 1 and ewma.steps_since_reset == 0 and ewma.age == 0.0
    for key in ("w", "b", "steps"):
        expected = seq[3][key].to(torch.float32) if seq[3][key].is_floating_point() else seq[3][key]
        assert torch.equal(ewma.prox_state_dict()[key], expected)


def test_step_resets_or_updates():
    seq = [weights_at(k) for k in range(3)]
    ewma = EwmaProximal(seq[0], 0.5, reset_threshold=0.9)
    assert ewma.step(seq[1], active_fraction=0.97) is False
    assert ewma.steps_since_reset == 1
    assert ewma.step(seq[2], active_fraction=0.5) is True
    assert torch.equal(ewma.prox_state_dict()["w"], seq[2]["w"].float())


def test_owns_its_copies():
    src = {"w": torch.ones(2)}
    ewma = EwmaProximal(src, 0.5, reset_threshold=0.9)
    src["w"].add_(10.0)
    assert torch.equal(ewma.prox_state_dict()["w"], torch.ones(2))


def test_checkpoint_round_trip_continues_identically():
    seq = [weights_at(k) for k in range(6)]
    a = EwmaProximal(seq[0], 0.6, reset_threshold=0.9)
    a.update(seq[1])
    a.reset(seq[2])
    a.update(seq[3])
    b = EwmaProximal(weights_at(99), 0.1, reset_threshold=0.5)
    b.load_state_dict(a.state_dict())
    for sd in seq[4:]:
        a.update(sd)
        b.update(sd)
    assert (b.beta, b.reset_threshold, b.reset_count, b.steps_since_reset, b.age) == (a.beta, a.reset_threshold, a.reset_count, a.steps_since_reset, a.age)
    for key, v in a.prox_state_dict().items():
        assert torch.equal(b.prox_state_dict()[key], v)


def test_validation():
    with pytest.raises(ValueError, match="beta"):
        EwmaProximal({"w": torch.zeros(1)}, 1.0, reset_threshold=0.9)
    with pytest.raises(ValueError, match="reset_threshold"):
        EwmaProximal({"w": torch.zeros(1)}, 0.5, reset_threshold=1.5)
    with pytest.raises(KeyError):
        EwmaProximal({"w": torch.zeros(1)}, 0.5, reset_threshold=0.9).update({"v": torch.zeros(1)})
