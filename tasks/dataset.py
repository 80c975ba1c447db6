"""Prompt datasets: the user's Parquet / JSONL / JSON files as the rows of each train step.

    data:
      train_files: [data/train.jsonl]     # paths or globs, read with Ray Data's readers
      test_files: [data/test.jsonl]       # optional: held-out evaluation (eval_every)
      prompt_key: prompt                  # a string column, or chat messages
      apply_chat_template: false          # wrap string prompts as one user message
      max_prompt_tokens: 512              # longer prompts are dropped (and counted), never cut
      shuffle: true                       # a new permutation per epoch, from the seed
      epochs: 2                           # optional: the run's steps follow from it

Every other column travels with its prompt into the trajectories and reaches the reward function.

Rows: each row gets `prompt_id` = "<file>:<row>" (the file relative to the files' common folder, the
row's 0-based position in it), stable across runs and machines. Rows whose prompt has more than
`max_prompt_tokens` tokens are dropped before anything else; the E rows left form an epoch.

Steps: train step s takes the prompts at positions s*P .. s*P+P-1 (P = prompts_per_step) of the
endless sequence epoch 0, epoch 1, ...; epoch e visits the E rows in the permutation
`default_rng([seed, e]).permutation(E)` (or in file order without `shuffle`). The rows of a step
are a pure function of (dataset, seed, step), so `--resume` from checkpoint k rebuilds steps k..
exactly: within an epoch no prompt repeats and none is skipped. `fingerprint()` (the files' bytes,
the tokenizer and every setting the mapping depends on) lets a resume detect a changed dataset.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")
# Columns a dataset cannot carry: trajflow writes them into every trajectory.
RESERVED_COLUMNS = (
    "trajectory_id", "group_id", "prompt_id", "prompt_tokens", "response_tokens", "loss_mask",
    "inference_logprobs", "versions", "old_logprobs", "finish_reason", "reward", "advantage",
    "rollout_step", "filter_reason", "trainer_version", "turns", "reward_error",
)


class DataError(ValueError):
    """The dataset cannot be used; the message is one line naming the file, column or key."""


class DataConfig(BaseModel):
    """The `data:` key of a job config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    train_files: list[str] = Field(min_length=1, description="Parquet / JSONL / JSON paths or globs")
    test_files: list[str] = Field(default_factory=list, description="held-out prompts (eval_every)")
    prompt_key: str = Field("prompt", min_length=1)
    apply_chat_template: bool = Field(False, description="wrap string prompts as one user message")
    max_prompt_tokens: int | None = Field(None, ge=1, description="drop (and count) longer prompts")
    shuffle: bool = True
    epochs: int | None = Field(None, ge=1, description="passes over the data (sets steps when steps is not given)")


# -- files -----------------------------------------------------------------------------------------
def expand_files(patterns: Sequence[str], key: str, base: Path | None = None) -> list[Path]:
    """Paths and globs -> existing files, sorted and deduplicated; a relative pattern that matches
    nothing under the working directory is tried under `base` (the repository root)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches and base is not None and not os.path.isabs(pattern):
            matches = sorted(glob.glob(str(base / pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataError(f"{key}: {pattern}: no such file")
        for m in matches:
            path = Path(m).resolve()
            if not path.name.endswith(PARQUET_SUFFIXES + JSON_SUFFIXES):
                raise DataError(f"{key}: {m}: unsupported format (use .parquet, .jsonl or .json)")
            if path not in files:
                files.append(path)
    return files


def file_labels(files: Sequence[Path]) -> list[str]:
    """Each file's name relative to the files' common folder (the `<file>` part of prompt ids)."""
    if len(files) == 1:
        return [files[0].name]
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    return [f.relative_to(root).as_posix() for f in files]


def first_record(path: Path) -> dict:
    """The first row of a dataset file, read without Ray (Parquet: the first row group; JSON: the
    first record of a JSON-lines file, or the first element of a JSON array)."""
    if path.name.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(path)
            batch = next(file.iter_batches(batch_size=1), None)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        if batch is None or not batch.num_rows:
            return dict.fromkeys(file.schema_arrow.names)
        return batch.to_pylist()[0]
    try:
        with open(path, encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), "")
        if line.lstrip().startswith("["):
            records = json.loads(Path(path).read_text(encoding="utf-8"))
            first = records[0] if records else None
        else:
            first = json.loads(line) if line else None
    except (ValueError, IndexError) as e:
        raise DataError(f"{path}: not valid JSON lines ({e})") from None
    if not isinstance(first, dict):
        raise DataError(f"{path}: the first record is not a JSON object")
    return first


def check_files(files: Sequence[Path], prompt_key: str, key: str) -> list[str]:
    """Every file has `prompt_key` and the same columns; returns the other (passthrough) columns."""
    columns: list[str] | None = None
    for path in files:
        names = list(first_record(path))
        if prompt_key not in names:
            raise DataError(f"{key}: {path.name}: no column {prompt_key!r} (data.prompt_key); columns: "
                            f"{', '.join(names)}")
        reserved = [c for c in names if c in RESERVED_COLUMNS]
        if reserved:
            raise DataError(f"{key}: {path.name}: column(s) {', '.join(reserved)} are reserved for trajflow's "
                            "own record; rename them")
        if columns is None:
            columns = names
        elif set(names) != set(columns):
            raise DataError(f"{key}: {path.name} has columns {sorted(names)}, {files[0].name} has {sorted(columns)}")
    return [c for c in (columns or []) if c != prompt_key]


# -- reading ---------------------------------------------------------------------------------------
def read_rows(files: Sequence[Path], labels: Sequence[str], *, with_ray: bool) -> pa.Table:
    """All rows of `files` in file order with a `prompt_id` column ("<label>:<row>").

    with_ray: Ray Data's readers (`read_parquet` / `read_json`, order preserved); else pyarrow on
    this process (same rows: used where no Ray Data execution may start, e.g. inside an actor).
    """
    tables = []
    for path, label in zip(files, labels):
        table = _read_with_ray(path) if with_ray else _read_with_arrow(path)
        ids = pa.array([f"{label}:{i:06d}" for i in range(table.num_rows)], pa.string())
        tables.append(table.add_column(0, "prompt_id", ids))
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"data: the files' column types do not agree ({e})") from None


def _read_with_ray(path: Path) -> pa.Table:
    import ray
    from ray.data import DataContext

    ctx = DataContext.get_current()
    keep = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True  # row i of the file is row i of the table
    try:
        reader = ray.data.read_parquet if path.name.endswith(PARQUET_SUFFIXES) else ray.data.read_json
        refs = reader(str(path), num_cpus=0.25).to_arrow_refs()
        blocks = [b for b in ray.get(refs) if b.num_rows]
    except Exception as e:  # noqa: BLE001 - a malformed file is the user's input
        raise DataError(f"data: {path.name}: cannot read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None
    finally:
        ctx.execution_options.preserve_order = keep
    if not blocks:
        raise DataError(f"data: {path.name}: no rows")
    return pa.concat_tables(blocks, promote_options="permissive")


def _read_with_arrow(path: Path) -> pa.Table:
    try:
        if path.name.endswith(PARQUET_SUFFIXES):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            text = path.read_text(encoding="utf-8")
            if text.lstrip().startswith("["):
                table = pa.Table.from_pylist(json.loads(text))
            else:
                import pyarrow.json as pj

                table = pj.read_json(path)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data: {path.name}: cannot read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None
    if not table.num_rows:
        raise DataError(f"data: {path.name}: no rows")
    return table


# -- the dataset -----------------------------------------------------------------------------------
class PromptDataset:
    """The tokenized, length-filtered rows of a dataset, and the rows of each train step.

    `table` columns: prompt_id, prompt, prompt_tokens (list<int32>), then the passthrough columns.
    `dropped`: rows removed for having more than `max_prompt_tokens` prompt tokens.
    """

    def __init__(self, table: pa.Table, dropped: int, columns: list[str], labels: list[str]) -> None:
        self.table = table
        self.dropped = dropped
        self.columns = columns
        self.labels = labels

    @property
    def epoch_size(self) -> int:
        return self.table.num_rows

    @classmethod
    def load(cls, config: DataConfig, files: Sequence[Path], tokenizer, *, with_ray: bool,
             key: str = "data.train_files") -> "PromptDataset":
        from trajflow.engines.tokenizer import encode_prompts

        columns = check_files(files, config.prompt_key, key)
        labels = file_labels(files)
        raw = read_rows(files, labels, with_ray=with_ray)
        prompts = raw[config.prompt_key].to_pylist()
        bad = next((i for i, p in enumerate(prompts) if p is None), None)
        if bad is not None:
            raise DataError(f"data: row {raw['prompt_id'][bad].as_py()}: {config.prompt_key} is null")
        try:
            tokens = encode_prompts(tokenizer, prompts, config.apply_chat_template)
        except (TypeError, ValueError) as e:
            raise DataError(f"data.prompt_key {config.prompt_key!r}: {e}") from None
        lengths = np.array([len(t) for t in tokens])
        keep = lengths <= config.max_prompt_tokens if config.max_prompt_tokens else np.ones(len(tokens), bool)
        if not keep.any():
            raise DataError(f"data.max_prompt_tokens: all {len(tokens)} prompts are longer than "
                            f"{config.max_prompt_tokens} tokens (shortest: {lengths.min()})")
        table = pa.table({
            "prompt_id": raw["prompt_id"],
            "prompt": raw[config.prompt_key],
            "prompt_tokens": pa.array(tokens, pa.list_(pa.int32())),
            **{c: raw[c] for c in columns},
        }).filter(pa.array(keep))
        return cls(table, int((~keep).sum()), columns, labels)

    def step_rows(self, step: int, prompts_per_step: int, seed: int, shuffle: bool) -> pa.Table:
        """The prompt rows of train step `step` (see the module docstring), with `rollout_step`."""
        positions = step * prompts_per_step + np.arange(prompts_per_step, dtype=np.int64)
        size = self.epoch_size
        epochs, offsets = positions // size, positions % size
        index = np.empty_like(positions)
        for epoch in np.unique(epochs):
            order = epoch_order(size, seed, int(epoch), shuffle)
            chosen = epochs == epoch
            index[chosen] = order[offsets[chosen]]
        rows = self.table.take(pa.array(index))
        return rows.add_column(0, "rollout_step", pa.array(np.full(prompts_per_step, step, np.int32)))

    def position(self, step: int, prompts_per_step: int) -> dict:
        """Where step `step` starts: {"epoch": e, "index": position within epoch e}."""
        start = step * prompts_per_step
        return {"epoch": start // self.epoch_size, "index": start % self.epoch_size}


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order in which epoch `epoch` visits the `size` rows."""
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(size)


def fingerprint(files: Sequence[Path], labels: Sequence[str], settings: dict, tokenizer_dir: Path | None) -> str:
    """sha256 of the files' bytes, their labels, the tokenizer files and the mapping's settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for path, label in zip(files, labels):
        digest.update(label.encode() + b"\0")
        _hash_file(digest, path)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (Path(tokenizer_dir) / name).is_file():
                digest.update(name.encode() + b"\0")
                _hash_file(digest, Path(tokenizer_dir) / name)
    return digest.hexdigest()[:16]


def _hash_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
