"""The old log-prob stage that copies the inference log-probs (a light stage, without torch: it runs
in whichever process its neighbours do, and the driver that builds the stage list builds it)."""

from __future__ import annotations

import pyarrow as pa

from trajflow.schemas.columns import replace_column


class InferenceAsOld:
    """The old log-prob stage where its forward pass would repeat the inference log-probs in the
    same numerics (PipelineConfig.old_is_inference): `old_logprobs` := `inference_logprobs`, a
    column copy (a light stage: no model, no store)."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        return replace_column(batch, "old_logprobs", batch["inference_logprobs"])
