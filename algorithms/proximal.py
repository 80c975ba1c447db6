"""Where the "old" (proximal) log-probs come from, for each correction strategy.

The objective (objective.py) takes `old_logprobs` as given; the strategy decides what goes there.
Exact strategies and EWMA produce them with a forward pass outside this module (an operator, or
the trainer scoring with its EWMA weights); the train-time baselines are computed here.

Version convention (A-3PO): v_behav is the version that sampled the token (the `versions`
column), v_theta is the version this update produces (the trainer holds weights v_theta - 1 and
publishes v_theta after the step), and v_prox defaults to v_theta - 1: the weights the trainer
holds before the update, i.e. what `recompute` scores with. If the trainer is at version k
(on-policy tokens carry version k), pass theta_version = k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

StrategyKind = Literal["exact", "approximate", "baseline"]


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: StrategyKind
    source: Literal["operator", "trainer"]  # who fills old_logprobs
    meaning: str


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("snapshot", "exact", "operator",
                 "score each token with the stored weights of its own version (policy-store snapshots)"),
        Strategy("dedicated", "exact", "operator",
                 "a separate old-logit model follows the rollout versions and scores each batch as it is generated"),
        Strategy("interrupt", "exact", "operator",
                 "at each weight publish, score in-flight prefixes with the still-resident version, then resume"),
        Strategy("ewma", "approximate", "trainer",
                 "score with an EWMA of the trainer's weights (beta = W/(W+2)), reset when active fraction < tau"),
        Strategy("recompute", "baseline", "trainer",
                 "score with the trainer's current weights before the update (pi_async): drift leaks into r_d"),
        Strategy("behavior", "baseline", "trainer",
                 "old := inference log-probs (r_d = 1): one clip absorbs both numerics and staleness"),
        Strategy("loglinear", "baseline", "trainer",
                 "log mu + alpha (log pi_theta - log mu), alpha from versions (A-3PO); Prop. 1: only rescales a bound on pi_theta/mu"),
    )
}


def format_strategies() -> str:
    """The STRATEGIES table as aligned text, for the pipeline to log at start."""
    return "\n".join(f"{s.name:<10} {s.kind:<12} {s.source:<9} {s.meaning}" for s in STRATEGIES.values())


def behavior_logprobs(inference_logprobs: Tensor) -> Tensor:
    """`behavior`: old := mu, the inference engine's own log-probs."""
    return inference_logprobs.detach()


def recompute_logprobs(current_before_update: Tensor) -> Tensor:
    """`recompute`: old := the trainer's current weights scored *before* the optimizer step.

    With one optimizer step per batch this is current_logprobs.detach() of that step's forward
    pass; with several minibatches or epochs, score once before the first update and reuse it.
    In async training those weights are newer than the token's version (pi_async, not pi_old).
    """
    return current_before_update.detach()


def loglinear_alpha(versions: Tensor, theta_version: int, prox_version: int | None = None) -> Tensor:
    """Per-token alpha = (v_prox - v_behav) / (v_theta - v_behav), clamped to [0, 1].

    v_prox defaults to v_theta - 1, giving alpha = s / (s + 1) with s = v_prox - v_behav the
    staleness: on-policy tokens (s = 0) get alpha = 0 (prox = mu), older ones approach 1.
    Edge case v_theta == v_behav (the token came from the very weights being optimised): alpha := 1,
    prox := current, the trainer-numerics reference that `recompute` would give.
    """
    v_b = versions.to(torch.float64)
    v_t = float(theta_version)
    v_p = float(theta_version - 1 if prox_version is None else prox_version)
    span = v_t - v_b
    alpha = torch.where(span != 0, (v_p - v_b) / torch.where(span != 0, span, 1.0), 1.0)
    return alpha.clamp(0.0, 1.0).to(torch.float32)


def loglinear_logprobs(current_logprobs: Tensor, inference_logprobs: Tensor, alpha: Tensor | float) -> Tensor:
    """`loglinear` (A-3PO): log pi_prox = log mu + alpha (log pi_theta - log mu), detached."""
    cur, inf = current_logprobs.detach(), inference_logprobs.detach()
    return inf + alpha * (cur - inf)


def linear_logprobs(current_logprobs: Tensor, inference_logprobs: Tensor, alpha: Tensor | float) -> Tensor:
    """Arithmetic interpolation (linear_prox): pi_prox = (1 - alpha) mu + alpha pi_theta, as a log, detached."""
    cur, inf = current_logprobs.detach(), inference_logprobs.detach()
    alpha = torch.as_tensor(alpha, dtype=cur.dtype, device=cur.device)
    return torch.logaddexp(torch.log1p(-alpha) + inf, torch.log(alpha) + cur)


def proximal_logprobs(
    strategy: str,
    *,
    current_logprobs: Tensor,
    inference_logprobs: Tensor,
    old_logprobs: Tensor | None = None,
    versions: Tensor | None = None,
    theta_version: int | None = None,
) -> Tensor:
    """The `old_logprobs` the objective should use under `strategy` (detached).

    snapshot / dedicated / interrupt / ewma: `old_logprobs` computed upstream (required).
    recompute: `old_logprobs` if scored before the update, else current_logprobs.detach().
    behavior: the inference log-probs. loglinear: needs `versions` and `theta_version`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    if strategy == "behavior":
        return behavior_logprobs(inference_logprobs)
    if strategy == "recompute":
        return recompute_logprobs(current_logprobs if old_logprobs is None else old_logprobs)
    if strategy == "loglinear":
        if versions is None or theta_version is None:
            raise ValueError("strategy 'loglinear' needs versions and theta_version")
        alpha = loglinear_alpha(versions, theta_version).to(current_logprobs.device)
        return loglinear_logprobs(current_logprobs, inference_logprobs, alpha)
    if old_logprobs is None:
        raise ValueError(f"strategy {strategy!r} needs old_logprobs computed upstream, got None")
    return old_logprobs.detach()
