"""Teacher-forced scoring: per-token processed log-probs of given responses.

Batch layout (shared with the generation engine's re-prefill so both see identical inputs):

    [pad … pad | prompt | response | pad … pad]
      left-pad to the longest prompt, right-pad to the longest response

Prompts are left-padded so every response starts at the same column P (response logits are the
last T columns, which `logits_to_keep` selects); responses are right-padded, and since attention is
causal the trailing pads cannot influence any real position. position_ids count real tokens only
(0 at the first prompt token), so a row's numerics do not depend on how much padding it gets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from trajflow.engines.sampling import SamplingConfig, processed_entropy, support_logprobs


def pack_batch(
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Left-pad prompts, right-pad continuations -> (input_ids, attention_mask, position_ids, P).

    All tensors are [B, P + T] int64 (mask: int64 0/1); column P is each continuation's first token.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. bos)")
    P = max(len(p) for p in prompts)
    T = max((len(c) for c in continuations), default=0)
    B = len(prompts)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        ids[i, P - len(p):P] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, P:P + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
        mask[i, P - len(p):P + len(c)] = 1
    # Padding positions get position 0; they are masked out of every real query anyway.
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device), P


def _pad_id(model: PreTrainedModel) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def response_logprobs(
    model: PreTrainedModel,
    prompt_tokens: Sequence[Sequence[int]],
    response_tokens: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    grad: bool = False,
    entropy: list[Tensor] | None = None,
    top_k_ids: Tensor | None = None,
    top_k: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Teacher-forced processed log-probs of each response token.

    Returns (logprobs [B, T_max] float32, valid [B, T_max] bool), right-padded to the longest
    response (padding entries are 0.0 and invalid). A token that the sampling filters (top-k/top-p)
    exclude under `model` scores -inf. With grad=True the result is differentiable w.r.t. the model
    parameters; the model's train/eval mode is left as the caller set it. `entropy`: a list that
    receives the entropy of the processed distribution at each response position [B, T_max]
    (differentiable like the log-probs; 0 on padding) — the entropy term of the loss.
    `top_k_ids` [B, >= T_max, K] int64: ids per response position (a top-k support); `top_k` is a
    list that receives their processed log-probs [B, T_max, K] from the same forward pass
    (differentiable like the log-probs; 0 on padding).
    """
    device = next(model.parameters()).device
    lengths = torch.tensor([len(r) for r in response_tokens], dtype=torch.long, device=device)
    ids, mask, positions, P = pack_batch(prompt_tokens, response_tokens, _pad_id(model), device)
    T = ids.shape[1] - P
    valid = torch.arange(T, device=device)[None, :] < lengths[:, None]
    if T == 0:
        return torch.zeros((len(prompt_tokens), 0), dtype=torch.float32, device=device), valid

    with torch.set_grad_enabled(grad):
        # The last column is never an input (nothing to predict after it); the logits at columns
        # P-1 … P+T-2 predict the response tokens at P … P+T-1.
        logits = model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=False,
            logits_to_keep=T,
        ).logits
        # the logits' device, which is not the parameters' when FSDP offloads them to the host
        targets = ids[:, P:].to(logits.device)
        # One row at a time: the processed [T, V] temporaries (tempering, sort for top-p) then
        # exist for a single sequence, not the whole batch. The rows are views from `unbind`,
        # whose backward stacks the rows' gradients into one [B, T, V] tensor; indexing row b
        # instead (`logits[b]`) has a backward that zero-fills a whole [B, T, V] tensor per row
        # (B^2 T V: quadratic in the rows; on a large vocabulary a visible share of a train step).
        # The sampled token and a top-k support are gathered from one warp: column 0 is the
        # token, columns 1.. the support.
        ids = targets[..., None]
        if top_k_ids is not None:
            ids = torch.cat([ids, top_k_ids[:, :T].to(device=logits.device, dtype=ids.dtype)], dim=-1)
        rows = logits.unbind(0)
        gathered = torch.stack([support_logprobs(row, row_ids, sampling) for row, row_ids in zip(rows, ids)])
        valid = valid.to(logits.device)
        logprobs = gathered[..., 0].masked_fill(~valid, 0.0)
        if top_k is not None:
            top_k.append(gathered[..., 1:].masked_fill(~valid[..., None], 0.0))
        if entropy is not None:
            entropy.append(torch.stack([processed_entropy(row, sampling) for row in rows]).masked_fill(~valid, 0.0))
    return logprobs, valid


def score(
    model: PreTrainedModel,
    prompt_tokens: Sequence[Sequence[int]],
    response_tokens: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    batch_size: int | None = None,
) -> list[np.ndarray]:
    """No-grad teacher-forced log-probs as ragged float32 arrays, one per response.

    batch_size bounds rows per forward pass (None = all at once); results do not depend on it
    beyond float rounding.
    """
    n = len(prompt_tokens)
    step = batch_size or max(n, 1)
    out: list[np.ndarray] = []
    for start in range(0, n, step):
        prompts = prompt_tokens[start:start + step]
        responses = response_tokens[start:start + step]
        lp, _ = response_logprobs(model, prompts, responses, sampling, grad=False)
        lp = lp.cpu().numpy()
        out.extend(lp[i, : len(r)].astype(np.float32, copy=True) for i, r in enumerate(responses))
    return out
