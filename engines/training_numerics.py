"""Training numerics: how the trainer computes log-probs — one object for pi_theta and every pi_old.

r_s = pi_theta / pi_old is 1 on-policy only if both sides are computed the same way: same device
kind, same autocast dtype, same train/eval mode. `TrainingNumerics` is that one definition. The
train step computes pi_theta with it; every exact strategy's old log-probs (the old log-prob
operator, interrupt's prefix scoring), `recompute` and the EWMA model score through it.

- device: "cuda" when this process sees a GPU, else "cpu" (Ray hides GPUs from actors that did
  not ask for one, so the choice follows the actor's resources).
- mixed_precision: "no" (float32) or "bf16" (torch.autocast around the forward pass; weights and
  optimizer state stay float32).
- dropout: off. RL runs the policy in eval mode. With dropout on, pi_theta is a random function
  of the forward pass: r_s != 1 on-policy, and old log-probs scored in eval mode stop being exact.

The object is a setting the driver builds and every stage's process gets; torch is imported by the
methods that compute, so building it does not load torch.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from trajflow.engines.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch
    from torch import Tensor

MixedPrecision = Literal["no", "bf16"]


def choose_device(cuda_available: bool) -> str:
    """The device of a training-numerics process: the GPU it was given, else the CPU."""
    return "cuda" if cuda_available else "cpu"


@dataclass(frozen=True)
class TrainingNumerics:
    mixed_precision: MixedPrecision = "no"
    device: str | None = None  # None: choose_device(torch.cuda.is_available()) in the process that scores

    def __post_init__(self) -> None:
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device or choose_device(torch.cuda.is_available()))

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision == "no":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.torch_device().type, dtype=torch.bfloat16)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to this device and switch dropout off (eval mode); returns it."""
        return model.to(self.torch_device()).eval()

    def logprobs(
        self,
        model: torch.nn.Module,
        prompt_tokens: Sequence[Sequence[int]],
        response_tokens: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        width: int,
        grad: bool = False,
        entropy: list[Tensor] | None = None,
        top_k_ids: Tensor | None = None,
        top_k: list[Tensor] | None = None,
    ) -> Tensor:
        """Per-token processed log-probs [B, width] (right-padded with 0) on the CPU; a token the
        sampling filter excludes scores -inf. Differentiable when grad=True. `entropy`: a list
        that receives the per-token entropy [B, width] of the processed distribution (the loss's
        entropy term), from the same forward pass. `top_k_ids` [B, width, K]: a support per
        position; `top_k`: a list that receives its log-probs [B, width, K] (same pass)."""
        import torch

        from trajflow.engines.scoring import response_logprobs

        found: list[Tensor] | None = [] if entropy is not None else None
        support: list[Tensor] | None = [] if top_k is not None else None
        with self.autocast():
            logprobs, _ = response_logprobs(model, prompt_tokens, response_tokens, sampling, grad=grad, entropy=found,
                                            top_k_ids=top_k_ids, top_k=support)
        pad = (0, width - logprobs.shape[1])
        if entropy is not None:
            entropy.append(torch.nn.functional.pad(found[0].float().cpu(), pad))
        if top_k is not None:
            top_k.append(torch.nn.functional.pad(support[0].float().cpu(), (0, 0, *pad)))
        return torch.nn.functional.pad(logprobs.float().cpu(), pad)

    def score(
        self,
        model: torch.nn.Module,
        prompt_tokens: Sequence[Sequence[int]],
        response_tokens: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        top_k_ids: Sequence[np.ndarray] | None = None,
        top_k: list[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """No-grad log-probs as ragged float32 arrays, one per response. `top_k_ids`: one [T, K]
        support per response; `top_k` receives its log-probs, one [T, K] float32 array each."""
        import torch

        width = max((len(r) for r in response_tokens), default=0)
        support: list[Tensor] | None = None
        ids = None
        if top_k_ids is not None:
            support = []
            k = max((len(row[0]) for row in top_k_ids if len(row)), default=0)
            ids = torch.zeros((len(response_tokens), width, k), dtype=torch.long)
            for i, row in enumerate(top_k_ids):
                ids[i, : len(row)] = torch.as_tensor(np.asarray(row, dtype=np.int64).reshape(-1, k))
        logprobs = self.logprobs(model, prompt_tokens, response_tokens, sampling, width=width, top_k_ids=ids,
                                 top_k=support).numpy()
        if top_k is not None and support is not None:
            found = support[0].numpy()
            top_k.extend(found[i, : len(r)].copy() for i, r in enumerate(response_tokens))
        return [logprobs[i, : len(r)].copy() for i, r in enumerate(response_tokens)]

    def describe(self) -> str:
        precision = "float32" if self.mixed_precision == "no" else "bf16 autocast (float32 weights)"
        return f"{precision}, dropout off (the policy runs in eval mode during RL)"


def checkpoint_dropout(model_path: str | Path) -> dict[str, float]:
    """The dropout probabilities > 0 a local checkpoint's config.json sets (training turns them off)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in config.items()
            if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
