"""Checkpoints without pickle: weights, optimizer and strategy state as safetensors + JSON structure.

A checkpoint of version v (the weights after v optimizer updates) is a directory, for a
replicated trainer (`trainer.sharding: none`)

    step-000012/
        model.safetensors        the weights (float32, every state-dict key, tied ones duplicated);
                                 a LoRA run (engines/lora.py): adapter.safetensors, the adapter
                                 (the base is the model directory's), and no model.safetensors
                                 except in the last, exported one (the adapter merged in)
        optimizer.safetensors    every tensor of optimizer.state_dict() ...
        optimizer.json           ... and its structure (scalars, param groups) with tensor keys
        strategy.safetensors/.json   the strategy's state (e.g. EWMA), when it has one
        meta.json                version, step, time; written last

and for a sharded one (`trainer.sharding: fsdp`), where every worker writes its own shards with
torch.distributed.checkpoint (DCP) in its Hugging Face format (`save_sharded`, `load_sharded`)

    step-000012/
        shards/model/shard-0000r-model-00001-of-00001.safetensors   worker r-1's shard of each tensor
        shards/optimizer/..., shards/strategy/...                    (the offsets in each header)
        model.json, optimizer.json, strategy.json                    the structures (JSON)
        meta.json                version, ..., "sharding": {"method": "fsdp", "workers": N}

DCP's default writer pickles its metadata (`.metadata`); the Hugging Face writer
(`save_distributed=True`) keeps each shard's offsets in its safetensors header instead, so nothing
here is pickled. `Checkpoint.model_state()` assembles the full weights of either kind in one
process. The run's last checkpoint is also a plain Hugging Face model directory (`export_model`:
full float32 `model.safetensors`, the model's config and tokenizer files), loadable with
`from_pretrained`.

It is written atomically (`writing_checkpoint`): into a hidden temp dir beside it, fsynced, then
renamed. A process killed mid-write leaves a `.tmp-*` dir that `list_checkpoints` ignores (and
`clean_partial` removes), so the previous checkpoint stays the latest complete one. Nothing is
ever unpickled: JSON for structure, safetensors for tensors (`torch.load` is never used).

`save_weights` / `load_weights` write single version files (`versions/v000012.safetensors`) for
runs that keep every version for exact offline replay. A LoRA run's version is its adapter
(engines/lora.py), kept in PEFT's format with the base weights once beside it:

    versions/
        base/                    the base weights (float32) as a Hugging Face model directory
        v000012/                 adapter_model.safetensors + adapter_config.json (PEFT's format,
                                 base_model_name_or_path: ../base), loadable with
                                 `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), v000012)`

`load_version` reads either kind back as the version's payload (full weights, or the adapter).

One module on purpose: the on-disk formats (replicated, sharded, exported, version files) and
their atomic writing and checked reading are one contract; a writer and a reader kept apart
could drift.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trajflow.schemas.io import atomic_write

if TYPE_CHECKING:  # torch and safetensors load lazily: the CLI checks its inputs without them
    import torch

StateDict = dict[str, "torch.Tensor"]
CHECKPOINT_PREFIX = "step-"
VERSION_PREFIX = "v"
SHARDS = "shards"  # a sharded checkpoint's DCP directories: shards/model, shards/optimizer, ...
# files of a model directory that hold weights (everything else, config and tokenizer, is exported)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")


class CheckpointError(ValueError):
    """A checkpoint or version file is missing, incomplete or not what it claims to be."""


# -- small durable-file helpers ------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` via a temp file in the same dir, fsync, rename."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


# -- tensors <-> (safetensors, JSON) -------------------------------------------------------------
def _own(t: "torch.Tensor") -> "torch.Tensor":
    # safetensors refuses shared storage (tied embeddings) and non-contiguous views: copy
    return t.detach().to("cpu").contiguous().clone()


def local_part(t: "torch.Tensor") -> "torch.Tensor":
    """This worker's part of `t`: the local shard of a sharded tensor (DTensor), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t: "torch.Tensor") -> tuple:
    """What makes two tensors one (tied weights): their local data's address, offset, shape, dtype."""
    part = local_part(t)
    return part.untyped_storage().data_ptr(), part.storage_offset(), tuple(t.shape), t.dtype


def flatten_state(obj: Any, prefix: str = "", copy: bool = True) -> tuple[StateDict, Any]:
    """Split a nested state (dicts, lists, tuples, tensors, scalars) into (tensors, JSON structure).

    Tensors are replaced by {"__tensor__": key}; a tensor met twice (tied weights) is stored once
    and both places name its key, so it comes back as one tensor; dicts become {"__dict__":
    [[key, value], ...]} so that int keys (optimizer param ids) survive; tuples {"__tuple__":
    [...]}; non-finite floats {"__float__": "nan"}. Anything else (objects that would need pickle)
    is a TypeError. `copy`: tensors are detached CPU copies (for safetensors); else the tensors
    themselves (sharded ones stay sharded: DCP writes and loads them in place).
    """
    import torch

    tensors: StateDict = {}
    seen: dict[tuple, str] = {}

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            key = storage_key(x)
            if key not in seen:
                seen[key] = path
                tensors[path] = _own(x) if copy else x
            return {"__tensor__": seen[key]}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state key {k!r} at {path or '<root>'} is not a str or int")
                items.append([k, enc(v, f"{path}.{k}" if path else str(k))])
            return {"__dict__": items}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}.{i}") for i, v in enumerate(x)]
        if isinstance(x, float) and not math.isfinite(x):
            return {"__float__": repr(x)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot checkpoint {type(x).__name__} at {path or '<root>'} without pickle")

    structure = enc(obj, prefix)
    return tensors, structure


def unflatten_state(tensors: StateDict, structure: Any) -> Any:
    """Inverse of `flatten_state`."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                key = x["__tensor__"]
                if key not in tensors:
                    raise CheckpointError(f"tensor {key!r} named by the structure is missing")
                return tensors[key]
            if "__dict__" in x:
                return {k: dec(v) for k, v in x["__dict__"]}
            if "__tuple__" in x:
                return tuple(dec(v) for v in x["__tuple__"])
            if "__float__" in x:
                return float(x["__float__"])
            raise CheckpointError(f"unknown structure node {sorted(x)}")
        return x

    return dec(structure)


def _save_safetensors(tensors: StateDict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: _own(v) for k, v in tensors.items()}, str(path))
    _fsync_file(path)


def save_state(obj: Any, directory: Path, name: str) -> None:
    """`name.safetensors` + `name.json` for a nested state (optimizer, strategy)."""
    tensors, structure = flatten_state(obj)
    _save_safetensors(tensors, directory / f"{name}.safetensors")
    (directory / f"{name}.json").write_text(json.dumps(structure))
    _fsync_file(directory / f"{name}.json")


def load_state(directory: Path, name: str) -> Any:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / f"{name}.safetensors"))
    structure = json.loads((directory / f"{name}.json").read_text())
    return unflatten_state(tensors, structure)


# -- sharded state (every worker of a torch.distributed group) ----------------------------------
def save_sharded(directory: Path, name: str, state: Any, coordinator: bool) -> None:
    """Write a nested state whose tensors may be sharded (DTensors) as `shards/name/` (each
    worker's shards, DCP's Hugging Face safetensors format) + `name.json` (the structure, written
    by the `coordinator`). Every worker of the default process group calls it with its own state
    (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, structure = flatten_state(state, copy=False)
    shards = Path(directory) / SHARDS / name
    shards.mkdir(parents=True, exist_ok=True)
    if tensors:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(shards), save_distributed=True))
    if coordinator:  # DCP's writer fsyncs the shards itself
        (Path(directory) / f"{name}.json").write_text(json.dumps(structure))
        _fsync_file(Path(directory) / f"{name}.json")


def load_sharded(directory: Path, name: str, template: Callable[[], Any]) -> Any | None:
    """The state `save_sharded` wrote as `name` (None if the checkpoint has none). If it holds
    tensors, `template()` gives a state of the same structure whose tensors (sharded as this
    worker's) the saved values are loaded into, in place. A collective, like the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = Path(directory) / f"{name}.json"
    if not path.is_file():
        return None
    structure = json.loads(path.read_text())
    if not _names_tensors(structure):
        return unflatten_state({}, structure)
    tensors, _ = flatten_state(template(), copy=False)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(Path(directory) / SHARDS / name)))
    return unflatten_state(tensors, structure)


def _names_tensors(structure: Any) -> bool:
    if isinstance(structure, list):
        return any(_names_tensors(x) for x in structure)
    if isinstance(structure, dict):
        return "__tensor__" in structure or any(_names_tensors(x) for x in structure.values())
    return False


def assemble_sharded(directory: Path, name: str) -> Any:
    """The state `save_sharded` wrote as `name`, with every tensor whole, read in this process
    (no process group): DCP reads each tensor's shards at their offsets."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    shards = str(Path(directory) / SHARDS / name)
    metadata = HuggingFaceStorageReader(shards).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in metadata.items()}
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(shards), no_dist=True)
    return unflatten_state(tensors, json.loads((Path(directory) / f"{name}.json").read_text()))


def export_model(directory: Path, weights: "Iterable[tuple[str, torch.Tensor]]", model_path: str | os.PathLike) -> None:
    """Make `directory` a plain Hugging Face model directory: `model.safetensors` (full float32
    tensors, unless it is there already) and the files of `model_path` that are not weights
    (config, generation config, tokenizer)."""
    directory = Path(directory)
    if not (directory / "model.safetensors").is_file():
        _save_safetensors(_float32(dict(weights)), directory / "model.safetensors")
    for path in Path(model_path).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not (directory / path.name).exists():
            shutil.copyfile(path, directory / path.name)
            _fsync_file(directory / path.name)


# -- single weight files -------------------------------------------------------------------------
def _float32(weights: "Mapping[str, torch.Tensor]") -> StateDict:
    import torch

    return {k: _own(v).to(torch.float32) if v.is_floating_point() else _own(v) for k, v in weights.items()}


def save_weights(weights: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]",
                 path: str | os.PathLike) -> Path:
    """Weights (a state dict, or (name, tensor) pairs such as a trainer's `full_weights()`) as
    one safetensors file (float32 copy), written atomically."""
    from safetensors.torch import save_file

    state = _float32(dict(weights))
    return atomic_write(path, lambda tmp: save_file(state, str(tmp)))


def load_weights(path: str | os.PathLike) -> StateDict:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such weights file")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e


def weights_nbytes(path: str | os.PathLike, dtype_bytes: int = 4) -> int:
    """Bytes of one float32 copy of the weights in a safetensors file (or a model dir), from the
    header only (nothing is loaded)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = 0
    for file in files:
        with safe_open(str(file), framework="numpy") as f:  # "pt" would import torch for a header
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape()) * dtype_bytes
    return total


def version_file(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"{VERSION_PREFIX}{version:06d}.safetensors"


BASE_DIR = "base"  # a LoRA run's versions/: the base weights, once


def version_dir(directory: str | os.PathLike, version: int) -> Path:
    """A LoRA version's PEFT adapter directory (module docstring)."""
    return Path(directory) / f"{VERSION_PREFIX}{version:06d}"


def saved_version(directory: str | os.PathLike, version: int) -> Path | None:
    """Version `version`'s file (full weights) or adapter directory (LoRA) under `directory`, or None."""
    from trajflow.engines.lora import PEFT_CONFIG

    if version_file(directory, version).is_file():
        return version_file(directory, version)
    if (version_dir(directory, version) / PEFT_CONFIG).is_file():
        return version_dir(directory, version)
    return None


def save_adapter_version(directory: str | os.PathLike, version: int, payload: "Mapping[str, torch.Tensor]",
                         base_weights: "Callable[[], Iterable[tuple[str, torch.Tensor]]]",
                         model_path: str | os.PathLike) -> Path:
    """A LoRA version under `directory`: the adapter in PEFT's format (`v000012/`), and the base
    weights once (`base/`, from `base_weights()` and `model_path`'s config and tokenizer files,
    the adapter's base_model_name_or_path), each written atomically."""
    from trajflow.engines.lora import write_peft_adapter

    directory = Path(directory)
    base = directory / BASE_DIR
    if not (base / "model.safetensors").is_file():
        with writing_dir(base) as tmp:
            export_model(tmp, base_weights(), model_path)
    with writing_dir(version_dir(directory, version)) as tmp:
        write_peft_adapter(payload, tmp, base_model=f"../{BASE_DIR}")
    return version_dir(directory, version)


def load_version(path: str | os.PathLike) -> StateDict:
    """A version's payload from its file (full weights) or its PEFT adapter directory (a LoRA
    run's adapter, engines/lora.py)."""
    from trajflow.engines.lora import read_peft_adapter

    path = Path(path)
    if path.is_dir():
        try:
            return read_peft_adapter(path)
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: not a readable PEFT adapter directory: {e}") from e
    return load_weights(path)


# -- checkpoints ---------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    path: Path
    version: int
    meta: dict = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """Written by a sharded trainer (every worker its shards, module docstring)."""
        return (self.path / SHARDS / "model").is_dir()

    def model_state(self) -> StateDict:
        """The version's payload a resumed run starts from: a LoRA run's adapter (`ADAPTER_FILE`),
        else the full weights (`model.safetensors`, or a sharded checkpoint's shards assembled)."""
        if (self.path / ADAPTER_FILE).is_file():
            return load_weights(self.path / ADAPTER_FILE)
        if (self.path / "model.safetensors").is_file():
            return load_weights(self.path / "model.safetensors")
        return assemble_sharded(self.path, "model")

    def optimizer_state(self) -> dict | None:
        return load_state(self.path, "optimizer") if (self.path / "optimizer.json").is_file() else None

    def strategy_state(self) -> dict | None:
        return load_state(self.path, "strategy") if (self.path / "strategy.json").is_file() else None


def checkpoint_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"{CHECKPOINT_PREFIX}{version:06d}"


def save_checkpoint(
    root: str | os.PathLike,
    version: int,
    model_state: StateDict,
    optimizer_state: dict | None = None,
    strategy_state: dict | None = None,
    meta: dict | None = None,
) -> Checkpoint:
    """Write checkpoint `version` of a replicated trainer under `root` atomically."""
    with writing_checkpoint(root, version, meta) as tmp:
        write_replica(tmp, model_state, optimizer_state, strategy_state)
    return Checkpoint(checkpoint_dir(root, version), version, {"version": version, "complete": True, **(meta or {})})


ADAPTER_FILE = "adapter.safetensors"  # a LoRA trainer's weights: the adapter payload (engines/lora.py)


def write_replica(directory: Path, model_state: StateDict, optimizer_state: dict | None = None,
                  strategy_state: dict | None = None, weights_file: str = "model.safetensors") -> None:
    """A replicated trainer's checkpoint files (module docstring) into `directory`; a LoRA
    trainer's weights are its adapter, in `ADAPTER_FILE`."""
    _save_safetensors(model_state, directory / weights_file)
    if optimizer_state is not None:
        save_state(optimizer_state, directory, "optimizer")
    if strategy_state:
        save_state(strategy_state, directory, "strategy")


@contextlib.contextmanager
def writing_checkpoint(root: str | os.PathLike, version: int, meta: dict | None = None) -> Iterator[Path]:
    """A hidden temp dir to write checkpoint `version`'s files into; on leaving the block,
    `meta.json` is written last, everything fsynced and the dir renamed into place (an error
    leaves nothing)."""
    with writing_dir(checkpoint_dir(root, version)) as tmp:
        yield tmp
        meta = {"version": version, "complete": True, **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        _fsync_file(tmp / "meta.json")


@contextlib.contextmanager
def writing_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A hidden temp dir beside `final` to write its files into; on leaving the block everything
    is fsynced and the dir renamed to `final` (replacing one that exists); an error leaves nothing."""
    final = Path(final)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for file in (f for f in tmp.rglob("*") if f.is_file()):
            _fsync_file(file)
        for directory in [*(d for d in tmp.rglob("*") if d.is_dir()), tmp]:  # a sharded checkpoint has subdirs
            _fsync_dir(directory)
        if final.exists():  # e.g. re-written after a resume: swap, then drop the old one
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("complete") else None


def list_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Complete checkpoints under `root`, oldest first (temp dirs and partial ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        if not (path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX)):
            continue
        try:
            version = int(path.name[len(CHECKPOINT_PREFIX):])
        except ValueError:
            continue
        meta = _read_meta(path)
        if meta is None or meta.get("version") != version:
            continue
        checkpoint = Checkpoint(path, version, meta)
        if (path / "model.safetensors").is_file() or (path / ADAPTER_FILE).is_file() or checkpoint.sharded:
            out.append(checkpoint)
    return sorted(out, key=lambda c: c.version)


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read whole (truncated, or a header that is not one), from
    its header and size alone (nothing is loaded), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name}: truncated ({size} bytes, no header)"
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            return f"{path.name}: truncated ({size} bytes, its header alone needs {8 + length})"
        try:
            header = json.loads(f.read(length))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path.name}: not a safetensors file (unreadable header)"
    if 8 + length + end > size:
        return f"{path.name}: truncated ({size} of {8 + length + end} bytes)"
    return None


def checkpoint_problem(checkpoint: Checkpoint) -> str | None:
    """Why a checkpoint that looks complete cannot be loaded (a truncated or corrupt file), or None."""
    for file in sorted(checkpoint.path.rglob("*")):
        if file.suffix == ".safetensors":
            problem = safetensors_problem(file)
        elif file.suffix == ".json":
            try:
                json.loads(file.read_bytes())
                problem = None
            except ValueError:
                problem = f"{file.relative_to(checkpoint.path)}: not valid JSON (truncated?)"
        else:
            continue
        if problem is not None:
            return problem
    return None


def latest_intact_checkpoint(root: str | os.PathLike) -> tuple[Checkpoint | None, list[tuple[Checkpoint, str]]]:
    """The newest checkpoint whose files are whole (checkpoint_problem), and the newer ones passed
    over with what is wrong with each, newest first."""
    skipped = []
    for checkpoint in reversed(list_checkpoints(root)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append((checkpoint, problem))
    return None, skipped


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[int]:
    """Keep the newest `keep` complete checkpoints; returns the versions deleted."""
    found = list_checkpoints(root)
    doomed = found[:-keep] if keep > 0 else found
    for ckpt in doomed:
        # rename first so that a kill mid-delete never leaves a half-deleted "complete" checkpoint
        trash = ckpt.path.with_name(f".del-{ckpt.path.name}-{uuid.uuid4().hex[:8]}")
        ckpt.path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return [c.version for c in doomed]


def clean_partial(root: str | os.PathLike) -> None:
    """Remove temp/trash dirs left by a process killed mid-write."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((".tmp-", ".old-", ".del-")):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".") and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
