"""`trajflow eval`: a model's greedy mean reward on held-out prompts, without Ray.

    trajflow eval --config byo.yaml --model RUN/checkpoints/step-000060    a run's checkpoint
    trajflow eval --config byo.yaml --model RUN                            its latest checkpoint
    trajflow eval --config byo.yaml --model RUN/versions/v000012.safetensors  a kept version
    trajflow eval --config byo.yaml --model path/to/hf_model               any local HF directory
    trajflow eval --task addition                                          a built-in task

With `--config`, the prompts are the config's held-out ones (`data.test_files`, every row unless
`--n`; for a task, its test split, `eval_prompts` of them) and the responses are scored by the
config's reward, under its per-item timeout (tasks/rollout.py `heldout_rewards`, the code of the
run's `eval_every`). The model defaults to the config's. A checkpoint that is not a complete
Hugging Face directory (every checkpoint but a run's last), or a version's weights (kept with
`save_all_versions`), is loaded onto the architecture of the model its run started from (the
run's config.yaml, else the config's).

One line: the mean reward over the prompts (a failed reward counts as 0, and the failures are
counted), and an accuracy only when every reward is 0 or 1; a continuous reward is a mean reward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trajflow.engines import checkpoint as ckpt
from trajflow.pipelines.config import PipelineConfig, check_model_dir
from trajflow.tasks.workload import Workload


class EvalModelError(ValueError):
    """`--model` names neither a model directory nor a run's checkpoint; the message is one line."""


@dataclass(frozen=True)
class EvalModel:
    """What `--model` names: a Hugging Face directory (`weights` None), or a checkpoint's or a
    version file's weights on the architecture and tokenizer of `base`."""

    base: Path
    weights: ckpt.Checkpoint | Path | None = None
    label: str = ""


def resolve_model(model: str | os.PathLike | None, config: PipelineConfig) -> EvalModel:
    """The model `--model` names (default: the config's), checked before torch loads."""
    if model is None:
        try:
            check_model_dir(config.model_path)
        except ValueError as e:
            raise EvalModelError(f"model (of the config): {e}") from None
        return EvalModel(config.model_path, label=str(config.model_path))
    path = Path(model)
    if path.is_file() and path.suffix == ".safetensors" and path.parent.name == "versions":
        return EvalModel(_run_model(path.parent.parent, config, path), path, label=str(path))
    if not path.is_dir():
        raise EvalModelError(f"--model {path}: no such directory (nor a run's versions/vNNNNNN.safetensors)")
    if (path / "config.json").is_file():  # a Hugging Face directory (a run's last checkpoint is one too)
        try:
            check_model_dir(path)
        except ValueError as e:
            raise EvalModelError(f"--model: {e}") from None
        return EvalModel(path, label=str(path))
    run_root = path if (path / "checkpoints").is_dir() else path.parent.parent
    checkpoint = ckpt.latest_checkpoint(path / "checkpoints") if path == run_root else next(
        (c for c in ckpt.list_checkpoints(path.parent) if c.path.resolve() == path.resolve()), None)
    if checkpoint is None:
        raise EvalModelError(f"--model {path}: neither a model directory (no config.json) nor a run's "
                             "checkpoint (checkpoints/step-N with meta.json) or run dir with one")
    return EvalModel(_run_model(run_root, config, path), checkpoint, label=str(checkpoint.path))


def _run_model(run_root: Path, config: PipelineConfig, given: Path) -> Path:
    """The model a run started from: its config.yaml's, else `config`'s."""
    base = config.model_path
    if (run_root / "config.yaml").is_file():
        from trajflow.jobs.config import load_job_config

        base = load_job_config(run_root / "config.yaml").model_path
    try:
        check_model_dir(base)
    except ValueError as e:
        raise EvalModelError(f"--model {given}: the model its run started from: {e}") from None
    return base


def load(model: EvalModel):
    """(model, tokenizer) in float32, eval mode."""
    from trajflow.engines.lora import is_adapter, merged
    from trajflow.engines.models import load_model, load_tokenizer

    net = load_model(model.base)
    if model.weights is not None:
        weights = model.weights
        state = ckpt.load_weights(weights) if isinstance(weights, Path) else weights.model_state()
        net.load_state_dict(merged(net.state_dict(), state) if is_adapter(state) else state)
    return net, load_tokenizer(model.base)


@dataclass(frozen=True)
class EvalResult:
    rewards: list[float | None]  # per prompt; None: the reward failed on it

    @property
    def prompts(self) -> int:
        return len(self.rewards)

    @property
    def errors(self) -> int:
        return sum(r is None for r in self.rewards)

    @property
    def mean(self) -> float:
        return sum(r or 0.0 for r in self.rewards) / max(1, self.prompts)

    @property
    def binary(self) -> bool:
        """Every reward is 0 or 1 (then the mean is an accuracy)."""
        return all(r in (0.0, 1.0) for r in self.rewards if r is not None)

    def line(self, what: str, model: str) -> str:
        text = f"mean reward {self.mean:.4f} on {self.prompts} held-out prompts of {what}"
        if self.binary:
            text += f" (accuracy {sum(r == 1.0 for r in self.rewards)}/{self.prompts} = {self.mean:.1%})"
        if self.errors:
            text += f"; the reward failed on {self.errors} (counted as 0)"
        return f"{text} | model {model}"


def evaluate(workload: Workload, model: EvalModel, n: int | None, max_new_tokens: int,
             stop: tuple[str, ...] = ()) -> EvalResult:
    """Greedy responses of `model` on the first n held-out prompts (None: every row of
    data.test_files), scored by the workload's reward."""
    import torch

    from trajflow.tasks.rollout import heldout_rewards

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    net, tokenizer = load(model)
    return EvalResult(heldout_rewards(net, tokenizer, workload, n, max_new_tokens, stop=stop))
