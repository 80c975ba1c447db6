"""Multi-turn agentic rollouts: the calculator environment, episodes, env tokens, versions across turns.

- The environment is deterministic, seedable, has a disjoint held-out split and an expert that
  solves every episode.
- Episodes: environment (tool output) tokens have loss_mask false, inference log-prob 0.0 and the
  resident version; they receive exactly zero gradient and do not enter ratios or diagnostics.
- On a real (embedded) Ray pipeline, with turns spanning >= 2 versions: the exact strategies
  (snapshot, interrupt) give old == inference log-probs on every policy token with float32
  inference, and the staleness bound holds per token.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.algorithms import CorrectionConfig, decoupled_loss
from trajflow.engines.models import REPO_ROOT, load_model, load_tokenizer
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.scoring import response_logprobs, score
from trajflow.engines.tokenizer import CHARACTERS, decode_response
from trajflow.engines.torch_engine import TorchEngine
from trajflow.tasks import Environment, Task, get_task, is_environment
from trajflow.tasks.environments import CalculatorEnv, calculator
from trajflow.tasks.rollout import heldout_mean_reward, heldout_success_rate, run_episodes

CALC_WARM_START = REPO_ROOT / "artifacts" / "warm_start" / "calc"
TURN_TOKENS = 8


@pytest.fixture(scope="module")
def env() -> CalculatorEnv:
    return get_task("calc")


@pytest.fixture(scope="module")
def warm():
    return load_model(CALC_WARM_START), load_tokenizer(CALC_WARM_START)


def sampled_episodes(model, tok, env, n_prompts=8, n=4, seed=0):
    engine = TorchEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                         sampling=SamplingConfig(temperature=1.0, max_new_tokens=TURN_TOKENS), seed=seed)
    prompts = list(itertools.islice(env.prompts("train", seed), n_prompts))
    return prompts, run_episodes(engine, env, tok, prompts, n=n)


# -- the environment -------------------------------------------------------------------------------

def test_calc_is_a_registered_environment_and_a_task(env):
    assert isinstance(env, Task) and isinstance(env, Environment) and is_environment(env)
    assert not is_environment(get_task("addition"))
    assert env.name == "calc"


def test_calc_is_deterministic_heldout_disjoint_and_in_vocab(env):
    a = list(itertools.islice(env.prompts("train", 3), 300))
    assert a == list(itertools.islice(env.prompts("train", 3), 300))
    test = env.heldout(300)
    assert {p.text for p in test}.isdisjoint({p.text for p in a})
    allowed = set(CHARACTERS)
    for p in a + test:
        episode = env.reset(p)
        for turn in env.expert_turns(p):
            step = episode.step(turn)
            assert set(turn) <= allowed and set(step.observation) <= allowed
        assert step.done and step.reward == 1.0  # the expert solves every episode
        assert set(p.text) <= allowed


def test_calculator_and_episode_steps(env):
    assert calculator("12*34") == "408" and calculator("408+56") == "464" and calculator("3-5") == "-2"
    assert calculator("1+2+3") is None and calculator("x") is None and calculator("") is None
    prompt = next(env.prompts("train", 0))
    episode = env.reset(prompt)
    s = episode.step("12*3")
    assert (s.observation, s.reward, s.done) == ("=36;", 0.0, False)
    s = episode.step("what")
    assert (s.observation, s.reward, s.done) == ("=?;", 0.0, False)
    wrong = str(int(prompt.answer) + 1)
    assert env.reset(prompt).step(wrong) == type(s)("", 0.0, True)
    assert env.reset(prompt).step(prompt.answer).reward == 1.0


# -- episodes ----------------------------------------------------------------------------------

def test_episode_rows_mark_environment_tokens(warm, env):
    model, tok = warm
    prompts, episodes = sampled_episodes(model, tok, env)
    assert {e.finish_reason for e in episodes} <= {"stop", "length"}
    assert any(e.turns >= 2 for e in episodes), "no multi-turn episode"
    env_tokens = 0
    for e in episodes:
        n = len(e.response_tokens)
        assert n <= env.max_response_tokens and e.turns <= env.max_turns
        assert len(e.loss_mask) == len(e.logprobs) == len(e.versions) == n
        # Replay the episode: policy turns end at eos (or the per-turn limit); what follows a turn
        # until the next policy token is exactly the environment's observation.
        replay = env.reset(prompts[e.prompt_index])
        t, reward = 0, 0.0
        while t < n:
            assert e.loss_mask[t], "a response must resume with a policy token"
            start = t
            while t < n and e.loss_mask[t] and t - start < TURN_TOKENS:
                t += 1
                if e.response_tokens[t - 1] == tok.eos_token_id:
                    break
            step = replay.step(decode_response(tok, e.response_tokens[start:t]))
            reward += step.reward
            obs_start = t
            while t < n and not e.loss_mask[t]:
                t += 1
            obs = e.response_tokens[obs_start:t]
            assert tok.decode(obs) == step.observation[: len(obs)]
            assert all(e.logprobs[k] == 0.0 for k in range(obs_start, t))
            assert all(e.logprobs[k] < 0.0 for k in range(start, obs_start))
            env_tokens += t - obs_start
            if step.done:
                assert t == n and e.finish_reason == "stop"
        assert reward == e.reward
    assert env_tokens > 0


def test_environment_tokens_get_exactly_zero_gradient(warm, env):
    model, tok = warm
    model = load_model(CALC_WARM_START)  # a private copy: this test trains it
    prompts, episodes = sampled_episodes(model, tok, env, n_prompts=4, n=4, seed=1)
    prompt_tokens = [e.prompt_tokens for e in episodes]
    responses = [e.response_tokens for e in episodes]
    width = max(len(r) for r in responses)

    def pad(rows, fill, dtype):
        return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)

    mask = pad([e.loss_mask for e in episodes], False, torch.bool)
    env_mask = pad([[not m for m in e.loss_mask] for e in episodes], False, torch.bool)
    assert env_mask.any()
    inference = pad([e.logprobs for e in episodes], 0.0, torch.float32)
    advantages = torch.linspace(-1.0, 1.0, len(episodes))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=TURN_TOKENS)
    config = CorrectionConfig(mask_level="sequence", mask_c_seq=1.05)

    def loss_and_grads(inference, old_shift):
        model.zero_grad(set_to_none=True)
        current, _ = response_logprobs(model, prompt_tokens, responses, sampling, grad=True)
        current = torch.nn.functional.pad(current, (0, width - current.shape[1]))
        current.retain_grad()
        old = current.detach() + old_shift
        out = decoupled_loss(current, old, inference, advantages, mask, config)
        out.loss.backward()
        return out, current.grad.clone(), [p.grad.clone() for p in model.parameters()]

    out, grad, params = loss_and_grads(inference, torch.zeros_like(inference))
    assert torch.equal(out.loss_mask, mask)
    assert (grad[env_mask] == 0.0).all(), "an environment token received gradient"
    assert (grad[mask] != 0.0).any()
    # Whatever log-probs an environment token carries (inference or old), nothing changes: they are
    # in no ratio, no mask decision, no diagnostic.
    noise = torch.where(env_mask, torch.randn_like(inference) * 5.0, torch.zeros_like(inference))
    out2, grad2, params2 = loss_and_grads(inference + noise, noise * -3.0)
    assert torch.equal(out.loss, out2.loss) and torch.equal(grad, grad2)
    assert all(torch.equal(a, b) for a, b in zip(params, params2))


def test_float32_inference_logprobs_match_full_context_scoring(warm, env):
    """The engine's per-turn log-probs equal teacher-forced scoring of the whole episode."""
    model, tok = warm
    _, episodes = sampled_episodes(model, tok, env, n_prompts=6, n=2, seed=2)
    scored = score(model, [e.prompt_tokens for e in episodes], [e.response_tokens for e in episodes],
                   SamplingConfig(temperature=1.0, max_new_tokens=TURN_TOKENS))
    for e, lp in zip(episodes, scored):
        m = np.asarray(e.loss_mask)
        assert np.abs(lp[m] - np.asarray(e.logprobs)[m]).max() < 1e-5


def test_heldout_mean_reward_dispatches_to_episode_success(warm, env):
    model, tok = warm
    rate = heldout_success_rate(model, tok, env, 60, TURN_TOKENS)
    assert rate == heldout_mean_reward(model, tok, env, 60, TURN_TOKENS)
    assert 0.0 < rate < 1.0  # the warm start solves some, not all


# -- the pipeline on Ray ---------------------------------------------------------------------------

MULTI = dict(task="calc", model=CALC_WARM_START, steps=6, prompts_per_step=4, group_size=4,
             drop_zero_variance_groups=False, seed=1, sampling={"max_new_tokens": TURN_TOKENS})


def _log_batches(directory: str):
    def on_step(train_step, batch: pa.Table, metrics: dict) -> None:
        import pyarrow.parquet as pq

        pq.write_table(batch, f"{directory}/step{metrics['step']:04d}.parquet")

    return on_step


@pytest.mark.parametrize("strategy", ["snapshot", "interrupt"])
def test_exact_strategies_on_episodes_spanning_versions(ray_session, publish_inside_rollouts, tmp_path, strategy):
    import polars as pl
    import pyarrow.parquet as pq

    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    max_staleness = 1
    config = PipelineConfig(**MULTI, strategy=strategy, max_staleness=max_staleness,
                            old_logprob_forward="always")  # the operator's forward over environment tokens
    # A publish lands between the turns (snapshot) or inside a turn (interrupt) of every rollout
    # that runs ahead of the trainer.
    pipe = publish_inside_rollouts(RLPipeline(config))
    pipe.hooks.on_step = _log_batches(str(tmp_path))
    m = pipe.run(progress=False)
    print(f"\ncalc {strategy} S={max_staleness}: max|log r_d|={m['mismatch/max_abs_log_rd'].max():.2e} "
          f"max lag={m['staleness/max'].max()} spanning rows={m['rows_spanning_versions'].sum()} "
          f"reward={m['reward/mean'].mean():.3f}")
    assert m.height == config.steps
    assert m["mismatch/max_abs_log_rd"].max() < 1e-5
    assert m["mask/token_kept_frac"].min() == 1.0
    assert m["rows_spanning_versions"].sum() > 0, "no episode spanned two versions"
    assert m["staleness/max"].max() <= max_staleness
    assert m["staleness/max"].max() >= 1
    assert m["staleness/over_stale_tokens"].sum() == 0

    files = sorted(Path(tmp_path).glob("step*.parquet"))
    batches = pa.concat_tables([pq.read_table(p) for p in files], promote_options="permissive")
    assert batches.num_rows == config.steps * config.rows_per_step
    trainer_versions = np.repeat([int(p.stem[4:]) for p in files], config.rows_per_step)
    spanning, env_old_nonzero = 0, 0
    for row, trainer_version in zip(batches.to_pylist(), trainer_versions):
        mask = np.asarray(row["loss_mask"])
        versions = np.asarray(row["versions"])
        inference = np.asarray(row["inference_logprobs"], dtype=np.float64)
        assert (inference[~mask] == 0.0).all()
        # the staleness bound, token by token: 0 <= trainer version - token version <= S
        lag = trainer_version - versions[mask]
        assert (lag >= 0).all() and (lag <= max_staleness).all()
        if row["filter_reason"] is None:
            old = np.asarray(row["old_logprobs"], dtype=np.float64)
            assert np.abs(old[mask] - inference[mask]).max() < 1e-5
            env_old_nonzero += int((np.abs(old[~mask]) > 1e-3).sum())
        # the versions of the policy tokens: several turns, several versions
        spanning += len(set(versions[mask].tolist())) > 1
        assert row["turns"] >= 1
        if row["reward"] == 1.0:
            assert row["finish_reason"] == "stop"
    assert spanning > 0
    if strategy == "snapshot":
        # The snapshot operator scores environment tokens too (real log-probs, far from their 0.0
        # inference entries), yet max|log r_d| above is ~0: they are in no ratio or diagnostic.
        assert env_old_nonzero > 0
    assert pl.from_arrow(batches.select(["turns"]))["turns"].max() >= 2
