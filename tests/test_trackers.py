"""`report_to`: a real run reported to W&B (offline) and MLflow (its SQLite store in the run dir),
read back from both: the resolved config, every step's metrics and the summary, the run's files
(PNGs, config.yaml, summary.txt); `trajflow compare` reads the same runs from the trackers. A
missing tracker package is one line naming the extra, exit 2, before Ray starts; the old
`tensorboard:` key still works with a one-line notice.

The end-to-end run is the quickstart at a small size in this process, on the session's Ray. The
W&B run is read back from its transaction log (RUN/wandb/offline-run-*/run-*.wandb, what `wandb
sync` uploads) by trajflow's reader, and its history also by decoding the protobuf records
independently here; MLflow's with MLflow's own client.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

pytestmark = pytest.mark.slow

SMALL = dict(steps=3, prompts_per_step=8, group_size=4, eval_every=0, checkpoint_every=0, save_all_versions=False)


@pytest.fixture(scope="module")
def tracked_run(ray_session, tmp_path_factory) -> Path:
    pytest.importorskip("wandb", reason="report_to wandb needs the wandb extra (pip install 'trajflow[wandb]')")
    pytest.importorskip("mlflow", reason="report_to mlflow needs the mlflow extra (pip install 'trajflow[mlflow]')")
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.run import run_job

    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    config = load_job_config("quickstart", [f"{k}={json.dumps(v)}" for k, v in SMALL.items()] + [
        "report_to=[wandb, mlflow, tensorboard]", "wandb_mode=offline", "tracker_project=trajflow-test"])
    config = config.model_copy(update={"run_dir": run_dir})
    return run_job(config, progress=False)


def _metrics(run_dir: Path) -> pl.DataFrame:
    return pl.read_parquet(run_dir / "metrics.parquet").sort("step")


def _numeric(metrics: pl.DataFrame) -> list[str]:
    return [c for c, t in metrics.schema.items() if t.is_numeric() and c != "step" and metrics[c].null_count() == 0]


def test_the_offline_wandb_run_holds_config_every_step_and_the_summary(tracked_run):
    from trajflow.jobs.tracked_runs import load_wandb_run, wandb_records
    from trajflow.jobs.trackers import tracked_summary

    (offline,) = (tracked_run / "wandb").glob("offline-run-*")
    run = load_wandb_run(offline)
    config = yaml.safe_load((tracked_run / "config.yaml").read_text())
    assert run.config == config and run.config["report_to"] == ["wandb", "mlflow", "tensorboard"]
    logged = _metrics(tracked_run)
    assert run.metrics["step"].to_list() == logged["step"].to_list() == [0, 1, 2]
    keys = _numeric(logged)
    assert {"reward/mean", "loss", "mask/token_kept_frac", "clip/frac", "mismatch/k3"} <= set(keys)
    for key in keys:
        assert run.metrics[key].to_list() == pytest.approx(logged[key].to_list(), rel=1e-9), key
    summary = tracked_summary(tracked_run)
    assert summary["final_reward"] == pytest.approx(logged["reward/mean"].tail(1).item(), abs=1e-3)
    for key, value in summary.items():
        if value is not None:
            assert run.state["summary"][key] == (pytest.approx(value) if isinstance(value, float) else value), key
    # the history records decoded here, independently of load_wandb_run: one per step, at its step
    steps = [int(next(json.loads(i.value_json) for i in r.history.item if list(i.nested_key) == ["_step"]))
             for r in wandb_records(next(offline.glob("run-*.wandb"))) if r.WhichOneof("record_type") == "history"]
    assert steps == [0, 1, 2]
    files = {p.name for p in (offline / "files").iterdir()}
    assert {"report.png", "config.yaml", "summary.txt"} <= files


def test_the_mlflow_store_holds_config_every_step_and_the_summary(tracked_run):
    from mlflow import MlflowClient

    from trajflow.jobs.trackers import flat_config, tracked_summary

    ids = json.loads((tracked_run / "trackers.json").read_text())
    uri = f"sqlite:///{tracked_run / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "trajflow-test"
    config = yaml.safe_load((tracked_run / "config.yaml").read_text())
    assert run.data.params == flat_config(config)
    assert run.data.params["optimizer.lr"] == "0.0003" and run.data.params["strategy"] == "snapshot"
    logged = _metrics(tracked_run)
    for key in _numeric(logged):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in history] == [0, 1, 2], key
        assert [v for _, v in history] == pytest.approx(logged[key].to_list(), rel=1e-9), key
    summary = tracked_summary(tracked_run)
    for key, value in summary.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert run.data.metrics[f"summary/{key}"] == pytest.approx(value), key
    assert json.loads(run.data.tags["trajflow.summary"])["final_reward"] == summary["final_reward"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.png", "config.yaml", "summary.txt"} <= artifacts
    assert (tracked_run / "tensorboard").is_dir()  # and TensorBoard's event files, as before


def test_compare_reads_the_runs_back_from_the_trackers(tracked_run, tmp_path, capfd):
    from trajflow.jobs.cli import main

    ids = json.loads((tracked_run / "trackers.json").read_text())
    (offline,) = (tracked_run / "wandb").glob("offline-run-*")
    mlflow_run = f"mlflow:sqlite:///{tracked_run / 'mlflow' / 'mlflow.db'}#{ids['mlflow']}"
    capfd.readouterr()
    assert main(["compare", str(tracked_run), str(offline), mlflow_run, "--out", str(tmp_path / "c.png")]) == 0
    out = capfd.readouterr().out
    # the table may wrap into blocks of runs: the row of each block
    final = [v for line in out.splitlines() if line.startswith("final reward") for v in line.split()[2:]]
    assert len(final) == 3 and len(set(final)) == 1, out  # the same run, read three ways
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_a_missing_tracker_package_is_one_line_before_ray(tmp_path, monkeypatch, capfd):
    import ray

    from trajflow.jobs.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a config that names a missing tracker")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.chdir(tmp_path)
    for package, extra in (("wandb", "wandb"), ("mlflow", "mlflow")):
        monkeypatch.setitem(sys.modules, package, None)  # as if not installed
        capfd.readouterr()
        code = main(["run", "quickstart", "--run-dir", "out", "--set", f"report_to=[tensorboard, {package}]"])
        err = capfd.readouterr().err
        assert code == 2
        assert err == (f"trajflow: config error: report_to: {package} is not installed: pip install "
                       f"'trajflow[{extra}]' (or remove {package} from report_to)\n")
    assert not any(tmp_path.iterdir())


def test_the_tensorboard_key_still_works_with_a_notice(capfd):
    from trajflow.jobs.cli import _one_line_warnings
    from trajflow.jobs.config import build_job_config

    _one_line_warnings()
    assert build_job_config({"tensorboard": False}).report_to == []
    assert build_job_config({"tensorboard": True}).report_to == ["tensorboard"]
    assert build_job_config({"tensorboard": False, "report_to": ["tensorboard"]}).report_to == ["tensorboard"]
    err = capfd.readouterr().err.splitlines()
    assert err[0] == "trajflow: deprecated: tensorboard: use report_to: []; the old key goes in the next release"
    assert build_job_config({}).report_to == ["tensorboard"]


def test_a_resumed_run_continues_the_same_tracker_runs(ray_session, tmp_path):
    """Two sessions of one run dir (steps 0-1, then --resume to 4 steps): one MLflow run holds
    steps 0-3, and the W&B run keeps its id (an offline resume writes a second directory of the
    same run, which `wandb sync` merges)."""
    pytest.importorskip("wandb", reason="report_to wandb needs the wandb extra (pip install 'trajflow[wandb]')")
    pytest.importorskip("mlflow", reason="report_to mlflow needs the mlflow extra (pip install 'trajflow[mlflow]')")
    from mlflow import MlflowClient

    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.run import resume_job, run_job
    from trajflow.jobs.tracked_runs import load_wandb_run

    run_dir = tmp_path / "run"
    small = {**SMALL, "steps": 2, "checkpoint_every": 1}
    config = load_job_config("quickstart", [f"{k}={json.dumps(v)}" for k, v in small.items()] + [
        "report_to=[wandb, mlflow]", "wandb_mode=offline"])
    run_job(config.model_copy(update={"run_dir": run_dir}), progress=False)
    first = json.loads((run_dir / "trackers.json").read_text())
    resume_job(run_dir, ["steps=4"], progress=False)
    assert json.loads((run_dir / "trackers.json").read_text()) == first
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    history = sorted(m.step for m in client.get_metric_history(first["mlflow"], "reward/mean"))
    assert history == [0, 1, 2, 3]
    assert client.get_run(first["mlflow"]).info.status == "FINISHED"
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(first["wandb"]) for r in runs)
    assert load_wandb_run(runs[1]).metrics["step"].to_list() == [2, 3]
