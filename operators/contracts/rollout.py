"""What the generate stage is built from (operators/generate.py): how a step's rollouts are
sampled and by which engine. Here, apart from the operator, so that the driver that builds the
stage list does not import the operator's module (torch, the engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.tokenizer import TokenIds


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollouts of a step are sampled (each a setting of the pipeline's config,
    pipelines/config/, which holds its default and documents it)."""

    group_size: int                       # responses per prompt
    sampling: SamplingConfig
    seed: int
    partial_rollout: bool = False         # take new weights between decode steps
    scores_at_switch: bool = False        # the strategy scores the prefix before a switch (interrupt)
    simulate_decode_seconds: float = 0.0  # sleep per decode step (a slower engine, for studies)
    top_k_logprobs: int = 0               # K > 0: record each token's top-K (module docstring)


@dataclass(frozen=True)
class EngineConfig:
    """Which generation engine samples, in which numerics (engines/factory.py `ENGINES`)."""

    name: str                             # a registered engine or an import path
    inference_dtype: str                  # float32, bfloat16 or fp8 (simulated)
    settings: Any = None                  # the engine's settings (its `Settings`; None: its defaults)
    lora_slots: int = 0                   # an engine that serves adapters: those kept resident (the window's)
    lora_rank: int = 0
    # eos, pad and stop ids from the driver's tokenizer (the generator then loads it only to
    # decode); None: the generator loads the tokenizer and reads them itself
    token_ids: TokenIds | None = None
