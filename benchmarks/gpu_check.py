"""The GPU check: trajflow's operators in one process on a lent GPU, one table, under 10 minutes.

    bash scripts/gpu_check.sh            # what a lent machine runs (its README: benchmarks/results/gpu.md)
    python -m benchmarks.gpu_check --device cpu --small     # the same code on the CPU (tests/test_gpu_check.py)

The machine this project may be lent (one H100 or H200, 16 cores, no network) has PyTorch with
CUDA, transformers, PEFT, pyarrow and safetensors but no Ray, vLLM or polars, and trajflow is not
installed there. So the check runs the pipeline's own stage list (`RLPipeline`) through the
in-process loop (pipelines/local.py `iter_in_process`: an in-process policy store, the train
step's workers as threads) and imports nothing that needs Ray or polars; trajflow is imported
from this source tree; pydantic, which the config needs, travels as wheels
(scripts/gpu_check.sh). It installs nothing and needs no model download: the model is built
from a config (SmolLM2-135M's shape, random weights) with the built-in character tokenizer.

What it runs, each a row of the table (`--small`: tiny shapes, for the test on the CPU):

    environment        torch, CUDA, the GPU, transformers, PEFT
    model              LlamaForCausalLM of SmolLM2-135M's shape from its config, saved as a model dir
    exact: snapshot, dedicated, interrupt
                       two steps each, float32 inference: max |old - inference| log-prob over the
                       trained tokens, against `EXACT_TOLERANCE` (the exactness invariant)
    scored at each token's version
                       the snapshot scorer on one batch whose rows carry versions 0 and 1: each
                       token scored with its own version's weights
    bf16 generate + bf16 autocast train
                       the torch engine in bf16, the snapshot scorer and the train step under bf16
                       autocast: generated and trained tokens per second (the last step: the first
                       warms up), peak GPU memory, the train-inference mismatch (k3, max |log r_d|)
    fsdp2 (world size 1)
                       the sharded trainer over a group of one (NCCL on CUDA): its loss against
                       the replicated trainer's on the same step
    lora               a LoRA (r 8) step: the adapter moved, old = inference on its versions

Without CUDA (and without `--device cpu`) it prints what it would run and exits 0: CI runs it so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M's config.json): LlamaForCausalLM, tied embeddings
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, hidden_act="silu")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128, tie_word_embeddings=True, max_position_embeddings=256, rms_norm_eps=1e-5,
            hidden_act="silu")
# float32 generation (KV cache, incremental) against teacher-forced scoring of the same weights:
# equal up to the order of reductions (1.5e-5 measured on the CPU for SmolLM2-135M, docs/design.md §6)
EXACT_TOLERANCE = 1e-4
EXACT_STRATEGIES = ("snapshot", "dedicated", "interrupt")


@dataclass(frozen=True)
class Shape:
    """The model and the step sizes of one check."""

    model: dict
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    throughput_prompts: int  # the bf16 run's prompts per step (its tokens per second)
    throughput_tokens: int

    def describe(self) -> str:
        m = self.model
        return (f"Llama {m['num_hidden_layers']} layers x {m['hidden_size']} (heads {m['num_attention_heads']}/"
                f"{m['num_key_value_heads']}, mlp {m['intermediate_size']}, vocab {m['vocab_size']}); steps of "
                f"{self.prompts_per_step} x {self.group_size} rows x {self.max_new_tokens} new tokens, the "
                f"throughput run {self.throughput_prompts} x {self.group_size} x {self.throughput_tokens}")


GPU_SHAPE = Shape(SMOLLM2_135M, prompts_per_step=16, group_size=8, max_new_tokens=64, throughput_prompts=32,
                  throughput_tokens=128)
CPU_SHAPE = Shape(TINY, prompts_per_step=2, group_size=2, max_new_tokens=4, throughput_prompts=2, throughput_tokens=4)


@dataclass
class Row:
    check: str
    ok: bool
    measured: str
    seconds: float = 0.0


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, check: str, ok: bool, measured: str, started: float) -> Row:
        row = Row(check, ok, measured, time.perf_counter() - started)
        self.rows.append(row)
        print(f"gpu_check: {'ok  ' if ok else 'FAIL'} {check}: {measured} ({row.seconds:.1f} s)", flush=True)
        return row

    def table(self) -> str:
        lines = ["| check | result | measured | s |", "|---|---|---|---:|"]
        lines += [f"| {r.check} | {'ok' if r.ok else 'FAIL'} | {r.measured.replace('|', '&#124;')} | {r.seconds:.1f} |"
                  for r in self.rows]
        return "\n".join(lines)


def import_trajflow() -> None:
    """trajflow from this source tree when it is not installed (the lent machine installs
    nothing): its top-level folders are the package's subpackages (pyproject's package-dir)."""
    try:
        import trajflow.pipelines  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import trajflow

        trajflow.__path__.append(str(ROOT))


def varied_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A reward that varies within a group whatever the (random) model says: the completion's
    length modulo 3. The check measures numerics and speed, not learning."""
    return [float(len(c) % 3) for c in completions]


# -- the pieces ---------------------------------------------------------------------------------------
def build_model_dir(directory: Path, shape: Shape) -> tuple[Path, int]:
    """A model of `shape` from its config (random weights, seed 0) saved with the built-in
    character tokenizer; (its directory, its parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trajflow.engines.models import save_model
    from trajflow.engines.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**shape.model, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_model(model, tokenizer, directory)
    return directory, sum(p.numel() for p in model.parameters())


def pipeline_config(model_dir: Path, shape: Shape, **settings):
    """The run's config: the addition task's prompts, `varied_reward`, no held-out evaluation,
    every group trained (the reward of a random model is noise), the exact strategies' old
    log-prob forward kept (the check measures it), then `settings`."""
    from trajflow.pipelines.config import PipelineConfig

    base = dict(model=model_dir, task="addition", reward=f"{Path(__file__).resolve()}:varied_reward", steps=2,
                prompts_per_step=shape.prompts_per_step, group_size=shape.group_size, max_staleness=1,
                inference_dtype="float32", sampling={"max_new_tokens": shape.max_new_tokens, "temperature": 1.0},
                drop_zero_variance_groups=False, eval_every=0, seed=0, old_logprob_forward="always")
    return PipelineConfig(**{**base, **settings})


@dataclass
class Steps:
    """What a run in this process gave: per step, the batch as it reached the train step, its
    metrics row, and the newest version's weights after it; the peak GPU memory."""

    batches: list
    rows: list[dict]
    weights: list[dict]
    peak_bytes: int


def run_steps(config, hooks=None) -> Steps:
    """`config`'s pipeline in this process (pipelines/local.py), version 0 the model directory's."""
    import torch

    from trajflow.engines.models import load_model
    from trajflow.pipelines.local import iter_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(config)
    if hooks is not None:
        pipe.hooks.on_step = hooks
    store = InProcessStore(config.max_staleness, pipe.strategy.keep_history)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out = Steps([], [], [], 0)
    for batch, row in iter_in_process(pipe, store, range(config.steps)):
        out.batches.append(batch)
        out.rows.append(row)
        out.weights.append({k: v.detach().cpu().clone() for k, v in store.weights(store.latest_version())[1].items()})
    out.peak_bytes = torch.cuda.max_memory_allocated() if cuda else 0
    return out


def exactness_gap(batches) -> float:
    """max |old - inference| over the loss tokens of rows that carry old log-probs."""
    import numpy as np

    worst = 0.0
    for batch in batches:
        for old, inference, mask in zip(batch["old_logprobs"].to_pylist(), batch["inference_logprobs"].to_pylist(),
                                        batch["loss_mask"].to_pylist()):
            if old is None or not any(mask):
                continue
            gap = np.abs(np.asarray(old) - np.asarray(inference))[np.asarray(mask)]
            worst = max(worst, float(gap.max()))
    return worst


def scored_at_each_version(model_dir: Path, shape: Shape, run: Steps) -> float:
    """The snapshot scorer on one batch holding rows of versions 0 and 1 (the first two steps'
    rows, their old log-probs cleared), the store holding both versions: max |old - inference|."""
    import pyarrow as pa

    from trajflow.engines.models import load_model
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline
    from trajflow.schemas.columns import replace_column

    pipe = RLPipeline(pipeline_config(model_dir, shape, strategy="snapshot"))
    store = InProcessStore(max_staleness=2, keep_history=True)
    for version, weights in enumerate([load_model(model_dir).state_dict(), run.weights[0]]):
        store.publish(weights, version)
        store.weights(version, pin=True)  # the generator's pin: kept until the scorer releases it
    batch = pa.concat_tables([b.select(run.batches[1].column_names) for b in run.batches[:2]],
                             promote_options="permissive")
    versions = sorted({v for vs in batch["versions"].to_pylist() for v in vs})
    assert versions == [0, 1], versions
    (scorer,) = [p.stage for p in pipe.strategy.stages(pipe.stage_context())]
    cleared = replace_column(batch, "old_logprobs", pa.nulls(batch.num_rows, pa.list_(pa.float32())))
    return exactness_gap([scorer.fn(store=store, **scorer.kwargs)(cleared)])


def tokens_per_second(run: Steps) -> tuple[float, float]:
    """(generated, trained) tokens per second in the last step: the first warms up."""
    batch, row = run.batches[-1], run.rows[-1]
    generated = sum(len(r) for r in batch["response_tokens"].to_pylist())
    trained = sum(len(p) + len(r) for p, r in zip(batch["prompt_tokens"].to_pylist(),
                                                   batch["response_tokens"].to_pylist()))
    return generated / row["seconds/generate"], trained / row["seconds/train"]


def finite(row: dict, *keys: str) -> bool:
    return all(row.get(k) is not None and math.isfinite(row[k]) for k in keys)


# -- the check ------------------------------------------------------------------------------------------
def plan(shape: Shape, device: str) -> list[str]:
    return [f"environment: torch, CUDA and the GPU, transformers, PEFT (device {device})",
            f"model: {shape.describe()}",
            *(f"exact: {s}: 2 steps, float32 inference, max |old - inference| <= {EXACT_TOLERANCE:g}"
              for s in EXACT_STRATEGIES),
            "scored at each token's version: the snapshot scorer on rows of versions 0 and 1",
            "bf16 generate + bf16 autocast train: tokens/s, peak memory, mismatch",
            "fsdp2 (world size 1, NCCL on CUDA): the loss against the replicated trainer's",
            "lora (r 8): the adapter moved, old = inference"]


def check(shape: Shape, report: Report) -> Report:
    import peft
    import torch
    import transformers

    from trajflow.operators.trainer.collective import choose_backend

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpu = f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB" \
        if cuda else "no GPU: device cpu"
    report.add("environment", True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu}; transformers "
               f"{transformers.__version__}, peft {peft.__version__}", started)
    with tempfile.TemporaryDirectory(prefix="trajflow-gpu-check-") as tmp:
        started = time.perf_counter()
        model_dir, params = build_model_dir(Path(tmp) / "model", shape)
        report.add("model", True, f"{params / 1e6:.1f} M parameters ({shape.describe()})", started)

        runs = {}
        for strategy in EXACT_STRATEGIES:
            started = time.perf_counter()
            runs[strategy] = run = run_steps(pipeline_config(model_dir, shape, strategy=strategy))
            gap = exactness_gap(run.batches)
            report.add(f"exact: {strategy}", gap <= EXACT_TOLERANCE and finite(run.rows[-1], "loss"),
                       f"max |old - inference| {gap:.1e} over {len(run.batches)} steps", started)

        started = time.perf_counter()
        gap = scored_at_each_version(model_dir, shape, runs["snapshot"])
        report.add("scored at each token's version", gap <= EXACT_TOLERANCE,
                   f"versions 0 and 1 in one batch: max |old - inference| {gap:.1e}", started)

        started = time.perf_counter()
        fast = run_steps(pipeline_config(model_dir, shape, steps=3, strategy="snapshot", inference_dtype="bfloat16",
                                         optimizer={"mixed_precision": "bf16"},
                                         prompts_per_step=shape.throughput_prompts,
                                         sampling={"max_new_tokens": shape.throughput_tokens, "temperature": 1.0}))
        generated, trained = tokens_per_second(fast)
        last = fast.rows[-1]
        report.add("bf16 generate + bf16 autocast train", finite(last, "loss", "grad/norm"),
                   f"generate {generated:,.0f} tok/s, train {trained:,.0f} tok/s, peak {fast.peak_bytes / 2**30:.2f} GiB; "
                   f"k3 {last['mismatch/k3']:.1e}, max |log r_d| {last['mismatch/max_abs_log_rd']:.2f}", started)

        started = time.perf_counter()
        backends: list[str] = []

        def record_backend(trainstep, batch, metrics) -> None:  # while the sharded trainer's group is up
            backends.append(torch.distributed.get_backend())

        sharded = run_steps(pipeline_config(model_dir, shape, strategy="snapshot", trainer={"sharding": "fsdp"}),
                            hooks=record_backend)
        replicated = runs["snapshot"]
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(sharded.rows, replicated.rows))
        expected = choose_backend(torch.device("cuda" if cuda else "cpu"))
        ok = diff <= 1e-4 and set(backends) == {expected if expected == "nccl" else "trajflow_gloo"}
        report.add("fsdp2 (world size 1)", ok, f"backend {','.join(sorted(set(backends)))}; loss vs replicated "
                   f"{diff:.1e}; peak {sharded.peak_bytes / 2**30:.2f} GiB", started)

        started = time.perf_counter()
        adapted = run_steps(pipeline_config(model_dir, shape, strategy="snapshot", lora={"r": 8, "alpha": 16.0},
                                            optimizer={"lr": 1e-3}))
        moved = max(float(v.abs().max()) for k, v in adapted.weights[-1].items() if ".lora_B." in k)
        gap = exactness_gap(adapted.batches[1:])  # step 1's tokens: version 1, an adapter
        report.add("lora (r 8)", moved > 0 and gap <= EXACT_TOLERANCE,
                   f"lora_B moved {moved:.1e}; max |old - inference| on adapter versions {gap:.1e}", started)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cpu: run the same code on the CPU (default: cuda when there is one, else a dry run)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU test)")
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    if args.device == "cpu":  # every operator picks the GPU it sees: let it see none
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import_trajflow()
    shape = CPU_SHAPE if args.small else GPU_SHAPE
    try:
        import torch
    except ImportError:  # a dry run needs no torch: a machine without one has no CUDA either
        torch = None
        if args.device is None:
            print(f"gpu_check: {sys.executable} has no torch (on the GPU machine, python3 has)")
    device = args.device or ("cuda" if torch is not None and torch.cuda.is_available() else None)
    if device is None:
        print("gpu_check: no CUDA device here; on a GPU machine this runs, in one process:")
        for line in plan(shape, "cuda"):
            print(f"  - {line}")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    started = time.perf_counter()
    report = check(shape, Report())
    table = report.table()
    print(f"\ntrajflow GPU check ({time.perf_counter() - started:.0f} s)\n{table}", flush=True)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0 if all(r.ok for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
