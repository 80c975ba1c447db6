"""The `auto` settings: torch threads per section and the trainer's micro-batch size, chosen from
the machine and the model so that a config need not know them (an explicit number still wins).

Read on the driver before Ray starts, without torch: the model's shape from its config.json, the
CPUs this process may run on and the machine's memory. The choices and why they are what they
are (measured on SmolLM2-135M, 2 cores: benchmarks/results/real_model.md, defaults.md):

- threads: a model under SMALL_MODEL_PARAMETERS gets 1 thread per process (its matrices are too
  small for torch's intra-op threads to pay); a larger one, synchronous (max_staleness 0: every
  stage in one process, one after another), gets every CPU; asynchronous, the trainer (the
  bottleneck on a real model: a train step at 1 thread takes 1.9x its 2-thread time) gets every
  CPU and the rollout side (generator, scorer) half of them. A stage on a GPU gets the CPUs it
  reserves (at least 1).
- micro-batches: the padded tokens whose activations fit in ACTIVATION_SHARE of the machine's
  memory, at `activation_bytes_per_token` (the float32 activations a Llama-shaped decoder keeps
  for its backward pass per token, and the logits over the vocabulary), rounded down to a power
  of two; none (the whole update at once, as without the setting) when the largest update
  possible fits anyway. A GPU trainer's memory is not known here: an explicit number there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
SMALL_MODEL_PARAMETERS = 20_000_000  # below: 1 torch thread per process
ACTIVATION_SHARE = 1 / 8  # of the machine's memory: the train step's activations (beside the
# generator's and scorer's processes, the trainer's weights and AdamW state, Ray's object store)
FLOAT_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """What the choices read of a model: its size and the widths that set activation memory."""

    parameters: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    max_positions: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelShape | None":
        """From a Hugging Face model directory's config.json (a decoder: Llama, Qwen, GPT-2 keys);
        None when it has no such file or keys (then `auto` keeps the settings' former defaults:
        1 thread, the whole update at once)."""
        try:
            return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def from_config(cls, c: dict) -> "ModelShape":
        """From a config.json's keys (parameters counted from the widths; norms left out)."""
        c = {**c.get("text_config", {}), **c}
        hidden = int(c.get("hidden_size") or c.get("n_embd"))
        layers = int(c.get("num_hidden_layers") or c.get("n_layer"))
        intermediate = int(c.get("intermediate_size") or c.get("n_inner") or 4 * hidden)
        vocab = int(c["vocab_size"])
        heads = int(c.get("num_attention_heads") or c.get("n_head") or 1)
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        attention = hidden * head_dim * (2 * heads + 2 * kv)  # q, o; k, v
        mlp = (3 if "intermediate_size" in c else 2) * hidden * intermediate  # gated (Llama) or not
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", True) else 2)
        return cls(parameters=layers * (attention + mlp) + embeddings, vocab=vocab, hidden=hidden,
                   intermediate=intermediate, layers=layers,
                   max_positions=int(c.get("max_position_embeddings") or c.get("n_positions") or 2048))

    def activation_bytes_per_token(self) -> int:
        """Float32 bytes a forward pass keeps per token for its backward: per layer about 8 hidden
        and 4 intermediate widths (norms, q/k/v, attention and MLP outputs, the gate's products),
        and the logits, their log-softmax and gradient over the vocabulary."""
        return FLOAT_BYTES * (self.layers * (8 * self.hidden + 4 * self.intermediate) + 3 * self.vocab)


@dataclass(frozen=True)
class Machine:
    """The CPUs this process may run on (an embedded Ray gives the run all of them) and the memory."""

    cpus: int
    memory_bytes: int

    @classmethod
    def here(cls) -> "Machine":
        import psutil

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(cpus=max(1, cpus), memory_bytes=int(psutil.virtual_memory().total))


def auto_threads(section: str, model: ModelShape | None, machine: Machine, synchronous: bool,
                 num_gpus: float = 0.0, num_cpus: float = 0.0) -> int:
    """torch intra-op threads of a section's processes (`generator`, `scorer`, `trainer`)."""
    if num_gpus > 0:
        return max(1, int(num_cpus))
    if model is None or model.parameters < SMALL_MODEL_PARAMETERS:
        return 1
    if synchronous or section == "trainer":
        return machine.cpus
    return max(1, machine.cpus // 2)


def auto_microbatch_tokens(model: ModelShape | None, machine: Machine, largest_update_tokens: int) -> int | None:
    """Padded tokens per forward/backward of the train step, or None: the whole update at once.
    `largest_update_tokens`: the padded tokens of the largest update a worker can get (its rows x
    the longest prompt + response possible)."""
    if model is None:
        return None
    budget = int(machine.memory_bytes * ACTIVATION_SHARE) // model.activation_bytes_per_token()
    if budget >= largest_update_tokens:
        return None
    return 1 << max(0, budget.bit_length() - 1)  # a power of two at or below the budget
