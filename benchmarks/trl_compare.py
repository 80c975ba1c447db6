"""Benchmark: trajflow side by side with Hugging Face TRL's GRPOTrainer at quickstart size.

Same warm-start model (the committed addition model, loaded from its local directory: no
download), same addition task and reward, 16 prompts x 8 samples per step, 6 new tokens,
lr 1.5e-4, one optimizer step per rollout. TRL runs synchronously in one process on the CPU
(`pip install 'trajflow[bench]'` installs it; a benchmark-only extra). Each system runs in a fresh
Python process, one after the other, `repeats` times: steady s/step (from the third step on),
start-up to the end of the first step, and the whole process tree's peak PSS.
"""

from __future__ import annotations

import os
import time

from benchmarks.common import run_script

TRL = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.environ["HF_HUB_OFFLINE"] = "1"
steps = int(sys.argv[1])
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from benchmarks.common import ProcessTree
from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
from trajflow.tasks import get_task

torch.set_num_threads(int(os.environ.get("TRL_THREADS", torch.get_num_threads())))
task = get_task("addition")
stream = task.prompts("train", seed=0)
prompts = [next(stream) for _ in range(16 * (steps + 1))]
data = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in prompts])

def reward(prompts, completions, answer, **_):
    return [task.reward(p, a, c) for p, a, c in zip(prompts, answer, completions)]

ends = []
class Clock(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        ends.append(time.perf_counter())

args = GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=128, num_generations=8,
                  max_completion_length=6, learning_rate=1.5e-4, max_steps=steps, beta=0.0,
                  temperature=1.0, top_k=0, top_p=1.0, use_cpu=True, report_to="none",
                  save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0, bf16=False)
tokenizer = load_tokenizer(WARM_START_DIR)
with ProcessTree(interval=0.5) as tree:
    trainer = GRPOTrainer(model=load_model(WARM_START_DIR), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
print("RESULT " + json.dumps({"first_step": ends[0] - t0, "s_per_step": (ends[-1] - ends[1]) / (len(ends) - 2),
                              "pss": tree.peak_pss_bytes, "processes": tree.peak_processes}))
"""

TRAJFLOW = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.environ["HF_HUB_OFFLINE"] = "1"
from benchmarks.common import ProcessTree
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.rl_loop import RLPipeline
import ray
from ray.data import DataContext
config = PipelineConfig(strategy="snapshot", steps=int(sys.argv[1]), prompts_per_step=16, group_size=8,
                        max_staleness=int(sys.argv[2]), optimizer={"lr": 1.5e-4})
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
DataContext.get_current().enable_progress_bars = False
ends = []
with ProcessTree(interval=0.5) as tree:
    for row in RLPipeline(config).iter_metrics():
        ends.append(time.perf_counter())
ray.shutdown()
print("RESULT " + json.dumps({"first_step": ends[0] - t0, "s_per_step": (ends[-2] - ends[1]) / (len(ends) - 3),
                              "pss": tree.peak_pss_bytes, "processes": tree.peak_processes}))
"""


def run(steps: int = 60, repeats: int = 3) -> list[dict]:
    import tempfile

    results: dict[str, list[dict]] = {"TRL GRPOTrainer (sync, 1 process)": [], "trajflow sync (max_staleness 0)": [],
                                      "trajflow async (max_staleness 2)": []}
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every system
        with tempfile.TemporaryDirectory() as out:
            results["TRL GRPOTrainer (sync, 1 process)"].append(run_script(TRL, str(steps), out))
        results["trajflow sync (max_staleness 0)"].append(run_script(TRAJFLOW, str(steps), "0"))
        results["trajflow async (max_staleness 2)"].append(run_script(TRAJFLOW, str(steps), "2"))
    trl = min(r["s_per_step"] for r in results["TRL GRPOTrainer (sync, 1 process)"])
    rows = []
    for name, runs in results.items():
        per_step = [r["s_per_step"] for r in runs]
        rows.append({
            "system": name,
            "s/step (min..max over repeats)": f"{min(per_step):.3f}..{max(per_step):.3f}",
            "s/step vs TRL (best)": min(per_step) / trl,
            "start-up to end of step 1 s": min(r["first_step"] for r in runs),
            "tree processes": max(r["processes"] for r in runs),
            "tree peak PSS GiB": max(r["pss"] for r in runs) / 2**30,
        })
    return rows


if __name__ == "__main__":
    started = time.perf_counter()
    for row in run(steps=int(os.environ.get("STEPS", 60)), repeats=int(os.environ.get("REPEATS", 3))):
        print(row)
    print(f"{time.perf_counter() - started:.0f} s")
