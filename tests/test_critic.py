"""PPO with a critic, in one process: the value model, the values stage's exactness (recorded
values = the critic recomputed at each token's value version), train-time values and GAE, the
critic's warm-up, and both learners' checkpoints (operators/trainer/critic.py)."""

from __future__ import annotations

import pytest
import torch

from support import max_abs_difference
from trajflow.pipelines.config import PipelineConfig

# the quickstart's task, small: 8 prompts x 4 samples, a critic that moves fast
PPO = dict(prompts_per_step=8, group_size=4, drop_zero_variance_groups=False, inference_dtype="float32",
           advantage={"estimator": "gae", "lam": 0.95}, critic={"optimizer": {"lr": 3e-3}}, seed=3)


class RecordingStore:
    """An in-process store that keeps a copy of every critic version published (the store itself
    keeps the newest only), so a test can score with the critic of any version."""

    def __new__(cls, max_staleness: int, keep_history: bool):
        from trajflow.operators.contracts.store import CRITIC
        from trajflow.pipelines.policy_store import InProcessStore

        class Store(InProcessStore):
            critics: dict[int, dict] = {}

            def publish(self, weights, version=None, *, learner="policy"):
                if learner == CRITIC:
                    self.critics[version] = {k: v.detach().clone() for k, v in weights.items()}
                return super().publish(weights, version, learner=learner)

        store = Store(max_staleness, keep_history)
        store.critics = {}
        return store


def _run(overrides: dict, steps: int, lag: int = 0, on_rows=None):
    """(batches as they reached the train step, metrics rows, the store, the pipeline) of an
    in-process run; `on_rows(trainstep, batch, step)`: the step's rows as trained."""
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(**{**PPO, **overrides, "steps": steps}))
    pipe.hooks.on_rows = on_rows
    store = RecordingStore(pipe.config.max_staleness, pipe.strategy.keep_history)
    pipe.publish_start(store, 0)
    out = list(iter_in_process(pipe, store, range(steps), lag=lag))
    return [b for b, _ in out], [m for _, m in out], store, pipe


def test_value_model_reads_the_state_before_each_token_and_starts_at_zero(one_torch_thread):
    from trajflow.engines.models import WARM_START_DIR
    from trajflow.engines.value_model import load_value_model, values

    model = load_value_model(WARM_START_DIR)
    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, 10], [11]]
    assert torch.equal(values(model, prompts, responses, width=4), torch.zeros(2, 4))  # a zero head
    with torch.no_grad():
        model.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        model.score.bias.fill_(0.25)
    got = values(model, prompts, responses, width=4)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        hidden = model.model(torch.tensor([p + r])).last_hidden_state[0]
        by_hand = model.score(hidden)[len(p) - 1: len(p) - 1 + len(r), 0]  # the state before token t
        assert torch.allclose(got[i, : len(r)], by_hand, atol=1e-6)
        assert torch.all(got[i, len(r):] == 0)


@pytest.mark.timeout(300)
def test_recorded_values_equal_the_critic_at_each_tokens_value_version(one_torch_thread):
    """Exactness of the old values at max_staleness 2 with a moving critic: every token's value
    is the critic of its recorded version, recomputed, within 1e-5 (float32)."""
    from trajflow.engines.models import WARM_START_DIR
    from trajflow.engines.value_model import load_value_model, values
    from trajflow.schemas.columns import padded

    batches, rows, store, _ = _run({"max_staleness": 2}, steps=5, lag=2)
    assert [r["critic/value_staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert max_abs_difference(store.critics[4], store.critics[0]) > 1e-3, "the critic did not move"
    critic = load_value_model(WARM_START_DIR)
    worst, compared = 0.0, set()
    for batch in batches:
        width = max(len(r) for r in batch["response_tokens"].to_pylist())
        recorded = torch.from_numpy(padded(batch["values"], width, 0.0))
        versions = batch["value_versions"].to_pylist()
        version = versions[0][0]
        assert all(set(v) == {version} for v in versions)  # one pass, one version per row
        critic.load_state_dict(store.critics[version])
        again = values(critic, batch["prompt_tokens"].to_pylist(), batch["response_tokens"].to_pylist(), width=width)
        worst = max(worst, float((again - recorded).abs().max()))
        compared.add(version)
    print(f"\nvalue versions compared {sorted(compared)}, worst |recorded - recomputed| {worst:.2e}")
    assert compared == {0, 1, 2} and worst < 1e-5
    # recomputed at the wrong version, the same values differ: the check can fail
    critic.load_state_dict(store.critics[4])
    stale = values(critic, batches[-1]["prompt_tokens"].to_pylist(), batches[-1]["response_tokens"].to_pylist(),
                   width=width)
    assert float((stale - recorded).abs().max()) > 1e-3


@pytest.mark.timeout(300)
def test_train_time_values_are_the_trainers_critic_and_gae_uses_them(one_torch_thread):
    """critic.values_at: train: no values stage; the logged `train_values` are the critic of the
    trainer's version, and the trained advantages and returns are GAE on them (whitened)."""
    from trajflow.algorithms.gae import gae, token_rewards, whiten
    from trajflow.engines.models import WARM_START_DIR
    from trajflow.engines.value_model import load_value_model, values
    from trajflow.schemas.columns import padded

    logged: list = []
    _, rows, store, pipe = _run({"max_staleness": 1, "critic": {"values_at": "train", "optimizer": {"lr": 3e-3}}},
                                steps=3, lag=1, on_rows=lambda trainstep, batch, step: logged.append(batch))
    assert "values" not in [s.name for s in pipe.stages]  # the trainer's critic scores them
    assert all(r["critic/value_staleness_max"] == 0.0 for r in rows)
    critic = load_value_model(WARM_START_DIR)
    for step in (1, 2):
        batch = logged[step]
        width = max(len(r) for r in batch["response_tokens"].to_pylist())
        critic.load_state_dict(store.critics[step])  # the trainer trains step k at version k
        now = values(critic, batch["prompt_tokens"].to_pylist(), batch["response_tokens"].to_pylist(), width=width)
        recorded = torch.from_numpy(padded(batch["train_values"], width, 0.0))
        mask = torch.from_numpy(padded(batch["loss_mask"], width, False, bool))
        assert float((now - recorded)[mask].abs().max()) < 1e-5
        rewards = torch.tensor(batch["reward"].to_pylist(), dtype=torch.float64)
        adv, ret = gae(token_rewards(rewards, mask), recorded.double(), mask, 1.0, 0.95)
        adv = torch.where(mask, whiten(adv, mask), 0.0)
        assert torch.allclose(torch.from_numpy(padded(batch["token_advantages"], width, 0.0)).double(), adv, atol=1e-5)
        assert torch.allclose(torch.from_numpy(padded(batch["returns"], width, 0.0)).double()[mask], ret[mask],
                              atol=1e-5)


@pytest.mark.timeout(300)
def test_critic_warmup_trains_the_critic_alone(one_torch_thread):
    from trajflow.operators.contracts.store import CRITIC  # noqa: F401 (the store's critic stream)

    policies: dict[int, dict] = {}
    _, rows, store, _ = _run({"critic": {"warmup_steps": 2, "optimizer": {"lr": 3e-3}}}, steps=3,
                             on_rows=lambda trainstep, batch, step: policies.update(
                                 {step: {k: v.clone() for k, v in trainstep.policy.policy_state_dict().items()}}))
    assert max_abs_difference(policies[0], policies[1]) == 0.0  # steps 0 and 1: the policy keeps its weights
    assert max_abs_difference(policies[1], policies[2]) > 1e-6  # step 2: it trains
    assert max_abs_difference(store.critics[1], store.critics[0]) > 1e-4  # the critic trained
    assert rows[0].get("optimizer/lr") is None and rows[2]["optimizer/lr"] is not None
    assert [r["version"] for r in rows] == [1, 2, 3]
