"""The critic as a learner on the session's Ray (operators/trainer/learner.py): two data-parallel
workers and two FSDP workers train it as one worker does, and a run resumed from a checkpoint
restores both learners, weights and optimizer, exactly. The killed-worker recovery of a PPO run:
tests/test_recovery.py."""

from __future__ import annotations

import pytest
import torch
from support import SYNC, max_abs_difference, run_with_final_weights

from trajflow.pipelines.config import PipelineConfig

# the synchronous pipeline of the data-parallel tests, with a critic (2 updates per step each)
PPO_SYNC = dict(SYNC, advantage={"estimator": "gae", "lam": 0.95},
                critic={"optimizer": {"lr": 3e-3, "minibatches_per_step": 2}})


def _recorder(run_dir, steps: int, resume_from: str | None = None, log: bool = False):
    """The job's recorder; `log`: the trajectory log and every version (both learners'), for a replay."""
    from trajflow.jobs.recorder import RunRecorder

    return RunRecorder(run_dir=str(run_dir), steps=steps, checkpoint_every=2, keep_checkpoints=5,
                       save_all_versions=log, trajectory_log=log, resume_from=resume_from)


def _critic_state(run_dir) -> tuple[dict, dict | None]:
    """The last checkpoint's critic weights and optimizer state (None: a sharded checkpoint's,
    in shards)."""
    from trajflow.engines import checkpoint as ckpt
    from trajflow.operators.contracts.store import CRITIC
    from trajflow.operators.trainer.state import learner_dir

    last = ckpt.latest_checkpoint(run_dir / "checkpoints")
    saved = ckpt.Checkpoint(learner_dir(last.path, CRITIC), last.version)
    return saved.model_state(), None if saved.sharded else saved.optimizer_state()


@pytest.fixture(scope="module")
def one_worker_ppo(ray_session, tmp_path_factory):
    """The PPO pipeline on one worker: (metrics, final policy weights, run dir)."""
    run_dir = tmp_path_factory.mktemp("ppo-one")
    metrics, weights = run_with_final_weights(PipelineConfig(**PPO_SYNC),
                                              recorder=_recorder(run_dir, SYNC["steps"], log=True))
    return metrics, weights, run_dir


@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", [{"num_workers": 2}, {"sharding": "fsdp", "num_workers": 2}],
                         ids=["2 workers", "fsdp x 2"])
def test_two_workers_train_the_critic_as_one_does(one_worker_ppo, tmp_path, trainer):
    one, one_weights, one_dir = one_worker_ppo
    run_dir = tmp_path / "run"
    other, weights = run_with_final_weights(PipelineConfig(**PPO_SYNC, trainer=trainer),
                                            recorder=_recorder(run_dir, SYNC["steps"]))
    one_critic, _ = _critic_state(one_dir)
    critic, _ = _critic_state(run_dir)
    print(f"\n{trainer}: value loss {one['critic/value_loss'].to_list()}, differs by "
          f"{max(abs(a - b) for a, b in zip(other['critic/value_loss'], one['critic/value_loss'])):.1e}; "
          f"critic weights by {max_abs_difference(critic, one_critic):.1e}")
    assert max_abs_difference(one_critic, _critic_state(one_dir)[0]) == 0.0
    assert other["critic/value_loss"].to_list() == pytest.approx(one["critic/value_loss"].to_list(), abs=1e-6)
    assert other["loss"].to_list() == pytest.approx(one["loss"].to_list(), abs=1e-6)
    assert other["critic/explained_variance"].to_list() == pytest.approx(
        one["critic/explained_variance"].to_list(), rel=1e-5, abs=1e-6)
    assert max_abs_difference(critic, one_critic) < 1e-5
    assert max_abs_difference(weights, one_weights) < 1e-5
    from trajflow.engines.models import WARM_START_DIR
    from trajflow.engines.value_model import load_value_model

    assert max_abs_difference(one_critic, load_value_model(WARM_START_DIR).state_dict()) > 1e-3, \
        "the critic did not move: the comparison would prove nothing"


@pytest.mark.timeout(600)
def test_a_resumed_ppo_run_restores_both_learners_exactly(one_worker_ppo, tmp_path):
    from trajflow.engines import checkpoint as ckpt
    from trajflow.operators.contracts.store import CRITIC, POLICY
    from trajflow.operators.trainer.state import learner_weights

    whole, whole_weights, whole_dir = one_worker_ppo
    steps = SYNC["steps"]
    config = PipelineConfig(**PPO_SYNC)
    cut = tmp_path / "cut"
    run_with_final_weights(config, range(0, 2), recorder=_recorder(cut, steps))  # then "killed"
    checkpoint = ckpt.latest_checkpoint(cut / "checkpoints")
    assert checkpoint.version == 2 and (checkpoint.path / CRITIC / "model.safetensors").is_file()
    weights = learner_weights(checkpoint.path, [POLICY, CRITIC])
    resumed, resumed_weights = run_with_final_weights(config, range(2, steps), initial_weights=weights,
                                                      recorder=_recorder(cut, steps, str(checkpoint.path)))
    critic, critic_optimizer = _critic_state(cut)
    whole_critic, whole_optimizer = _critic_state(whole_dir)
    print(f"\nresumed vs uninterrupted: policy {max_abs_difference(resumed_weights, whole_weights):.1e}, "
          f"critic {max_abs_difference(critic, whole_critic):.1e}")
    for key in ("loss", "critic/value_loss", "critic/explained_variance", "critic/lr"):
        assert resumed[key].to_list() == pytest.approx(whole[key].to_list()[2:], abs=1e-7), key
    assert max_abs_difference(resumed_weights, whole_weights) < 1e-7
    assert max_abs_difference(critic, whole_critic) < 1e-7
    moments = [(a, b) for a, b in zip(_tensors(critic_optimizer), _tensors(whole_optimizer))]
    assert moments and max(float((a - b).abs().max()) for a, b in moments) < 1e-7


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) optimizer state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.timeout(600)
def test_a_ppo_log_replays_reading_its_values_and_retraces_both_learners(one_worker_ppo):
    """--diagnose reads the log's values (each token's at its value version, no critic needed) and
    recomputes GAE on them; --train starts its critic from the first step's version of it and
    retraces the run: the policy's and the critic's losses, and the final policy weights. (The
    run makes 2 updates per step, so a diagnosis, one set of weights per step, has other losses.)"""
    from trajflow.engines import checkpoint as ckpt
    from trajflow.pipelines.replay import Replay

    logged, _, run_dir = one_worker_ppo
    config = PipelineConfig(**PPO_SYNC)
    assert (run_dir / "versions" / "critic" / "v000003.safetensors").is_file()  # both learners' versions kept
    diagnosed = Replay(config, run_dir / "trajectories", run_dir / "versions", ["snapshot"], "diagnose").run(
        progress=False)
    assert diagnosed["rows_trained"].to_list() == logged["rows_trained"].to_list()
    assert diagnosed["mask/token_kept_frac"].to_list() == pytest.approx(logged["mask/token_kept_frac"].to_list())
    trained = Replay(config, run_dir / "trajectories", run_dir, ["snapshot"], "train")
    metrics = trained.run(progress=False)
    assert metrics["version"].to_list() == logged["version"].to_list()
    for key in ("loss", "critic/value_loss", "critic/explained_variance"):
        assert metrics[key].to_list() == pytest.approx(logged[key].to_list(), rel=1e-5, abs=1e-6), key
    final = ckpt.load_weights(run_dir / "versions" / f"v{SYNC['steps']:06d}.safetensors")
    assert max_abs_difference(trained.final_weights, final) < 1e-5
