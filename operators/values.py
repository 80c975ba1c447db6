"""Values at behavior time: V(s_t) of every response token from the critic version the store
holds when the rollout is scored (Ray Data actor; an operator like the old log-probs').

The pipeline places it right after generation (`critic:` with `critic.values_at: rollout`, or a
value clip anchored there): it takes the newest critic version from the store's `critic` stream,
scores every row under the training numerics (engines/value_model.py) and writes `values` and
`value_versions` (the version, per token: a row scored in one pass has one). Asynchronous, that
version lags the trainer's critic by up to `max_staleness` versions: the value staleness the
train step reports per token.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch

from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.engines.value_model import load_value_model, values
from trajflow.operators.contracts.store import CRITIC, PolicyStoreClient
from trajflow.schemas.columns import VALUE_VERSIONS_COLUMN, VALUES_COLUMN, replace_column


class CriticValues:
    """The newest critic's values of every row of a batch (module docstring)."""

    def __init__(self, store: PolicyStoreClient, model_path: str | Path, numerics: TrainingNumerics,
                 torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.store = store
        self.numerics = numerics
        self.model = numerics.prepare(load_value_model(model_path)).requires_grad_(False)
        self.resident_version: int | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        # version 0 is published with the run's first policy version; a values stage that starts
        # before the trainer has put its critic there waits for it
        self.store.wait_for_version(0, learner=CRITIC)
        version, weights = self.store.weights(learner=CRITIC)
        if version != self.resident_version:
            self.model.load_state_dict(weights)
            self.resident_version = version
        responses = batch["response_tokens"].to_pylist()
        width = max((len(r) for r in responses), default=0)
        with self.numerics.autocast():
            scored = values(self.model, batch["prompt_tokens"].to_pylist(), responses, width=width).numpy()
        batch = replace_column(batch, VALUES_COLUMN, pa.array([row[: len(r)].tolist() for row, r in
                                                              zip(scored, responses)], pa.list_(pa.float32())))
        batch = replace_column(batch, VALUE_VERSIONS_COLUMN, pa.array([[version] * len(r) for r in responses],
                                                                      pa.list_(pa.int32())))
        self.store.add_counters({"values_seconds": time.perf_counter() - started})
        return batch
