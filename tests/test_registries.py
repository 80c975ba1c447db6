"""One way to extend every part (trajflow/registry.py): a generation engine, a tracker and an
advantage estimator are each one new file, used by import path or registered by name, selected
from a YAML job config, checked with one-line errors, used by the code that runs them
(`make_engine`, `Trackers`, the Advantage operator) and listed in the generated reference; a
strategy's settings are typed like every key, and the old `strategy_options` form still works."""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.algorithms.config import AdvantageConfig
from trajflow.algorithms.estimators import ESTIMATORS
from trajflow.deprecations import TrajflowDeprecation
from trajflow.engines.factory import ENGINES, make_engine
from trajflow.jobs.config import JobConfigError, build_job_config, load_job_config
from trajflow.jobs.config_reference import render, undocumented
from trajflow.jobs.trackers import TRACKERS, Trackers
from trajflow.operators.strategies import Strategy
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.registry import Registry

TOY_ENGINE = '''
"""A torch engine whose responses stop at its own token budget, whatever the sampling asks."""
import dataclasses
from dataclasses import dataclass

from trajflow.engines.factory import GenerationEngine
from trajflow.settings import check_settings, setting


@dataclass(frozen=True)
class ShortSettings:
    max_new_tokens: int = setting(2, "the engine's own cap on a response's tokens", ge=1)

    def __post_init__(self) -> None:
        check_settings(self)


class ShortTorch(GenerationEngine):
    """The torch engine, responses capped at `max_new_tokens`."""

    name = "short_torch"
    Settings = ShortSettings

    @classmethod
    def build(cls, model, settings, **contract):
        from trajflow.engines.torch_engine import TorchEngine

        cap = min(settings.max_new_tokens, contract["sampling"].max_new_tokens)
        return TorchEngine(model, **{**contract, "sampling": dataclasses.replace(contract["sampling"],
                                                                              max_new_tokens=cap)})
'''

TOY_TRACKER = '''
"""Every metrics row as a line of RUN/rows.jsonl; the summary and the end state in RUN/end.json."""
import json

from trajflow.jobs.trackers import Tracker


class JsonLines(Tracker):
    """Metrics rows as JSON lines in the run dir."""

    name = "jsonl"
    files = False

    def __init__(self, root):
        self.root = root

    @classmethod
    def open(cls, run):
        return cls(run.root)

    def log(self, row):
        with (self.root / "rows.jsonl").open("a") as f:
            f.write(json.dumps(dict(row)) + "\\n")

    def finish(self, summary, files, state):
        (self.root / "end.json").write_text(json.dumps({"state": state, **summary}))
'''

TOY_ESTIMATOR = '''
"""A group-median baseline: A = r - the median reward of the row's group."""
import numpy as np

from trajflow.algorithms.estimators import AdvantageEstimator


class MedianBaseline(AdvantageEstimator):
    """r - the group's median reward (robust to one outlier sample)."""

    name = "median"
    min_group_size = 2

    def advantages(self, config, rewards, group_ids, *, token_counts=None):
        rewards, groups = np.asarray(rewards, np.float64), np.asarray(group_ids)
        medians = {g: np.median(rewards[groups == g]) for g in np.unique(groups)}
        return (rewards - np.array([medians[g] for g in groups])).astype(np.float32)
'''

TOY_STRATEGY = '''
"""A strategy of one's own with settings: old := mu + weight (pi_theta - mu), in log space."""
from dataclasses import dataclass

from trajflow.operators.strategies import Strategy
from trajflow.settings import check_settings, setting


@dataclass(frozen=True)
class TowardSettings:
    weight: float = setting(0.5, "how far pi_old sits from mu toward pi_theta", ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        check_settings(self)


class Toward(Strategy):
    name = "toward"
    kind = "baseline"
    meaning = "old := log mu + weight (log pi_theta - log mu)"
    Settings = TowardSettings

    def __init__(self, weight: float = TowardSettings.weight) -> None:
        self.weight = TowardSettings(weight=weight).weight

    def old_logprobs(self, batch, current, trainer):
        return batch.inference + self.weight * (current.detach() - batch.inference)
'''


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def registered():
    """register(registry, cls, name): registered for this test only."""
    added: list[tuple[Registry, str]] = []

    def register(registry: Registry, cls: type, name: str) -> type:
        registry.register(name)(cls)
        added.append((registry, name))
        return cls

    yield register
    for registry, name in added:
        registry.unregister(name)


@pytest.fixture
def toys(tmp_path, registered):
    """The three toy files, each loaded by import path and registered under its name:
    {kind: (import path, class)}."""
    found = {}
    for kind, registry, text, cls_name in [("engine", ENGINES, TOY_ENGINE, "ShortTorch"),
                                           ("tracker", TRACKERS, TOY_TRACKER, "JsonLines"),
                                           ("estimator", ESTIMATORS, TOY_ESTIMATOR, "MedianBaseline")]:
        spec = f"{_write(tmp_path, f'toy_{kind}', text)}:{cls_name}"
        cls = registry.resolve(spec)  # by import path, without registering
        found[kind] = (spec, registered(registry, cls, cls.name))
    return found


# -- the registry itself ----------------------------------------------------------------------------
def test_names_are_the_builtins_then_the_registered_and_typos_are_one_line(toys):
    assert ENGINES.names() == ["torch", "vllm", "short_torch"]
    assert TRACKERS.names() == ["tensorboard", "wandb", "mlflow", "jsonl"]
    assert ESTIMATORS.names()[-1] == "median" and list(ESTIMATORS.builtins())[-1] == "gae"
    for registry, typo in [(ENGINES, "short_torhc"), (TRACKERS, "jsonll"), (ESTIMATORS, "medain")]:
        with pytest.raises(ValueError) as caught:
            registry.resolve(typo)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"unknown {registry.kind} {typo!r}; registered: ")
        assert registry.names()[-1] in message and "module:Class / path/to/file.py:Class" in message


def test_register_refuses_a_taken_name_a_wrong_class_and_a_name_that_disagrees(toys, registered):
    engine = toys["engine"][1]
    with pytest.raises(ValueError, match="engine 'torch' is registered already"):
        registered(ENGINES, type("Other", (engine,), {"name": "torch"}), "torch")
    with pytest.raises(ValueError, match="is not a GenerationEngine subclass"):
        ENGINES.register("plain")(type("Plain", (), {}))
    with pytest.raises(ValueError, match="registered as engine 'other' but its name is 'short_torch'"):
        ENGINES.register("other")(engine)
    with pytest.raises(ValueError, match="json:JSONDecoder is not a Tracker subclass"):
        TRACKERS.resolve("json:JSONDecoder")
    assert ENGINES.register("short_torch")(engine) is engine  # the same class again: a no-op


# -- selected from a YAML job config -----------------------------------------------------------------
def test_a_job_config_selects_each_toy_by_name_or_import_path(toys, tmp_path):
    engine_path, engine = toys["engine"]
    tracker_path, tracker = toys["tracker"]
    estimator_path, estimator = toys["estimator"]
    config = tmp_path / "toys.yaml"
    config.write_text("engine: {name: short_torch, max_new_tokens: 3}\nadvantage: {estimator: median}\n"
                      "report_to: [jsonl, tensorboard]\nsteps: 2\n")
    job = load_job_config(config)
    # a registered name is stored as its import path: Ray workers and a resumed run need no registration
    assert job.engine == engine_path and ENGINES.resolve(job.engine) is engine
    assert job.settings.engine == engine.Settings(max_new_tokens=3)
    assert job.advantage.estimator == estimator_path and ESTIMATORS.resolve(job.advantage.estimator) is estimator
    assert job.report_to == [tracker_path, "tensorboard"] and TRACKERS.resolve(job.report_to[0]) is tracker
    again = build_job_config(__import__("yaml").safe_load(job.to_yaml()))  # the saved config reads back
    assert again == job and again.settings.engine == job.settings.engine
    by_path = build_job_config({"engine": {"name": engine_path}, "advantage": estimator_path,
                                "report_to": [tracker_path]})
    assert by_path.settings.engine == engine.Settings()  # its settings' defaults
    assert by_path.advantage.estimator == estimator_path


@pytest.mark.parametrize("data, expected", [
    ({"engine": "short_torhc"}, "config error: engine: unknown engine 'short_torhc'; registered: torch, vllm, "
                                "short_torch, or an import path"),
    ({"engine": {"name": "short_torch", "max_new_token": 3}},
     "config error: engine.max_new_token: unknown key (engine short_torch takes max_new_tokens)"),
    ({"engine": {"name": "short_torch", "max_new_tokens": 0}}, "config error: engine.max_new_tokens: must be >= 1"),
    ({"engine": {"name": "torch", "max_new_tokens": 3}},
     "config error: engine.max_new_tokens: unknown key (engine torch takes no settings)"),
    ({"engine": {"max_new_tokens": 3}}, "config error: engine: a mapping names its engine: {name: NAME"),
    ({"engine": {"name": "vllm", "enforce_eager": False}, "vllm": {"enforce_eager": False}},
     "config error: engine: vllm's settings go in one place"),
    ({"report_to": ["jsonll"]}, "config error: report_to: unknown tracker 'jsonll'; registered: tensorboard, "),
    ({"advantage": {"estimator": "medain"}},
     "config error: advantage: AdvantageConfig.estimator: unknown advantage estimator 'medain'; registered: grpo"),
    ({"advantage": {"estimator": "median", "std": "population"}},
     "config error: advantage: AdvantageConfig.std: read by estimator grpo only, not median"),
    ({"advantage": "median", "group_size": 1}, "config error: group_size: 1 sample per prompt gives every "
                                               "trajectory advantage 0 under advantage"),
])
def test_a_typo_in_a_toy_is_one_line_naming_the_key(toys, data, expected):
    with pytest.raises(JobConfigError) as caught:
        build_job_config(data)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(expected), str(caught.value)


# -- used by the code that runs each part --------------------------------------------------------------
def test_the_toy_engine_builds_through_make_engine(toys, tiny, one_torch_thread):
    from trajflow.engines.sampling import SamplingConfig
    from trajflow.engines.tokenizer import EOS_ID, PAD_ID, encode_prompt
    from trajflow.engines.torch_engine import TorchEngine

    prompts = [encode_prompt(tiny[1], text) for text in ("12+34=", "7+8=")]
    contract = dict(eos_id=EOS_ID, pad_id=PAD_ID, sampling=SamplingConfig(max_new_tokens=6), seed=0)
    for spec, settings in [("short_torch", None), (toys["engine"][0], toys["engine"][1].Settings(max_new_tokens=1))]:
        engine = make_engine(spec, tiny[0], settings=settings, **contract)
        cap = 2 if settings is None else 1  # the settings' default, or the ones given
        assert isinstance(engine, TorchEngine)
        generations = engine.generate(prompts, n=2)
        assert len(generations) == 4 and all(len(g.response_tokens) <= cap for g in generations)
    overridden = make_engine("short_torch", tiny[0], max_new_tokens=1, **contract)  # a setting as a keyword
    assert all(len(g.response_tokens) == 1 for g in overridden.generate(prompts))
    with pytest.raises(TypeError, match="engine 'torch' takes no settings"):
        make_engine("torch", tiny[0], settings=toys["engine"][1].Settings(), **contract)


def test_the_toy_tracker_receives_the_logged_rows(toys, tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    trackers = Trackers(root, [toys["tracker"][0]], {"steps": 2}, first_step=0)
    rows = [{"step": 0, "loss": 1.5, "strategy": "snapshot"}, {"step": 1, "loss": 0.5, "strategy": "snapshot"}]
    for row in rows:
        trackers.log(row)
    assert list(trackers.trackers) == ["jsonl"] and trackers.describe() is None
    trackers.finish({"reward": 0.25}, "finished")
    assert [json.loads(line) for line in (root / "rows.jsonl").read_text().splitlines()] == rows
    assert json.loads((root / "end.json").read_text()) == {"state": "finished", "reward": 0.25}


def test_the_toy_estimator_is_what_the_advantage_operator_computes(toys):
    from trajflow.algorithms.advantages import compute_advantages
    from trajflow.operators.advantage import Advantage

    table = pa.table({
        "reward": pa.array([1.0, 0.0, 0.0, None, 1.0, 0.5, 0.25], pa.float32()),
        "group_id": ["a", "a", "a", "a", "b", "b", "b"],
        "response_tokens": pa.array([[1], [2, 3], [4], [5], [6], [7], [8]], pa.list_(pa.int32())),
        "loss_mask": pa.array([[True], [True, True], [True], [True], [True], [True], [True]], pa.list_(pa.bool_())),
    })
    config = AdvantageConfig(estimator="median")
    out = Advantage(config)(table)["advantage"].to_pylist()
    # group a: rewards 1, 0, 0 (the failed row is left out): median 0; group b: 1, 0.5, 0.25: median 0.5
    assert out == pytest.approx([1.0, 0.0, 0.0, None, 0.5, 0.0, -0.25])
    direct = compute_advantages(config, np.array([1.0, 0.0, 0.0, 0.5]), np.array([0, 0, 0, 1]))
    assert direct.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_pipeline_step_runs_on_the_toy_engine_and_estimator(toys, one_torch_thread):
    """The operators of one pipeline, in this process, with the registered toys by name."""
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(steps=1, prompts_per_step=4, group_size=4, engine="short_torch",
                                     advantage="median", drop_zero_variance_groups=False))
    metrics = run_in_process(pipe)
    assert metrics["step"].to_list() == [0] and np.isfinite(metrics["loss"].to_list()).all()
    assert pipe.config.engine == toys["engine"][0] and pipe.config.advantage.estimator == toys["estimator"][0]


# -- listed in the generated reference --------------------------------------------------------------
def test_each_toy_appears_in_the_generated_reference(toys):
    text = render()
    for fragment in ("| `short_torch` | The torch engine, responses capped at `max_new_tokens`. | `max_new_tokens` |",
                     "### engine `short_torch`", "| `max_new_tokens` | integer, >= 1 | `2` | the engine's own cap",
                     "| `jsonl` | Metrics rows as JSON lines in the run dir. | none |",
                     "| `median` | r - the group's median reward (robust to one outlier sample). | none |",
                     "### strategy `ewma`", "| `window` | integer or null, >= 1 | `null` |",
                     "### advantage estimator `gae`", "| `vllm` | vLLM"):
        assert fragment in text, fragment
    assert undocumented() == []


# -- strategies: typed settings, and the old form ------------------------------------------------------
@pytest.mark.parametrize("strategy, expected", [
    ({"name": "ewma", "windw": 2}, "config error: strategy.windw: unknown key (strategy ewma takes window, "
                                   "reset_threshold)"),
    ({"name": "ewma", "window": True}, "config error: strategy.window: expected an integer or null, got the "
                                       "boolean true"),
    ({"name": "loglinear", "alpha": 2}, "config error: strategy.alpha: must be <= 1, got 2"),
    ({"name": "snapshot", "window": 2}, "config error: strategy.window: unknown key (strategy snapshot takes no "
                                        "settings)"),
])
def test_a_strategy_setting_typo_is_one_line_naming_the_key(strategy, expected):
    with pytest.raises(JobConfigError) as caught:
        build_job_config({"strategy": strategy})
    assert str(caught.value) == expected or str(caught.value).startswith(expected), str(caught.value)
    assert "\n" not in str(caught.value)


def test_strategy_settings_typed_with_derived_defaults_and_the_old_form_with_one_notice():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = build_job_config({"strategy": {"name": "ewma", "reset_threshold": 0.5}, "max_staleness": 3})
        assert not [w for w in caught if issubclass(w.category, TrajflowDeprecation)]
        old = build_job_config({"strategy": "m2po", "strategy_options": {"m2_threshold": 0.1}})
    notices = [str(w.message) for w in caught if issubclass(w.category, TrajflowDeprecation)]
    assert notices == ["strategy_options: use strategy: {name: NAME, <its settings>}; the old key goes in the next "
                       "release"]
    ewma = new.build_strategy()
    assert (ewma.window, ewma.reset_threshold) == (3, 0.5)  # window null: max(1, max_staleness)
    assert old.build_strategy().m2_threshold == 0.1
    dumped = __import__("yaml").safe_load(old.to_yaml())
    assert dumped["strategy"] == {"name": "m2po", "m2_threshold": 0.1} and "strategy_options" not in dumped
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrajflowDeprecation)  # the saved config is in the new form
        assert build_job_config(dumped).build_strategy().m2_threshold == 0.1


def test_a_strategy_with_the_old_hook_names_still_works_with_one_notice():
    """`proximal` / `proximal_top_k` were pi_old's hooks before this release (one name for pi_old:
    `old_logprobs` from the record to the loss): a user strategy defining them still runs them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Halfway(Strategy):
            name, kind, meaning = "halfway", "baseline", "old := (log mu + log pi_theta) / 2"

            def proximal(self, batch, current, trainer):
                return 0.5 * (batch.inference + current)

            def proximal_top_k(self, batch):
                return batch.top_k_inference

    notices = [str(w.message) for w in caught if issubclass(w.category, TrajflowDeprecation)]
    assert [n.split(":")[0] for n in notices] == [
        f"{Halfway.__qualname__}.proximal()", f"{Halfway.__qualname__}.proximal_top_k()"]
    assert all(n.endswith("the old name goes in the next release") for n in notices)
    batch = type("B", (), {"inference": torch.tensor([[-1.0, -3.0]]), "top_k_inference": torch.zeros(1, 2, 4)})()
    assert torch.equal(Halfway().old_logprobs(batch, torch.tensor([[-2.0, -1.0]]), None), torch.tensor([[-1.5, -2.0]]))
    assert Halfway().old_top_k(batch) is batch.top_k_inference


def test_a_user_strategy_by_import_path_declares_settings_the_same_way(tmp_path):
    spec = f"{_write(tmp_path, 'toward', TOY_STRATEGY)}:Toward"
    strategy = build_job_config({"strategy": {"name": spec, "weight": 0.25}}).build_strategy()
    assert strategy.name == "toward" and strategy.weight == 0.25
    with pytest.raises(JobConfigError, match=r"^config error: strategy.wieght: unknown key \(strategy toward takes "
                                             r"weight\)$"):
        build_job_config({"strategy": {"name": spec, "wieght": 0.25}})
    assert STRATEGIES.settings_class(spec).__name__ == "TowardSettings"
