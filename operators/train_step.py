"""Train step: one optimizer step per rollout step, then publish the new weights (Ray Data actor).

Batch in: all rows of one rollout step (trajectories with rewards, advantages, filter reasons and,
for the exact strategies, old log-probs). Batch out: one metrics row.

The step, top to bottom:
1. Staleness check where tokens are trained: lag = trainer version - token version. Tokens with
   lag > max_staleness are removed from the loss and counted (rows left with no token: reason
   `over_stale`). Admission already bounds lag; this makes the bound hold whatever Ray Data does.
2. The proximal ("old") log-probs of the strategy: the column (snapshot, dedicated, interrupt),
   mu (behavior), the current weights before the update (recompute), the EWMA weights (ewma) or
   the log-linear interpolation (loglinear).
3. decoupled_loss from algorithms/, backward, clip, optimizer step (per minibatch).
4. EWMA update/reset, publish the weights to the policy store, emit diagnostics.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import ray
import torch
from accelerate import Accelerator

from trajflow.algorithms import CorrectionConfig, decoupled_loss
from trajflow.algorithms.diagnostics import correction_diagnostics
from trajflow.algorithms.ewma import EwmaProximal, ewma_beta
from trajflow.algorithms.proximal import loglinear_alpha, loglinear_logprobs
from trajflow.engines.models import load_model, load_tokenizer
from trajflow.engines.sampling import SamplingParams
from trajflow.engines.scoring import response_logprobs
from trajflow.schemas.weights import SharedStateDict
from trajflow.operators.columns import apply_staleness_bound, padded, replace_column, step_metrics
from trajflow.operators.evaluate import heldout_accuracy
from trajflow.schemas import conform
from trajflow.tasks.workload import Workload

OPERATOR_STRATEGIES = ("snapshot", "dedicated", "interrupt")


def publish_weights(store: ray.actor.ActorHandle, model: torch.nn.Module, version: int | None = None) -> int:
    """Put a float32 copy of the weights in the object store (the only copy: see
    schemas/weights.py) and register it as a new version."""
    state = SharedStateDict.of(model)
    return ray.get(store.publish.remote([ray.put(state)], state.nbytes, version))


class TrainStep:
    def __init__(
        self,
        store: ray.actor.ActorHandle,
        model_path: str | Path,
        workload: Workload,
        strategy: str,
        correction: CorrectionConfig,
        sampling: SamplingParams,
        max_staleness: int,
        lr: float = 1.5e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        grad_clip: float | None = 1.0,
        minibatches_per_step: int = 1,
        mixed_precision: str = "no",
        ewma_window: int = 1,
        ewma_tau: float = 0.9,
        loglinear_alpha: float | None = None,
        eval_every: int = 0,
        eval_prompts: int = 200,
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
        self.grad_clip = grad_clip
        self.minibatches = minibatches_per_step
        self.fixed_alpha = loglinear_alpha
        self.eval_every = eval_every
        self.eval_prompts = eval_prompts
        self.workload = workload
        self.tokenizer = load_tokenizer(model_path)
        self.on_step = on_step  # e.g. the job's trajectory log and checkpoints (after publishing)

        model = load_model(model_path)
        # Start from the store's newest weights: version 0 on a fresh run, the resumed one later.
        self.version, (ref,) = ray.get(store.get.remote(None))
        model.load_state_dict(ray.get(ref))
        self.accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.model.train()
        self.ewma: EwmaProximal | None = None
        self.prox_model = None
        if strategy == "ewma":
            self.ewma = EwmaProximal(self._state_dict(), ewma_beta(ewma_window), tau=ewma_tau)
            self.prox_model = copy.deepcopy(self._unwrapped()).eval()
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        if on_start is not None:
            on_start(self)  # e.g. a resumed job restores optimizer and EWMA state here

    def _unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._unwrapped().state_dict().items()}

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        wall_started = time.perf_counter()
        steps = np.unique(batch["rollout_step"].to_numpy())
        if len(steps) != 1:
            raise RuntimeError(f"a train batch must hold exactly one rollout step, got steps {steps.tolist()}")
        trainer_version = self.version
        batch, trained, stale_tokens = apply_staleness_bound(batch, trainer_version, self.max_staleness)
        metrics = step_metrics(batch, trainer_version, int(steps[0]), trained, stale_tokens)
        metrics["strategy"] = self.strategy

        if len(trained):
            diagnostics, old_used = self._optimize(batch.take(pa.array(trained)), trainer_version)
            metrics.update(diagnostics)
            old_column = np.full(batch.num_rows, None, dtype=object)
            old_column[trained] = old_used
            batch = replace_column(batch, "old_logprobs", pa.array(old_column.tolist(), pa.list_(pa.float32())))
        # A step with nothing to train still publishes (unchanged weights, new version): the
        # rollouts of later steps wait on this version.
        self.version = publish_weights(self.store, self._unwrapped())
        metrics["version"] = self.version
        metrics["train_seconds"] = time.perf_counter() - wall_started
        self.busy_seconds += metrics["train_seconds"]
        metrics["trainer_busy_frac"] = self.busy_seconds / max(time.perf_counter() - self.started, 1e-9)
        if self.eval_every and self.version % self.eval_every == 0:
            self.model.eval()
            metrics["heldout_accuracy"] = heldout_accuracy(
                self._unwrapped(), self.tokenizer, self.workload, self.eval_prompts, self.sampling.max_new_tokens,
                stop=self.sampling.stop
            )
            self.model.train()
        stats = ray.get(self.store.stats.remote(True))
        metrics.update(
            {
                "snapshot_versions_held": len(stats.versions_held),
                "snapshot_bytes": stats.snapshot_bytes,
                "snapshot_max_versions_held": stats.max_versions_held,
                **{f"seconds/{k}" if k.endswith("seconds") else k: v for k, v in stats.counters.items()},
            }
        )
        if self.on_step is not None:
            self.on_step(self, conform(batch), metrics)
        return pa.Table.from_pylist([metrics])

    def _tensors(self, batch: pa.Table) -> dict[str, torch.Tensor]:
        width = max(len(r) for r in batch["response_tokens"].to_pylist())
        t = {
            "inference": torch.from_numpy(padded(batch["inference_logprobs"], width, 0.0)),
            "versions": torch.from_numpy(padded(batch["versions"], width, self.version, np.int64)),
            "loss_mask": torch.from_numpy(padded(batch["loss_mask"], width, False, bool)),
            "advantages": torch.from_numpy(batch["advantage"].to_numpy(zero_copy_only=False).astype(np.float32)),
        }
        if self.strategy in OPERATOR_STRATEGIES:
            if batch["old_logprobs"].null_count:
                raise RuntimeError(f"strategy {self.strategy}: rows reached the train step without old_logprobs")
            t["old"] = torch.from_numpy(padded(batch["old_logprobs"], width, 0.0))
        return t

    def _current(self, prompts, responses, grad: bool, model=None) -> torch.Tensor:
        """Per-token log-probs [b, width] (right-padded with 0 to the whole batch's width)."""
        logprobs, _ = response_logprobs(model or self.model, prompts, responses, self.sampling, grad=grad)
        return torch.nn.functional.pad(logprobs, (0, self.width - logprobs.shape[1]))

    def _optimize(self, batch: pa.Table, trainer_version: int) -> tuple[dict, list]:
        prompts = batch["prompt_tokens"].to_pylist()
        responses = batch["response_tokens"].to_pylist()
        t = self._tensors(batch)
        self.width = t["inference"].shape[1]
        if self.strategy == "recompute":
            with torch.no_grad():  # pi_async: the trainer's weights before this step's update
                t["old"] = self._current(prompts, responses, grad=False)
        rows = np.arange(batch.num_rows)
        outputs, olds = [], torch.zeros_like(t["inference"])
        for chunk in np.array_split(rows, self.minibatches):
            idx = torch.from_numpy(chunk)
            p, r = [prompts[i] for i in chunk], [responses[i] for i in chunk]
            current = self._current(p, r, grad=True)
            old = self._proximal(t, idx, current, p, r, trainer_version)
            olds[idx] = old
            out = decoupled_loss(
                current, old, t["inference"][idx], t["advantages"][idx], t["loss_mask"][idx], self.correction
            )
            self.optimizer.zero_grad(set_to_none=True)
            self.accelerator.backward(out.loss)
            if self.grad_clip:
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            outputs.append((idx, out))
            if self.ewma is not None:
                self.ewma.update(self._state_dict())

        merged = _merge_outputs(outputs, t["loss_mask"].shape)
        diagnostics = correction_diagnostics(merged, versions=t["versions"], trainer_version=trainer_version,
                                             advantages=t["advantages"])
        diagnostics["loss"] = float(sum(out.loss.item() for _, out in outputs) / len(outputs))
        if self.ewma is not None:
            fired = self.ewma.maybe_reset(diagnostics["active_frac"], self._state_dict())
            diagnostics.update({"ewma/reset": float(fired), "ewma/reset_count": float(self.ewma.reset_count),
                                "ewma/age": self.ewma.age})
        versions_per_row = batch["versions"].to_pylist()
        diagnostics["rows_spanning_versions"] = sum(len(set(v)) > 1 for v in versions_per_row)
        lengths = [len(r) for r in responses]
        return diagnostics, [row[:n].tolist() for row, n in zip(olds.numpy(), lengths)]

    def _proximal(self, t, idx, current, prompts, responses, trainer_version) -> torch.Tensor:
        if self.strategy in OPERATOR_STRATEGIES or self.strategy == "recompute":
            return t["old"][idx]
        if self.strategy == "behavior":
            return t["inference"][idx]
        if self.strategy == "ewma":
            self.prox_model.load_state_dict(self.ewma.prox_state_dict())
            with torch.no_grad():
                return self._current(prompts, responses, grad=False, model=self.prox_model)
        if self.strategy == "loglinear":
            alpha = (
                self.fixed_alpha
                if self.fixed_alpha is not None
                else loglinear_alpha(t["versions"][idx], theta_version=trainer_version + 1)
            )
            return loglinear_logprobs(current.detach(), t["inference"][idx], alpha)
        raise ValueError(f"unknown strategy {self.strategy!r}")


def _merge_outputs(outputs, shape) -> "object":
    """Reassemble per-minibatch LossOutputs into one with full-batch [B, T] bookkeeping."""
    if len(outputs) == 1:
        return outputs[0][1]
    first = outputs[0][1]
    merged = copy.copy(first)
    for name in ("loss_mask", "discrepancy_mask", "clipped_low", "clipped_high", "dual_clipped", "active",
                 "log_rd", "log_rs", "is_weights", "token_weights"):
        full = torch.zeros(shape, dtype=getattr(first, name).dtype)
        for idx, out in outputs:
            part = getattr(out, name)
            full[idx, : part.shape[1]] = part
        setattr(merged, name, full)
    return merged
