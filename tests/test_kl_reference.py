"""The KL penalty to a frozen reference model (`kl:`): where the reference is scored, what it
writes, and that it holds the policy closer to the reference than the same run without it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from trajflow.algorithms.config import AdvantageConfig, KLConfig
from trajflow.engines.models import load_model, load_tokenizer
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.torch_engine import TorchEngine
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.advantage import Advantage
from trajflow.operators.reference import ReferenceLogprobs
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.local import run_in_process
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.tasks.workload import Workload

SMALL = dict(prompts_per_step=8, group_size=4, drop_zero_variance_groups=False, seed=4, max_staleness=0)


def _names(**kl) -> list[str]:
    return [s.name for s in RLPipeline(PipelineConfig(**SMALL, kl=kl)).stages]


def test_beta_zero_builds_no_reference_and_the_kl_goes_where_it_acts():
    assert "reference" not in _names()
    assert "reference" not in _names(beta=0.0, **{"in": "reward"})
    assert _names(beta=0.1) == ["generate", "reward", "advantage", "filter", "old_logprobs", "reference", "train"]
    assert _names(beta=0.1, **{"in": "reward"}) == ["generate", "reward", "reference", "advantage", "filter",
                                                    "old_logprobs", "train"]


def _rollout(model_path, rows: int = 8):
    """A step of trajectories generated at float32 by the model itself (so mu = pi_ref)."""
    tokenizer = load_tokenizer(model_path)
    source = Workload(task="addition").prompt_source(tokenizer, seed=1, prompts_per_step=rows)
    prompts = source.step_rows(0)["prompt_tokens"].to_pylist()
    engine = TorchEngine(load_model(model_path), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                         sampling=SamplingConfig(), seed=0)
    gens = engine.generate(prompts, n=2)
    return pa.table({
        "group_id": [f"g{g.prompt_index}" for g in gens],
        "prompt_tokens": pa.array([prompts[g.prompt_index] for g in gens], pa.list_(pa.int32())),
        "response_tokens": pa.array([g.response_tokens for g in gens], pa.list_(pa.int32())),
        "inference_logprobs": pa.array([g.logprobs for g in gens], pa.list_(pa.float32())),
        "loss_mask": pa.array([[True] * len(g.response_tokens) for g in gens], pa.list_(pa.bool_())),
        "reward": pa.array(np.linspace(0, 1, len(gens)), pa.float32()),
    })


def test_reference_scores_in_training_numerics_and_penalises_the_reward_in_reward_mode(one_torch_thread):
    from trajflow.engines.models import WARM_START_DIR

    batch = _rollout(WARM_START_DIR)
    kl = KLConfig(beta=0.5, estimator="k1", in_="reward")
    op = ReferenceLogprobs(None, WARM_START_DIR, kl, SamplingConfig(), TrainingNumerics(), skip_filtered=False,
                           torch_threads=1)
    out = op(batch)
    ref = pc.list_flatten(out["reference_logprobs"]).to_numpy(zero_copy_only=False)
    mu = pc.list_flatten(out["inference_logprobs"]).to_numpy(zero_copy_only=False)
    # the reference is the model that sampled (float32 both sides): the same numbers
    assert np.abs(ref - mu).max() < 1e-5
    # k1 of identical log-probs is 0: the penalty is 0 (to rounding)
    assert np.abs(out["kl_penalty"].to_numpy()).max() < 1e-4
    # sampled by a policy whose log-probs are 0.1 above the reference's on every token: the
    # penalty is beta x the sum over the row's tokens of k1 = 0.1
    shifted = batch.set_column(batch.schema.get_field_index("inference_logprobs"), "inference_logprobs",
                               pa.array([[v + 0.1 for v in row] for row in batch["inference_logprobs"].to_pylist()],
                                        pa.list_(pa.float32())))
    out = op(shifted)
    penalty = out["kl_penalty"].to_numpy()
    lengths = np.array([len(r) for r in shifted["response_tokens"].to_pylist()])
    np.testing.assert_allclose(penalty, 0.5 * 0.1 * lengths, rtol=1e-3, atol=1e-4)
    # and the advantage is computed from reward - kl_penalty; `reward` keeps the task's value
    adv = Advantage(AdvantageConfig(estimator="dr_grpo"))(out.append_column(
        "advantage", pa.nulls(out.num_rows, pa.float32())))
    rewards = shifted["reward"].to_numpy() - penalty
    groups = np.array(shifted["group_id"].to_pylist())
    expected = rewards - np.array([rewards[groups == g].mean() for g in groups])
    np.testing.assert_allclose(adv["advantage"].to_numpy(), expected, atol=1e-5)
    assert adv["reward"].equals(shifted["reward"])


def _kl_to(weights: dict, reference_dir, prompts: int = 32) -> float:
    """KL(pi || pi_ref) by Monte Carlo: mean over tokens sampled from pi of log pi - log pi_ref
    (k1, unbiased), both scored in float32 training numerics."""
    tokenizer = load_tokenizer(reference_dir)
    source = Workload(task="addition").prompt_source(tokenizer, seed=99, prompts_per_step=prompts)
    prompt_tokens = source.step_rows(0)["prompt_tokens"].to_pylist()
    policy = load_model(reference_dir)
    policy.load_state_dict(weights)
    engine = TorchEngine(policy, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                         sampling=SamplingConfig(), seed=5)
    gens = engine.generate(prompt_tokens, n=4)
    p, r = [prompt_tokens[g.prompt_index] for g in gens], [g.response_tokens for g in gens]
    numerics = TrainingNumerics()
    own = np.concatenate(numerics.score(numerics.prepare(policy), p, r, SamplingConfig()))
    ref = np.concatenate(numerics.score(numerics.prepare(load_model(reference_dir)), p, r, SamplingConfig()))
    return float(np.mean(own - ref))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["loss", "reward"])
def test_a_kl_penalty_keeps_the_policy_closer_to_the_reference(one_torch_thread, where):
    """Same seed, same steps, a learning rate that moves the policy well away (KL 0.4-0.8 nats in
    10 steps, measured over seeds 1, 2, 4): the run with beta 1 ends with a smaller KL to the
    reference (the warm start) than the run with beta 0 (0.20-0.39 in the loss, 0.27-0.53 in the
    reward, same seeds)."""
    base = dict(SMALL, steps=10, optimizer={"lr": 5e-4}, inference_dtype="float32")
    free, free_weights = run_in_process(RLPipeline(PipelineConfig(**base)), final_weights=True)
    held, held_weights = run_in_process(RLPipeline(PipelineConfig(**base, kl={"beta": 1.0, "in": where})),
                                        final_weights=True)
    assert "kl/mean" not in free.columns  # beta 0: no reference, no measurement in the run
    assert held["kl/mean"].is_not_null().all() and (held["kl/mean"] >= -1e-6).all()
    reference = RLPipeline(PipelineConfig(**base)).model_path
    kl_free, kl_held = _kl_to(free_weights, reference), _kl_to(held_weights, reference)
    print(f"\nKL to the reference after 10 steps, kl in {where}: beta 0 {kl_free:.4f}, beta 1 {kl_held:.4f}")
    assert kl_free > 0.1  # the free run did move away
    assert kl_held < kl_free
