"""The built-in generation engine: any Hugging Face causal LM, own decode loop with a KV cache.

Why an own loop instead of `model.generate`: the engine must (a) record per-token log-probs under
exactly the processed distribution it samples from (`sampling.sample_tokens`, shared with scoring),
(b) stamp every token with the weight version that produced it, and (c) let a callback swap the
weights between decode steps, after which the KV cache — computed under the old weights — is
rebuilt by re-prefilling prompt + generated prefix under the new ones ("interrupt" strategy).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from trajflow.engines.numerics import check_inference_dtype, load_inference_weights, make_inference_model
from trajflow.engines.sampling import SamplingConfig, sample_tokens
from trajflow.engines.scoring import pack_batch
from trajflow.engines.tokenizer import StopStrings

FINISH_REASONS = ("stop", "length", "abort")


def cache_key(model: torch.nn.Module) -> str:
    """The KV cache's argument and output name: `cache` from transformers 5.24 (where the old
    `past_key_values` warns on every call), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class Generation:
    prompt_index: int
    response_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # under the processed distribution sampled from
    versions: list[int] = field(default_factory=list)  # engine version when each token was sampled
    finish_reason: str = ""  # "stop" | "length" | "abort"; "" while still being generated
    # with top_k_logprobs K > 0: per token, the K most likely ids of the processed distribution it
    # was sampled from (most likely first) and their log-probs (-inf past the filter's support)
    top_k_ids: list[list[int]] = field(default_factory=list)
    top_k_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""


BetweenSteps = Callable[["TorchEngine", list[Generation]], None]


class TorchEngine:
    """Batched sampling with a KV cache, per-token log-probs and versions, and mid-flight weight swaps.

    A response ends ("stop") at `eos_id` or any of `stop_token_ids` (kept as its last token), or at
    the token that completes one of `sampling.stop` (decoded with `tokenizer`).

    The engine owns an inference copy of `model` with `inference_dtype` numerics (see
    engines/numerics.py); the caller's model is never modified. Sampling draws from a torch.Generator
    seeded with `seed`, so an engine built with the same seed and given the same calls (and weight
    swaps) reproduces its outputs. `top_k_logprobs` K > 0 also records each token's top-K
    (`Generation.top_k_ids` / `top_k_logprobs`) from the logits it was sampled from.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_id: int,
        pad_id: int,
        sampling: SamplingConfig,
        inference_dtype: str = "float32",
        seed: int = 0,
        version: int = 0,
        stop_token_ids: Sequence[int] = (),
        tokenizer=None,
        top_k_logprobs: int = 0,
    ) -> None:
        self.inference_dtype = check_inference_dtype(inference_dtype)
        self.top_k_logprobs = int(top_k_logprobs)
        self.model = make_inference_model(model, inference_dtype)
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.tokenizer = tokenizer  # decodes responses for sampling.stop strings
        self.sampling = sampling
        self.version = int(version)
        self.device = next(self.model.parameters()).device
        self.cache_key = cache_key(self.model)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._weights_changed = False  # set by load_weights: the KV cache is stale
        self._abort_requested = False

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Install a float32 training state dict as `version`. Safe to call from `between_steps`:
        the running generate() re-prefills its KV cache before sampling the next token."""
        load_inference_weights(self.model, state_dict, self.inference_dtype)
        self.version = int(version)
        self._weights_changed = True

    def abort(self) -> None:
        """From `between_steps`: stop the running generate(); unfinished sequences end "abort"."""
        self._abort_requested = True

    @torch.no_grad()
    def _prefill(
        self, prompts: Sequence[Sequence[int]], prefixes: Sequence[Sequence[int]]
    ) -> tuple[Tensor, object, Tensor, Tensor]:
        """Forward prompt + generated prefix (all prefixes the same length) with a fresh cache.

        Returns (next-token float32 logits [B, V], cache, attention mask [B, L], next positions [B]).
        Uses the same padded layout as teacher-forced scoring.
        """
        ids, mask, positions, _ = pack_batch(prompts, prefixes, self.pad_id, self.device)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float(), out[self.cache_key], mask, mask.sum(-1)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        *,
        between_steps: BetweenSteps | None = None,
    ) -> list[Generation]:
        """Sample n responses per prompt; returns len(prompts) * n Generations, prompt-major.

        `between_steps(engine, generations)` runs after every decode step with the live (partial)
        Generation objects — read them, do not mutate them. It may call `engine.load_weights(...)`
        (later tokens then come from, and are stamped with, the new version) or `engine.abort()`.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            return []
        max_new = self.sampling.max_new_tokens
        stop_ids = {self.eos_id, *self.stop_token_ids}
        stop_strings = StopStrings(self.tokenizer, self.sampling.stop)
        gens = [Generation(prompt_index=i) for i in range(len(prompts)) for _ in range(n)]
        self._weights_changed = False
        self._abort_requested = False

        # Prefill each prompt once, then replicate logits and cache for its n samples.
        logits, cache, mask, next_pos = self._prefill(prompts, [[] for _ in prompts])
        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)
            cache.batch_repeat_interleave(n)
            mask = mask.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)
        rows = list(range(len(gens)))  # Generation index of each live cache row

        for _ in range(max_new):
            version = self.version
            sampled = sample_tokens(logits, self.sampling, self.generator, self.top_k_logprobs)
            tokens = sampled.tokens
            top = (sampled.top_k_ids.tolist(), sampled.top_k_logprobs.tolist()) if self.top_k_logprobs else None
            keep: list[int] = []  # cache rows still generating
            for j, (token, logprob) in enumerate(zip(tokens.tolist(), sampled.logprobs.tolist())):
                g = gens[rows[j]]
                g.response_tokens.append(token)
                g.logprobs.append(logprob)
                g.versions.append(version)
                if top is not None:
                    g.top_k_ids.append(top[0][j])
                    g.top_k_logprobs.append(top[1][j])
                if token in stop_ids or (stop_strings and stop_strings.hit(g.response_tokens)):
                    g.finish_reason = "stop"
                elif len(g.response_tokens) >= max_new:
                    g.finish_reason = "length"
                else:
                    keep.append(j)

            if between_steps is not None:
                between_steps(self, gens)
            if self._abort_requested:
                for j in keep:
                    gens[rows[j]].finish_reason = "abort"
                break
            if not keep:
                break

            rows = [rows[j] for j in keep]
            if self._weights_changed:
                # The cache holds keys/values of the old weights: recompute them for the whole
                # prefix. Live rows have all generated the same number of tokens.
                self._weights_changed = False
                logits, cache, mask, next_pos = self._prefill(
                    [prompts[gens[r].prompt_index] for r in rows], [gens[r].response_tokens for r in rows]
                )
                continue
            if len(keep) < tokens.shape[0]:
                # Drop finished rows so the batch only pays for live sequences.
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                tokens, mask, next_pos = tokens[idx], mask[idx], next_pos[idx]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{self.cache_key: cache},
            )
            logits, cache = out.logits[:, -1].float(), out[self.cache_key]
            next_pos = next_pos + 1

        self._abort_requested = False
        return gens


def greedy_engine(model: PreTrainedModel, tokenizer, max_new_tokens: int,
                  stop_token_ids: Sequence[int] = ()) -> TorchEngine:
    """A float32 greedy engine for evaluation (held-out accuracy, episode success)."""
    return TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                       sampling=SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens),
                       stop_token_ids=stop_token_ids)
