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

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
    out = dict(base)
    for weight, delta in deltas(payload).items():
        out[weight] = delta.apply(base[weight])
    return out


@dataclass(frozen=True)
class Delta:
    """One adapted layer's update: W -> W + scaling x B @ A."""

    a: "Tensor"
    b: "Tensor"
    scaling: float

    def apply(self, weight: "Tensor") -> "Tensor":  # on the weight's device (a trainer's may be a GPU)
        b, a = (t.to(device=weight.device, dtype=weight.dtype) for t in (self.b, self.a))
        return weight + self.scaling * (b @ a)


def deltas(payload: Mapping[str, "Tensor"]) -> dict[str, Delta]:
    """The adapted layers of an adapter payload, by the plain model's name of their weight."""
    scaling = float(payload[ADAPTER_SCALING])
    out = {}
    for key, a in payload.items():
        if key.endswith(".lora_A.weight"):
            layer = key[len(ADAPTER_PREFIX):].removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
            out[f"{layer}.weight"] = Delta(a, payload[key.replace(".lora_A.", ".lora_B.")], scaling)
    return out


# -- a version on disk: PEFT's adapter format --------------------------------------------------------
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def write_peft_adapter(payload: Mapping[str, "Tensor"], path: str | Path, base_model: str | None = None) -> None:
    """An adapter payload as a PEFT adapter directory (`PeftModel.from_pretrained(base, path)`
    and vLLM's LoRARequest load it): the tensors under PEFT's own keys, and a config whose r
    (lora_A's rows) and alpha (scaling x r) give the payload's scaling; `base_model`: the
    directory of the base weights it applies to."""
    from safetensors.torch import save_file

    tensors = {k[len(ADAPTER_PREFIX):]: v.detach().contiguous().cpu() for k, v in payload.items()
               if k != ADAPTER_SCALING}
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"an adapter payload needs one rank over its lora_A tensors, got {sorted(ranks)}")
    r = ranks.pop()
    modules = sorted({k.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for k in tensors
                      if k.endswith(".lora_A.weight")})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": float(payload[ADAPTER_SCALING]) * r,
              "target_modules": modules, "bias": "none", "lora_dropout": 0.0,
              **({"base_model_name_or_path": str(base_model)} if base_model is not None else {})}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / PEFT_WEIGHTS))
    (path / PEFT_CONFIG).write_text(json.dumps(config))


def read_peft_adapter(path: str | Path) -> dict[str, "Tensor"]:
    """A PEFT LoRA adapter directory as a version's payload (the inverse of `write_peft_adapter`)."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / PEFT_CONFIG).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{path}: not a plain LoRA adapter (peft_type LORA, no rsLoRA or DoRA)")
    tensors = {ADAPTER_PREFIX + k: v for k, v in load_file(str(path / PEFT_WEIGHTS)).items()}
    scaling = float(config["lora_alpha"]) / int(config["r"])
    return {**tensors, ADAPTER_SCALING: torch.tensor(scaling, dtype=torch.float64)}


def adapter_nbytes(model_path: str | Path, settings: LoraConfig) -> int:
    """Bytes of one float32 adapter of `settings` on the model at `model_path`, from its weight
    files' headers (nothing is loaded): r x (in + out) x 4 per adapted linear layer."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:  # "pt" would import torch for a header
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                module = key.removesuffix(".weight").rsplit(".", 1)[-1]
                if key.endswith(".weight") and len(shape) == 2 and module in settings.target_modules:
                    total += settings.r * (shape[0] + shape[1]) * 4
    return total


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
