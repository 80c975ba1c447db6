"""The embedded Ray runs without Ray Data's cluster-wide helper actors and without the autoscaler
and log monitors (pipelines/ray/patches.py, patches 2 and 3), and Ray Data still computes the
same thing on it. (On a Ray outside the pinned series this fails: tests/test_ray_patches.py says
why.)"""

from __future__ import annotations

import pyarrow as pa
import pytest

from trajflow.pipelines.ray.patches import data_services

psutil = pytest.importorskip("psutil")

# (name, namespace) of the helper actors Ray Data 2.60 creates on a first execution
HELPER_ACTORS = (
    ("ActorLocationTracker", "ActorLocationTracker"),
    ("datasets_stats_actor", "_dataset_stats_actor"),
    ("AutoscalingCoordinator", "AutoscalingCoordinator"),
)


def _helper_actors(ray) -> list[str]:
    found = []
    for name, namespace in HELPER_ACTORS:
        try:
            ray.get_actor(name, namespace=namespace)
            found.append(name)
        except ValueError:
            pass
    return found


@pytest.mark.timeout(300)
def test_an_actor_pool_pipeline_runs_without_ray_datas_helper_actors(ray_session):
    ray = ray_session
    assert data_services.active()
    class AddOne:  # defined here: pickled by value, so workers need not import this test module
        def __call__(self, batch: pa.Table) -> pa.Table:
            import pyarrow.compute as pc

            return batch.set_column(0, "x", pc.add(batch["x"], 1))

    blocks = [pa.table({"x": pa.array([10 * i + j for j in range(4)], pa.int64())}) for i in range(3)]
    ds = ray.data.from_blocks(blocks).map_batches(
        AddOne, batch_size=4, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.1)
    out = sorted(row["x"] for row in ds.iter_rows())
    assert out == sorted(10 * i + j + 1 for i in range(3) for j in range(4))
    assert _helper_actors(ray) == []


def test_the_embedded_ray_has_no_autoscaler_log_monitor_or_api_server(ray_session):
    """The session's Ray is started with log_to_driver=False and no dashboard, so neither monitor
    nor the API server runs; its GCS and raylet (the driver's children) do."""
    lines = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
             if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert any("gcs_server" in line for line in lines) and any("/raylet" in line for line in lines)
    left_out = ("autoscaler/_private/monitor.py", "log_monitor.py", "dashboard/dashboard.py")
    assert not [line for line in lines if any(name in line for name in left_out)]
