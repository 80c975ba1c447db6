"""What `trajflow run` checks before Ray starts or anything is written: GPUs asked of a machine
without one, the run's actors against the cluster's resources, the disk space every saved version
takes, and that a resumed dataset run sees the data its checkpoint was made with. Each failure is
one line (RunError, exit status 2)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.config import JobConfig
from trajflow.jobs.errors import RunError


def local_gpus() -> int:
    """GPUs an embedded Ray would find here: CUDA_VISIBLE_DEVICES if set, else the NVIDIA
    driver's devices (no torch import: it would delay the start)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


GPU_KEYS = ("generator", "scorer", "trainer")  # the sections with a num_gpus


def check_gpus_here(config: JobConfig) -> None:
    """A GPU asked of an embedded Ray on a machine without one: one line before Ray starts (Ray
    would wait for it forever)."""
    if config.ray_address or os.environ.get("RAY_ADDRESS"):
        return  # the cluster's GPUs are checked once connected (check_cluster)
    asked = [f"{key}.num_gpus" for key in GPU_KEYS if getattr(config, key).num_gpus > 0]
    if asked and local_gpus() == 0:
        raise RunError(f"{asked[0]}: {getattr(config, asked[0].split('.')[0]).num_gpus:g} GPU asked, but this "
                       "machine has no GPU (set it to 0, or give ray_address of a cluster with GPUs)")


def check_cluster(pipeline) -> None:
    """The pipeline's actors (RLPipeline.resource_demand) fit the Ray they will run on: each actor on
    one node, all of them at once in the cluster's total. Ray would otherwise wait for resources
    that never come, without a word. RunError (one line, exit 2) before anything is written."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value
    need: dict[str, float] = {}
    parts: dict[str, list[str]] = {}
    for which, count, bundle in pipeline.resource_demand():
        asked = {k: v for k, v in bundle.items() if v > 0}
        if not any(all(node.get(k, 0.0) >= v - 1e-9 for k, v in asked.items()) for node in nodes):
            key, value = next((k, v) for k, v in asked.items() if not any(n.get(k, 0.0) >= v - 1e-9 for n in nodes))
            have = max((n.get(key, 0.0) for n in nodes), default=0.0)
            raise RunError(f"resources: {which} asks {value:g} {key} per actor, but no node of the Ray cluster has "
                           f"that much (the largest has {have:g}); lower its {_resource_key(which, key)}")
        for key, value in asked.items():
            need[key] = need.get(key, 0.0) + count * value
            parts.setdefault(key, []).append(f"{which} {f'{count} x ' if count > 1 else ''}{value:g}")
    for key, value in need.items():
        if value > total.get(key, 0.0) + 1e-9:
            raise RunError(f"resources: the run's actors ask {value:g} {key} at once ({', '.join(parts[key])}), but "
                           f"the Ray cluster has {total.get(key, 0.0):g}; lower trainer.num_workers, num_generators "
                           f"or the stages' {_resource_key('', key)}")


def _resource_key(which: str, resource: str) -> str:
    name = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(resource, f"resources.{resource}")
    return f"trainer.{name}" if which == "trainer.num_workers" else name


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def check_version_space(config: JobConfig, model_path: Path, root: Path) -> str:
    """The disk space save_all_versions will take; RunError if the run dir's disk lacks it. A
    LoRA run keeps each version's adapter and the base weights once."""
    full = ckpt.weights_nbytes(model_path)
    versions = config.steps + 1
    if config.lora.r > 0:
        from trajflow.engines.lora import adapter_nbytes

        nbytes = adapter_nbytes(model_path, config.settings.lora)
        total = full + nbytes * versions
        estimate = (f"save_all_versions: the base once ({_human(full)}) + {versions} adapters x {_human(nbytes)} = "
                    f"{_human(total)} of weights")
    else:
        total = full * versions
        estimate = f"save_all_versions: {versions} versions x {_human(full)} = {_human(total)} of weights"
    free = shutil.disk_usage(root).free
    if total > free:
        raise RunError(f"{estimate}, but only {_human(free)} is free under {root} "
                       "(set save_all_versions: false, or fewer steps)")
    return estimate + " under versions/"


def check_same_data(config: JobConfig, checkpoint: ckpt.Checkpoint | None) -> None:
    """A resumed dataset run must see the dataset (and settings) its checkpoint was made with."""
    import json

    if checkpoint is None or config.data is None:
        return
    recorded = json.loads((checkpoint.path / "meta.json").read_text()).get("data", {}).get("fingerprint")
    now = config.workload().fingerprint(config.model_path, config.seed, config.prompts_per_step)
    if recorded != now:
        raise RunError(f"resume: data.train_files (or the tokenizer, seed, prompts_per_step or data settings) changed "
                       f"since checkpoint {checkpoint.path.name} (fingerprint {recorded} -> {now}); resume needs "
                       "the data the run started with")
