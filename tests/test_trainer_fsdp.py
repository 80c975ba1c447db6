"""The sharded trainer (`trainer.sharding: fsdp`, issue #21): FSDP2 workers give the one-worker update.

- the plan in lockstep: every worker gets as many passes per update as the busiest (dummies);
- numerics: FSDP with float32 parameters under the training numerics' autocast keeps r_s = 1
  on-policy against the pi_old scorer, while FSDP's bf16 parameter policy does not;
- the CPU-offload and backend choices (the CUDA part skipped without a GPU);
- real pipelines on real Ray with a real gloo group (worker 0 is this process, worker 1 a Ray
  actor): synchronously, 2 sharded workers log the per-step loss of 1 unsharded worker within
  1e-6 and end with its weights within 1e-5 with gradient checkpointing, and so do 3 with
  micro-batches (dummy passes included); each holds about 1/N of its bytes of parameters,
  gradients and optimizer state; the strategies whose state follows the weights (ewma) or that
  score with the policy (recompute) or gather statistics (m2po) give the unsharded run's numbers
  (asynchronously on Ray Data, exactness with 2 workers: tests/test_weight_sync.py);
- `full_weights()`: every worker gathers in step, tied weights stay one tensor, the dtype is the
  reader's, and a consumer that stops early leaves the workers in step;
- checkpoints: every worker writes its shards (safetensors + JSON, nothing pickled), a run resumed
  from a sharded checkpoint equals the uninterrupted run, and the last checkpoint is a plain
  Hugging Face model directory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import SYNC, max_abs_difference, run_with_final_weights

from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.trainer.collective import Collective
from trajflow.operators.trainer.plan import plan_shards
from trajflow.pipelines.config import PipelineConfig


# -- the plan ---------------------------------------------------------------------------------
def test_plan_in_lockstep_pads_every_worker_to_the_busiest():
    lengths = np.array([10, 3, 7, 7, 2, 9, 4, 6, 12, 5])
    free = plan_shards(lengths, minibatches=2, world_size=3, max_tokens_per_microbatch=14)
    step = plan_shards(lengths, minibatches=2, world_size=3, max_tokens_per_microbatch=14, lockstep=True)
    for rank in range(3):
        assert step.rows(rank) == free.rows(rank)  # the same rows, in the same micro-batches
        for m in range(2):
            assert [micro for micro in step.microbatches[rank][m] if micro] == free.microbatches[rank][m]
    for m in range(2):
        passes = {len(step.microbatches[rank][m]) for rank in range(3)}
        assert passes == {max(len(free.microbatches[rank][m]) for rank in range(3))}
    assert step.num_microbatches == free.num_microbatches  # dummies are not micro-batches
    assert sum(not micro for worker in step.microbatches for mb in worker for micro in mb) > 0


# -- numerics -----------------------------------------------------------------------------------
def test_float32_parameters_under_autocast_keep_r_s_one_where_bf16_parameters_do_not(one_torch_thread):
    """bf16 training numerics: pi_theta of the sharded policy against pi_old of the scorer
    (the unsharded model in TrainingNumerics), on the same weights: r_s must be exactly 1."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.operators.trainer.fsdp import decoder_layers, shard_model

    numerics, sampling = TrainingNumerics(mixed_precision="bf16"), SamplingConfig()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 40, 6).tolist() for _ in range(4)]
    responses = [rng.integers(4, 40, 5).tolist() for _ in range(4)]
    old = numerics.logprobs(numerics.prepare(load_model(WARM_START_DIR)), prompts, responses, sampling, width=5)
    collective = Collective(default_group=True)  # a group of one in this process
    try:
        ours = load_model(WARM_START_DIR)
        shard_model(ours, collective.mesh)
        bf16_params = load_model(WARM_START_DIR)
        for module in [*decoder_layers(bf16_params), bf16_params]:
            fully_shard(module, mesh=collective.mesh,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        assert isinstance(ours, FSDPModule) and isinstance(bf16_params, FSDPModule)
        current = numerics.logprobs(ours, prompts, responses, sampling, width=5, grad=True)
        other = numerics.logprobs(bf16_params, prompts, responses, sampling, width=5)
    finally:
        collective.close()
    gap = float((other - old).abs().max())
    print(f"\nmax |log r_s| on-policy: float32 params {float((current - old).abs().max()):.1e}, "
          f"bf16 params {gap:.1e}")
    assert torch.equal(current.detach(), old)  # r_s == 1 exactly
    assert gap > 1e-3  # the bf16 parameter policy computes another pi_theta: r_s != 1 on-policy
    assert not torch.distributed.is_initialized()  # closed cleanly: the next test may build its own


def test_gradient_checkpointing_recomputes_sharded_layers(one_torch_thread):
    """Checkpointing inside FSDP units: each layer runs its forward again in the backward pass
    (gathered again), and the gradient is the one without checkpointing."""
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.operators.trainer.fsdp import full, shard_model
    from trajflow.operators.trainer.learner import enable_gradient_checkpointing

    numerics, grads = TrainingNumerics(), []
    collective = Collective(default_group=True)
    try:
        for checkpointing in (False, True):
            model = load_model(WARM_START_DIR)
            if checkpointing:
                enable_gradient_checkpointing(model)
            shard_model(model, collective.mesh)
            mlp_runs = []
            model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: mlp_runs.append(1))
            numerics.logprobs(model, [[1, 5, 6, 7]] * 3, [[8, 9, 10]] * 3, SamplingConfig(), width=3,
                              grad=True).sum().backward()
            assert len(mlp_runs) == (2 if checkpointing else 1)
            grads.append([full(p.grad) for p in model.parameters()])
    finally:
        collective.close()
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) <= 1e-6


# -- device, backend, offload -------------------------------------------------------------------
def test_offload_and_backend_follow_the_device():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from trajflow.operators.trainer.collective import choose_backend
    from trajflow.operators.trainer.fsdp import offload_policy

    assert isinstance(offload_policy(True, "cuda"), CPUOffloadPolicy) and offload_policy(True, "cuda").pin_memory
    for cpu_offload, device in ((True, "cpu"), (False, "cuda"), (False, "cpu")):
        assert not isinstance(offload_policy(cpu_offload, device), CPUOffloadPolicy)  # the no-op policy
    assert choose_backend("cuda") == "nccl" and choose_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="cpu_offload: needs sharding: fsdp"):
        PipelineConfig(trainer={"cpu_offload": True})
    dp = PipelineConfig(trainer={"sharding": "fsdp", "cpu_offload": True, "num_workers": 2}).settings.trainer
    assert (dp.sharding, dp.cpu_offload, dp.num_workers) == ("fsdp", True, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_sharded_trainer_on_cuda_with_nccl_and_cpu_offload_needs_cuda(one_torch_thread):
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.operators.trainer.fsdp import shard_model

    numerics = TrainingNumerics(mixed_precision="bf16")
    collective = Collective(device=numerics.torch_device(), default_group=True)
    try:
        assert torch.distributed.get_backend() == "nccl"
        model = load_model(WARM_START_DIR)
        shard_model(model, collective.mesh, cpu_offload=True)
        assert next(model.parameters()).device.type == "cpu"  # offloaded shards
        logprobs = numerics.logprobs(model, [[1, 5, 6]], [[7, 8]], SamplingConfig(), width=2, grad=True)
        logprobs.sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        collective.close()


# -- real pipelines -------------------------------------------------------------------------------
FSDP2 = {"sharding": "fsdp", "num_workers": 2}


@pytest.mark.timeout(600)
def test_two_sharded_workers_reproduce_one_unsharded_worker(one_worker_sync_run):
    """Two runs cover four cases: gradient checkpointing on 2 workers (no dummy passes), and on
    3 workers one row per micro-batch (micro-batches and dummy passes; no checkpointing). The
    checkpointed gradient equals the plain one layer by layer in
    test_gradient_checkpointing_recomputes_sharded_layers."""
    from trajflow.engines.models import WARM_START_DIR, load_model

    one, one_weights = one_worker_sync_run  # conftest.py: SYNC on one unsharded worker
    runs = {
        "fsdp + gradient checkpointing": run_with_final_weights(PipelineConfig(
            **SYNC, trainer={**FSDP2, "gradient_checkpointing": True})),
        # 16 rows of 7-12 tokens, 2 updates, one row per micro-batch on 3 workers: 3, 3 and 2
        # passes per update, so worker 2 adds a dummy
        "fsdp x 3 + micro-batches + dummy passes": run_with_final_weights(PipelineConfig(
            **SYNC, trainer={"sharding": "fsdp", "num_workers": 3, "max_tokens_per_microbatch": 12})),
    }
    moved = max_abs_difference(one_weights, load_model(WARM_START_DIR).state_dict())
    print(f"\n1 unsharded worker moved the weights by {moved:.2e}; loss {one['loss'].to_list()}")
    assert moved > 5e-4, "the updates did not move the weights: the comparison would prove nothing"
    for name, (other, weights) in runs.items():
        print(f"{name}: weights differ by {max_abs_difference(weights, one_weights):.2e}, loss by "
              f"{max(abs(a - b) for a, b in zip(other['loss'], one['loss'])):.1e}")
        workers = int(other["trainer/num_workers"][0])
        assert other["step"].to_list() == one["step"].to_list()
        assert other["rows_trained"].to_list() == one["rows_trained"].to_list()
        assert other["loss"].to_list() == pytest.approx(one["loss"].to_list(), abs=1e-6)
        assert other["grad/norm"].to_list() == pytest.approx(one["grad/norm"].to_list(), rel=1e-5)
        assert other["active_frac"].to_list() == one["active_frac"].to_list()
        assert other["optimizer_steps"].to_list() == one["optimizer_steps"].to_list()
        assert max_abs_difference(weights, one_weights) < 1e-5
        # each worker holds about 1/N of the replica's parameters, gradients and Adam moments
        for kind in ("parameter", "gradient", "optimizer"):
            ratio = other[f"trainer/{kind}_bytes"].max() / one[f"trainer/{kind}_bytes"].max()
            assert 1 / workers <= ratio < 1.06 / workers, (name, kind, ratio)  # + padding to equal shards
    assert (runs["fsdp + gradient checkpointing"][0]["trainer/dummy_passes"] == 0).all()
    three = runs["fsdp x 3 + micro-batches + dummy passes"][0]
    assert (three["trainer/microbatches"] == 16).all() and (three["trainer/dummy_passes"] == 2).all()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ewma", "recompute", "m2po"])
def test_strategies_that_score_or_gather_give_the_unsharded_numbers(ray_session, strategy):
    """ewma: each worker keeps the EWMA of its shards and scores with a sharded copy of the
    policy; recompute (2 updates per step): scores the whole step with the policy first; m2po:
    its mask's statistics are gathered from every worker. On 3 workers with one row per
    micro-batch (so one worker makes a dummy pass per update, which must score too), each
    equals one unsharded worker."""
    config = dict(SYNC, steps=3, strategy=strategy)
    one, one_weights = run_with_final_weights(PipelineConfig(**config))
    two, two_weights = run_with_final_weights(PipelineConfig(
        **config, trainer={"sharding": "fsdp", "num_workers": 3, "max_tokens_per_microbatch": 12}))
    assert (two["trainer/dummy_passes"] > 0).all()
    print(f"\n{strategy}: weights differ by {max_abs_difference(two_weights, one_weights):.2e}")
    assert two["loss"].to_list() == pytest.approx(one["loss"].to_list(), abs=1e-6)
    assert max_abs_difference(two_weights, one_weights) < 1e-5
    keys = [k for k in one.columns if k.startswith(f"{strategy}/")] + ["mask/token_kept_frac", "clip/frac"]
    assert len(keys) > 2 or strategy == "recompute"
    for key in keys:  # m2po's M2 (~1e-3) of log-ratios that differ by ~1e-7 between batch layouts
        assert two[key].to_list() == pytest.approx(one[key].to_list(), rel=1e-4, abs=1e-9), key


@pytest.mark.timeout(300)
def test_full_weights_gathers_on_every_worker_in_step(ray_session):
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(**SYNC, trainer={**FSDP2, "collective_timeout_seconds": 60}))
    store = pipe.start_store()
    stage = pipe.stage("train")
    trainstep = stage.fn(store=store, **stage.kwargs)
    try:
        start = load_model(WARM_START_DIR).state_dict()
        shard = dict(trainstep.policy.model.state_dict())["model.layers.0.mlp.up_proj.weight"]
        assert shard.to_local().shape[0] == start["model.layers.0.mlp.up_proj.weight"].shape[0] // 2
        full = dict(trainstep.full_weights())
        assert list(full) == list(start) and max_abs_difference(full, start) == 0.0
        assert full["lm_head.weight"] is full["model.embed_tokens.weight"]  # tied: one tensor
        bf16 = dict(trainstep.full_weights(torch.bfloat16))
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, start[k].to(torch.bfloat16)) for k, t in bf16.items())
        early = trainstep.full_weights()
        next(early)
        early.close()  # stopped after one tensor: the gathers still finish on every worker
        assert max_abs_difference(dict(trainstep.full_weights()), start) == 0.0  # and they are in step
        policy = trainstep.unsharded_policy()
        assert max_abs_difference(policy.state_dict(), start) == 0.0
    finally:
        trainstep.close()
        pipe.shutdown()
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(600)
def test_a_run_resumed_from_a_sharded_checkpoint_equals_the_uninterrupted_run(ray_session, tmp_path):
    """ewma on 2 sharded workers (its EWMA is sharded state too), checkpoint every 2 steps, under
    a linear lr schedule with warm-up (its position: the optimizer's step count in the shards)."""
    from trajflow.engines import checkpoint as ckpt
    from trajflow.engines.models import load_model
    from trajflow.jobs.recorder import RunRecorder

    schedule = {"minibatches_per_step": 2, "schedule": "linear", "warmup_steps": 3}
    config = PipelineConfig(**dict(SYNC, steps=4, strategy="ewma", optimizer=schedule), trainer=FSDP2)

    def recorder(run_dir, resume_from=None) -> RunRecorder:
        return RunRecorder(run_dir=str(run_dir), steps=4, checkpoint_every=2, keep_checkpoints=5,
                           save_all_versions=False, trajectory_log=False, resume_from=resume_from)

    whole, whole_weights = run_with_final_weights(config, recorder=recorder(tmp_path / "whole"))
    # its checkpoint at version 2 is the one a run killed after step 2 leaves (steps 0-1 are the same)
    checkpoint = {c.version: c for c in ckpt.list_checkpoints(tmp_path / "whole" / "checkpoints")}[2]
    assert checkpoint.version == 2 and checkpoint.sharded and checkpoint.meta["sharding"] == {
        "method": "fsdp", "workers": 2}
    for name in ("model", "optimizer", "strategy"):  # one file per worker; no pickled metadata
        assert sorted(p.name for p in (checkpoint.path / "shards" / name).iterdir()) == [
            f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert {p.suffix for p in checkpoint.path.rglob("*") if p.is_file()} == {".safetensors", ".json"}
    resumed, resumed_weights = run_with_final_weights(config, range(2, 4), initial_weights=checkpoint.model_state(),
                                                      recorder=recorder(tmp_path / "resumed", str(checkpoint.path)))
    print(f"\nresumed vs uninterrupted: weights differ by {max_abs_difference(resumed_weights, whole_weights):.1e}, "
          f"losses {resumed['loss'].to_list()} vs {whole['loss'].to_list()[2:]}")
    assert resumed["loss"].to_list() == pytest.approx(whole["loss"].to_list()[2:], abs=1e-7)
    assert resumed["optimizer_steps"].to_list() == whole["optimizer_steps"].to_list()[2:]
    assert len(set(whole["optimizer/lr"].to_list())) == 4  # the lr moved every step
    assert resumed["optimizer/lr"].to_list() == whole["optimizer/lr"].to_list()[2:]
    assert resumed["ewma/age"].to_list() == whole["ewma/age"].to_list()[2:]
    assert max_abs_difference(resumed_weights, whole_weights) < 1e-7
    # the last checkpoint is a plain Hugging Face model directory with the final weights
    final = ckpt.latest_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert final.version == 4 and (final.path / "config.json").is_file()
    assert max_abs_difference(load_model(final.path).state_dict(), resumed_weights) == 0.0


@pytest.mark.timeout(900)
def test_lora_on_two_sharded_workers_ends_where_lora_on_one_worker_does(ray_session, tmp_path):
    """LoRA (r 8) with FSDP x 2, the adapter sharded with its layer: the same per-step loss
    (1e-6), gradient norms and final adapter (1e-5) as LoRA on one unsharded worker; each worker
    holds about half of the adapter's parameters, gradients and Adam moments (the frozen base is
    not counted: the optimizer has only the adapter). Its checkpoints keep the adapter's shards
    and the whole adapter (not the base); a run resumed from one equals the uninterrupted run."""
    from trajflow.engines import checkpoint as ckpt
    from trajflow.engines import lora
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.jobs.recorder import RunRecorder

    config = dict(SYNC, steps=4, lora={"r": 8, "alpha": 16.0})

    def recorder(run_dir, resume_from=None) -> RunRecorder:
        return RunRecorder(run_dir=str(run_dir), steps=4, checkpoint_every=2, keep_checkpoints=5,
                           save_all_versions=False, trajectory_log=False, resume_from=resume_from)

    one, one_adapter = run_with_final_weights(PipelineConfig(**config))
    sharded = PipelineConfig(**config, trainer=FSDP2)
    two, two_adapter = run_with_final_weights(sharded, recorder=recorder(tmp_path / "whole"))
    assert lora.is_adapter(one_adapter) and lora.is_adapter(two_adapter)
    moved = max(float(v.abs().max()) for k, v in one_adapter.items() if ".lora_B." in k)
    gap = max_abs_difference(two_adapter, one_adapter)
    print(f"\nLoRA, fsdp x 2 vs 1 worker: adapter differs by {gap:.1e} (lora_B moved {moved:.1e}), loss by "
          f"{max(abs(a - b) for a, b in zip(two['loss'], one['loss'])):.1e}")
    assert moved > 1e-4, "lora_B is still 0: the comparison would prove nothing"
    assert two["loss"].to_list() == pytest.approx(one["loss"].to_list(), abs=1e-6)
    assert two["grad/norm"].to_list() == pytest.approx(one["grad/norm"].to_list(), rel=1e-5)
    assert two["optimizer_steps"].to_list() == one["optimizer_steps"].to_list()
    assert gap < 1e-5
    for kind in ("parameter", "gradient", "optimizer"):  # the adapter's bytes, halved (+ padding)
        ratio = two[f"trainer/{kind}_bytes"].max() / one[f"trainer/{kind}_bytes"].max()
        assert 0.5 <= ratio < 0.56, (kind, ratio)
    checkpoint = {c.version: c for c in ckpt.list_checkpoints(tmp_path / "whole" / "checkpoints")}[2]
    assert checkpoint.sharded and (checkpoint.path / ckpt.ADAPTER_FILE).is_file()
    shards = sum(p.stat().st_size for p in (checkpoint.path / "shards" / "model").iterdir())
    assert shards < 1.2 * (checkpoint.path / ckpt.ADAPTER_FILE).stat().st_size  # the adapter's shards only
    resumed, resumed_adapter = run_with_final_weights(
        sharded, range(2, 4), initial_weights=checkpoint.model_state(),
        recorder=recorder(tmp_path / "resumed", str(checkpoint.path)))
    assert resumed["loss"].to_list() == pytest.approx(two["loss"].to_list()[2:], abs=1e-7)
    assert max_abs_difference(resumed_adapter, two_adapter) < 1e-7
    final = ckpt.latest_checkpoint(tmp_path / "resumed" / "checkpoints")  # exported: the adapter merged in
    expected = lora.merged(load_model(WARM_START_DIR).state_dict(), resumed_adapter)
    assert max_abs_difference(ckpt.load_weights(final.path / "model.safetensors"), expected) < 1e-6
