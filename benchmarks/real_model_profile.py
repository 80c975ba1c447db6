"""Where the train step's time goes on the real model (SmolLM2-135M-Instruct, Q4_1 dequantized).

    python -m benchmarks.real_model_profile                       # 8 prompts x 4, 64 new tokens
    python -m benchmarks.real_model_profile --profile out.txt     # + torch profiler's op table
    python -m benchmarks.real_model_profile --trainer max_tokens_per_microbatch=1024  # a trainer setting

One step of the smollm2 workload is generated, rewarded and scored once (snapshot, float32, every
row trained: `drop_zero_variance_groups: false`), in this process, on the pipeline's own operators
(an in-process policy store, no Ray). Then the train operator runs `--repeats` times on that same
batch (`max_staleness` large enough that no token is over-stale), each timed; with `--profile`, one
more step runs under the torch profiler, whose table of operators by CPU time goes to that file.
Reports seconds per train step (min and median) and the process's peak RSS from the first train
step on (VmHWM reset after generation and scoring).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def step_batch(prompts: int, group: int, max_new_tokens: int, threads: int, seed: int = 0,
               trainer: dict | None = None, **overrides):
    """(the train operator, the step's batch as it reaches the train stage, the pipeline)."""
    import torch

    from trajflow.engines.models import load_model, load_tokenizer
    from trajflow.engines.prepared import SMOLLM2, prepare
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    torch.set_num_threads(threads)
    config = PipelineConfig(**{
        "model": prepare(SMOLLM2.name), "reward": "math", "strategy": "snapshot",
        "data": {"train_files": [str(REPO / "artifacts/smollm2/train.jsonl")]},
        "prompts_per_step": prompts, "group_size": group, "max_staleness": 64, "inference_dtype": "float32",
        "drop_zero_variance_groups": False, "sampling": {"max_new_tokens": max_new_tokens}, "seed": seed,
        "optimizer": {"lr": 1e-5}, "steps": 64,
        "trainer": {"torch_threads": threads, **(trainer or {})}, "generator": {"torch_threads": threads},
        "scorer": {"num_cpus": 0.25, "torch_threads": threads}, **overrides})
    pipe = RLPipeline(config)
    store = InProcessStore(config.max_staleness, pipe.strategy.keep_history)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    ops = {s.name: s.fn(**{"store": store, **s.kwargs}) if s.is_actor else s.fn for s in pipe.stages}
    source = pipe.workload.prompt_source(load_tokenizer(pipe.model_path), config.seed, config.prompts_per_step)
    batch = source.step_rows(0)
    for name, op in ops.items():
        if name == "train":
            break
        batch = op(batch)
    return ops["train"], batch, pipe


def _reset_peak_rss() -> None:
    """Start the process's peak RSS (VmHWM) afresh: from here it is the train steps' own."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--lora", type=int, default=0, help="train a LoRA adapter of this rank (0: full fine-tuning)")
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=JSON",
                   help="a trainer setting, e.g. gradient_checkpointing=true (repeatable)")
    p.add_argument("--profile", type=Path, help="write the torch profiler's table of one more step here")
    a = p.parse_args()
    import numpy as np
    import pyarrow.compute as pc

    lora = {"lora": {"r": a.lora}} if a.lora else {}
    trainer = {key: json.loads(value) for key, value in (kv.split("=", 1) for kv in a.trainer)}
    train, batch, pipe = step_batch(a.prompts, a.group, a.max_new_tokens, a.threads, trainer=trainer, **lora)
    lengths = pc.list_value_length(batch["response_tokens"]).to_numpy()
    prompt_lengths = pc.list_value_length(batch["prompt_tokens"]).to_numpy()
    seconds = []
    _reset_peak_rss()
    for step in range(a.repeats):
        started = time.perf_counter()
        metrics = train(batch.set_column(batch.schema.get_field_index("rollout_step"), "rollout_step",
                                         pc.add(batch["rollout_step"], step))).to_pylist()[0]
        seconds.append(time.perf_counter() - started)
        print(f"train step {step}: {seconds[-1]:.2f} s (rows trained {metrics['rows_trained']})", flush=True)
    train_peak = _peak_rss()
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(batch.set_column(batch.schema.get_field_index("rollout_step"), "rollout_step",
                                   pc.add(batch["rollout_step"], a.repeats)))
        a.profile.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    import resource

    payload = train.version_payload() if a.lora else train.model.state_dict()  # what a version holds
    import tempfile

    from safetensors.torch import save_file

    unique: dict = {}
    for name, tensor in payload.items():  # tied weights: one tensor under two names, stored once
        unique.setdefault(tensor.data_ptr(), (name, tensor))
    with tempfile.TemporaryDirectory() as tmp:
        save_file({name: t.detach().contiguous() for name, t in unique.values()}, f"{tmp}/version.safetensors")
        file_bytes = os.path.getsize(f"{tmp}/version.safetensors")
    print(json.dumps({
        "version_bytes": sum(t.numel() * t.element_size() for _, t in unique.values()),
        "version_file_bytes": file_bytes,
        "trainable_parameters": sum(p.numel() for p in train.model.parameters() if p.requires_grad),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "lora_r": a.lora,
        "train_peak_rss_bytes": train_peak,
        "rows": batch.num_rows, "response_tokens_mean": float(np.mean(lengths)), "response_tokens_max": int(lengths.max()),
        "prompt_tokens_mean": float(np.mean(prompt_lengths)), "prompt_tokens_max": int(prompt_lengths.max()),
        "train_step_s_min": min(seconds), "train_step_s_median": statistics.median(seconds),
        "load_1min": os.getloadavg()[0], "threads": a.threads, "trainer": trainer}))


if __name__ == "__main__":
    main()
