"""Data-parallel training (issue #13): N workers and micro-batches give the one-worker update.

- loss normalisation over shards, by hand (no Ray): token-mean, seq-mean-token-mean and
  token-sum-norm over 2 shards with the global denominator equal the loss of the whole batch;
- the shard plan is deterministic, balanced and keeps micro-batches within their budget;
- real pipelines on real Ray with real gloo groups: synchronously, 2 workers (and 2 workers with
  micro-batches) log the per-step loss of 1 worker within 1e-6 and end with its weights within
  1e-5 (the pipeline's own stage objects run in this process, which is worker 0: no Ray Data
  start-up per run); on Ray Data, asynchronously, the exactness invariant holds with 2 workers
  under `snapshot` at max_staleness 1, and the workers end with the run;
- one optimizer update on 1 worker vs 2 (replicas in two threads joined by gloo): M2PO's
  gathered mask, seq-mean and token-sum normalisation, with and without micro-batches;
- the device and collective backend follow the resources (CUDA only with a GPU; the CUDA
  path itself is skipped without one).

The kill/resume and two-node tests are in tests/test_trainer_dp_jobs.py and
tests/test_jobs_cluster.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from support import SYNC, max_abs_difference, run_with_final_weights, step_rows

from trajflow.algorithms.objective import CorrectionConfig, WholeUpdate, decoupled_loss, loss_denominator
from trajflow.engines.training_numerics import TrainingNumerics, choose_device
from trajflow.operators.trainer.collective import choose_backend
from trajflow.operators.trainer.plan import padded_tokens, plan_shards
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.rl_loop import RLPipeline


# -- loss normalisation, by hand -------------------------------------------------------------------
def _batch():
    """4 sequences x 3 tokens; row 3 has no loss token. On-policy (current = old = inference), so
    with the clip inactive each kept token's loss is -A (r_s = 1)."""
    loss_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    logp = torch.full((4, 3), -1.0)
    advantages = torch.tensor([1.0, 2.0, -1.0, 5.0])
    return logp, advantages, loss_mask


@pytest.mark.parametrize("aggregation, expected", [
    # token-mean: sum over the 6 kept tokens of -A / 6 = -(3*1 + 1*2 + 2*(-1)) / 6
    ("token-mean", -(3 * 1 + 2 - 2) / 6),
    # seq-mean-token-mean: mean over the 3 sequences with a token of their token mean of -A
    ("seq-mean-token-mean", -(1 + 2 - 1) / 3),
    # token-sum-norm with loss_norm_tokens 3: sum of -A over kept tokens / (3 x 4 rows)
    ("token-sum-norm", -(3 * 1 + 2 - 2) / 12),
])
def test_loss_over_two_shards_with_the_global_denominator_equals_the_whole_batch(aggregation, expected):
    config = CorrectionConfig(aggregation=aggregation, mask_level="none", loss_norm_tokens=3)
    logp, advantages, loss_mask = _batch()
    current = logp.clone().requires_grad_(True)
    whole = decoupled_loss(current, logp, logp, advantages, loss_mask, config)
    assert float(whole.loss.detach()) == pytest.approx(expected, abs=1e-7)
    whole.loss.backward()

    shards = [torch.tensor([0, 3]), torch.tensor([1, 2])]  # uneven: 3 and 3 kept tokens, 1 and 2 sequences
    counts = [float(loss_denominator(loss_mask[s], config)) for s in shards]
    total = sum(counts)
    assert total == float(loss_denominator(loss_mask, config))
    shard_current = logp.clone().requires_grad_(True)
    losses = []
    for rows in shards:
        out = decoupled_loss(shard_current[rows], logp[rows], logp[rows], advantages[rows], loss_mask[rows], config,
                             whole=WholeUpdate(denominator=total))
        out.loss.backward()  # gradients accumulate, as over micro-batches or summed over workers
        losses.append(float(out.loss.detach()))
    assert sum(losses) == pytest.approx(expected, abs=1e-7)
    assert torch.allclose(shard_current.grad, current.grad, atol=1e-7)
    # each shard's own denominator would give a different (wrong) total
    if aggregation != "token-sum-norm" or counts[0] != counts[1]:
        local = [float(decoupled_loss(logp[s], logp[s], logp[s], advantages[s], loss_mask[s], config).loss)
                 for s in shards]
        assert sum(local) != pytest.approx(expected, abs=1e-4)


# -- the shard plan ------------------------------------------------------------------------------
def test_plan_deals_rows_balanced_in_order_and_within_the_budget():
    lengths = np.array([10, 3, 7, 7, 2, 9, 4, 6])
    plan = plan_shards(lengths, minibatches=2, world_size=2, max_tokens_per_microbatch=None)
    assert plan == plan_shards(lengths, 2, 2, None)  # deterministic
    # minibatch 0 = rows 0..3 (lengths 10 3 7 7): longest first to the lighter worker
    assert plan.microbatches[0][0] == [[0, 1]] and plan.microbatches[1][0] == [[2, 3]]
    every = sorted(r for rank in range(2) for r in plan.rows(rank))
    assert every == list(range(8))
    budgeted = plan_shards(lengths, minibatches=1, world_size=1, max_tokens_per_microbatch=20)
    micro = budgeted.microbatches[0][0]
    assert [r for m in micro for r in m] == list(range(8))  # in step order
    assert all(padded_tokens(lengths[m]) <= 20 or len(m) == 1 for m in micro)
    assert budgeted.num_microbatches == len(micro) >= 3
    # more workers than rows: a worker with no rows gets no micro-batch, but a minibatch entry
    sparse = plan_shards(np.array([5]), minibatches=1, world_size=3, max_tokens_per_microbatch=None)
    assert sparse.microbatches == [[[[0]]], [[]], [[]]]


# -- device and backend ------------------------------------------------------------------------
def test_device_and_backend_follow_the_gpu():
    assert choose_device(cuda_available=False) == "cpu" and choose_backend("cpu") == "gloo"
    assert choose_device(cuda_available=True) == "cuda" and choose_backend(choose_device(True)) == "nccl"
    numerics = TrainingNumerics(mixed_precision="bf16", device=choose_device(cuda_available=True))
    assert numerics.torch_device().type == "cuda"
    import warnings

    with warnings.catch_warnings():  # a CPU-only build warns that CUDA autocast is unavailable
        warnings.simplefilter("ignore")
        autocast = numerics.autocast()
    assert autocast.device == "cuda" and autocast.fast_dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_trainer_trains_on_cuda_with_bf16_needs_cuda(tiny):
    from trajflow.engines.sampling import SamplingConfig

    numerics = TrainingNumerics(mixed_precision="bf16")
    model = numerics.prepare(tiny[0])
    assert next(model.parameters()).device.type == "cuda"
    logprobs = numerics.logprobs(model, [[1, 5, 6]], [[7, 8]], SamplingConfig(), width=2, grad=True)
    logprobs.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


# -- one update on 1 worker vs 2 (two replicas in threads of this process, a real gloo group) -------
def _replicas_update(store, table, world_size: int, strategy_name: str, aggregation: str, budget: int | None):
    """Train one step of `table` (2 minibatches) on `world_size` replicas; returns (each replica's
    ShardResult, worker 0's weights, worker 0's strategy after-step metrics)."""
    import threading

    from trajflow.engines.models import WARM_START_DIR
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.operators.strategies.registry import resolve_strategy
    from trajflow.operators.trainer.collective import Collective, listening_socket
    from trajflow.operators.trainer.replica import ShardWork, TrainerReplica
    from trajflow.operators.trainer.spec import TrainStepConfig

    options = {"m2_threshold": 0.5} if strategy_name == "m2po" else {}
    config = PipelineConfig(optimizer={"minibatches_per_step": 2}, prompts_per_step=2, group_size=2)
    spec = TrainStepConfig(
        model_path=str(WARM_START_DIR), strategy=resolve_strategy(strategy_name)(**options),
        correction=CorrectionConfig(aggregation=aggregation, loss_norm_tokens=6, mask_level="none"),
        kl=config.settings.kl, optimizer=config.settings.optimizer, sampling=SamplingConfig(), numerics=TrainingNumerics(),
        trainer=config.settings.trainer)
    replicas = [TrainerReplica(store, spec, version=0) for _ in range(world_size)]
    lengths = np.array([len(p) + len(r) for p, r in zip(table["prompt_tokens"].to_pylist(),
                                                         table["response_tokens"].to_pylist())])
    plan = plan_shards(lengths, 2, world_size, budget)
    width = max(len(r) for r in table["response_tokens"].to_pylist())
    listen = listening_socket("127.0.0.1")
    port = listen.getsockname()[1]  # before worker 0's store takes the socket over
    results: list = [None] * world_size
    errors: list = []

    def work(rank: int) -> None:
        try:
            replica = replicas[rank]
            replica.join_group(Collective(rank, world_size, port=port, listen=listen if rank == 0 else None,
                                          timeout_seconds=60))
            rows = plan.rows(rank)
            results[rank] = replica.update(ShardWork(table.take(rows), rows, plan.microbatches[rank], 0, width)).policy
        except BaseException as e:  # surfaced below: a failed thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    metrics = replicas[0].finish_step({"active_frac": 1.0})
    return results, replicas[0].policy.policy_state_dict(), metrics


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy, aggregation, budget", [
    ("m2po", "token-mean", None),              # the mask's cutoff gathered from both workers
    ("m2po", "token-mean", 12),                # ... and from every micro-batch
    ("behavior", "seq-mean-token-mean", 12),   # PPO clip; the global sequence count
    ("behavior", "token-sum-norm", None),      # the global row count
])
def test_one_update_on_two_workers_equals_one_worker(one_torch_thread, strategy, aggregation, budget):
    """In one process, no Ray: the replicas read version 0 from an in-process store and join a
    real gloo group on threads."""
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.pipelines.policy_store import InProcessStore

    store = InProcessStore(max_staleness=0, keep_history=False)
    store.publish(load_model(WARM_START_DIR).state_dict(), 0)
    table = step_rows()
    (one,), one_weights, one_metrics = _replicas_update(store, table, 1, strategy, aggregation, None)
    two, two_weights, two_metrics = _replicas_update(store, table, 2, strategy, aggregation, budget)
    assert sum(r.microbatches for r in two) > 2 if budget else sum(r.microbatches for r in two) == 4
    assert two[0].losses == pytest.approx(one.losses, abs=1e-6) and two[1].losses == two[0].losses
    print(f"\n{strategy} {aggregation} budget {budget}: weights differ by "
          f"{max_abs_difference(two_weights, one_weights):.2e}, grad norms {one.norms} vs {two[0].norms}")
    assert max_abs_difference(one_weights, load_model(WARM_START_DIR).state_dict()) > 1e-4

    def count(results, field):
        return sum(int(getattr(out, field).sum()) for r in results for _, out in r.parts)

    for field in ("trust_masked", "clipped_low", "clipped_high", "active"):
        assert count(two, field) == count([one], field), field
    if strategy == "m2po":
        assert count([one], "trust_masked") > 0, "the mask never acted: the comparison would prove nothing"
        assert two_metrics == pytest.approx(one_metrics, rel=1e-5), (one_metrics, two_metrics)
    else:
        assert count([one], "clipped_low") + count([one], "clipped_high") > 0
    # Micro-batches pad to their own widths: forward passes round differently (~1e-7), and Adam
    # turns that into ~1e-6 on parameters whose gradient is near zero; equal shapes give 0.0.
    assert max_abs_difference(two_weights, one_weights) < (1e-5 if budget else 1e-6)


def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradient():
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.operators.trainer.learner import enable_gradient_checkpointing

    numerics, grads = TrainingNumerics(), []
    for checkpointing in (False, True):
        model = numerics.prepare(load_model(WARM_START_DIR))
        if checkpointing:
            enable_gradient_checkpointing(model)
        mlp_runs = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: mlp_runs.append(1))
        numerics.logprobs(model, [[1, 5, 6, 7]] * 3, [[8, 9, 10]] * 3, SamplingConfig(), width=3, grad=True).sum().backward()
        assert len(mlp_runs) == (2 if checkpointing else 1)  # recomputed in the backward pass
        assert not any(m.training for m in model.modules() if not hasattr(m, "_gradient_checkpointing_func"))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) <= 1e-6


# -- real pipelines ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_two_workers_and_micro_batches_reproduce_one_worker(one_worker_sync_run):
    from trajflow.engines.models import WARM_START_DIR, load_model

    one, one_weights = one_worker_sync_run  # conftest.py: SYNC on one worker
    two, two_weights = run_with_final_weights(PipelineConfig(**SYNC, trainer={"num_workers": 2}))
    micro, micro_weights = run_with_final_weights(PipelineConfig(
        **SYNC, trainer={"num_workers": 2, "max_tokens_per_microbatch": 12}))
    start = load_model(WARM_START_DIR).state_dict()
    moved = max_abs_difference(one_weights, start)
    print(f"\n1 worker moved the weights by {moved:.2e}; 2 workers differ by "
          f"{max_abs_difference(two_weights, one_weights):.2e}, 2 workers x micro-batches by "
          f"{max_abs_difference(micro_weights, one_weights):.2e}; loss {one['loss'].to_list()}")
    assert moved > 5e-4, "the updates did not move the weights: the comparison would prove nothing"
    assert (one["trainer/microbatches"] == 2).all()  # 2 minibatches, one micro-batch each
    assert (two["trainer/microbatches"] == 4).all()  # ... on each of 2 workers
    # a budget of 12 tokens: one row (7-15 tokens) per micro-batch, 4 per worker and minibatch
    assert (micro["trainer/microbatches"] >= 2 * 2 * 3).all()
    assert set(two["trainer/nodes"][0].split(",")) == {ray.get_runtime_context().get_node_id()}
    for other, weights in ((two, two_weights), (micro, micro_weights)):
        assert other["step"].to_list() == one["step"].to_list()
        assert other["rows_trained"].to_list() == one["rows_trained"].to_list()
        assert other["loss"].to_list() == pytest.approx(one["loss"].to_list(), abs=1e-6)
        assert other["grad/norm"].to_list() == pytest.approx(one["grad/norm"].to_list(), rel=1e-5)
        assert other["active_frac"].to_list() == one["active_frac"].to_list()
        assert other["optimizer_steps"].to_list() == one["optimizer_steps"].to_list()
        assert max_abs_difference(weights, one_weights) < 1e-5


IN_PROCESS_DP = """
import json, sys
import ray
import torch
from trajflow import PipelineConfig, RLPipeline, run_in_process
from trajflow.engines.models import WARM_START_DIR, load_model

torch.set_num_threads(1)
sync = json.loads(sys.argv[1])
one, one_weights = run_in_process(RLPipeline(PipelineConfig(**sync)), final_weights=True)
two, two_weights = run_in_process(RLPipeline(PipelineConfig(**sync, trainer={"num_workers": 2})), final_weights=True)
print(json.dumps({"ray_started": ray.is_initialized(),
                  "one": one.select("loss", "grad/norm", "rows_trained", "trainer/microbatches").to_dict(as_series=False),
                  "two": two.select("loss", "grad/norm", "rows_trained", "trainer/microbatches",
                                    "trainer/num_workers").to_dict(as_series=False),
                  "weights_differ": max(float((one_weights[k] - two_weights[k]).abs().max()) for k in one_weights),
                  "moved": max(float((one_weights[k] - w).abs().max())
                               for k, w in load_model(WARM_START_DIR).state_dict().items())}))
"""


@pytest.mark.timeout(300)
def test_two_workers_in_one_process_without_ray_equal_one_worker():
    """Data parallelism without Ray (pipelines/local.py): the train step's worker 1 is a thread of
    the same process (InProcessGroup), joined with worker 0 in a real gloo group; a fresh process,
    so nothing of the test session's Ray is there to be used."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IN_PROCESS_DP, json.dumps(SYNC)], capture_output=True, text=True,
                          timeout=280, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = out["one"], out["two"]
    print(f"\n2 workers in one process differ from 1 by {out['weights_differ']:.2e} (1 moved {out['moved']:.2e})")
    assert not out["ray_started"]
    assert out["moved"] > 5e-4, "the updates did not move the weights: the comparison would prove nothing"
    assert two["trainer/num_workers"] == [2] * SYNC["steps"]
    assert two["trainer/microbatches"] == [4] * SYNC["steps"] and one["trainer/microbatches"] == [2] * SYNC["steps"]
    assert two["rows_trained"] == one["rows_trained"]
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert two["grad/norm"] == pytest.approx(one["grad/norm"], rel=1e-5)
    assert out["weights_differ"] < 1e-5


@pytest.mark.timeout(300)
def test_exact_old_logprobs_with_two_workers_under_snapshot(ray_session):
    config = PipelineConfig(steps=5, prompts_per_step=4, group_size=4, drop_zero_variance_groups=False, seed=1,
                            strategy="snapshot", max_staleness=1, trainer={"num_workers": 2})
    m = RLPipeline(config).run(progress=False)  # on Ray Data, async: the real thing
    print(f"\nsnapshot S=1, 2 workers: max|log r_d| {m['mismatch/max_abs_log_rd'].max():.2e}, "
          f"max lag {m['staleness/max'].max()}")
    assert m["step"].to_list() == list(range(5))
    assert m["mismatch/max_abs_log_rd"].max() < 1e-5
    assert m["mask/token_kept_frac"].min() == 1.0
    assert 1 <= m["staleness/max"].max() <= 1
    assert (m["trainer/num_workers"] == 2).all()
    # Ray Data ended the train step: its workers and their placement group ended with the run
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
