"""A run that heals itself (issue #24), and the one line when it cannot."""

from __future__ import annotations

import pytest

from trajflow.jobs.run import trainer_state_lost
from trajflow.operators.data_parallel import RESUME_HINT, TrainerStateLost

LINE = f"trainer worker 0 of 1 (node abc) was restarted after its process died; the state is lost: {RESUME_HINT}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("original", [False, True], ids=["wrapped", "original"])
def test_the_lost_line_survives_ray_datas_retry_advice(ray_session, original):
    """Ray Data appends its retry advice ("To change retry attempts ... `ray.data.DataContext`")
    to the message of the exception it re-raises — with `raise_original_map_exception`, to the
    TrainerStateLost itself; the line trajflow prints is still exactly the TrainerStateLost's."""
    from ray.data import DataContext

    def lost(batch):  # nested: shipped by value (the test module is not importable in Ray's workers)
        raise TrainerStateLost(LINE)

    ctx = DataContext.get_current()
    before = ctx.raise_original_map_exception
    ctx.raise_original_map_exception = original
    try:
        with pytest.raises(Exception) as caught:
            ray_session.data.range(1).map_batches(lost).materialize()
    finally:
        ctx.raise_original_map_exception = before
    assert "To change retry attempts" in str(caught.value)  # Ray's advice is in the error's text
    assert trainer_state_lost(caught.value) == LINE


def test_no_line_for_other_errors():
    assert trainer_state_lost(RuntimeError("To change retry attempts, configure ray.data.DataContext")) is None
