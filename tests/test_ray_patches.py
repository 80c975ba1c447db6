"""Ray is pinned to the series trajflow's patches were written for (pipelines/ray/patches.py).

- CI fails, never skips, when the installed Ray is outside the pin, or when the pin in
  pyproject.toml and `RAY_SERIES` (the series the patches were read against) disagree;
- on another Ray (simulated: `ray.__version__` set for the test, since only one Ray can be
  installed) no patch is applied, one line says so, and an embedded Ray that would listen beyond
  127.0.0.1 is refused;
- the patches of the embedded Ray's start hold for the start only;
- the workers' lines Ray forwards go to a file while `worker_output` points there, and are
  printed as Ray does again after `to(None)`.
(tests/test_executor_patch.py and tests/test_ray_data_services.py assert patches 3 and 4 are
active; the embedded Ray's processes and sockets are checked there and in test_jobs_local_ray.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

from trajflow.pipelines.ray import patches as ray_patches
from trajflow.pipelines.ray.patches import RAY_SERIES, RayVersionError, data_services, executor, worker_output

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _ray_requirements() -> dict[str, Requirement]:
    """Every requirement on `ray` in pyproject.toml, by where it is declared."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    declared = {"dependencies": project["dependencies"]}
    declared.update({f"[{extra}]": reqs for extra, reqs in project["optional-dependencies"].items()})
    return {where: req for where, reqs in declared.items() for req in map(Requirement, reqs) if req.name == "ray"}


def test_the_installed_ray_is_the_pinned_series():
    import ray

    found = _ray_requirements()
    assert {"dependencies", "[dev]", "[cluster]"} <= set(found), found
    pin = SpecifierSet(f"=={RAY_SERIES}.*")
    assert {where: req.specifier for where, req in found.items()} == dict.fromkeys(found, pin), (
        f"pyproject.toml pins Ray other than pipelines/ray/patches.py's RAY_SERIES {RAY_SERIES}: read every "
        "patch there against the new Ray, then move RAY_SERIES and the pins together")
    assert ray.__version__ in pin and ray_patches.ray_in_series(), (
        f"Ray {ray.__version__} is installed, trajflow is pinned to {RAY_SERIES}.x and runs unpatched on "
        f"it: pip install -e '.[dev]' (or 'ray[data]=={RAY_SERIES}.*')")


@pytest.mark.parametrize("version, inside", [
    ("2.60.0", True), ("2.60.3", True), ("2.60.0rc1", True), ("2.60.1.dev0", True),
    ("2.6.0", False), ("2.600.0", False), ("2.61.0", False), ("2.59.9", False), ("3.60.0", False), ("", False),
])
def test_the_series_is_major_and_minor(version, inside):
    assert RAY_SERIES == "2.60"  # the cases above are written for it
    assert ray_patches.ray_in_series(version) is inside


def test_on_another_ray_simulated_nothing_is_patched_and_one_line_says_so(ray_session, monkeypatch, caplog,
                                                                          tmp_path):
    ray = ray_session
    from ray._private import node, ray_constants, services
    from ray.data._internal.execution import streaming_executor_state
    from ray.data._internal.execution.operators import actor_pool_map_operator as pool

    executor_was_active = executor.active()
    executor.revert()
    data_services.revert()
    shipped_wait, shipped_tracker = streaming_executor_state.ray, pool.get_or_create_actor_location_tracker
    shipped_node, cluster = (node.Node.__init__, node.Node.start_api_server), ray_constants.ENABLE_RAY_CLUSTER
    shipped_get_node = services.get_node
    try:
        monkeypatch.setattr(ray, "__version__", "2.61.0")
        with caplog.at_level(logging.WARNING, logger="trajflow"):
            assert executor.apply() is False and not executor.active()
            assert data_services.apply() is False and not data_services.active()
            with ray_patches.lean_head(log_monitor=False):
                assert (node.Node.__init__, node.Node.start_api_server) == shipped_node
                assert services.get_node is shipped_get_node
            assert ray_patches.raylet_register_seconds() == 30.0  # Ray's own wait, as RayStartError says
            worker_output.to(tmp_path / "workers.log")
            assert not worker_output.active() and not (tmp_path / "workers.log").exists()
            refused = (r"^Ray 2\.61\.0 would listen beyond "
                       r"127\.0\.0\.1: pip install the pinned 'ray\[data\]==2\.60\.\*'$")
            with pytest.raises(RayVersionError, match=refused):
                with ray_patches.loopback_node():
                    pass
        assert streaming_executor_state.ray is shipped_wait
        assert pool.get_or_create_actor_location_tracker is shipped_tracker
        assert ray_constants.ENABLE_RAY_CLUSTER is cluster
        lines = [r.getMessage() for r in caplog.records if r.name == "trajflow"]
        assert len(lines) == 1, lines
        assert lines[0].startswith("trajflow: Ray 2.61.0 is not the pinned 2.60.x") and "ray[data]==2.60.*" in lines[0]
        assert len(lines[0]) <= 100 and "\n" not in lines[0]
    finally:
        monkeypatch.undo()
        assert data_services.apply(dashboard=False)  # the session's Ray as conftest started it
        if executor_was_active:
            executor.apply()


def test_the_patches_of_the_embedded_start_hold_for_the_start_only():
    from ray._private import node, ray_constants, services

    before = (node.Node.__init__, node.Node.start_api_server, ray_constants.ENABLE_RAY_CLUSTER, services.get_node)
    with pytest.raises(KeyError):  # as when ray.init fails
        with ray_patches.loopback_node(), ray_patches.lean_head(log_monitor=False):
            assert node.Node.__init__ is not before[0] and node.Node.start_api_server is not before[1]
            assert ray_constants.ENABLE_RAY_CLUSTER is False and services.get_node is not before[3]
            raise KeyError("ray.init failed")
    assert (node.Node.__init__, node.Node.start_api_server, ray_constants.ENABLE_RAY_CLUSTER,
            services.get_node) == before


class _Clock:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _registers_after(clock: _Clock, seconds: float):
    def get_node(gcs_address, node_id):
        if clock.now - 100.0 < seconds:
            raise RuntimeError(f"node {node_id} not found")
        return {"node_id": node_id}

    return get_node


def test_the_embedded_raylet_gets_its_registration_budget_not_rays_30_seconds():
    """A raylet that registers 45 s after the first poll (Ray gives up at 30) is found by the
    first poll; one that never registers: Ray's own error once the budget is spent."""
    assert ray_patches.raylet_register_seconds() == 120.0
    clock = _Clock()
    wait = ray_patches.patient(_registers_after(clock, 45.0), 120.0, poll_seconds=0.5, clock=lambda: clock.now,
                               sleep=clock.sleep)
    assert wait("127.0.0.1:6379", "abc") == {"node_id": "abc"}
    assert clock.now - 100.0 == pytest.approx(45.0)
    clock = _Clock()
    wait = ray_patches.patient(_registers_after(clock, 1e9), 120.0, poll_seconds=0.5, clock=lambda: clock.now,
                               sleep=clock.sleep)
    with pytest.raises(RuntimeError, match="node abc not found"):
        wait("127.0.0.1:6379", "abc")
    assert clock.now - 100.0 == pytest.approx(120.0)
    with pytest.raises(RuntimeError):  # a later poll (Ray's loop polls again) gets no new budget
        wait("127.0.0.1:6379", "abc")
    assert clock.now - 100.0 == pytest.approx(120.0)


def test_worker_output_goes_to_the_file_and_back_to_rays_printer(monkeypatch, tmp_path):
    """The workers' lines (Ray's dispatcher) and the raylet's error messages (Ray's error thread,
    which prints through `ray._private.worker.print_to_stdstream`) go to the file, then back."""
    from ray._private import ray_logging
    from ray._private import worker as ray_worker

    rays_print = ray_worker.print_to_stdstream

    dispatcher = ray_logging.WorkerStandardStreamDispatcher()  # as ray.init(log_to_driver=True) leaves it
    printed: list[dict] = []
    dispatcher.add_handler(worker_output.PRINTER, printed.append)
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    line = {"pid": 42, "is_err": True, "actor_name": "MapWorker(Reward)", "lines": ["UserWarning: careful", "x"]}
    try:
        worker_output.to(tmp_path / "workers.log")
        dispatcher.emit(line)
        dispatcher.emit({"pid": 7, "is_err": False, "task_name": "read", "lines": ["hello"]})
        assert printed == []
        ray_worker.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": ["Task T failed"]},
                                      ignore_prefix=False)  # as listen_error_messages calls it
        worker_output.to(tmp_path / "second.log")  # a later run of the same process: its own file
        dispatcher.emit({"pid": 8, "is_err": False, "lines": ["later"]})
    finally:
        worker_output.to(None)
    assert (tmp_path / "workers.log").read_text() == (
        "(MapWorker(Reward) pid=42 stderr) UserWarning: careful\n(MapWorker(Reward) pid=42 stderr) x\n"
        "(read pid=7) hello\n(raylet) Task T failed\n")
    assert (tmp_path / "second.log").read_text() == "(pid=8) later\n"
    assert ray_worker.print_to_stdstream is rays_print
    dispatcher.emit(line)
    assert printed == [line] and [name for name, _ in dispatcher.handlers] == [worker_output.PRINTER]
