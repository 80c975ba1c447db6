"""RunRecorder (the trainer-side hooks that write a run dir) and resume truncation, without Ray:
a small trainer with a real optimizer, the real EWMA strategy and the train step's own
checkpoint methods."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.algorithms.config import OptimizerConfig
from trajflow.engines import checkpoint as ckpt
from trajflow.engines.lora import LoraConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.jobs.recorder import RunPaths, RunRecorder, logged_steps, read_metrics, truncate_after
from trajflow.operators.strategies.ewma import Ewma
from trajflow.operators.train_step import TrainStep
from trajflow.operators.trainer.policy import PolicyLearner
from trajflow.pipelines.config import PipelineConfig
from trajflow.schemas import from_rows, read_parquet


class SmallPolicy(PolicyLearner):
    """The real policy learner (optimizer, EWMA strategy, checkpoint state) over a linear model."""

    def build_model(self, weights):
        model = torch.nn.Linear(3, 2)
        if weights:
            model.load_state_dict(weights)
        return model


class SmallTrainer(TrainStep):
    """A TrainStep without Ray or a language model: one learner (SmallPolicy: a linear model,
    AdamW, the EWMA strategy) and the train step's own public methods the recorder may call
    (full_weights, save_checkpoint, restore), as a replicated trainer of one worker.
    `model_path`: the directory whose config and tokenizer files the run's last checkpoint
    exports beside the weights."""

    def __init__(self, version: int = 0, seed: int = 0, model_path: str | None = None) -> None:
        torch.manual_seed(seed)  # not TrainStep.__init__: no store, model loading or worker group
        self.trainer = PipelineConfig().settings.trainer
        self.spec = SimpleNamespace(  # the fields of TrainStepConfig a policy learner reads
            model_path=model_path, lora=LoraConfig(), strategy=Ewma(window=2), correction=None, sampling=None,
            optimizer=OptimizerConfig(lr=1e-2), numerics=TrainingNumerics(), trainer=self.trainer,
            total_updates=None)
        self.numerics, self.sharded, self.group = self.spec.numerics, False, None
        self.policy, self.critic = SmallPolicy(self.spec, {}), None
        self.version = self.policy.version = version

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    @property
    def optimizer_steps(self) -> int:
        return self.policy.optimizer_steps

    def train(self) -> None:
        loss = self.model(torch.randn(4, 3)).pow(2).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.policy.optimizer_steps += 1
        self.strategy.after_update(self.policy)
        self.version += 1


def _batch(step: int, n: int = 4) -> pa.Table:
    rows = [{
        "trajectory_id": f"s{step:06d}-p000-n{i:03d}", "group_id": f"s{step:06d}-p000", "prompt_id": "p",
        "prompt_tokens": [1, 4], "response_tokens": [5, 2], "loss_mask": [True, True],
        "inference_logprobs": [-0.1, -0.2], "versions": [step, step], "old_logprobs": None,
        "finish_reason": "stop", "reward": 1.0, "advantage": 0.0, "rollout_step": step, "filter_reason": None,
    } for i in range(n)]
    return from_rows(rows)


def _recorder(run_dir, **kw) -> RunRecorder:
    args = dict(run_dir=str(run_dir), steps=6, checkpoint_every=2, keep_checkpoints=2, save_all_versions=True,
                trajectory_log=True)
    args.update(kw)
    return RunRecorder(**args)


def _step(recorder: RunRecorder, trainer: SmallTrainer) -> dict:
    step = trainer.version
    trainer.train()
    metrics = {"step": step, "version": trainer.version, "reward/mean": 0.5, "rows_trained": 4,
               "optimizer_steps": trainer.optimizer_steps}
    recorder.on_rows(trainer, _batch(step), step)
    recorder.on_step(trainer, _batch(step), metrics)
    return metrics


def test_steps_write_logs_checkpoints_and_versions(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "linear"}')
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "model.safetensors").write_text("the initial weights: never exported")
    recorder, trainer = _recorder(tmp_path / "run"), SmallTrainer(model_path=str(model_dir))
    tmp_path = tmp_path / "run"
    recorder.on_start(trainer)
    metrics = [_step(recorder, trainer) for _ in range(5)]
    paths = RunPaths(tmp_path)
    assert logged_steps(paths) == [0, 1, 2, 3, 4]
    assert read_metrics(paths)["optimizer_steps"].to_list() == [1, 2, 3, 4, 5]
    assert [m.get("checkpoint") for m in metrics] == [None, 2, None, 4, None]
    import ray

    # the node of the process that trained: none outside Ray (unless this test process started one)
    assert metrics[0]["trainer_node"] == (ray.get_runtime_context().get_node_id() if ray.is_initialized() else "")
    ends = read_metrics(paths)["seconds/step_end"].to_list()  # wall clock at each step's end, in order
    assert ends == sorted(ends) and abs(ends[-1] - __import__("time").time()) < 60
    part = read_parquet(paths.trajectory_file(3))
    assert part["trainer_version"].to_pylist() == [3] * 4
    assert [c.version for c in ckpt.list_checkpoints(paths.checkpoints)] == [2, 4]
    assert sorted(p.name for p in paths.versions.iterdir()) == [f"v{v:06d}.safetensors" for v in range(6)]
    # non-finite rows go to quarantine, the partition stays schema-valid
    bad = _batch(5)
    lp = bad["inference_logprobs"].to_pylist()
    lp[1] = [float("nan"), -0.2]
    bad = bad.set_column(bad.schema.get_field_index("inference_logprobs"), "inference_logprobs",
                         pa.array(lp, pa.list_(pa.float32())))
    trainer.train()
    recorder.on_rows(trainer, bad, 5)
    recorder.on_step(trainer, bad, {"step": 5, "version": 6})
    assert read_parquet(paths.trajectory_file(5)).num_rows == 3
    assert (paths.quarantine / "step=000005.parquet").is_file()
    checkpoints = ckpt.list_checkpoints(paths.checkpoints)
    assert [c.version for c in checkpoints] == [4, 6]  # final one + retention
    # the final one is also a model directory: the final weights, the model's config and tokenizer
    assert (checkpoints[-1].path / "config.json").read_text() == '{"model_type": "linear"}'
    assert (checkpoints[-1].path / "tokenizer.json").is_file() and not (checkpoints[0].path / "config.json").exists()
    final = checkpoints[-1].model_state()
    assert all(torch.equal(final[k], v) for k, v in trainer.model.state_dict().items())
    assert checkpoints[-1].meta["sharding"] == {"method": "none", "workers": 1}


def test_resume_restores_optimizer_and_ewma_and_truncates_later_steps(tmp_path):
    recorder, trainer = _recorder(tmp_path), SmallTrainer()
    recorder.on_start(trainer)
    for _ in range(3):  # steps 0..2, checkpoint 2; step 2's logs exist beyond the checkpoint
        _step(recorder, trainer)
    paths = RunPaths(tmp_path)
    (paths.checkpoints / ".tmp-step-000004-x").mkdir()  # a checkpoint write killed mid-way
    latest = ckpt.latest_checkpoint(paths.checkpoints)
    assert latest.version == 2

    removed = truncate_after(paths, latest.version)
    assert removed == [2] and logged_steps(paths) == [0, 1]
    assert not paths.trajectory_file(2).exists() and not ckpt.version_file(paths.versions, 3).exists()
    assert not (paths.checkpoints / ".tmp-step-000004-x").exists()

    resumed = SmallTrainer(version=2, seed=1)
    resumed.model.load_state_dict(latest.model_state())
    _recorder(tmp_path, resume_from=str(latest.path)).on_start(resumed)
    saved_ewma = latest.strategy_state()
    ewma = resumed.strategy.ewma
    assert ewma.norm == pytest.approx(saved_ewma["norm"]) and ewma.steps_since_reset == 2
    for k, v in saved_ewma["weights"].items():
        assert torch.equal(ewma.weights[k], v)
    opt = resumed.optimizer.state_dict()["state"]
    assert {float(s["step"]) for s in opt.values()} == {2.0} and resumed.optimizer_steps == 2
    assert json.loads((latest.path / "meta.json").read_text())["strategy"] == "ewma"
    # a checkpoint without the strategy's state cannot resume it silently
    (latest.path / "strategy.json").unlink()
    with pytest.raises(RuntimeError, match="no state of strategy ewma"):
        _recorder(tmp_path, resume_from=str(latest.path)).on_start(SmallTrainer(version=2))

    with pytest.raises(RuntimeError, match="starts at version 3"):
        _recorder(tmp_path, resume_from=str(latest.path)).on_start(SmallTrainer(version=3))


def test_recorder_is_picklable_for_the_trainer_actor(tmp_path):
    """Ray ships the recorder to the trainer actor with its cloudpickle: the copy is equal and
    writes the run dir the original names; a metric the train step reports as a numpy scalar is
    logged as a plain number."""
    import ray.cloudpickle

    data_state = {"prompts_per_step": 4, "epoch_size": 6, "prompts_dropped_too_long": 1}
    recorder = _recorder(tmp_path, data_state=data_state)
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(recorder))
    assert copy == recorder and copy is not recorder
    trainer = SmallTrainer()
    copy.on_start(trainer)
    for _ in range(3):
        trainer.train()
        copy.on_step(trainer, _batch(trainer.version - 1), {"step": trainer.version - 1, "version": trainer.version,
                                                            "loss": np.float32(0.25)})
    paths = RunPaths(tmp_path)
    assert logged_steps(paths) == [0, 1, 2]
    metrics = read_metrics(paths)
    assert metrics["loss"].to_list() == [0.25] * 3
    assert metrics["data/epoch"].to_list() == [0, 0, 1]  # step * 4 prompts // 6 per epoch
    assert metrics["data/prompts_too_long"].to_list() == [1, 1, 1]
    meta = json.loads((ckpt.latest_checkpoint(paths.checkpoints).path / "meta.json").read_text())
    assert meta["data"] == {**data_state, "next_step": 2, "epoch": 1, "index_in_epoch": 2}


def test_start_checkpoint_lets_a_trainer_lost_before_the_first_checkpoint_be_rebuilt(tmp_path):
    """With recovery on, a new run checkpoints version 0 at its start: a trainer lost at step 1
    (before checkpoint_every) is rebuilt from it (the starting weights) plus step 0's logged rows;
    a resumed run writes no second start checkpoint."""
    from trajflow.operators.trainer.recovery import replay_plan

    recorder, trainer = _recorder(tmp_path, checkpoint_start=True, checkpoint_every=4), SmallTrainer(seed=3)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    recorder.on_start(trainer)
    (zero,) = ckpt.list_checkpoints(recorder.paths.checkpoints)
    assert zero.version == 0 and all(torch.equal(zero.model_state()[k], v) for k, v in start.items())
    _step(recorder, trainer)
    directory, version, batches = replay_plan(recorder, 1)
    assert (version, [b["trajectory_id"].to_pylist() for b in batches]) == (0, [_batch(0)["trajectory_id"].to_pylist()])
    # a resumed trainer: restores, writes nothing new at its start
    resumed = _recorder(tmp_path, checkpoint_start=True, resume_from=directory)
    resumed.on_start(SmallTrainer(seed=3))
    assert [c.version for c in ckpt.list_checkpoints(recorder.paths.checkpoints)] == [0]
    # off (recovery.max_restarts: 0): no start checkpoint
    off = _recorder(tmp_path / "off", checkpoint_every=4)
    off.on_start(SmallTrainer())
    assert ckpt.list_checkpoints(off.paths.checkpoints) == []


def test_the_source_covers_a_step_logged_before_the_trainer_died(tmp_path):
    """Rows are logged before a version is published: a trainer that died after step 3's rows
    but before its metrics left version 4 in the store, so the rebuilt trainer's plan retrains
    step 3 from the log, also when the step at hand is a retried task's earlier step."""
    from trajflow.operators.trainer.recovery import replay_plan

    recorder, trainer = _recorder(tmp_path, checkpoint_every=2), SmallTrainer()
    recorder.on_start(trainer)
    for _ in range(3):
        _step(recorder, trainer)  # steps 0-2; checkpoint 2
    trainer.train()
    recorder.on_rows(trainer, _batch(3), 3)  # ... and the process died here
    assert (recorder.last_logged_step(), recorder.metrics_logged(2), recorder.metrics_logged(3)) == (3, True, False)
    directory, version, batches = replay_plan(recorder, 3)  # the step at hand: 3 (or a retried 2)
    assert version == 2 and [b["rollout_step"][0].as_py() for b in batches] == [2, 3]
    assert replay_plan(recorder, 2)[1:] == (version, batches)
