"""Sampling parameters and the one logits processor shared by generation and scoring.

Log-prob semantics (recorded in the trajectory schema as "processed" log-probs): the log-prob of a
token is taken under the distribution the engine actually samples from — logits divided by the
temperature, then top-k, then top-p filtering (filtered entries are -inf, the rest renormalised).
Generation and teacher-forced scoring both go through `warp_logits`, so the two agree exactly up to
float rounding of the forward pass.

temperature == 0 means greedy decoding. A point mass is useless as a log-prob, so log-probs are then
reported under the *untempered* (temperature 1) distribution, still with top-k/top-p applied; the
greedy token (the argmax) is never filtered out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from trajflow.settings import check_settings, setting

if TYPE_CHECKING:  # torch loads in the functions below: a job config's `sampling:` section is
    # built from SamplingConfig before Ray starts, without torch (tests/test_startup.py)
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled, and so the distribution every log-prob is taken under."""

    temperature: float = setting(1.0, "0 = greedy (log-probs then at temperature 1)", ge=0.0)
    top_p: float = setting(1.0, "nucleus filter: keep the smallest set of tokens with this mass", gt=0.0, le=1.0)
    top_k: int = setting(0, "keep the k most likely tokens (0 = off)", ge=0)
    max_new_tokens: int = setting(6, "response length limit in tokens (per turn for an environment)", ge=1)
    stop: tuple[str, ...] = setting((), "strings that end a response (besides the eos tokens)")

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_logits(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Float32 logits [..., V] -> tempered, top-k/top-p filtered logits (filtered entries -inf).

    Not normalised: `process_logits` / `token_logprobs` normalise. Differentiable in the kept
    entries (the filter is a selection, carrying no gradient).
    """
    import torch

    logits = logits.float()
    if not sampling.greedy and sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        # Ties with the k-th value are kept (same rule as transformers' TopKLogitsWarper).
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # Keep the smallest prefix of tokens (by descending prob) whose mass reaches top_p; the
        # top token always survives. Computed on the top-k-filtered distribution, as in HF.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.detach(), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= sampling.top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def process_logits(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Float32 logits [..., V] -> processed log-probs [..., V] (temperature, top-k, top-p; -inf
    where filtered). The distribution generation samples from."""
    import torch

    return torch.log_softmax(warp_logits(logits, sampling), dim=-1)


def processed_entropy(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Entropy [...] of the processed distribution (the one sampled from) at each position of
    float32 logits [..., V]; filtered entries contribute 0. Differentiable."""
    import torch

    logp = process_logits(logits, sampling)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def support_logprobs(logits: Tensor, ids: Tensor, sampling: SamplingConfig) -> Tensor:
    """Processed log-probs [..., K] of the ids [..., K] under `logits` [..., V], in the
    memory-light gather-minus-logsumexp form (no [..., V] log-softmax kept). Equals
    `process_logits(logits).gather(ids)`; a filtered id scores -inf."""
    import torch

    warped = warp_logits(logits, sampling)
    return warped.gather(-1, ids) - torch.logsumexp(warped, dim=-1, keepdim=True)


def token_logprobs(logits: Tensor, tokens: Tensor, sampling: SamplingConfig) -> Tensor:
    """Processed log-prob of `tokens` [...] under `logits` [..., V] (`support_logprobs` of one id)."""
    return support_logprobs(logits, tokens.unsqueeze(-1), sampling).squeeze(-1)


class Sampled(NamedTuple):
    """One decode step: the sampled tokens [B], their processed log-probs [B], and with `top_k`
    K > 0 the K most likely ids [B, K] of the processed distribution and their log-probs [B, K]
    (most likely first; -inf past the filter's support)."""

    tokens: Tensor
    logprobs: Tensor
    top_k_ids: Tensor | None = None
    top_k_logprobs: Tensor | None = None


def sample_tokens(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None,
                  top_k: int = 0) -> Sampled:
    """Sample one token per row from float32 logits [B, V] (see `Sampled`).

    Log-probs are under the processed distribution (see module docstring for temperature 0).
    """
    import torch

    warped = warp_logits(logits, sampling)
    # Same gather-minus-logsumexp arithmetic as `support_logprobs`, so generation and scoring of
    # the same logits give bit-identical log-probs, of the sampled token and of the top k alike.
    lse = torch.logsumexp(warped, dim=-1, keepdim=True)
    if sampling.greedy:
        tokens = torch.argmax(warped, dim=-1)
    else:
        tokens = torch.multinomial(torch.exp(warped - lse), 1, generator=generator).squeeze(-1)
    picked = warped.gather(-1, tokens.unsqueeze(-1))
    if not top_k:
        return Sampled(tokens, (picked - lse).squeeze(-1))
    top = torch.topk(warped, top_k, dim=-1)
    return Sampled(tokens, (picked - lse).squeeze(-1), top.indices, top.values - lse)
