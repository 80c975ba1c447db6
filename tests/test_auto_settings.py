"""The `auto` defaults (pipelines/config/auto.py): torch threads per section and the trainer's
micro-batch size, from the model's config.json, the CPUs and the memory; an explicit number wins;
the run's header says what was chosen."""

from __future__ import annotations

import json
import shutil

import pytest

from trajflow.jobs.config import build_job_config, load_job_config
from trajflow.jobs.config_reference import SMOLLM2_CONFIG, SMOLLM2_SHAPE
from trajflow.pipelines.config.auto import (
    SMALL_MODEL_PARAMETERS,
    Machine,
    ModelShape,
    auto_microbatch_tokens,
    auto_threads,
)
from trajflow.pipelines.config.pipeline import RunSettings

HERE = Machine(cpus=2, memory_bytes=24 * 2**30)


def test_the_model_shape_counts_parameters_as_torch_does():
    from transformers import AutoModelForCausalLM

    quickstart = load_job_config("quickstart").pipeline_config().model_path
    counted = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(quickstart).parameters())
    shape = ModelShape.of(quickstart)
    assert 0 < counted - shape.parameters < 0.01 * counted  # the norms left out
    # SmolLM2-135M by hand: 30 x (576 x 64 x (2 x 9 + 2 x 3) + 3 x 576 x 1536) + 49152 x 576 (tied)
    assert SMOLLM2_SHAPE.parameters == 30 * (576 * 64 * 24 + 3 * 576 * 1536) + 49152 * 576 == 134_479_872
    assert SMOLLM2_SHAPE.activation_bytes_per_token() == 4 * (30 * (8 * 576 + 4 * 1536) + 3 * 49152) == 1_880_064


def test_a_directory_without_a_readable_config_keeps_the_former_defaults(tmp_path):
    assert ModelShape.of(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "something else"}))
    assert ModelShape.of(tmp_path) is None
    assert auto_threads("trainer", None, HERE, synchronous=True) == 1
    assert auto_microbatch_tokens(None, HERE, 10**9) is None


@pytest.mark.parametrize("section, synchronous, expected", [
    ("generator", True, 8), ("scorer", True, 8), ("trainer", True, 8),  # sync: one process, every CPU
    ("generator", False, 4), ("scorer", False, 4), ("trainer", False, 8),  # async: the trainer is the bottleneck
])
def test_threads_from_the_cpus_and_sync_or_async(section, synchronous, expected):
    machine = Machine(cpus=8, memory_bytes=2**35)
    assert auto_threads(section, SMOLLM2_SHAPE, machine, synchronous) == expected
    small = ModelShape.from_config({**SMOLLM2_CONFIG, "num_hidden_layers": 2, "vocab_size": 1000})
    assert small.parameters < SMALL_MODEL_PARAMETERS
    assert auto_threads(section, small, machine, synchronous) == 1
    assert auto_threads(section, SMOLLM2_SHAPE, machine, synchronous, num_gpus=1, num_cpus=3) == 3
    assert auto_threads("generator", SMOLLM2_SHAPE, Machine(cpus=1, memory_bytes=2**33), False) == 1


def test_microbatches_fit_an_eighth_of_the_memory_as_a_power_of_two():
    per_token = SMOLLM2_SHAPE.activation_bytes_per_token()
    # 24 GiB / 8 = 3 GiB: 1,713 tokens' activations -> 1,024
    assert (3 * 2**30) // per_token == 1713
    assert auto_microbatch_tokens(SMOLLM2_SHAPE, HERE, 32 * 256) == 1024
    assert auto_microbatch_tokens(SMOLLM2_SHAPE, Machine(2, 64 * 2**30), 32 * 256) == 4096  # 4,568 -> 4,096
    assert auto_microbatch_tokens(SMOLLM2_SHAPE, HERE, 1713) is None  # the largest update fits: as before
    assert auto_microbatch_tokens(SMOLLM2_SHAPE, HERE, 1714) == 1024


def test_auto_is_resolved_from_the_config_and_an_explicit_number_wins(tmp_path):
    model = tmp_path / "model"  # the warm start's tokenizer, SmolLM2's shape (its weights are not read)
    shutil.copytree(load_job_config("quickstart").pipeline_config().model_path, model)
    (model / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    # the shape of a real model without its weights
    data = dict(model=str(model), prompts_per_step=8, group_size=4, sampling={"max_new_tokens": 96})
    sync = RunSettings(build_job_config({**data, "max_staleness": 0}).pipeline_config(), HERE)
    assert [sync.generator.torch_threads, sync.scorer.torch_threads, sync.trainer.torch_threads] == [2, 2, 2]
    # 32 rows of up to 8,192 positions (no data.max_prompt_tokens): over 1,713 tokens, 1,024 per micro-batch
    assert sync.trainer.max_tokens_per_microbatch == 1024
    assert sync.auto_choices() == ("auto: torch threads generator 2, scorer 2, trainer 2; micro-batches of 1024 "
                                   "tokens (2 CPUs, 24 GiB, 134.5M parameters, sync)")
    explicit = build_job_config({**data, "max_staleness": 1, "generator": {"torch_threads": 3},
                                 "trainer": {"max_tokens_per_microbatch": 512}}).pipeline_config()
    chosen = RunSettings(explicit, HERE)
    assert [chosen.generator.torch_threads, chosen.scorer.torch_threads, chosen.trainer.torch_threads] == [3, 1, 2]
    assert chosen.trainer.max_tokens_per_microbatch == 512
    assert chosen.auto_choices().startswith("auto: torch threads scorer 1, trainer 2 (")


def test_the_quickstart_gets_what_it_had_before_auto():
    """1 thread per process and its own micro-batches: the quickstart's numbers are unchanged."""
    settings = load_job_config("quickstart").pipeline_config().settings
    assert [settings.generator.torch_threads, settings.scorer.torch_threads, settings.trainer.torch_threads] == [1, 1, 1]
    assert settings.trainer.max_tokens_per_microbatch == 4096
