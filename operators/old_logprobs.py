"""Old log-probs at the behavior version: pi_v^train for every token, exactly (Ray Data actor).

For each version v carried by the batch's tokens, the operator loads the weights of v from the
policy store (under `weight_sync.method: collective`: from the window v-S..v the trainer sent
this process, operators/trainer/weight_sync.py) into a model scored under the training numerics (engines/training_numerics.py: the
trainer's device kind and autocast, dropout off), scores the responses teacher-forced and keeps
the log-probs of the tokens stamped v. A trajectory spanning versions is thus scored under each
token's own version. A token outside the sampling filter's support under these numerics gets
-inf (the train step takes it out of the loss and counts it). When the rows carry the sampler's
top-k ids (`top_k_logprobs` K > 0), the same pass scores pi_old on them at each token's version
(`top_k_old_logprobs`). After scoring it releases the batch's pins on those versions, so the store
frees a snapshot as soon as no in-flight token needs it.

The same operator serves the exact strategies; what differs is where each places it
(operators/strategies/):
- `dedicated`: right after generate, on its own actor (its own CPU/GPU share). It follows the
  generator's versions in lockstep — the store holds a version only until its batch is scored —
  so it switches at most as often as the generator and keeps no history.
- `snapshot`: right before the train step. Rows the filter dropped are never scored, but the
  store must keep every version still inside the staleness window (up to max_staleness + 1).
- in an offline replay, for any strategy that reads the column (e.g. `interrupt`, whose live
  values come from the generator).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trajflow.engines.lora import VersionWeights
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.store import PolicyStoreClient, VersionNotHeld
from trajflow.operators.trainer.weight_receiver import weight_source
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.schemas.columns import filter_reasons, mark_filtered, nested_array, nested_rows, replace_column


class OldLogprobsAtBehaviorVersion:
    """pi_v^train of every token at its own version v (see the module docstring)."""

    def __init__(
        self,
        store: PolicyStoreClient,
        model_path: str | Path,
        sampling: SamplingConfig,
        skip_filtered: bool,
        numerics: TrainingNumerics,
        torch_threads: int,
        weight_sync: WeightSyncConfig,
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.store = store
        # the training numerics' weights, the staleness window of them (collective: in this process)
        self.source = weight_source(store, weight_sync, "float32", history=True,
                                     device=str(numerics.torch_device()))
        self.numerics = numerics
        self.model = numerics.prepare(load_model(model_path))
        self.versions = VersionWeights(model_path)  # a LoRA run's versions are adapters
        self.sampling = sampling
        self.skip_filtered = skip_filtered
        self.resident_version: int | None = None

    def _ensure(self, version: int) -> None:
        if version != self.resident_version:
            self.model.load_state_dict(self.versions.full(self.source.weights(version)))
            self.resident_version = version

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        versions = batch["versions"].to_pylist()
        rows = range(batch.num_rows)
        if self.skip_filtered:
            reasons = filter_reasons(batch)
            rows = [i for i in rows if reasons[i] is None]
        prompts = batch["prompt_tokens"].to_pylist()
        responses = batch["response_tokens"].to_pylist()
        old: list[list[float] | None] = [None] * batch.num_rows
        supports = nested_rows(batch["top_k_ids"]) if "top_k_ids" in batch.column_names else None
        old_top_k: list[np.ndarray | None] = [None] * batch.num_rows
        needed = sorted({v for i in rows for v in versions[i]})
        # Score under the resident version first, so a batch of one version never switches twice.
        needed.sort(key=lambda v: v != self.resident_version)
        evicted: set[int] = set()
        for version in needed:
            try:
                self._ensure(version)
            except VersionNotHeld:
                evicted.add(version)  # out of the staleness window: its tokens cannot be trained
                continue
            todo = [i for i in rows if version in versions[i]]
            tops: list[np.ndarray] = []
            scored = self.numerics.score(self.model, [prompts[i] for i in todo], [responses[i] for i in todo],
                                         self.sampling, top_k_ids=None if supports is None else
                                         [supports[i] for i in todo], top_k=tops)
            for j, (i, lp) in enumerate(zip(todo, scored)):
                if old[i] is None:
                    old[i] = [float("nan")] * len(responses[i])
                mine = np.asarray(versions[i]) == version
                for t in np.flatnonzero(mine):
                    old[i][t] = float(lp[t])
                if supports is not None:
                    if old_top_k[i] is None:
                        old_top_k[i] = np.full(supports[i].shape, np.nan, np.float32)
                    old_top_k[i][mine] = tops[j][mine]
        over_stale = np.array([bool(evicted & set(vs)) for vs in versions])
        for i in np.flatnonzero(over_stale):
            old[i] = old_top_k[i] = None
        for version in {v for vs in versions for v in vs}:
            self.store.release(version)
        self.store.add_counters(
            {"old_logprobs_seconds": time.perf_counter() - started, "old_logprob_version_switches": float(len(needed))}
        )
        batch = replace_column(batch, "old_logprobs", pa.array(old, pa.list_(pa.float32())))
        if supports is not None:
            k = next((r.shape[1] for r in supports if r is not None), 0)
            batch = replace_column(batch, "top_k_old_logprobs", nested_array(old_top_k, pa.float32(), k))
        return mark_filtered(batch, over_stale, "over_stale") if over_stale.any() else batch


