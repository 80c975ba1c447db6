"""The event-driven executor wake-ups (pipelines/ray/patches.py, patch 4): what the stand-in
`ray.wait` does, checked against a scripted fake (no timing), and that applying/reverting touches
exactly Ray Data's executor module. The pipeline tests run every pipeline with the patch applied.
(On a Ray outside the pinned series this fails: tests/test_ray_patches.py says why.)"""

from __future__ import annotations

from trajflow.pipelines.ray.patches import REPEAT_PACE_S, EventDrivenWait, executor


class FakeRay:
    """`wait` answers from a script of ready sets and records every call."""

    def __init__(self, ready_sets: list[set]) -> None:
        self.ready_sets, self.calls = list(ready_sets), []
        self.something = "passed through"

    def wait(self, refs, *, num_returns, timeout, fetch_local):
        self.calls.append((list(refs), num_returns, timeout))
        ready = self.ready_sets.pop(0) if self.ready_sets else set()
        ready = [r for r in refs if r in ready][:num_returns]
        return ready, [r for r in refs if r not in ready]


def test_returns_at_once_with_everything_that_is_ready():
    fake = FakeRay([{"b", "c"}])
    wait = EventDrivenWait(fake)
    assert wait.wait(["a", "b", "c"], num_returns=3, timeout=0.1, fetch_local=False) == (["b", "c"], ["a"])
    assert fake.calls == [(["a", "b", "c"], 3, 0)]  # a non-blocking poll only
    assert wait.something == "passed through"


def test_sleeps_until_any_task_has_news_instead_of_waiting_for_all():
    fake = FakeRay([set(), {"a"}, {"a"}])
    wait = EventDrivenWait(fake)
    assert wait.wait(["a", "b"], num_returns=2, timeout=0.1, fetch_local=False) == (["a"], ["b"])
    # poll, then block for ONE of them (not all) with the executor's timeout, then collect
    assert fake.calls == [(["a", "b"], 2, 0), (["a", "b"], 1, 0.1), (["a", "b"], 2, 0)]


def test_a_task_left_ready_and_unread_is_paced_not_spun_on():
    fake = FakeRay([{"a"}, {"a"}, set(), {"a"}])
    wait = EventDrivenWait(fake)
    wait.wait(["a", "b"], num_returns=2, timeout=0.1, fetch_local=False)
    fake.calls.clear()
    # "a" was reported last time and is still ready (e.g. output backpressure): wait for news
    # from the others, at most the pace
    assert wait.wait(["a", "b"], num_returns=2, timeout=0.1, fetch_local=False) == (["a"], ["b"])
    assert fake.calls == [(["a", "b"], 2, 0), (["b"], 1, REPEAT_PACE_S), (["a", "b"], 2, 0)]


def test_other_calls_are_ray_wait_unchanged():
    fake = FakeRay([{"a"}])
    EventDrivenWait(fake).wait(["a", "b"], num_returns=1, timeout=5, fetch_local=True)
    assert fake.calls == [(["a", "b"], 1, 5)]


def test_apply_and_revert_touch_only_the_executor_module(monkeypatch):
    from ray.data._internal.execution import metadata_fetcher, streaming_executor_state

    executor.revert()
    original_ray, original_thread = streaming_executor_state.ray, metadata_fetcher._PREFETCH_ON_THREAD
    monkeypatch.setenv("TRAJFLOW_EXECUTOR_PATCH", "0")
    assert executor.apply() is False and not executor.active() and streaming_executor_state.ray is original_ray
    monkeypatch.delenv("TRAJFLOW_EXECUTOR_PATCH")
    assert executor.apply() is True and executor.active()
    assert isinstance(streaming_executor_state.ray, EventDrivenWait)
    assert metadata_fetcher._PREFETCH_ON_THREAD is False
    import ray

    assert ray.wait is not streaming_executor_state.ray.wait  # Ray itself is untouched
    executor.revert()
    assert not executor.active()
    assert streaming_executor_state.ray is original_ray and metadata_fetcher._PREFETCH_ON_THREAD == original_thread
