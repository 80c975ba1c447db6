"""Reference log-probs: log pi_ref of every response token under a frozen reference model, for
the KL penalty (`kl:`; algorithms/kl.py). Ray Data actor; runs without Ray in one process.

The reference is scored like every pi_old: teacher-forced, in the training numerics
(engines/training_numerics.py), so the KL compares the policy with the reference, not two kinds
of arithmetic. The pipeline places this operator only when `kl.beta > 0` (beta 0 builds no
reference model):

- `kl.in: loss`   right before the train step, on the rows that will be trained: the train step
                  adds beta x KL(pi_theta || pi_ref) to the loss (decoupled_loss).
- `kl.in: reward` right after the reward, on every scored row: it also writes `kl_penalty`,
                  beta x the sum over the row's loss tokens of the per-token KL estimate between
                  the sampled tokens' inference log-probs (mu, the policy that generated them) and
                  pi_ref; the advantage is then computed from reward - kl_penalty (veRL's
                  use_kl_in_reward). `reward` keeps the task's reward.

Columns: `reference_logprobs` (list<float32>, null for a row not scored), `kl_penalty` (float32,
reward mode). A token outside the sampling support under the reference scores -inf; its KL
contribution is 0 (log-ratios are clamped, and such a token is not trained anyway).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trajflow.algorithms.config import KLConfig
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.schemas.columns import KL_PENALTY_COLUMN, REFERENCE_COLUMN, filter_reasons, padded, replace_column


class FrozenScorer:
    """A frozen model read from its own directory, scoring the response tokens of a batch's rows
    teacher-forced in the training numerics (the reference's and the teacher's machinery: neither
    asks the policy store for weights). `skip_filtered`: only the rows that will be trained."""

    def __init__(self, model_path: str | Path, sampling: SamplingConfig, numerics: TrainingNumerics,
                 skip_filtered: bool, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.sampling = sampling
        self.numerics = numerics
        self.skip_filtered = skip_filtered
        self.model = numerics.prepare(load_model(model_path)).requires_grad_(False)

    def rows_to_score(self, batch: pa.Table) -> list[int]:
        if not self.skip_filtered:
            return list(range(batch.num_rows))
        reasons = filter_reasons(batch)
        return [i for i in range(batch.num_rows) if reasons[i] is None]

    def score(self, batch: pa.Table, rows: list[int], **top_k) -> list[list[float] | None]:
        """Per row of `batch`, the log-probs of its response tokens (None for a row not in `rows`);
        `top_k`: TrainingNumerics.score's top_k_ids / top_k (one support per scored row)."""
        prompts, responses = batch["prompt_tokens"].to_pylist(), batch["response_tokens"].to_pylist()
        scored = self.numerics.score(self.model, [prompts[i] for i in rows], [responses[i] for i in rows],
                                     self.sampling, **top_k) if rows else []
        out: list[list[float] | None] = [None] * batch.num_rows
        for i, lp in zip(rows, scored):
            out[i] = lp.tolist()
        return out


class ReferenceLogprobs(FrozenScorer):
    """log pi_ref of every token of the scored rows (see the module docstring)."""

    def __init__(self, store: PolicyStoreClient | None, model_path: str | Path, kl: KLConfig, sampling: SamplingConfig,
                 numerics: TrainingNumerics, skip_filtered: bool, torch_threads: int) -> None:
        # `store`: every class stage is handed the policy store; the reference is frozen and
        # read from its directory, so it never asks it for weights
        super().__init__(model_path, sampling, numerics, skip_filtered, torch_threads)
        self.kl = kl

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self.rows_to_score(batch)
        reference = self.score(batch, rows)
        batch = replace_column(batch, REFERENCE_COLUMN, pa.array(reference, pa.list_(pa.float32())))
        if self.kl.in_ == "reward":
            batch = replace_column(batch, KL_PENALTY_COLUMN, pa.array(self._penalty(batch, rows), pa.float32()))
        return batch

    def _penalty(self, batch: pa.Table, rows: list[int]) -> np.ndarray:
        from trajflow.algorithms.kl import kl_estimate, kl_penalized_rewards

        penalty = np.zeros(batch.num_rows, np.float32)
        if not rows:
            return penalty
        table = batch.take(pa.array(rows, pa.int64()))
        width = max(1, max(len(r) for r in table["response_tokens"].to_pylist()))
        mu = torch.from_numpy(padded(table["inference_logprobs"], width, 0.0))
        ref = torch.from_numpy(padded(table[REFERENCE_COLUMN], width, 0.0))
        mask = torch.from_numpy(padded(table["loss_mask"], width, False, bool)) & torch.isfinite(ref)
        kl = kl_estimate(mu, torch.where(mask, ref, mu), self.kl.estimator)
        penalty[rows] = -kl_penalized_rewards(torch.zeros(len(rows), dtype=torch.float64), kl.double(), mask,
                                              self.kl.beta).numpy()
        return penalty
