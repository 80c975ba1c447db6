"""Weights through the object store: SharedStateDict round trips (values, dtypes, tied weights, no
copy on read), and the policy store's ownership rule — no copy per publish, and the final version
outlives the actor that published it."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from trajflow.schemas.weights import SharedStateDict


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 3, generator=g)
    return {"embed.weight": embed, "lm_head.weight": embed,  # tied: one tensor, two names
            "norm.weight": torch.randn(3, generator=g, dtype=torch.float64),
            "scale": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.zeros(0, 4)}


def test_shared_state_dict_round_trips_values_dtypes_and_ties():
    state = SharedStateDict.of(_state(), dtype=None)
    assert state.nbytes == 5 * 3 * 4 + 3 * 8 + 2  # the tied tensor counts once
    back = pickle.loads(pickle.dumps(state, protocol=5))
    assert list(back) == list(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    assert back["embed.weight"].data_ptr() == back["lm_head.weight"].data_ptr()
    as_float = SharedStateDict.of(_state())
    assert {t.dtype for t in as_float.values()} == {torch.float32}


def test_shared_state_dict_of_a_module_is_a_view_not_a_copy():
    layer = torch.nn.Linear(3, 2)
    state = SharedStateDict.of(layer)
    assert state["weight"].data_ptr() == layer.weight.data_ptr()
    assert not state["weight"].requires_grad


def test_a_process_without_torch_passes_a_version_on_as_raw_buffers():
    """The policy store unpickles (and re-puts) the final version without importing torch."""
    state = SharedStateDict.of(_state(), dtype=None)
    relay = ("import pickle, sys\n"
             "obj = pickle.loads(sys.stdin.buffer.read())\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n"
             "sys.stdout.buffer.write(pickle.dumps(obj, protocol=5))\n")
    out = subprocess.run([sys.executable, "-c", relay], input=pickle.dumps(state, protocol=5),
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    back = pickle.loads(out.stdout)
    assert isinstance(back, SharedStateDict)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.timeout(300)
def test_ray_get_returns_views_into_shared_memory(ray_session):
    ray = ray_session
    state = SharedStateDict.of({"w": torch.arange(300_000, dtype=torch.float32)})
    ref = ray.put(state)
    back, again = ray.get(ref), ray.get(ref)
    assert isinstance(back, SharedStateDict) and torch.equal(back["w"], state["w"])
    # both reads map the same shared memory: a deserialising copy would give two buffers
    assert back["w"].data_ptr() == again["w"].data_ptr()
    plain = ray.put({"w": state["w"].clone()})
    assert ray.get(plain)["w"].data_ptr() != ray.get(plain)["w"].data_ptr()  # what torch pickling does


@pytest.mark.timeout(300)
def test_only_the_final_version_is_copied_and_it_outlives_the_publisher(ray_session):
    ray = ray_session
    from trajflow.pipelines.policy_store import RayStore

    @ray.remote(num_cpus=0)
    class Trainer:
        def __init__(self, store):
            self.store, self.model = store, torch.nn.Linear(4, 4)

        def step(self) -> int:
            with torch.no_grad():
                self.model.weight.add_(1.0)
            return self.store.publish(self.model.state_dict())

        def weight(self):
            return self.model.weight.detach().clone()

    store = RayStore.start(max_staleness=0, keep_history=False, final_version=2)
    trainer = Trainer.remote(store)
    published = [ray.get(trainer.step.remote()) for _ in range(3)]
    assert published == [0, 1, 2]
    final_weight = ray.get(trainer.weight.remote())
    ray.kill(trainer)
    version, weights = store.weights()
    assert version == 2
    assert torch.equal(weights["weight"], final_weight)  # the store's own copy: the trainer is gone

    # without a final version every version is the store's own (the safe default)
    store_all = RayStore.start(max_staleness=0, keep_history=False)
    trainer = Trainer.remote(store_all)
    ray.get(trainer.step.remote())
    ray.kill(trainer)
    assert store_all.weights()[1]["weight"].shape == (4, 4)
    for s in (store, store_all):
        s.kill()


def test_in_process_store_keeps_pinned_versions_within_the_window_and_bounds_admission():
    """The store's bookkeeping, in one process: snapshots live while pinned and inside the
    staleness window; admission of step b waits for version b - max_staleness."""
    import threading

    from trajflow.operators.contracts.store import VersionNotHeld
    from trajflow.pipelines.policy_store import InProcessStore

    store = InProcessStore(max_staleness=1, keep_history=True)
    weights = {"w": torch.zeros(2)}
    assert store.publish(weights) == 0
    weights["w"] += 1.0  # the store holds its own copy
    assert torch.equal(store.weights(0)[1]["w"], torch.zeros(2))
    store.weights(0, pin=True)
    store.publish({"w": torch.ones(2)})
    assert store.stats().versions_held == [0, 1]  # pinned, inside the window
    store.publish({"w": torch.ones(2)})
    assert store.stats().versions_held == [2]  # out of the window (2 - 1 > 0): freed though pinned
    assert store.stats().evicted_pinned == 1
    with pytest.raises(VersionNotHeld, match="version 0 are not held"):
        store.weights(0)

    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(store.admit(4)))  # needs version 3
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not admitted
    store.publish({"w": torch.ones(2)})
    waiter.join(timeout=10)
    assert admitted == [3]


@pytest.mark.timeout(120)
def test_ray_store_reports_a_missing_version_as_the_same_error(ray_session):
    from trajflow.operators.contracts.store import VersionNotHeld
    from trajflow.pipelines.policy_store import RayStore

    store = RayStore.start(max_staleness=0, keep_history=False)
    try:
        store.publish({"w": torch.zeros(3)})
        store.publish({"w": torch.ones(3)})
        with pytest.raises(VersionNotHeld) as caught:
            store.weights(0)
        assert str(caught.value) == "weights of version 0 are not held by the policy store (held: [1])"
        store.add_counters({"generate_seconds": 1.5})
        store.add_counters({"generate_seconds": 0.5})
        assert store.stats(reset_counters=True).counters == {"generate_seconds": 2.0}
        assert store.stats().counters == {}
    finally:
        store.kill()
