"""Train step: one step of the policy per rollout step (Ray Data actor).

Batch in: all rows of one rollout step (trajectories with rewards, advantages, filter reasons and,
for the exact strategies, old log-probs). Batch out: one metrics row.

The step, top to bottom:
1. Staleness bound where tokens are trained: lag = trainer version - token version. Tokens with
   lag > max_staleness are removed from the loss and counted (rows left with no token: reason
   `over_stale`). Admission already bounds lag; this makes the bound hold whatever Ray Data does.
2. Per minibatch: pi_theta under the training numerics (engines/training_numerics.py: dropout
   off, the same autocast as every pi_old), then the strategy's correction (operators/correction.py:
   its proximal, tokens outside the sampling support taken out and counted, its trust mask, the
   decoupled loss), backward, gradient clip and the optimizer update. An update whose gradient
   is not finite is skipped and counted (`grad/nonfinite_skipped`), never applied.
3. The strategy's after-update / after-step hooks (EWMA update and reset, M2PO's metrics); the
   trainer now holds version k + 1.
4. The `after_step` services (operators/after_step.py: publish, held-out evaluation, store
   statistics), then the job's `on_step` hook — all in this process.

Public for the jobs layer: `version`, `strategy`, `policy()`, `policy_state_dict()`,
`checkpoint_state()` / `load_checkpoint_state()` (optimizer + strategy state, for resume).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import torch

from trajflow.algorithms import CorrectionConfig
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingParams
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.after_step import AfterStep
from trajflow.operators.columns import apply_staleness_bound, replace_column, step_metrics
from trajflow.operators.correction import (
    PolicyHolder,
    StepBatch,
    correct,
    merge_outputs,
    old_column,
    step_diagnostics,
)
from trajflow.operators.strategies.base import Strategy
from trajflow.schemas import conform


class TrainStep(PolicyHolder):
    def __init__(
        self,
        store: ray.actor.ActorHandle,
        model_path: str | Path,
        strategy: Strategy,
        correction: CorrectionConfig,
        sampling: SamplingParams,
        max_staleness: int,
        numerics: TrainingNumerics = TrainingNumerics(),
        lr: float = 1.5e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        grad_clip: float | None = 1.0,
        minibatches_per_step: int = 1,
        after_step: Sequence[AfterStep] = (),
        torch_threads: int = 1,
        on_start: Callable[["TrainStep"], None] | None = None,
        on_step: Callable[["TrainStep", pa.Table, dict], None] | None = None,
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.store = store
        self.strategy = strategy
        self.correction = correction
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.numerics = numerics
        self.grad_clip = grad_clip
        self.updates_per_version = minibatches_per_step
        self.after_step = list(after_step)
        self.on_step = on_step  # the job's hook (trajectory log, checkpoints), after the services

        # Start from the store's newest weights: version 0 on a fresh run, the resumed one later.
        self.version, (ref,) = ray.get(store.get.remote(None))
        self.model = numerics.prepare(load_model(model_path))
        self.model.load_state_dict(ray.get(ref))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        self.optimizer_steps = 0
        self.strategy.bind(self)
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        if on_start is not None:
            on_start(self)  # e.g. a resumed job restores optimizer and strategy state here

    # -- for the jobs layer ----------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps besides the weights: optimizer and strategy state."""
        return {"optimizer": self.optimizer.state_dict(), "strategy": self.strategy.state_dict()}

    def load_checkpoint_state(self, optimizer: dict | None, strategy: dict | None) -> None:
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            steps = [float(s["step"]) for s in self.optimizer.state_dict()["state"].values() if "step" in s]
            self.optimizer_steps = int(max(steps)) if steps else 0
        if strategy:
            self.strategy.load_state_dict(strategy)
        elif self.strategy.state_dict():
            raise RuntimeError(f"resume: the checkpoint holds no state of strategy {self.strategy.name}")

    # -- the step ----------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        steps = np.unique(batch["rollout_step"].to_numpy())
        if len(steps) != 1:
            raise RuntimeError(f"a train batch must hold exactly one rollout step, got steps {steps.tolist()}")
        trainer_version = self.version
        batch, trained, stale_tokens = apply_staleness_bound(batch, trainer_version, self.max_staleness)
        metrics = step_metrics(batch, trainer_version, int(steps[0]), trained, stale_tokens)
        metrics["strategy"] = self.strategy.name

        if len(trained):
            diagnostics, old_used = self._update(batch.take(pa.array(trained)), trainer_version)
            metrics.update(diagnostics)
            old = np.full(batch.num_rows, None, dtype=object)
            old[trained] = old_used
            batch = replace_column(batch, "old_logprobs", pa.array(old.tolist(), pa.list_(pa.float32())))
        self.version = trainer_version + 1
        metrics["version"] = self.version
        metrics["optimizer_steps"] = self.optimizer_steps
        for hook in self.after_step:
            hook(self, batch, metrics)
        metrics["train_seconds"] = time.perf_counter() - started
        self.busy_seconds += metrics["train_seconds"]
        metrics["trainer_busy_frac"] = self.busy_seconds / max(time.perf_counter() - self.started, 1e-9)
        if self.on_step is not None:
            self.on_step(self, conform(batch), metrics)
        return pa.Table.from_pylist([metrics])

    def _update(self, table: pa.Table, trainer_version: int) -> tuple[dict, list]:
        batch = StepBatch.from_table(table, trainer_version)
        self.strategy.before_step(batch, self)
        parts, olds = [], torch.zeros_like(batch.inference)
        outside, norms, skipped = 0, [], 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        for chunk in np.array_split(np.arange(len(batch)), self.updates_per_version):
            minibatch = batch.select(torch.from_numpy(chunk))
            result = correct(self.strategy, minibatch, self.current(minibatch, grad=True), self, self.correction)
            olds[minibatch.rows] = result.old
            outside += result.outside_support
            parts.append((minibatch.rows, result.loss))
            self.optimizer.zero_grad(set_to_none=True)
            result.loss.loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip or math.inf))
            if not math.isfinite(norm):  # never step on a NaN/inf gradient: count it instead
                skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            norms.append(norm)
            self.optimizer.step()
            self.optimizer_steps += 1
            self.strategy.after_update(self)

        diagnostics = step_diagnostics(merge_outputs(parts, batch.loss_mask.shape), batch, trainer_version, outside)
        diagnostics["grad/norm"] = float(np.mean(norms)) if norms else None
        diagnostics["grad/nonfinite_skipped"] = float(skipped)
        diagnostics.update(self.strategy.after_step(self, diagnostics))
        return diagnostics, old_column(olds, [len(r) for r in batch.responses])
