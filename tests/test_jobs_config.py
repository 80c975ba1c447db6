"""Job configs and checkpoints, without Ray: validation messages, --set parsing, the bundled
configs, and the pickle-free checkpoint format (atomic writes, retention, optimizer round trip)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import (
    JobConfig,
    JobConfigError,
    build_job_config,
    bundled_configs,
    load_job_config,
    parse_config_text,
)
from trajflow.pipelines.config import PipelineConfig

WARM = Path(__file__).resolve().parent.parent / "artifacts" / "warm_start" / "addition"


@pytest.mark.parametrize(
    "data, overrides, expected",
    [
        ({}, ["optimizer.lr=-1"], "config error: optimizer.lr: must be > 0, got -1"),
        ({"optimizer": {"lr": 0}}, [], "config error: optimizer.lr: must be > 0, got 0"),
        ({"optimiser": {"lr": 1e-3}}, [], "config error: optimiser: unknown key"),
        ({"sampling": {"temprature": 1.0}}, [], "config error: sampling.temprature: unknown key"),
        ({"strategy": "exactish"}, [], "config error: strategy: unknown strategy 'exactish'; registered: snapshot, "),
        ({"strategy": "no_such_module:Thing"}, [], "config error: strategy: cannot import no_such_module "),
        ({"strategy": "interrupt", "num_generators": 2}, [], "config error: num_generators: the interrupt strategy"),
        ({"advantage": {"std": "unbiased"}}, [], "config error: advantage.std: expected one of 'sample', 'population'"),
        ({"strategy": {"name": "m2po", "m2_treshold": 0.1}}, [],
         "config error: strategy.m2_treshold: unknown key (strategy m2po takes m2_threshold)"),
        ({"strategy": {"name": "m2po", "m2_threshold": -1}}, [],
         "config error: strategy.m2_threshold: must be >= 0, got -1"),
        ({"engine": "tensorrt"}, [], "config error: engine: unknown engine 'tensorrt'; registered: torch, vllm, "),
        ({"advantage": "grpoo"}, [], "config error: advantage: AdvantageConfig.estimator: unknown advantage "
                                     "estimator 'grpoo'; registered: grpo, "),
        ({"report_to": ["tensorbord"]}, [], "config error: report_to: unknown tracker 'tensorbord'; registered: "
                                            "tensorboard, wandb, mlflow, "),
        ({"steps": "many"}, [], "config error: steps: Input should be a valid integer"),
        ({"model": "/no/such/model"}, [], "config error: model: /no/such/model is not a local model directory"),
        ({"prompts_per_step": 3, "group_size": 2, "optimizer": {"minibatches_per_step": 4}}, [],
         "config error: optimizer.minibatches_per_step: 4 does not divide the 6 rows"),
        ({"keep_checkpoints": 0}, [], "config error: keep_checkpoints: Input should be greater than or equal to 1"),
        ({}, ["steps"], "config error: --set 'steps': expected key=value"),
        ({"sampling": {"temperature": 1.0}}, ["sampling.temperature.x=1"],
         "config error: sampling.temperature: is not a mapping"),
    ],
)
def test_bad_configs_fail_with_one_line_naming_the_key(data, overrides, expected):
    with pytest.raises(JobConfigError) as info:
        build_job_config(data, overrides)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_set_values_are_yaml_never_eval(tmp_path):
    config = build_job_config(
        {},
        ["generator.resources={gen_node: 0.1}", "optimizer.lr=1.0e-3", "sampling.max_new_tokens=4",
         "ray_address=null", "runs_root=__import__('os')"],
    )
    assert config.generator.resources == {"gen_node": 0.1}
    assert config.optimizer.lr == 1e-3 and config.sampling.max_new_tokens == 4
    assert config.ray_address is None
    assert config.runs_root == Path("__import__('os')")  # a string, not evaluated


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("steps: 3\noptimizer: {lr: [1,\n")
    with pytest.raises(JobConfigError, match=r"config error: .*broken.yaml: invalid YAML: .* at line \d+, column \d+"):
        load_job_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(JobConfigError, match="top level must be a mapping"):
        load_job_config(path)


def test_duplicate_yaml_keys_are_errors_but_merge_overrides_are_not(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("steps: 3\nsampling:\n  temperature: 1.0\n  temperature: 0.5\n")
    with pytest.raises(JobConfigError, match=r"dup.yaml: invalid YAML: duplicate key 'temperature' \(first given "
                                             r"at line 3\) at line 4"):
        load_job_config(path)
    path.write_text("base: &b {temperature: 1.0, top_k: 0}\n")  # YAML merge: overriding a merged key is fine
    assert parse_config_text("b: &b {temperature: 1.0, top_k: 0}\nsampling: {<<: *b, temperature: 0.5}\n")[
        "sampling"] == {"temperature": 0.5, "top_k": 0}
    with pytest.raises(JobConfigError, match="is not valid YAML"):
        build_job_config({}, ["sampling={top_k: 1, top_k: 2}"])
    with pytest.raises(JobConfigError, match="could not determine a constructor"):  # still safe_load: no objects
        parse_config_text("steps: !!python/object/apply:os.system ['true']\n")


def test_empty_and_non_utf8_files_are_refused(tmp_path):
    for text in ("", "\n\n", "# only a comment\n"):
        (tmp_path / "e.yaml").write_text(text)
        with pytest.raises(JobConfigError, match="e.yaml: the file holds no keys"):
            load_job_config(tmp_path / "e.yaml")
    assert build_job_config(parse_config_text("{}\n")).steps == 100  # an explicit empty mapping means defaults
    (tmp_path / "l.yaml").write_bytes(b"steps: 3\nname: r\xe9sum\xe9\n")
    with pytest.raises(JobConfigError, match=r"not UTF-8 text \(byte 0xe9 at line 2, column 8\)"):
        load_job_config(tmp_path / "l.yaml")


@pytest.mark.parametrize("data, expected", [
    ({"steps": True}, "steps: expected an integer, got the boolean true"),
    ({"sampling": {"top_k": False}}, "sampling.top_k: expected an integer, got the boolean false"),
    ({"optimizer": {"lr": True}}, "optimizer.lr: expected a number, got the boolean true"),
    ({"save_all_versions": 1}, "save_all_versions: expected true or false, got 1"),
    ({"drop_zero_variance_groups": "yes"}, "drop_zero_variance_groups: expected true or false, got 'yes'"),
    ({"steps": 10**12}, "steps: Input should be less than or equal to 1000000"),
    ({"group_size": 1}, "group_size: 1 sample per prompt gives every trajectory advantage 0 under advantage 'grpo'"),
    ({"group_size": 1, "advantage": "leave_one_out"}, "group_size: 1 sample per prompt"),
    ({"task": "additon"}, "task: unknown task 'additon'; registered: addition, calc, reverse"),
])
def test_values_that_would_run_the_wrong_job_are_refused(data, expected):
    with pytest.raises(JobConfigError) as info:
        build_job_config(data)
    assert str(info.value) == f"config error: {expected}" or str(info.value).startswith(f"config error: {expected}")


def test_model_dirs_need_a_config_and_a_tokenizer(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("not json")
    with pytest.raises(JobConfigError, match="config.json is not a JSON object"):
        build_job_config({"model": str(model)})
    (model / "config.json").write_text("{}")
    with pytest.raises(JobConfigError, match="m has no tokenizer"):
        build_job_config({"model": str(model)})
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(JobConfigError, match="config.json has no model_type"):
        build_job_config({"model": str(model)})
    (model / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(JobConfigError, match="model_type 'vit' is not a causal language model"):
        build_job_config({"model": str(model)})
    (model / "config.json").write_bytes((WARM / "config.json").read_bytes())
    with pytest.raises(JobConfigError, match="m has no weights"):
        build_job_config({"model": str(model)})
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "part-1.safetensors"}}))
    with pytest.raises(JobConfigError, match="lacks the weight file part-1.safetensors"):
        build_job_config({"model": str(model)})
    (model / "model.safetensors.index.json").unlink()
    (model / "model.safetensors").write_bytes((WARM / "model.safetensors").read_bytes())
    with pytest.raises(JobConfigError, match="the tokenizer does not load"):  # "{}" is JSON, not a tokenizer
        build_job_config({"model": str(model)})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((WARM / name).read_bytes())
    assert build_job_config({"model": str(model)}).model == model


def test_bundled_configs_validate_and_cover_every_strategy():
    from trajflow.operators.strategies import strategy_names

    strategies = strategy_names()
    assert {"quickstart", *strategies} <= set(bundled_configs())
    for name in strategies:  # one config per strategy, each valid on this machine
        assert load_job_config(name).strategy == name
    quick = load_job_config("quickstart")
    # a ~1 minute run on 2 cores (benchmarks/results/end_to_end.md): 30 steps x 1,024 rows at most
    assert quick.steps <= 30 and quick.steps * quick.rows_per_step <= 30 * 1024
    # the resolved config round-trips through YAML
    again = build_job_config(__import__("yaml").safe_load(quick.to_yaml()))
    assert again == quick
    # the pipeline's part of a job config: the same settings, without the run options
    pipeline = quick.pipeline_config()
    assert type(pipeline) is PipelineConfig and isinstance(quick, JobConfig)
    assert pipeline.model_dump() == {k: v for k, v in quick.model_dump().items() if k in PipelineConfig.model_fields}
    assert set(JobConfig.model_fields) - set(PipelineConfig.model_fields) == {
        "name", "runs_root", "run_dir", "checkpoint_every", "keep_checkpoints", "save_all_versions",
        "trajectory_log", "report_to", "tracker_project", "wandb_mode", "mlflow_tracking_uri", "ray_address",
        "dashboard", "status_every"}


def test_advantage_accepts_the_estimator_name_and_defaults_to_the_sample_std():
    default = build_job_config({}).advantage
    assert (default.estimator, default.std, default.overlong_buffer) == ("grpo", "sample", None)
    old_form = build_job_config({"advantage": "leave_one_out"})
    assert old_form.advantage.estimator == "leave_one_out" and old_form.advantage.std == "sample"
    population = build_job_config({}, ["advantage.std=population"])
    assert population.advantage.std == "population"
    again = build_job_config(__import__("yaml").safe_load(population.to_yaml()))
    assert again.advantage == population.advantage


def test_cli_config_error_is_one_line_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 4\noptimizer:\n  lr: -1\n")
    run_dir = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "trajflow.jobs.cli", "run", str(bad), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "trajflow: config error: optimizer.lr: must be > 0, got -1"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists()


# -- checkpoints -----------------------------------------------------------------------------------
def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight = torch.nn.Parameter(model[1].weight)  # plain params
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    model, optimizer = _model_and_optimizer()
    saved = ckpt.save_checkpoint(tmp_path, 3, model.state_dict(), optimizer_state=optimizer.state_dict(),
                                 meta={"note": "x"})
    files = sorted(p.name for p in saved.path.iterdir())
    assert files == ["meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors"]
    structure = json.loads((saved.path / "optimizer.json").read_text())  # plain JSON, tensors by key
    assert "__dict__" in structure

    loaded = ckpt.latest_checkpoint(tmp_path)
    assert loaded.version == 3 and loaded.meta["note"] == "x"
    model2, optimizer2 = _model_and_optimizer()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    model2.load_state_dict(loaded.model_state())
    optimizer2.load_state_dict(loaded.optimizer_state())
    # the same next step from both
    x = torch.randn(5, 4)
    for m, o in ((model, optimizer), (model2, optimizer2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert optimizer2.param_groups[0]["betas"] == (0.9, 0.99)


def test_flatten_refuses_objects_that_need_pickle():
    with pytest.raises(TypeError, match="without pickle"):
        ckpt.flatten_state({"fn": object()})
    state = {"a": {1: torch.ones(2), "b": (1, 2.5, float("inf"), None, True)}}
    tensors, structure = ckpt.flatten_state(state)
    back = ckpt.unflatten_state(tensors, json.loads(json.dumps(structure)))
    assert torch.equal(back["a"][1], torch.ones(2))
    assert back["a"]["b"] == (1, 2.5, float("inf"), None, True)


def test_partial_checkpoints_are_ignored_and_retention_keeps_the_newest(tmp_path):
    weights = {"w": torch.arange(4.0)}
    for v in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, v, weights)
    # a writer killed mid-way: a temp dir, and a dir without meta.json
    (tmp_path / ".tmp-step-000008-dead").mkdir()
    (tmp_path / "step-000008").mkdir()
    (tmp_path / "step-000008" / "model.safetensors").write_bytes(b"partial")
    assert [c.version for c in ckpt.list_checkpoints(tmp_path)] == [2, 4, 6]
    assert ckpt.latest_checkpoint(tmp_path).version == 6
    assert ckpt.prune_checkpoints(tmp_path, keep=2) == [2]
    assert [c.version for c in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    ckpt.clean_partial(tmp_path)
    assert not (tmp_path / ".tmp-step-000008-dead").exists()
    # rewriting an existing version swaps it atomically
    ckpt.save_checkpoint(tmp_path, 6, {"w": torch.zeros(4)})
    assert torch.equal(ckpt.latest_checkpoint(tmp_path).model_state()["w"], torch.zeros(4))


def test_tied_weights_and_version_files(tmp_path):
    shared = torch.randn(3, 2)
    state = {"embed.weight": shared, "lm_head.weight": shared}  # tied: same storage
    path = ckpt.save_weights(state, ckpt.version_file(tmp_path, 7))
    assert path.name == "v000007.safetensors"
    back = ckpt.load_weights(path)
    assert torch.equal(back["embed.weight"], shared) and torch.equal(back["lm_head.weight"], shared)
    assert ckpt.weights_nbytes(path) == 2 * 6 * 4
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ckpt.CheckpointError, match="not a readable safetensors"):
        ckpt.load_weights(tmp_path / "bad.safetensors")


def test_relative_model_paths_fall_back_to_the_repository_root(tmp_path, monkeypatch):
    from trajflow.engines.models import REPO_ROOT

    monkeypatch.chdir(tmp_path)  # not the repository root: the bundled calc config still loads
    calc = load_job_config("calc")
    assert calc.model == REPO_ROOT / "artifacts" / "warm_start" / "calc"
    (tmp_path / "artifacts" / "warm_start" / "calc").mkdir(parents=True)  # a local dir wins, if it is a model
    with pytest.raises(JobConfigError, match="model: artifacts/warm_start/calc is not a local model directory"):
        load_job_config("calc")
