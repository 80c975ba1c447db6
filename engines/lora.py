"""LoRA (`lora:` in a job config): the trainer trains a PEFT adapter over frozen base weights and
a weight version's payload is that adapter, not the full model.

What a version carries: the adapter's tensors under `ADAPTER_PREFIX` + PEFT's own key (as
`peft.get_peft_model_state_dict` names them), plus one scalar tensor `ADAPTER_SCALING` (alpha / r),
so a reader tells an adapter payload from full weights by its keys and needs no settings. Version
0 (the warm start) is the full base weights; the store keeps whatever is published, so the
`snapshot` window of `max_staleness + 1` versions holds adapters of a few KB-MB each.

How readers apply it (generators, old-log-prob scorers, diagnosis): `VersionWeights` holds the
base weights once (float32, from the model directory) and turns an adapter payload into full
weights W = W_base + scaling x B @ A for each adapted linear layer, which the reader then loads
as before (`load_state_dict`, the torch engine's inference casts). Every reader merges the same
way, so the generator's inference log-probs and the scorer's old log-probs of one version are
the same computation (the exactness invariant). The trainer computes pi_theta through PEFT's
unmerged forward (base(x) + B(A(x)) x scaling): the same function, rounded differently (~1e-7).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trajflow.deprecations import renamed_names
from trajflow.settings import check_settings, setting

if TYPE_CHECKING:
    import torch
    from torch import Tensor

ADAPTER_PREFIX = "lora:"
ADAPTER_SCALING = "lora:scaling"
_PEFT_PREFIX = "base_model.model."
INIT_SEED = 0


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter trained through PEFT over frozen base weights (engines/lora.py)."""

    r: int = setting(0, "adapter rank; 0 = off (full fine-tuning)", ge=0, le=1024)
    alpha: float = setting(16.0, "LoRA alpha: the update is scaled by alpha / r", gt=0.0)
    dropout: float = setting(
        0.0, "LoRA dropout; must be 0: RL runs the policy with dropout off (exact old log-probs)", ge=0.0, le=0.0)
    target_modules: tuple[str, ...] = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "names of the linear layers that get an adapter (PEFT's target_modules)")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.target_modules:
            raise ValueError("target_modules: name at least one linear layer")

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def wrap(model: "torch.nn.Module", settings: LoraConfig) -> "torch.nn.Module":
    """`model` as a PEFT model with a fresh adapter (B = 0: the base function) whose parameters
    alone require a gradient. A's random init is drawn from a fixed seed, apart from the
    process's random state: every run (and a resumed one's first session) starts from the same
    adapter whatever ran before in the process."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        wrapped = get_peft_model(model, config)
    # readers merge W + scaling B A, which is the layer's function for nn.Linear only (GPT-2's
    # Conv1D stores W transposed)
    other = sorted({type(m.base_layer).__name__ for m in wrapped.modules()
                    if hasattr(m, "lora_A") and not isinstance(m.base_layer, torch.nn.Linear)})
    if other:
        raise ValueError(f"lora.target_modules: only linear layers can carry an adapter here, got {other}")
    return wrapped


def adapter_payload(model: "torch.nn.Module", scaling: float) -> dict[str, "Tensor"]:
    """A PEFT model's adapter as a version's payload (module docstring): detached, not copied."""
    import torch
    from peft import get_peft_model_state_dict

    tensors = {ADAPTER_PREFIX + k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    return {**tensors, ADAPTER_SCALING: torch.tensor(scaling, dtype=torch.float64)}


def load_adapter(model: "torch.nn.Module", payload: Mapping[str, "Tensor"]) -> None:
    """Set a PEFT model's adapter from a payload (a resumed trainer)."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, {k[len(ADAPTER_PREFIX):]: v for k, v in payload.items()
                                      if k != ADAPTER_SCALING})


def is_adapter(payload: Mapping[str, object]) -> bool:
    return ADAPTER_SCALING in payload


def base_weights(model: "torch.nn.Module") -> Iterator[tuple[str, "Tensor"]]:
    """A PEFT model's frozen base weights under the plain model's names."""
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            yield name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."), tensor


def merged(base: Mapping[str, "Tensor"], payload: Mapping[str, "Tensor"]) -> dict[str, "Tensor"]:
    """Full weights: `base` with W + scaling x B @ A for each adapted layer of `payload` (the
    untouched tensors are `base`'s own, not copies)."""
    scaling = float(payload[ADAPTER_SCALING])
    out = dict(base)
    for key, a in payload.items():
        if not key.endswith(".lora_A.weight"):
            continue
        layer = key[len(ADAPTER_PREFIX):].removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = payload[key.replace(".lora_A.", ".lora_B.")]
        weight = f"{layer}.weight"
        out[weight] = base[weight] + scaling * (b.to(base[weight].dtype) @ a.to(base[weight].dtype))
    return out


class VersionWeights:
    """A reader's view of versions: full weights as they arrive, adapters merged into the base
    weights it holds once (loaded from `model_path` when the first adapter arrives)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = model_path
        self._base: dict[str, Tensor] | None = None

    def full(self, payload: Mapping[str, "Tensor"]) -> Mapping[str, "Tensor"]:
        if not is_adapter(payload):
            return payload
        if self._base is None:
            from trajflow.engines.models import load_model

            self._base = load_model(self.model_path).state_dict()
        return merged(self._base, payload)


__getattr__ = renamed_names(__name__, {"LoraSettings": LoraConfig})  # one release: the old name, with a notice
