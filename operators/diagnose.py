"""Diagnose: the correction diagnostics a train step would report, without training (Ray Data actor).

Batch in: all rows of one logged train step (with rewards, advantages, filter reasons and, for
the strategies that read it, the old_logprobs column from the old log-prob operator). Batch out: one
metrics row per strategy asked for — what would the mask / clip / active fractions, mismatch KL,
IS ESS and staleness have been under that strategy at that step?

"The trainer's weights of that step" are the weights of version k for train step k (the trainer
trains step k at version k and publishes k + 1), taken from the store; a replay therefore needs
every version's weights (`save_all_versions: true`). The step is the train step's own code: the
same staleness bound, the same rows, `StepBatch`, `correct` (the strategy's old_logprobs, tokens
outside the sampling support taken out, its trust mask, the decoupled loss) and
`step_diagnostics`, with current = pi_theta(version k) under no_grad and the same training
numerics. With one minibatch per step, diagnosing a logged run under its own strategy
reproduces its logged diagnostics.

A strategy whose state follows the weights (`follows_updates`, e.g. EWMA) is advanced after step k
with the weights of version k + 1 — one update per version, the unit it then counts its window in.

`gradients=True` adds the mechanism itself: current is computed with grad, and each strategy's
loss is differentiated with respect to every parameter (one backward each, on the same forward
pass); `grad/cos_vs_exact` and `grad/rel_err_vs_exact` compare it with the gradient of the first
exact strategy in `strategies` (algorithms/diagnostics.py `gradient_agreement`).

`max_tokens_per_microbatch` (the trainer's): the step's rows are cut into the trainer's micro-batches
(operators/trainer/plan.py), each with one forward; losses and gradients add up in sum form and are
divided once by the step's count, so the numbers equal the whole step's at the memory of one
micro-batch (a real model's whole step with gradients may not fit in memory at once).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trajflow.algorithms.config import CorrectionConfig, DistillConfig, KLConfig
from trajflow.algorithms.diagnostics import gradient_agreement
from trajflow.algorithms.objective import LossSum
from trajflow.engines.lora import VersionWeights
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.store import PolicyStoreClient, VersionNotHeld
from trajflow.operators.strategies.base import Strategy
from trajflow.operators.trainer.accounting import apply_staleness_bound, step_metrics
from trajflow.operators.trainer.correction import (PolicyHolder, StepBatch, correct, merge_outputs, step_diagnostics,
                                                   top_k_in_loss)
from trajflow.operators.trainer.plan import plan_shards


class Diagnose(PolicyHolder):
    """The correction metrics of each logged step under each of `strategies` (module docstring)."""

    def __init__(
        self,
        store: PolicyStoreClient,
        model_path: str | Path,
        strategies: list[Strategy],
        correction: CorrectionConfig,
        kl: KLConfig,
        sampling: SamplingConfig,
        max_staleness: int,
        numerics: TrainingNumerics,
        torch_threads: int,
        gradients: bool = False,
        distill: DistillConfig | None = None,
        max_tokens_per_microbatch: int | None = None,
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.store = store
        self.strategies = list(strategies)
        self.correction = correction
        self.kl = kl
        self.distill = distill
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.numerics = numerics
        exact = [s.name for s in self.strategies if s.kind == "exact"]
        if gradients and not exact:
            raise ValueError("gradients: compare against an exact strategy (e.g. snapshot); none was given")
        self.gradients_vs = exact[0] if gradients else None
        self.minibatches_per_step = 1  # the log holds one set of weights per version
        self.max_tokens_per_microbatch = max_tokens_per_microbatch  # the trainer's (None: the whole step)
        self.model = numerics.prepare(load_model(model_path))
        self.versions = VersionWeights(model_path)  # a LoRA run's versions are adapters
        self.version: int | None = None
        self.bound = False

    def _load(self, version: int) -> bool:
        """Make `version` the resident weights; False if the store does not hold it."""
        if self.version != version:
            try:
                _, weights = self.store.weights(version)
            except VersionNotHeld:
                return False
            self.model.load_state_dict(self.versions.full(weights))
            self.version = version
        return True

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        column = "trainer_version" if "trainer_version" in batch.column_names else "rollout_step"
        versions_here = np.unique(batch[column].to_numpy())
        if len(versions_here) != 1:
            raise RuntimeError(f"a diagnose batch must hold exactly one train step, got {versions_here.tolist()}")
        k = int(versions_here[0])
        batch, trained, stale_tokens = apply_staleness_bound(batch, k, self.max_staleness)
        rollout_step = int(batch["rollout_step"][0].as_py()) if "rollout_step" in batch.column_names else k
        base = step_metrics(batch, k, rollout_step, trained, stale_tokens)
        if not self._load(k):
            raise RuntimeError(f"diagnose: the weights of version {k} are not in the store")
        if not self.bound:  # as in the train step: strategies start from the first step's weights
            for strategy in self.strategies:
                strategy.bind(self)
            self.bound = True

        results: dict[str, dict] = {s.name: {} for s in self.strategies}
        if len(trained):
            step = StepBatch.from_table(batch.take(pa.array(trained)), k)
            for strategy in self.strategies:
                strategy.before_step(step, self)
            results = self._diagnose(step, k)
            self._after_step(k, results)
        rows = [{**base, "strategy": s.name, **results[s.name], "diagnose_seconds": time.perf_counter() - started}
                for s in self.strategies]
        keys = list(dict.fromkeys(key for row in rows for key in row))  # from_pylist reads only row 0's keys
        return pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])

    def _diagnose(self, step: StepBatch, k: int) -> dict[str, dict]:
        """Each strategy's step diagnostics (and gradient) on the step's trained rows, over the
        trainer's micro-batches: one forward of pi_theta per micro-batch, shared by the strategies;
        the losses (and gradients) in sum form, divided once by the step's count, as the trainer does."""
        lengths = step.lengths()
        micro = plan_shards(lengths, 1, 1, self.max_tokens_per_microbatch).microbatches[0][0]
        params = [p for p in self.model.parameters() if p.requires_grad] if self.gradients_vs else []
        parts: dict[str, list] = {s.name: [] for s in self.strategies}
        outside = dict.fromkeys(parts, 0)
        grads: dict[str, torch.Tensor] = {}
        for rows in micro:
            part = step.select(torch.tensor(rows, dtype=torch.int64))
            top_k = [] if any(top_k_in_loss(s, self.distill, part) for s in self.strategies) else None
            current = self.current(part, grad=self.gradients_vs is not None, top_k=top_k)
            for strategy in self.strategies:
                fixed = correct(strategy, part, current, self, self.correction, kl=self.kl, distill=self.distill,
                                current_top_k=top_k[0] if top_k else None)
                parts[strategy.name].append((part.rows, fixed.loss.detached()))
                outside[strategy.name] += fixed.outside_support
                if self.gradients_vs is not None:
                    pieces = torch.autograd.grad(fixed.loss.loss_sum, params, retain_graph=True, allow_unused=True)
                    flat = torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, pieces)])
                    if strategy.name in grads:
                        grads[strategy.name].add_(flat)
                    else:
                        grads[strategy.name] = flat
        results = {}
        for strategy in self.strategies:
            total = sum((LossSum(float(out.loss_sum), float(out.count)) for _, out in parts[strategy.name]), LossSum())
            merged = merge_outputs(parts[strategy.name], step.inference.shape, None if len(micro) == 1 else total.mean)
            results[strategy.name] = step_diagnostics(merged, step, k, outside[strategy.name], strategy,
                                                      strategy.correction(self.correction))
            if strategy.name in grads:
                grads[strategy.name] /= total.divisor
        for name, grad in grads.items():
            results[name].update(gradient_agreement(grad, grads[self.gradients_vs]))
        return results

    def _after_step(self, k: int, results: dict[str, dict]) -> None:
        """The strategies' after-update / after-step hooks, in the train step's order: strategies that
        follow the weights see version k + 1 (skipped at the end of a partial log)."""
        followers = [s for s in self.strategies if s.follows_updates]
        advanced = bool(followers) and self._load(k + 1)
        for strategy in self.strategies:
            if strategy.follows_updates:
                if not advanced:
                    continue
                strategy.after_update(self)
            results[strategy.name].update(strategy.after_step(self, results[strategy.name]))
