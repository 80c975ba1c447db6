"""Correction strategies as objects (operators/strategies/), without Ray: the registry, each
strategy's old_logprobs on a real tiny model, tokens outside the sampling support, minibatch merging,
training numerics, and user strategies by import path."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.algorithms import CorrectionConfig, LossOutput, decoupled_loss
from trajflow.engines.sampling import SamplingConfig
from trajflow.engines.training_numerics import TrainingNumerics, checkpoint_dropout, choose_device
from trajflow.operators.strategies import (
    BUILTIN,
    Strategy,
    format_strategies,
    resolve_strategy,
    strategy_class,
    strategy_names,
)
from trajflow.operators.trainer.correction import PolicyHolder, StepBatch, correct, merge_outputs
from trajflow.pipelines.config import PipelineConfig

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("trajflow", "schemas", "operators", "algorithms", "engines", "tasks", "pipelines", "jobs")


class TinyTrainer(PolicyHolder):
    """The Trainer a strategy sees, on the built-in tiny model (random weights)."""

    def __init__(self, model, sampling: SamplingConfig, minibatches_per_step: int = 1, version: int = 5) -> None:
        self.numerics = TrainingNumerics()
        self.model = self.numerics.prepare(model)
        self.sampling, self.version, self.minibatches_per_step = sampling, version, minibatches_per_step


def make_batch(n: int = 6, width: int = 5, seed: int = 0, versions=(3, 4, 5), old: bool = False,
               trainer: TinyTrainer | None = None) -> StepBatch:
    rng = np.random.default_rng(seed)
    responses = [rng.integers(4, 40, size=int(rng.integers(2, width + 1))).tolist() for _ in range(n)]
    table = pa.table({
        "prompt_tokens": [[1] + rng.integers(4, 40, size=3).tolist() for _ in range(n)],
        "response_tokens": responses,
        "inference_logprobs": pa.array([(-rng.random(len(r)) - 0.1).tolist() for r in responses],
                                       pa.list_(pa.float32())),
        "versions": [[int(rng.choice(versions))] * len(r) for r in responses],
        "loss_mask": [[True] * len(r) for r in responses],
        "advantage": pa.array(rng.normal(size=n), pa.float32()),
        "old_logprobs": pa.nulls(n, pa.list_(pa.float32())),
    })
    batch = StepBatch.from_table(table, trainer_version=5)
    if old:  # the column an exact strategy's operator would fill: the trainer's scores
        batch.old = trainer.score(trainer.policy(), batch)
    return batch


# -- the registry --------------------------------------------------------------------------------
def test_registry_catalogue():
    assert strategy_names() == ["snapshot", "dedicated", "interrupt", "ewma", "recompute", "behavior",
                                "loglinear", "m2po", "score_centering"]
    kinds = {name: cls.kind for name, cls in BUILTIN.items()}
    exact = ["snapshot", "dedicated", "interrupt", "score_centering"]
    assert [n for n, k in kinds.items() if k == "exact"] == exact
    assert kinds["ewma"] == "approximate"
    assert [n for n, c in BUILTIN.items() if c.old_from_column] == exact
    assert [n for n, c in BUILTIN.items() if c.keep_history] == ["snapshot", "dedicated", "score_centering"]
    assert [n for n, c in BUILTIN.items() if c.old_distribution] == [*exact[:3], "behavior", "score_centering"]
    assert [n for n, c in BUILTIN.items() if c.uses_current_top_k] == ["score_centering"]
    assert [n for n, c in BUILTIN.items() if c.scores_at_switch] == ["interrupt"]
    text = format_strategies()
    assert all(name in text for name in BUILTIN) and max(len(line) for line in text.splitlines()) <= 100
    for name, cls in BUILTIN.items():  # one file per strategy, named after it
        assert cls.__module__ == f"trajflow.operators.strategies.{name}"


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def test_no_package_file_outside_the_strategies_compares_a_strategy_name():
    names = set(BUILTIN)
    allowed = {("pipelines/config/pipeline.py", "snapshot")}  # the config's default value
    found = []
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("operators/strategies/"):
                continue
            found += [(rel, s) for s in _string_constants(path) & names if (rel, s) not in allowed]
    assert not found, f"strategy names outside operators/strategies/: {found}"


def test_pipeline_stages_come_from_the_strategy_object():
    from trajflow.pipelines.rl_loop import RLPipeline, Stage

    def names(strategy: str) -> list[str]:
        return [s.name for s in RLPipeline(PipelineConfig(strategy=strategy)).stages]

    assert names("snapshot") == ["generate", "reward", "advantage", "filter", "old_logprobs", "train"]
    assert names("dedicated") == ["generate", "old_logprobs", "reward", "advantage", "filter", "train"]
    for strategy in ("interrupt", "ewma", "recompute", "behavior", "loglinear", "m2po"):
        assert names(strategy) == ["generate", "reward", "advantage", "filter", "train"], strategy
    pipe = RLPipeline(PipelineConfig(strategy="interrupt"))
    assert pipe.stage("generate").kwargs["rollout"].scores_at_switch  # and so takes weights mid-generation
    assert pipe.stage("train").kwargs["spec"].strategy.name == "interrupt"
    assert "strategy interrupt (exact)" in pipe.describe() and "dropout off" in pipe.describe()
    assert Stage is __import__("trajflow.operators.contracts.stage", fromlist=["Stage"]).Stage  # still importable there


# -- each strategy's old_logprobs --------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tiny, one_torch_thread):
    return TinyTrainer(tiny[0], SamplingConfig())


def test_each_old_logprobs(trainer):
    batch = make_batch(old=True, trainer=trainer)
    current = trainer.current(batch, grad=True)
    by_name = {name: resolve_strategy(name).from_config(PipelineConfig(strategy=name, top_k_logprobs=8))
               for name in BUILTIN}
    for name in ("snapshot", "dedicated", "interrupt", "score_centering"):
        assert torch.equal(by_name[name].old_logprobs(batch, current, trainer), batch.old)
    for name in ("behavior", "m2po"):
        assert torch.equal(by_name[name].old_logprobs(batch, current, trainer), batch.inference)
    recompute = by_name["recompute"]
    recompute.before_step(batch, trainer)  # one update per step: the update's own forward pass
    assert torch.equal(recompute.old_logprobs(batch, current, trainer), current.detach())
    # loglinear: alpha = (v_prox - v) / (v_theta - v) with v_theta = 6, v_prox = 5
    alpha = (5.0 - batch.versions.double()) / (6.0 - batch.versions.double())
    expected = batch.inference.double() + alpha * (current.detach().double() - batch.inference.double())
    assert torch.allclose(by_name["loglinear"].old_logprobs(batch, current, trainer).double(), expected, atol=1e-6)
    ewma = by_name["ewma"]
    ewma.bind(trainer)  # starts at the trainer's weights: scores exactly like pi_theta
    assert torch.equal(ewma.old_logprobs(batch, current, trainer), current.detach())
    batch.old = None
    with pytest.raises(RuntimeError, match="snapshot: rows reached the trainer without old_logprobs"):
        by_name["snapshot"].old_logprobs(batch, current, trainer)


def test_recompute_scores_once_before_the_first_of_several_updates(tiny, one_torch_thread):
    trainer = TinyTrainer(tiny[0], SamplingConfig(), minibatches_per_step=2)
    batch = make_batch()
    before = trainer.current(batch, grad=False)
    strategy = resolve_strategy("recompute")()
    strategy.before_step(batch, trainer)
    half = batch.select(torch.tensor([3, 4, 5]))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)  # the first update happened
    assert torch.equal(strategy.old_logprobs(half, trainer.current(half, grad=False), trainer), before[3:])
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.sub_(0.01)


# -- tokens outside the sampling support ----------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILTIN))
def test_tokens_outside_top_k_leave_the_loss_for_every_strategy_and_level(tiny, one_torch_thread, name):
    trainer = TinyTrainer(tiny[0], SamplingConfig(top_k=20))
    batch = make_batch(n=8, seed=1, old=True, trainer=trainer)  # random tokens: about half outside the top 20
    outside_expected = int((batch.loss_mask & ~torch.isfinite(batch.old)).sum())
    assert 0 < outside_expected < int(batch.loss_mask.sum())
    uses_top_k = BUILTIN[name].uses_current_top_k
    if uses_top_k:  # random ids, scored by the trainer as the sampler and pi_old: about half outside the top 20
        batch.top_k_ids = torch.from_numpy(np.random.default_rng(2).integers(0, 64, size=(*batch.loss_mask.shape, 4)))
        scored: list[torch.Tensor] = []
        trainer.current(batch, grad=False, top_k=scored)
        batch.top_k_inference = batch.top_k_old = scored[0]
    for mask_level in ("token", "sequence", "none"):
        for clip_level in ("token", "sequence"):
            strategy = resolve_strategy(name).from_config(PipelineConfig(strategy=name, top_k_logprobs=8))
            strategy.bind(trainer)
            strategy.before_step(batch, trainer)
            trainer.model.zero_grad(set_to_none=True)
            top_k: list[torch.Tensor] | None = [] if uses_top_k else None
            current = trainer.current(batch, grad=True, top_k=top_k)
            config = CorrectionConfig(mask_level=mask_level, clip_level=clip_level, mask_c_token=1e6,
                                      mask_c_seq=1e6)
            result = correct(strategy, batch, current, trainer, config, current_top_k=top_k[0] if top_k else None)
            result.loss.loss.backward()
            assert math.isfinite(result.loss.loss.item()), (mask_level, clip_level)
            assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
            assert result.outside_support >= outside_expected if strategy.old_from_column else result.outside_support > 0
            assert not (result.loss.loss_mask & ~torch.isfinite(current.detach())).any()
            assert int(result.loss.loss_mask.sum()) == int(batch.loss_mask.sum()) - result.outside_support
    # what the removal prevents: the same -inf tokens fed to the loss give a NaN gradient
    trainer.model.zero_grad(set_to_none=True)
    current = trainer.current(batch, grad=True)
    raw = decoupled_loss(current, batch.old, batch.inference, batch.advantages, batch.loss_mask,
                         CorrectionConfig(mask_level="none", clip_level="sequence"))
    raw.loss.backward()
    assert not all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


# -- minibatches -----------------------------------------------------------------------------------------
def test_merge_outputs_keeps_every_field_of_every_minibatch():
    torch.manual_seed(0)
    b, t = 6, 4
    cur, old, inf = (torch.randn(b, t) * 0.3 - 1 for _ in range(3))
    adv, mask = torch.randn(b), torch.rand(b, t) > 0.2
    trust = torch.rand(b, t) > 0.3
    config = CorrectionConfig(tis_cap=2.0, dual_clip_c=3.0, eps_low=0.05, eps_high=0.05)
    rows = [torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])]
    parts = [(r, decoupled_loss(cur[r], old[r], inf[r], adv[r], mask[r], config, trust_mask=trust[r])) for r in rows]
    merged = merge_outputs(parts, mask.shape)
    fields = [f.name for f in dataclasses.fields(LossOutput)]
    assert "trust_masked" in fields and "log_rs_token" in fields
    for name in fields:
        value = getattr(merged, name)
        if name == "loss":
            assert torch.isclose(value, (parts[0][1].loss + parts[1][1].loss) / 2)
            continue
        if name in ("loss_sum", "count"):  # the sum form and its count add up over the parts
            assert torch.isclose(value, getattr(parts[0][1], name) + getattr(parts[1][1], name)), name
            continue
        assert value.shape == mask.shape, name
        for r, out in parts:
            assert torch.equal(value[r], getattr(out, name)), name
    assert merged.clipped_low.any() or merged.clipped_high.any()  # the fields carry something


# -- training numerics ------------------------------------------------------------------------------------
def test_device_choice_follows_the_process_resources():
    assert choose_device(cuda_available=True) == "cuda" and choose_device(cuda_available=False) == "cpu"
    assert TrainingNumerics(device="cpu").torch_device().type == "cpu"
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainingNumerics(mixed_precision="fp16")


def test_bf16_autocast_is_one_definition_and_dropout_is_off(tmp_path, tiny, one_torch_thread):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    config = model.config.to_dict() | {"attention_dropout": 0.1}
    dropped = AutoModelForCausalLM.from_config(type(model.config).from_dict(config))
    dropped.load_state_dict(model.state_dict())
    dropped.save_pretrained(tmp_path)
    assert checkpoint_dropout(tmp_path) == {"attention_dropout": 0.1}
    sampling = SamplingConfig()
    batch = make_batch()
    f32, bf16 = TrainingNumerics(), TrainingNumerics(mixed_precision="bf16")
    dropped.train()  # as loaded for training: dropout would be on
    for numerics in (f32, bf16):
        numerics.prepare(dropped)
        with_grad = numerics.logprobs(dropped, batch.prompts, batch.responses, sampling, width=batch.width, grad=True)
        scored = numerics.logprobs(dropped, batch.prompts, batch.responses, sampling, width=batch.width)
        assert torch.equal(with_grad.detach(), scored)  # pi_theta and pi_old: the same numbers
    a = f32.logprobs(dropped, batch.prompts, batch.responses, sampling, width=batch.width)
    b = bf16.logprobs(dropped, batch.prompts, batch.responses, sampling, width=batch.width)
    assert 1e-4 < float((a - b).abs().max()) < 0.1  # bf16 autocast is a different (close) numerics


# -- user strategies ------------------------------------------------------------------------------------------
def test_user_strategy_by_file_and_module_path(user_strategy_module, monkeypatch):
    tmp_path, _ = user_strategy_module("my_corrections")
    by_file = resolve_strategy(f"{tmp_path}/my_corrections.py:HalfwayOld")
    assert by_file.name == "halfway" and issubclass(by_file, Strategy)
    monkeypatch.chdir(tmp_path)
    config = PipelineConfig(strategy="my_corrections.py:HalfwayOld")  # relative: stored absolute
    assert config.strategy == f"{tmp_path}/my_corrections.py:HalfwayOld"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PipelineConfig(strategy="my_corrections:HalfwayOld").build_strategy().name == "halfway"
    for spec, message in [("my_corrections:NotAStrategy", "is not a Strategy subclass"),
                          ("my_corrections:Nameless", "must set the class attributes name, meaning"),
                          ("my_corrections:Missing", "my_corrections has no 'Missing'"),
                          (f"{tmp_path}/nope.py:X", "nope.py: no such file")]:
        with pytest.raises(ValueError, match=message):
            resolve_strategy(spec)


def test_a_user_strategy_travels_by_value_to_processes_that_cannot_import_it(user_strategy_module, monkeypatch):
    import ray.cloudpickle

    tmp_path, _ = user_strategy_module("my_corrections_bv")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = resolve_strategy("my_corrections_bv:HalfwayOld")
    strategy_class(cls())
    payload = ray.cloudpickle.dumps(cls())  # in memory, as Ray ships actor arguments
    load = "import sys, ray.cloudpickle; s = ray.cloudpickle.loads(sys.stdin.buffer.read()); print(s.name, s.kind)"
    proc = subprocess.run([sys.executable, "-c", load], input=payload, capture_output=True, cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().split() == ["halfway", "baseline"]


def test_a_strategy_object_is_checked_like_a_config_name():
    from trajflow.pipelines.rl_loop import RLPipeline

    interrupt = resolve_strategy("interrupt")()
    with pytest.raises(ValueError, match="num_generators: the interrupt strategy needs exactly one generator"):
        RLPipeline(PipelineConfig(num_generators=2), strategy=interrupt)
    with pytest.raises(ValueError, match="is not a Strategy subclass"):
        RLPipeline(PipelineConfig(), strategy=object())
    pipe = RLPipeline(PipelineConfig(strategy="snapshot"), strategy=resolve_strategy("m2po")(m2_threshold=0.1))
    assert [s.name for s in pipe.stages] == ["generate", "reward", "advantage", "filter", "train"]
    assert not pipe.strategy.keep_history and pipe.stage("train").kwargs["spec"].strategy.m2_threshold == 0.1
