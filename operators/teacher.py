"""Teacher log-probs: a second model scores the student's tokens, for on-policy distillation
(`teacher:` and `distill:`; algorithms/distillation.py). Ray Data actor; runs without Ray in one
process.

The teacher is a scorer like the dedicated old log-prob model: teacher-forced, in the training
numerics (engines/training_numerics.py), with the run's sampling semantics (temperature, top-k,
top-p: the distribution the student samples from is compared with the teacher's under the same
processing). It is frozen, read from its own directory, so it never asks the policy store for
weights and its scores never go stale — only the student's do, which is what AsyncOPD's
correction is about. It runs right before the train step on the rows that will be trained.

Columns: `teacher_logprobs` (list<float32>: the teacher's log-prob of each sampled token) and,
when the rows carry the sampler's top-k ids (`top_k_logprobs` K > 0), `top_k_teacher_logprobs`
(the teacher on those ids: the forward KL's support). Null for a row not scored. A token outside
the teacher's sampling support scores -inf; the train step takes it out of the loss and counts it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.reference import FrozenScorer
from trajflow.schemas.columns import nested_array, nested_rows, replace_column


class TeacherLogprobs(FrozenScorer):
    """The teacher's log-probs of the scored rows' tokens (see the module docstring)."""

    def __init__(self, store: PolicyStoreClient | None, model_path: str | Path, sampling: SamplingConfig,
                 numerics: TrainingNumerics, skip_filtered: bool, torch_threads: int) -> None:
        # `store`: every class stage is handed the policy store; the teacher never asks it for weights
        super().__init__(model_path, sampling, numerics, skip_filtered, torch_threads)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self.rows_to_score(batch)
        supports = nested_rows(batch["top_k_ids"]) if "top_k_ids" in batch.column_names else None
        tops: list[np.ndarray] = []
        teacher = self.score(batch, rows, top_k_ids=None if supports is None else [supports[i] for i in rows],
                             top_k=tops)
        batch = replace_column(batch, "teacher_logprobs", pa.array(teacher, pa.list_(pa.float32())))
        if supports is not None:
            on_support: list[np.ndarray | None] = [None] * batch.num_rows
            for i, top in zip(rows, tops):
                on_support[i] = top
            k = next((r.shape[1] for r in supports if r is not None), 0)
            batch = replace_column(batch, "top_k_teacher_logprobs", nested_array(on_support, pa.float32(), k))
        return batch
