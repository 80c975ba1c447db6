"""The optimizer settings in the train step (issue #22): the lr schedule and the entropy term.

- `optimizer.schedule` / `warmup_steps` / `min_lr_ratio`: the lr of each optimizer update
  (`optimizer/lr`, one update per step here) equals the formula computed by hand; a run resumed
  mid-schedule from a checkpoint logs the same lr, loss and weights as the uninterrupted run
  (the sharded path: tests/test_trainer_fsdp.py's resume test runs with a schedule too);
- `optimizer.betas` / `eps` are the AdamW's;
- `correction.entropy_coef > 0`: the train step's loss drops by coef x the token-mean entropy of
  the policy (computed here from the logits, independently), and its gradient by coef x that
  entropy's gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support import SYNC, max_abs_difference, run_with_final_weights, step_rows

from trajflow.pipelines.config import PipelineConfig

# 4 steps x 1 update, warm-up over 1 update, cosine to 0 at update N = 4
SCHEDULE = dict(SYNC, steps=4, optimizer={"minibatches_per_step": 1, "schedule": "cosine", "warmup_steps": 1,
                                          "lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6})


@pytest.mark.timeout(300)
def test_lr_per_update_follows_the_schedule_and_survives_a_resume(ray_session, tmp_path):
    from trajflow.engines import checkpoint as ckpt
    from trajflow.jobs.recorder import RunRecorder

    config = PipelineConfig(**SCHEDULE)

    def recorder(run_dir, resume_from=None) -> RunRecorder:
        return RunRecorder(run_dir=str(run_dir), steps=4, checkpoint_every=2, keep_checkpoints=5,
                           save_all_versions=False, trajectory_log=False, resume_from=resume_from)

    whole, whole_weights = run_with_final_weights(config, recorder=recorder(tmp_path / "whole"))
    # by hand, u = update index: u=0 warm-up 1/1; then p = (u - 1) / 3 and (1 + cos(pi p)) / 2
    expected = [1e-3 * m for m in (1.0, 1.0, 0.75, 0.25)]
    assert whole["optimizer/lr"].to_list() == pytest.approx(expected, rel=1e-9)
    assert whole["optimizer_steps"].to_list() == [1, 2, 3, 4]

    run_with_final_weights(config, range(0, 2), recorder=recorder(tmp_path / "cut"))  # then "killed"
    checkpoint = ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert checkpoint.version == 2
    resumed, resumed_weights = run_with_final_weights(config, range(2, 4), initial_weights=checkpoint.model_state(),
                                                      recorder=recorder(tmp_path / "cut", str(checkpoint.path)))
    print(f"\nlr {whole['optimizer/lr'].to_list()}; resumed vs uninterrupted weights differ by "
          f"{max_abs_difference(resumed_weights, whole_weights):.1e}")
    assert resumed["optimizer/lr"].to_list() == whole["optimizer/lr"].to_list()[2:]
    assert resumed["loss"].to_list() == pytest.approx(whole["loss"].to_list()[2:], abs=1e-7)
    assert max_abs_difference(resumed_weights, whole_weights) < 1e-7


def _replica(entropy_coef: float, **optimizer):
    from trajflow.algorithms.config import CorrectionConfig
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.engines.training_numerics import TrainingNumerics
    from trajflow.operators.strategies.registry import resolve_strategy
    from trajflow.operators.trainer.replica import TrainerReplica
    from trajflow.operators.trainer.spec import TrainStepConfig
    from trajflow.pipelines.policy_store import InProcessStore

    store = InProcessStore(max_staleness=0, keep_history=False)
    store.publish(load_model(WARM_START_DIR).state_dict(), 0)
    config = PipelineConfig(optimizer={"minibatches_per_step": 1, **optimizer})
    spec = TrainStepConfig(
        model_path=str(WARM_START_DIR), strategy=resolve_strategy("behavior")(),
        correction=CorrectionConfig(aggregation="token-mean", mask_level="none", entropy_coef=entropy_coef),
        kl=config.settings.kl, optimizer=config.settings.optimizer, sampling=SamplingConfig(), numerics=TrainingNumerics(),
        trainer=config.settings.trainer)
    return TrainerReplica(store, spec, version=0)


def _entropy(model: torch.nn.Module, prompts: list, responses: list, width: int) -> torch.Tensor:
    """Per-token entropy [B, width] of softmax(logits) at each response position, from scratch."""
    rows = []
    for p, r in zip(prompts, responses):
        logits = model(torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1].float()
        h = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        rows.append(torch.nn.functional.pad(h, (0, width - len(r))))
    return torch.stack(rows)


def test_adam_gets_the_configured_betas_and_eps(one_torch_thread):
    group = _replica(0.0, betas=[0.8, 0.95], eps=1e-6).policy.optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6


def test_entropy_term_changes_the_step_loss_and_gradient_by_hand(one_torch_thread):
    from trajflow.operators.trainer.correction import StepBatch, correct

    coef = 0.3
    table = step_rows(rows=4)
    batch = StepBatch.from_table(table, 0)
    positions = list(range(table.num_rows))
    plain, with_entropy = _replica(0.0).policy, _replica(coef).policy
    h = _entropy(plain.model, batch.prompts, batch.responses, batch.width)
    counted = batch.loss_mask & torch.isfinite(batch.inference)
    h_mean = (h * counted).sum() / counted.sum()

    # the gradient of one update's loss: with the term minus without it = -coef x grad(mean H)
    grads = []
    for replica in (plain, with_entropy):
        replica.model.zero_grad()
        found: list = []
        current = replica.current(batch, grad=True, entropy=found if replica is with_entropy else None)
        fixed = correct(replica.strategy, batch, current, replica, replica.correction,
                        entropy=found[0] if found else None)
        fixed.loss.loss.backward()
        grads.append({k: p.grad.clone() for k, p in replica.model.named_parameters()})
    plain.model.zero_grad()
    h_mean_grad = torch.autograd.grad(h_mean, list(plain.model.parameters()), allow_unused=True)
    names = [k for k, _ in plain.model.named_parameters()]
    worst = 0.0
    for name, g in zip(names, h_mean_grad):
        g = torch.zeros_like(grads[0][name]) if g is None else g
        worst = max(worst, float((grads[1][name] - grads[0][name] + coef * g).abs().max()))
    moved = max(float((coef * g).abs().max()) for g in h_mean_grad if g is not None)
    print(f"\nH mean {h_mean.item():.4f}; entropy gradient up to {moved:.2e}, off by {worst:.1e}")
    assert moved > 1e-4 and worst < 1e-5

    # the train step's own update applies the term: its loss is lower by coef x mean H
    from trajflow.operators.trainer.replica import ShardWork

    workers = [_replica(0.0), _replica(coef)]
    one, two = (w.update(ShardWork(table, positions, [[positions]], 0, batch.width)).policy for w in workers)
    assert two.losses[0] - one.losses[0] == pytest.approx(-coef * h_mean.item(), abs=1e-5)
    assert math.isfinite(two.lr) and two.lr == one.lr == plain.spec.optimizer.lr
    assert np.isfinite(two.norms).all()
