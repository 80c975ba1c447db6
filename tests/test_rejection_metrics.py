"""Each `correction.rejection` rule's rejected fraction of the step's loss tokens and sequences
(algorithms/rejection.py `rejection_metrics`, veRL's `rollout_rs_<option>_masked_fraction`)
reaches the train step's metrics row as `rejection/<statistic>/token_frac` and `/seq_frac`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from support import scored_step
from trajflow.algorithms.config import CorrectionConfig, RejectionRule
from trajflow.algorithms.objective import decoupled_loss
from trajflow.operators.trainer.correction import StepBatch, step_diagnostics

RULES = (RejectionRule("token_k1", upper=1.2), RejectionRule("seq_mean_k2", upper=0.03),
         RejectionRule("seq_max_k3", upper=1.0))


def test_step_diagnostics_reports_each_rules_rejected_tokens_and_sequences_by_hand():
    # log r_d = old - inference per token; row 2 has no loss token (its 0.9s count nowhere)
    log_rd = torch.tensor([[0.5, 0.0, 0.1], [0.0, -0.3, 0.0], [0.9, 0.9, 0.9]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    old = torch.full((3, 3), -1.0)
    config = CorrectionConfig(mask_level="none", rejection=RULES)
    out = decoupled_loss(old, old, old - log_rd, torch.ones(3), mask, config)
    batch = StepBatch(prompts=[[1]] * 3, responses=[[1, 2, 3], [1, 2], [1]], inference=old - log_rd,
                      versions=torch.zeros(3, 3, dtype=torch.long), loss_mask=mask, advantages=torch.ones(3), old=old,
                      rows=torch.arange(3), groups=torch.arange(3), reference=None)
    metrics = step_diagnostics(out, batch, 0, 0, config=config)
    # token_k1 keeps |log r_d| <= log 1.2 = 0.18: 0.5 (row 0) and -0.3 (row 1) out, 2 of 5 tokens, both rows
    assert metrics["rejection/token_k1/token_frac"] == pytest.approx(2 / 5)
    assert metrics["rejection/token_k1/seq_frac"] == pytest.approx(1.0)
    # seq_mean_k2: row 0 (0.125 + 0 + 0.005) / 3 = 0.043 > 0.03 out, row 1 0.045 / 2 = 0.0225 kept
    assert metrics["rejection/seq_mean_k2/token_frac"] == pytest.approx(3 / 5)
    assert metrics["rejection/seq_mean_k2/seq_frac"] == pytest.approx(1 / 2)
    # seq_max_k3: the largest, e^0.5 - 1.5 = 0.149 <= 1, keeps every row
    assert metrics["rejection/seq_max_k3/token_frac"] == 0.0 and metrics["rejection/seq_max_k3/seq_frac"] == 0.0
    without = step_diagnostics(out, batch, 0, 0, config=CorrectionConfig(mask_level="none"))
    assert not [key for key in without if key.startswith("rejection/")]


@pytest.mark.timeout(300)
def test_the_train_steps_metrics_row_carries_each_rules_fractions(one_torch_thread):
    """The pipeline's own operators for one step, in one process; row 0's inference log-probs are
    shifted by -0.5 after scoring, so log r_d = +0.5 on its tokens (about 0 elsewhere, float32)."""
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.rl_loop import RLPipeline

    rules = [{"statistic": "token_k1", "upper": 1.2}, {"statistic": "seq_max_k3", "upper": 1.0}]
    pipe = RLPipeline(PipelineConfig(strategy="snapshot", prompts_per_step=2, group_size=4, inference_dtype="float32",
                                     drop_zero_variance_groups=False, seed=3, steps=1,
                                     correction={"mask_level": "none", "rejection": rules}))
    store, ops, batch = scored_step(pipe, 2)
    inference = batch["inference_logprobs"].to_pylist()
    inference[0] = [x - 0.5 for x in inference[0]]
    batch = batch.set_column(batch.schema.get_field_index("inference_logprobs"), "inference_logprobs",
                             pa.array(inference, type=batch.schema.field("inference_logprobs").type))
    loss_tokens = [sum(row) for row in batch["loss_mask"].to_pylist()]
    assert loss_tokens[0] > 0 and batch.num_rows == 8
    metrics = ops["train"](batch).to_pylist()[0]
    assert metrics["rows_trained"] == 8 and np.isfinite(metrics["loss"])
    assert metrics["rejection/token_k1/token_frac"] == pytest.approx(loss_tokens[0] / sum(loss_tokens))
    assert metrics["rejection/token_k1/seq_frac"] == pytest.approx(1 / sum(n > 0 for n in loss_tokens))
    assert metrics["rejection/seq_max_k3/token_frac"] == 0.0 and metrics["rejection/seq_max_k3/seq_frac"] == 0.0
