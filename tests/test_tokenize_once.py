"""Tokenize once: the generator gets eos, pad and the stop ids from the driver's tokenizer (the
one the config's validation loaded) and loads the tokenizer itself only when it decodes
(`sampling.stop` strings, an environment's turns). Its generations are the same either way.
The start-up gain with a 131k-token tokenizer: benchmarks/startup_vocab.py."""

from __future__ import annotations

import dataclasses

import pytest

from trajflow.engines.models import load_tokenizer
from trajflow.engines.tokenizer import TokenIds, stop_token_ids
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.rl_loop import RLPipeline


def _generator(monkeypatch, **config):
    """The pipeline's own Generate, built with its kwargs in one process; how often it loaded a tokenizer."""
    import trajflow.operators.generate as generate

    loads = []
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: loads.append(path) or load_tokenizer(path))
    pipe = RLPipeline(PipelineConfig(prompts_per_step=2, group_size=2, inference_dtype="float32", seed=1, **config))
    store = InProcessStore(0, False)
    from trajflow.engines.models import load_model

    store.publish(load_model(pipe.model_path).state_dict(), 0)
    stage = pipe.stage("generate")
    return stage.fn(store=store, **stage.kwargs), pipe, loads


@pytest.mark.timeout(300)
def test_the_generator_loads_no_tokenizer_unless_it_decodes(monkeypatch, one_torch_thread):
    generator, pipe, loads = _generator(monkeypatch)
    assert loads == [] and generator.tokenizer is None
    tokenizer = load_tokenizer(pipe.model_path)
    assert pipe.stage("generate").kwargs["engine"].token_ids == TokenIds(
        tokenizer.eos_token_id, tokenizer.pad_token_id, tuple(stop_token_ids(tokenizer, pipe.model_path)))
    rows = pipe.prompts.step_rows(0)
    lean = generator(rows)
    # the same rollout from a generator that loaded the tokenizer itself (no token_ids given)
    kwargs = pipe.stage("generate").kwargs
    kwargs = dict(kwargs, engine=dataclasses.replace(kwargs["engine"], token_ids=None))
    store = generator.store
    full = type(generator)(store=store, **kwargs)
    assert full.tokenizer is not None
    again = full(rows)
    assert lean["response_tokens"].to_pylist() == again["response_tokens"].to_pylist()
    assert lean["finish_reason"].to_pylist() == again["finish_reason"].to_pylist()
    # stop strings are decoded: then it loads it
    stopping, _, loads = _generator(monkeypatch, sampling={"stop": ["="], "max_new_tokens": 6})
    assert len(loads) == 1 and stopping.tokenizer is not None
