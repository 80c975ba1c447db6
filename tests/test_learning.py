"""RL actually learns: synchronous training from the warm start raises held-out accuracy.

A shortened version of the closing-note run (300 steps of 64 prompts x 8 samples). Greedy evaluation on a
fixed set of 400 held-out prompts is deterministic, so the margin below is a real gain, not noise
of the evaluation; an untrained or randomly perturbed model does not gain 15 correct answers.
"""

from __future__ import annotations

import pytest

from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.local import run_in_process
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.tasks import get_task
from trajflow.tasks.rollout import heldout_mean_reward

EVAL_PROMPTS = 400
STEPS = 40


@pytest.mark.slow
def test_sync_rl_improves_heldout_accuracy(one_torch_thread):  # one thread, restored after the module
    before = heldout_mean_reward(load_model(WARM_START_DIR), load_tokenizer(WARM_START_DIR), get_task("addition"),
                              EVAL_PROMPTS, max_new_tokens=6)
    config = PipelineConfig(strategy="snapshot", steps=STEPS, eval_every=STEPS, eval_prompts=EVAL_PROMPTS, seed=0)
    metrics = run_in_process(RLPipeline(config))  # synchronous: the pipeline's own stages, in this process
    after = metrics["heldout/accuracy"].drop_nulls()[-1]
    print(f"\nheld-out accuracy {before:.3f} -> {after:.3f} after {STEPS} synchronous steps")
    assert after >= before + 0.05
