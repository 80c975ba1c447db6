"""The veRL knobs trajflow adopted, each as veRL defines it, on veRL's own unit-test inputs.

- several rejection criteria at once (`correction.rejection`, veRL's comma-separated `rollout_rs`)
  and the k2/k3 sequence statistics (sum, mean, max): verl-project/verl
  tests/trainer/ppo/test_rollout_corr.py (`test_each_supported_rollout_rs_option`,
  `test_rollout_rs_multiple_options`) and test_rollout_corr_integration.py (the chained
  "seq_mean_k1,seq_max_k3" config). veRL draws those inputs with torch.randn and no seed and checks
  only that each option runs; here the same shapes, noise and thresholds are drawn from seed 0 and
  the mask is checked against a float64 reference of veRL's definition (below), plus hand-computed
  values;
- straight-through KL estimators ("k3+": the k3 value, the k2 gradient): tests/trainer/ppo/
  test_core_algos_on_cpu.py (`test_kl_penalty_straight_through_value_matches_base`,
  `test_kl_penalty_k3_plus_uses_k2_gradient`), same seed and inputs;
- REINFORCE++ with a per-token discount gamma: tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py
  (every case: its token rewards, masks, gamma and expected returns).

Name mapping: veRL's `kl` / `kl+` is trajflow's `k1` / `k1+`; veRL's `k3` / `low_var_kl` (both
clamped to [-10, 10]) is trajflow's `low_var`, trajflow's `k3` is unclamped.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from support import scored_step
from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, KLConfig, RejectionRule
from trajflow.algorithms.discounted import discounted_returns, masked_whiten, reinforce_plus_plus_discounted
from trajflow.algorithms.kl import ReferenceKL, kl_estimate
from trajflow.algorithms.objective import decoupled_loss
from trajflow.algorithms.rejection import rejection_mask, rejection_metrics


# ---- a float64 reference of veRL's rollout_rs definition --------------------------------------------
def verl_keep(log_ratio: np.ndarray, mask: np.ndarray, option: str, threshold) -> np.ndarray:
    """veRL's compute_rollout_rejection_mask for one option, from its documented definition:
    k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (log_ratio clamped
    to ±20); k1 options keep log(lower) <= stat <= log(upper) ("lower_upper", or one number as
    upper with lower 1/upper); k2/k3 keep stat <= threshold."""
    x = np.clip(log_ratio.astype(np.float64), -20, 20)
    stats = {"k1": -x, "k2": 0.5 * x * x, "k3": np.exp(x) - 1 - x}
    level, kind = option.rsplit("_", 1)
    v = stats[kind]
    if level == "seq_sum":
        v = np.repeat((v * mask).sum(-1, keepdims=True), v.shape[1], -1)
    elif level == "seq_mean":
        v = np.repeat(((v * mask).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None], v.shape[1], -1)
    elif level == "seq_max":
        v = np.repeat(np.where(mask > 0, v, -np.inf).max(-1, keepdims=True), v.shape[1], -1)
    if kind == "k1":
        spec = str(threshold)
        lower, upper = (float(p) for p in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
        return (v >= math.log(lower)) & (v <= math.log(upper))
    return v <= float(threshold)


def rule(option: str, threshold) -> RejectionRule:
    """veRL's option and threshold spec as a trajflow RejectionRule."""
    spec = str(threshold)
    if "_" in spec:
        lower, upper = (float(p) for p in spec.split("_"))
        return RejectionRule(statistic=option, upper=upper, lower=lower)
    return RejectionRule(statistic=option, upper=float(spec))


def draws(batch: int, length: int, noise: float):
    """veRL's inputs: old_log_prob ~ N(0, 1), rollout = old + noise * N(0, 1), all tokens valid."""
    torch.manual_seed(0)
    old = torch.randn(batch, length)
    rollout = old + torch.randn(batch, length) * noise
    return old, rollout, torch.ones(batch, length, dtype=torch.bool)


EACH_OPTION = [("token_k1", "0.5_1.5"), ("token_k2", 2.0), ("token_k3", 2.0), ("seq_sum_k1", "0.6_1.4"),
               ("seq_sum_k2", 2.5), ("seq_sum_k3", 2.5), ("seq_mean_k1", "0.5_1.5"), ("seq_mean_k2", 2.0),
               ("seq_mean_k3", 2.0), ("seq_max_k2", 2.0), ("seq_max_k3", 2.0)]


@pytest.mark.parametrize(("option", "threshold"), EACH_OPTION)
def test_each_verl_rejection_option(option, threshold):
    """test_each_supported_rollout_rs_option: batch 3 x 7, noise 0.15, veRL's thresholds."""
    old, rollout, mask = draws(3, 7, 0.15)
    log_rd = old - rollout
    keep = rejection_mask(log_rd, mask, [rule(option, threshold)])
    expected = verl_keep(log_rd.numpy(), mask.numpy(), option, threshold)
    assert keep.numpy().tolist() == expected.tolist()
    # and on a noisier draw, where some criterion rejects for real
    log_rd = log_rd * 8
    keep = rejection_mask(log_rd, mask, [rule(option, threshold)])
    assert keep.numpy().tolist() == verl_keep(log_rd.numpy(), mask.numpy(), option, threshold).tolist()


@pytest.mark.parametrize(("options", "thresholds", "shape", "noise"), [
    ("token_k1,seq_max_k3", "0.4_1.8,3.0", (2, 6), 0.2),  # test_rollout_rs_multiple_options
    ("seq_mean_k1,seq_max_k3", "0.8_1.2,3.0", (4, 10), 0.1),  # test_rollout_corr_integration's chained config
])
def test_chained_criteria_keep_a_token_only_if_every_one_does(options, thresholds, shape, noise):
    old, rollout, mask = draws(*shape, noise)
    log_rd = (old - rollout) * 4  # so that each criterion rejects something
    rules = [rule(o, t) for o, t in zip(options.split(","), thresholds.split(","))]
    keep = rejection_mask(log_rd, mask, rules)
    each = [verl_keep(log_rd.numpy(), mask.numpy(), o, t) for o, t in zip(options.split(","), thresholds.split(","))]
    assert keep.numpy().tolist() == np.logical_and.reduce(each).tolist()
    assert not all(e.all() for e in each) and keep.any()
    metrics = rejection_metrics(log_rd, mask, rules)
    for option, alone in zip(options.split(","), each):
        assert metrics[f"rejection/{option}/token_frac"] == pytest.approx(1 - alone.mean())
        assert metrics[f"rejection/{option}/seq_frac"] == pytest.approx((~alone).any(-1).mean())


def test_sequence_k3_statistics_by_hand():
    # log r_d [0.1, -0.2, 0.3] (+ one padded token): k3 = e^x - 1 - x per token
    k3 = [math.exp(x) - 1 - x for x in (0.1, -0.2, 0.3)]  # 0.00517, 0.01873, 0.04986
    log_rd = torch.tensor([[0.1, -0.2, 0.3, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    mean, total = sum(k3) / 3, sum(k3)  # 0.02459, 0.07376
    for option, value in (("seq_mean_k3", mean), ("seq_sum_k3", total), ("seq_max_k3", max(k3))):
        assert rejection_mask(log_rd, mask, [RejectionRule(option, value * 1.001)]).tolist() == [[True] * 3 + [False]]
        assert not rejection_mask(log_rd, mask, [RejectionRule(option, value * 0.999)]).any()
    k2_mean = sum(0.5 * x * x for x in (0.1, -0.2, 0.3)) / 3  # 0.02333
    assert rejection_mask(log_rd, mask, [RejectionRule("seq_mean_k2", 0.0234)]).any()
    assert not rejection_mask(log_rd, mask, [RejectionRule("seq_mean_k2", k2_mean * 0.999)]).any()


def test_rejection_is_part_of_the_r_d_mask_in_the_loss():
    """Two sequences, r_s = 1, A = 1: row 1's mean k3 is above the threshold, so it leaves the
    mean under denominator kept (as veRL's rollout_rs edits response_mask) and counts with all."""
    inference = torch.zeros(2, 3)
    old = torch.tensor([[0.01, -0.01, 0.0], [0.5, -0.4, 0.3]])
    current = old.clone().requires_grad_(True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = CorrectionConfig(mask_level="none", rejection=({"statistic": "seq_mean_k3", "upper": 0.01},))
    out = decoupled_loss(current, old, inference, torch.ones(2), mask, config)
    assert out.discrepancy_mask.tolist() == [[True] * 3, [False] * 3]
    assert out.loss.item() == pytest.approx(-1.0)  # mean of -r_s A over row 0's 3 tokens
    out.loss.backward()
    assert torch.allclose(current.grad, torch.tensor([[-1 / 3] * 3, [0.0] * 3]))
    counted = decoupled_loss(old.clone(), old, inference, torch.ones(2), mask,
                             CorrectionConfig(mask_level="none", denominator="all", rejection=config.rejection))
    assert counted.loss.item() == pytest.approx(-0.5)
    # with a mask_level too, both must keep (the token mask at c 1.4 keeps every token here)
    both = CorrectionConfig(mask_level="token", mask_c_token=1.4, rejection=config.rejection)
    assert decoupled_loss(old.clone(), old, inference, torch.ones(2), mask, both).discrepancy_mask.tolist() == \
        [[True] * 3, [False] * 3]


def test_rejection_rules_from_a_job_config():
    from trajflow.jobs.config import JobConfigError, build_job_config

    config = build_job_config({"correction": {"rejection": [{"statistic": "token_k1", "upper": 1.8, "lower": 0.4},
                                                            {"statistic": "seq_max_k3", "upper": 3.0}]}})
    rules = config.settings.correction.rejection
    assert rules == (RejectionRule("token_k1", 1.8, 0.4), RejectionRule("seq_max_k3", 3.0))
    assert build_job_config(yaml_roundtrip(config)).settings.correction.rejection == rules  # the run's config.yaml
    for bad, fragment in (([{"statistic": "seq_mean_k4", "upper": 1}], "RejectionRule.statistic: expected one of"),
                          ([{"statistic": "seq_mean_k3", "upper": 1, "lower": 0.5}], "upper bound only"),
                          ([{"statistic": "seq_mean_k3"}], "a list of mappings with the keys statistic, upper, lower"),
                          ([{"statistic": "token_k1", "upper": 0.5, "lower": 2}], "must be <= upper")):
        with pytest.raises(JobConfigError, match="correction.rejection") as error:
            build_job_config({"correction": {"rejection": bad}})
        assert fragment in str(error.value)


def yaml_roundtrip(config) -> dict:
    import yaml

    return yaml.safe_load(config.to_yaml())


# ---- straight-through KL estimators ----------------------------------------------------------------
@pytest.mark.parametrize(("name", "base"), [("k1+", "k1"), ("abs+", "abs"), ("k3+", "k3"), ("low_var+", "low_var")])
def test_straight_through_value_matches_its_base(name, base):
    """test_kl_penalty_straight_through_value_matches_base (veRL's k1+ and kl+ are trajflow's k1+)."""
    torch.manual_seed(0)
    logprob = torch.randn(4, 8, requires_grad=True)
    ref_logprob = torch.randn(4, 8)
    assert torch.allclose(kl_estimate(logprob, ref_logprob, name), kl_estimate(logprob, ref_logprob, base))


@pytest.mark.parametrize("name", ["k1+", "abs+", "k3+", "low_var+"])
def test_straight_through_gradient_is_k2s(name):
    """test_kl_penalty_k3_plus_uses_k2_gradient, for every "+" estimator."""
    torch.manual_seed(0)
    logprob = torch.randn(4, 8, requires_grad=True)
    ref_logprob = torch.randn(4, 8)
    (grad_plus,) = torch.autograd.grad(kl_estimate(logprob, ref_logprob, name).sum(), logprob)
    k2_logprob = logprob.detach().clone().requires_grad_(True)
    (grad_k2,) = torch.autograd.grad(kl_estimate(k2_logprob, ref_logprob, "k2").sum(), k2_logprob)
    assert torch.allclose(grad_plus, grad_k2)
    assert torch.allclose(grad_k2, logprob.detach() - ref_logprob)  # d/dx x^2/2 = x


def test_straight_through_in_the_loss():
    """kl.estimator k3+: the loss value of k3, the gradient of k2."""
    torch.manual_seed(0)
    cur, ref = torch.randn(3, 5) * 0.3, torch.randn(3, 5) * 0.3
    mask = torch.ones(3, 5, dtype=torch.bool)

    def loss(estimator):
        current = cur.clone().requires_grad_(True)
        out = decoupled_loss(current, cur, cur, torch.tensor([1.0, -1.0, 0.5]), mask, CorrectionConfig(),
                             reference=ReferenceKL(ref, KLConfig(beta=0.5, estimator=estimator)))
        out.loss.backward()
        return out.loss.item(), current.grad

    plus, k3, k2 = loss("k3+"), loss("k3"), loss("k2")
    assert plus[0] == pytest.approx(k3[0]) and plus[0] != pytest.approx(k2[0])
    assert torch.allclose(plus[1], k2[1]) and not torch.allclose(plus[1], k3[1])


# ---- REINFORCE++ with a per-token discount ---------------------------------------------------------
def test_observation_span_does_not_block_returns():
    compact = discounted_returns([[0.0, 0.0, 0.0, 1.0]], [[1, 1, 1, 1]], 1.0)
    mask = np.array([[1, 1, 0, 0, 1, 1]], bool)
    expanded = discounted_returns([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], mask, 1.0)
    assert expanded[mask].tolist() == compact[np.ones((1, 4), bool)].tolist()


def test_observation_positions_have_zero_returns():
    returns = discounted_returns([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], [[1, 1, 0, 0, 1, 1]], 1.0)
    assert returns[0, 2] == 0.0 and returns[0, 3] == 0.0


def test_trailing_padding_stays_zero():
    returns = discounted_returns([[0.0, 0.0, 1.0, 0.0, 0.0]], [[1, 1, 1, 0, 0]], 1.0)
    assert returns.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]


def test_gamma_discount_across_observation_span():
    returns = discounted_returns([[0.0, 0.0, 0.0, 0.0, 2.0]], [[1, 1, 0, 0, 1]], 0.5)
    assert returns[0, 4] == 2.0 and returns[0, 2] == 0.0 and returns[0, 3] == 0.0
    assert returns[0, 1] == pytest.approx(1.0) and returns[0, 0] == pytest.approx(0.5)


def test_batch_dimension():
    returns = discounted_returns([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]], [[1, 0, 1, 1], [1, 1, 1, 0]], 1.0)
    assert returns.tolist() == [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]


def test_no_observation_tokens_unchanged():
    assert discounted_returns([[0.0, 0.0, 0.0, 0.0, 3.0]], np.ones((1, 5)), 1.0).tolist() == [[3.0] * 5]


def test_per_token_advantages_whiten_the_discounted_outcome():
    """Outcome rewards [2, -1] on rows of 3 and 2 loss tokens (row 1 with a tool token): returns
    gamma^k R, whitened over the 5 loss tokens; gamma 1 gives the per-row token-weighted REINFORCE++."""
    from trajflow.algorithms.advantages import reinforce_plus_plus

    mask = np.array([[1, 1, 1, 0], [1, 0, 1, 0]], bool)
    adv = reinforce_plus_plus_discounted([2.0, -1.0], mask, 0.5)
    returns = np.array([2 * 0.25, 2 * 0.5, 2.0, -1 * 0.5, -1.0])  # gamma^k R, k = loss tokens after
    mean, std = returns.mean(), returns.std(ddof=1)
    assert adv[mask] == pytest.approx((returns - mean) / np.sqrt(std ** 2 + 1e-8), abs=1e-6)
    assert (adv[~mask] == 0).all()
    flat = reinforce_plus_plus_discounted([2.0, -1.0], mask, 1.0)
    per_row = reinforce_plus_plus(np.array([2.0, -1.0]), np.array([0, 1]), token_counts=mask.sum(1))
    assert flat[mask] == pytest.approx(np.repeat(per_row, mask.sum(1)), abs=1e-6)
    assert masked_whiten(np.ones((1, 1)), np.ones((1, 1), bool)).tolist() == [[0.0]]


def test_the_advantage_operator_writes_per_token_advantages_the_trainer_reads():
    from trajflow.operators.advantage import Advantage
    from trajflow.operators.trainer.correction import StepBatch

    table = pa.table({
        "group_id": ["g0", "g0", "g1"], "reward": pa.array([1.0, 0.0, None], pa.float32()),
        "response_tokens": pa.array([[5, 6, 7], [5, 6], [1]], pa.list_(pa.int32())),
        "loss_mask": pa.array([[True, False, True], [True, True], [True]], pa.list_(pa.bool_())),
    })
    out = Advantage(AdvantageConfig(estimator="reinforce_plus_plus", gamma=0.9))(table)
    tokens = out["token_advantages"].to_pylist()
    mask = np.array([[1, 0, 1], [1, 1, 0]], bool)
    expected = reinforce_plus_plus_discounted([1.0, 0.0], mask, 0.9)
    assert tokens[0] == pytest.approx(expected[0].tolist()) and tokens[1] == pytest.approx(expected[1, :2].tolist())
    assert tokens[2] is None and out["advantage"][2].as_py() is None  # the reward failed
    assert out["advantage"][0].as_py() == pytest.approx(expected[0][mask[0]].mean())
    full = out.append_column("prompt_tokens", pa.array([[1]] * 3, pa.list_(pa.int32()))).append_column(
        "inference_logprobs", pa.array([[0.0] * 3, [0.0] * 2, [0.0]], pa.list_(pa.float32()))).append_column(
        "versions", pa.array([[0] * 3, [0] * 2, [0]], pa.list_(pa.int32()))).append_column(
        "old_logprobs", pa.nulls(3, pa.list_(pa.float32())))
    batch = StepBatch.from_table(full.slice(0, 2), trainer_version=0)
    assert batch.advantages.shape == (2, 3)
    assert batch.advantages.numpy() == pytest.approx(expected)
    # gamma 1 (the default) keeps one advantage per row, as before
    assert "token_advantages" not in Advantage(AdvantageConfig(estimator="reinforce_plus_plus"))(table).column_names


def test_gamma_belongs_to_reinforce_plus_plus_and_gae():
    from trajflow.settings import SettingError

    with pytest.raises(SettingError, match="AdvantageConfig.gamma: read by estimators reinforce_plus_plus and gae "
                                           "only, not grpo"):
        AdvantageConfig(gamma=0.9)
    with pytest.raises(SettingError, match="AdvantageConfig.lam: read by estimator gae only, not grpo"):
        AdvantageConfig(lam=0.9)
    assert AdvantageConfig(estimator="gae", gamma=0.99, lam=0.95).lam == 0.95
    with pytest.raises(SettingError, match="gamma: must be <= 1"):
        AdvantageConfig(estimator="reinforce_plus_plus", gamma=1.5)


@pytest.mark.timeout(300)
def test_a_discounted_reinforce_plus_plus_step_trains_in_one_process(one_torch_thread):
    """The pipeline's own operators for one step, in one process (tests/test_operators_in_process.py):
    the trajectories carry per-token advantages and the train step trains on them."""
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(strategy="snapshot", prompts_per_step=4, group_size=4, inference_dtype="float32",
                                     drop_zero_variance_groups=False, seed=3, steps=1,
                                     advantage={"estimator": "reinforce_plus_plus", "gamma": 0.9}))
    store, ops, batch = scored_step(pipe, 4)
    lengths = [len(r) for r in batch["response_tokens"].to_pylist()]
    assert [len(t) for t in batch["token_advantages"].to_pylist()] == lengths
    metrics = ops["train"](batch).to_pylist()[0]
    assert metrics["rows_trained"] == 16 and np.isfinite(metrics["loss"]) and store.latest_version() == 1
