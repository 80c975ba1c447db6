"""Diagnose: the correction diagnostics a train step would report, without training (Ray Data actor).

Batch in: all rows of one logged train step (with rewards, advantages, filter reasons and, for the
exact strategies, old log-probs from the old-logit operator). Batch out: one metrics row per
strategy asked for — what would the mask / clip / active fractions, mismatch KL, IS ESS and
staleness have been under that strategy at that step?

"The trainer's weights of that step" are the weights of version k for train step k (the trainer
trains step k at version k and publishes k + 1), taken from the store; a replay therefore needs
every version's weights (`save_all_versions: true`). The step mirrors TrainStep: the same
staleness bound, the same rows (the filter's survivors), the same padding, `decoupled_loss` with
current = pi_theta(version k) under no_grad, then `correction_diagnostics`. With one minibatch per
step, diagnosing a logged run under its own strategy reproduces its logged diagnostics.

Per strategy, old log-probs are:
- snapshot / dedicated / interrupt: the `old_logprobs` column (scored at each token's version);
- recompute: pi_theta itself (the trainer's weights before the update), so r_s = 1;
- behavior: the inference log-probs (r_d = 1);
- loglinear: log mu + alpha (log pi_theta - log mu), alpha from versions (or fixed);
- ewma: an EWMA of the trainer's weights over the replayed versions (reset when the active
  fraction falls below tau), advanced after each step with the weights of version k + 1.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import torch

from trajflow.algorithms import CorrectionConfig, decoupled_loss
from trajflow.algorithms.diagnostics import correction_diagnostics
from trajflow.algorithms.ewma import EwmaProximal, ewma_beta
from trajflow.algorithms.proximal import loglinear_alpha, loglinear_logprobs
from trajflow.engines.models import load_model
from trajflow.engines.sampling import SamplingParams
from trajflow.engines.scoring import response_logprobs
from trajflow.operators.columns import apply_staleness_bound, padded, step_metrics

EXACT_STRATEGIES = ("snapshot", "dedicated", "interrupt")


class Diagnose:
    def __init__(
        self,
        store: ray.actor.ActorHandle,
        model_path: str | Path,
        strategies: list[str],
        correction: CorrectionConfig,
        sampling: SamplingParams,
        max_staleness: int,
        ewma_window: int = 1,
        ewma_tau: float = 0.9,
        loglinear_alpha: float | None = None,
        torch_threads: int = 1,
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.store = store
        self.strategies = list(strategies)
        self.correction = correction
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.ewma_beta = ewma_beta(ewma_window)
        self.ewma_tau = ewma_tau
        self.fixed_alpha = loglinear_alpha
        self.model = load_model(model_path)
        self.resident: int | None = None
        self.ewma: EwmaProximal | None = None
        self.prox_model = copy.deepcopy(self.model) if "ewma" in self.strategies else None

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        _, (ref,) = ray.get(self.store.get.remote(version))
        return ray.get(ref)

    def _ensure(self, version: int) -> None:
        if self.resident != version:
            self.model.load_state_dict(self._weights(version))
            self.resident = version

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        if "trainer_version" in batch.column_names:
            versions_here = np.unique(batch["trainer_version"].to_numpy())
        else:
            versions_here = np.unique(batch["rollout_step"].to_numpy())
        if len(versions_here) != 1:
            raise RuntimeError(f"a diagnose batch must hold exactly one train step, got {versions_here.tolist()}")
        k = int(versions_here[0])
        batch, trained, stale_tokens = apply_staleness_bound(batch, k, self.max_staleness)
        rollout_step = int(batch["rollout_step"][0].as_py()) if "rollout_step" in batch.column_names else k
        base = step_metrics(batch, k, rollout_step, trained, stale_tokens)
        if "ewma" in self.strategies and self.ewma is None:  # as TrainStep: EWMA starts at the first version
            self.ewma = EwmaProximal(self._weights(k), self.ewma_beta, tau=self.ewma_tau)
        rows = []
        if len(trained):
            sub = batch.take(pa.array(trained))
            results = self._diagnose(sub, k)
        else:
            results = {s: {} for s in self.strategies}
        if "ewma" in results and results["ewma"]:
            self._advance_ewma(k, results["ewma"])
        for strategy in self.strategies:
            rows.append({**base, "strategy": strategy, **results[strategy],
                         "diagnose_seconds": time.perf_counter() - started})
        return pa.Table.from_pylist(rows)

    @torch.no_grad()
    def _diagnose(self, batch: pa.Table, k: int) -> dict[str, dict]:
        prompts = batch["prompt_tokens"].to_pylist()
        responses = batch["response_tokens"].to_pylist()
        width = max(len(r) for r in responses)
        inference = torch.from_numpy(padded(batch["inference_logprobs"], width, 0.0))
        versions = torch.from_numpy(padded(batch["versions"], width, k, np.int64))
        loss_mask = torch.from_numpy(padded(batch["loss_mask"], width, False, bool))
        advantages = torch.from_numpy(batch["advantage"].to_numpy(zero_copy_only=False).astype(np.float32))

        def score(model) -> torch.Tensor:
            logprobs, _ = response_logprobs(model, prompts, responses, self.sampling, grad=False)
            return torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1]))

        self._ensure(k)
        current = score(self.model)
        out: dict[str, dict] = {}
        for strategy in self.strategies:
            if strategy in EXACT_STRATEGIES:
                if batch["old_logprobs"].null_count:
                    raise RuntimeError(f"diagnose {strategy}: rows arrived without old_logprobs")
                old = torch.from_numpy(padded(batch["old_logprobs"], width, 0.0))
            elif strategy == "recompute":
                old = current
            elif strategy == "behavior":
                old = inference
            elif strategy == "loglinear":
                alpha = self.fixed_alpha if self.fixed_alpha is not None else loglinear_alpha(versions, theta_version=k + 1)
                old = loglinear_logprobs(current, inference, alpha)
            elif strategy == "ewma":
                self.prox_model.load_state_dict(self.ewma.prox_state_dict())
                old = score(self.prox_model)
            else:
                raise ValueError(f"unknown strategy {strategy!r}")
            result = decoupled_loss(current, old, inference, advantages, loss_mask, self.correction)
            diagnostics = correction_diagnostics(result, versions=versions, trainer_version=k, advantages=advantages)
            diagnostics["loss"] = float(result.loss.item())
            out[strategy] = diagnostics
        return out

    def _advance_ewma(self, k: int, diagnostics: dict) -> None:
        """After step k: fold in version k + 1 (the weights the update produced), reset if the
        active fraction was below tau — the order TrainStep uses."""
        try:
            after = self._weights(k + 1)
        except ray.exceptions.RayTaskError:
            return  # the last version of a partial log: nothing after it to fold in
        self.ewma.update(after)
        if "active_frac" in diagnostics:
            fired = self.ewma.maybe_reset(diagnostics["active_frac"], after)
            diagnostics.update({"ewma/reset": float(fired), "ewma/reset_count": float(self.ewma.reset_count),
                                "ewma/age": self.ewma.age})
