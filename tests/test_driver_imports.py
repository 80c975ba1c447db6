"""The driver without torch (issue 46): what it does instead of importing torch gives what torch
would have given. Version 0 from the model's files equals the loaded model's state dict bit for
bit; the tokenizer loaded directly is the one AutoTokenizer builds; transformers' table of causal
LMs read from its source is the table; and the operators the pipeline names by reference are
classes whose constructors take the arguments it gives them. (That `trajflow run`'s driver never
imports torch is checked on test_jobs_run.py's quickstart run.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from trajflow.engines.model_files import file_state
from trajflow.engines.models import TINY_CONFIG, load_model
from trajflow.engines.paths import REPO_ROOT
from trajflow.engines.tokenizer import load_tokenizer
from trajflow.jobs.config import load_job_config
from trajflow.operators.contracts.stage import ClassRef, check_arguments
from trajflow.pipelines.config.model_dir import causal_lm_model_types
from trajflow.pipelines.rl_loop import RLPipeline
from trajflow.schemas.weights import SharedStateDict

ARTIFACTS = REPO_ROOT / "artifacts"
BUNDLED = [ARTIFACTS / "warm_start" / "addition", ARTIFACTS / "warm_start" / "calc",
           ARTIFACTS / "warm_start" / "reverse", ARTIFACTS / "teacher" / "addition"]


def _unpacked(packed) -> SharedStateDict:
    """The packed state as a reader gets it: pickled as Ray does and rebuilt with torch."""
    rebuild, parts = packed.__reduce__()
    return rebuild(*parts)


def _tiny(tmp_path: Path, name: str, **config) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_CONFIG, **config}), dtype=torch.float32)
    dtype = config.pop("dtype", None)
    path = tmp_path / name
    model.to(dtype or torch.float32).save_pretrained(path, max_shard_size="200KB" if "sharded" in name else "5GB")
    return path


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_version_0_from_the_files_equals_the_loaded_models_state_dict(path):
    _check_file_state(path)


def test_the_files_state_of_bf16_untied_and_sharded_checkpoints(tmp_path):
    """bf16 on disk (widened to float32 exactly, as the loader does), an output layer of its own,
    and weights split over shards with an index."""
    bf16 = _tiny(tmp_path, "bf16", tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(bf16).to(torch.bfloat16).save_pretrained(bf16)
    _check_file_state(bf16)
    _check_file_state(_tiny(tmp_path, "untied", tie_word_embeddings=False))
    sharded = _tiny(tmp_path, "sharded", tie_word_embeddings=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    _check_file_state(sharded)


def test_another_architecture_is_left_to_the_model_loader():
    assert file_state(ARTIFACTS / "byo" / "model") is None  # qwen2: not read from its files


def _check_file_state(path: Path) -> None:
    expected = SharedStateDict.of(load_model(path))
    packed = file_state(path)
    assert packed is not None
    got = _unpacked(packed)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert packed.nbytes == expected.nbytes  # a tied tensor counted once, as the store counts it
    tied = [n for n in expected if expected[n].data_ptr() == expected["model.embed_tokens.weight"].data_ptr()]
    assert [n for n in got if got[n].data_ptr() == got["model.embed_tokens.weight"].data_ptr()] == tied


@pytest.mark.parametrize("path", [*BUNDLED, ARTIFACTS / "byo" / "model"], ids=lambda p: p.name)
def test_the_tokenizer_is_the_one_auto_tokenizer_builds(path):
    auto, direct = AutoTokenizer.from_pretrained(path, local_files_only=True), load_tokenizer(path)
    assert type(direct) is type(auto)
    text = "What is 12+7? <eos> <|im_end|>\n  answer: 19"
    assert direct(text)["input_ids"] == auto(text)["input_ids"]
    assert (direct.eos_token_id, direct.pad_token_id, direct.all_special_ids) == \
        (auto.eos_token_id, auto.pad_token_id, auto.all_special_ids)


def test_the_causal_lm_table_read_from_source_is_transformers_table():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert causal_lm_model_types() == frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("config, overrides", [
    ("quickstart", []),
    ("quickstart", ["strategy=dedicated", "kl.beta=0.01"]),
    ("quickstart", ["strategy=interrupt", "kl.beta=0.01", "kl.in=reward"]),
    ("ppo", []),
    ("quickstart", [f"teacher={ARTIFACTS / 'teacher' / 'addition'}", "distill.forward_kl_coef=1.0",
                    "top_k_logprobs=4"]),
])
def test_every_operator_named_by_reference_takes_the_arguments_it_is_given(config, overrides):
    pipe = RLPipeline(load_job_config(config, overrides).pipeline_config())
    named = [s for s in pipe.stages if isinstance(s.fn, ClassRef)]
    assert named
    for stage in named:
        cls = stage.fn.load()
        assert isinstance(cls, type) and stage.fn == cls
        check_arguments(stage.name, cls, stage.kwargs)
        workers = stage.kwargs.get("workers")
        if workers is not None:
            assert isinstance(workers, ClassRef) and isinstance(workers.load(), type)
