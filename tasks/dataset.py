"""Prompt datasets: the user's Parquet / JSONL / JSON files as the rows of each train step.

    data:
      train_files: [data/train.jsonl]     # paths or globs (Parquet, JSON lines, a JSON array)
      test_files: [data/test.jsonl]       # optional: held-out evaluation (eval_every)
      prompt_key: prompt                  # a string column, or chat messages
      apply_chat_template: false          # wrap string prompts as one user message
      max_prompt_tokens: 512              # longer prompts are dropped (and counted), never cut
      shuffle: true                       # a new permutation per epoch, from the seed
      epochs: 2                           # optional: the run's steps follow from it

Every other column travels with its prompt into the trajectories and reaches the reward function;
a column cannot be named like a column of the trajectory record (RESERVED_COLUMNS).

Checked before Ray starts, in one pass over every file (streamed BATCH_ROWS rows at a time:
Parquet by record batches, JSON lines line by line; a JSON array is read whole), with a progress
line past a few seconds: every row has every column, each column of one type in every row and
file, and the prompt and the reward's columns (`required`) never null — any other column may be
null in some rows (an optional note, a source URL), and the reward gets None there; every prompt
is a string or chat messages with a role and content, and goes through the tokenizer (and its
chat template) once. Any problem is one DataError line naming the file, the
row (for JSON lines, the line) and the column. The tokens are kept: the run's prompt source takes
them from `checked_dataset` instead of reading and tokenizing again.

Rows: each row gets `prompt_id` = "<file>:<row>" (the file relative to the files' common folder, the
row's 0-based position in it), stable across runs and machines. Rows whose prompt has more than
`max_prompt_tokens` tokens are dropped before anything else; the E rows left form an epoch.

Steps: train step s takes the prompts at positions s*P .. s*P+P-1 (P = prompts_per_step) of the
endless sequence epoch 0, epoch 1, ...; epoch e visits the E rows in the permutation
`default_rng([seed, e]).permutation(E)` (or in file order without `shuffle`). The rows of a step
are a pure function of (dataset, seed, step), so `--resume` from checkpoint k rebuilds steps k..
exactly: within an epoch no prompt repeats and none is skipped. `fingerprint()` (the files' bytes,
the tokenizer and every setting the mapping depends on) lets a resume detect a changed dataset.

One module on purpose: reading, checking, tokenizing and ordering a dataset are one streamed
pass with one set of row rules and one fingerprint; split, a rule could be checked in one place
and forgotten in another.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.settings import check_settings, fail, setting

PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")
# Columns a dataset cannot carry: trajflow writes them into every trajectory (the record's schema,
# the operators' own columns, `step` of the log's step=N partitions, which a reader of the log gets
# as a column) or passes them to the reward function beside the columns (`prompts`, `completions`).
# `prompt` is reserved too unless it is the prompt column (see reserved_columns).
RESERVED_COLUMNS = (
    "trajectory_id", "group_id", "prompt_id", "prompt_tokens", "response_tokens", "loss_mask",
    "inference_logprobs", "versions", "old_logprobs", "finish_reason", "reward", "advantage",
    "rollout_step", "filter_reason", "trainer_version", "turns", "reward_error", "step",
    "loss_old_logprobs", "reference_logprobs", "kl_penalty", "token_advantages", "prompts", "completions",
    "top_k_ids", "top_k_inference_logprobs", "top_k_old_logprobs", "top_k_teacher_logprobs", "teacher_logprobs",
    "values", "value_versions", "train_values", "returns", "agent", "token_agents",
)
BATCH_ROWS = 2048  # rows read, checked and tokenized at a time: validation's memory bound
PROGRESS_AFTER_SECONDS = 3.0  # a longer check prints a progress line ...
PROGRESS_EVERY_SECONDS = 5.0  # ... this often


class DataError(ValueError):
    """The dataset cannot be used; the message is one line naming the file, column or key."""


@dataclass(frozen=True)
class DataConfig:
    """A dataset of prompts the run trains on instead of a built-in task: read, checked and
    tokenized once before Ray starts (docs/workload.md)."""

    train_files: tuple[str, ...] = setting(doc="Parquet / JSONL / JSON paths or globs of the training prompts")
    test_files: tuple[str, ...] = setting((), "held-out prompts: the held-out evaluation (eval_every) and "
                                          "`trajflow eval --config`")
    prompt_key: str = setting("prompt", "the prompt column: a string, or chat messages [{role, content}, ...]")
    apply_chat_template: bool = setting(False, "wrap string prompts as one user message of the chat template "
                                        "(chat messages always go through it)")
    max_prompt_tokens: int | None = setting(None, "drop (and count) prompts longer than this; never truncated", ge=1)
    shuffle: bool = setting(True, "a new permutation of the rows per epoch, from the seed")
    epochs: int | None = setting(None, "passes over the data (sets steps when steps is not given)", ge=1)

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.train_files:
            fail(self, "train_files", "give at least one file")
        if not self.prompt_key:
            fail(self, "prompt_key", "name the prompt column")


# -- files -----------------------------------------------------------------------------------------
def expand_files(patterns: Sequence[str], key: str, base: Path | None = None) -> list[Path]:
    """Paths and globs -> existing files, sorted and deduplicated; a relative pattern that matches
    nothing under the working directory is tried under `base` (the repository root)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches and base is not None and not os.path.isabs(pattern):
            matches = sorted(glob.glob(str(base / pattern), recursive=True))
        if matches and all(os.path.isdir(m) for m in matches):
            raise DataError(f"{key}: {pattern}: is a directory; give its files (e.g. {pattern.rstrip('/')}/*.jsonl)")
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


def _open_error(key: str, path: Path, e: Exception) -> DataError:
    return DataError(f"{key}: {path.name}: cannot read ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def is_json_array(path: Path) -> bool:
    """A .json file holding one JSON array (read whole) rather than JSON lines (streamed)."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4096), b""):
            text = chunk.lstrip()
            if text:
                return text.startswith(b"[")
    return False


def file_columns(path: Path, key: str = "data") -> list[str]:
    """The column names of a dataset file, from its schema or first record (a cheap look)."""
    if path.name.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as e:  # noqa: BLE001 - a malformed file is the user's input
            raise DataError(f"{key}: {path.name}: not a readable Parquet file ({e})") from None
    batch = next(_record_batches(path, key), None)
    return list(batch.records[0]) if batch is not None else []


def check_columns(names: Sequence[str], prompt_key: str, key: str, name: str) -> None:
    """The prompt column is there and no column is reserved (module docstring)."""
    if prompt_key not in names:
        raise DataError(f"{key}: {name}: no column {prompt_key!r} (data.prompt_key); columns: {', '.join(names)}")
    reserved = [c for c in names if c in reserved_columns(prompt_key)]
    if reserved:
        raise DataError(f"{key}: {name}: column(s) {', '.join(reserved)} are reserved for trajflow's own record "
                        "(the trajectory log and the reward function's arguments); rename them")


def reserved_columns(prompt_key: str) -> tuple[str, ...]:
    """Names a dataset column cannot have; `prompt` too unless it is the prompt column itself
    (every trajectory carries the prompt under that name)."""
    return RESERVED_COLUMNS + (("prompt",) if prompt_key != "prompt" else ())


def check_files(files: Sequence[Path], prompt_key: str, key: str) -> list[str]:
    """Every file has `prompt_key` and the same columns; returns the other (passthrough) columns."""
    columns: list[str] | None = None
    for path in files:
        names = file_columns(path, key)
        if not names:
            raise DataError(f"{key}: {path.name}: no rows (the file is empty)")
        check_columns(names, prompt_key, key, path.name)
        if columns is None:
            columns = names
        elif set(names) != set(columns):
            raise DataError(f"{key}: {path.name} has columns {sorted(names)}, {files[0].name} has {sorted(columns)}")
    return [c for c in (columns or []) if c != prompt_key]


# -- reading: one pass, in batches of BATCH_ROWS --------------------------------------------------
@dataclass
class _Batch:
    """Consecutive records of one file: `first_row` is the 0-based row of the first; `lines` the
    1-based line of each (JSON lines) or None (Parquet rows, JSON array elements)."""

    records: list[dict] | None  # JSON: the records; Parquet: None (the batch is `table`)
    first_row: int
    lines: list[int] | None = None
    table: pa.Table | None = None

    def __len__(self) -> int:
        return len(self.records) if self.records is not None else self.table.num_rows

    def column(self, name: str) -> list:
        return [r[name] for r in self.records] if self.records is not None else self.table[name].to_pylist()

    def where(self, i: int) -> str:
        return f"line {self.lines[i]}" if self.lines is not None else f"row {self.first_row + i}"


def _record_batches(path: Path, key: str) -> Iterator[_Batch]:
    """The records of a JSON-lines file (one line at a time) or a JSON array (read whole)."""
    try:
        if is_json_array(path):
            try:
                records = json.loads(path.read_bytes())
            except ValueError as e:
                raise DataError(f"{key}: {path.name}: not valid JSON ({e})") from None
            if not isinstance(records, list):
                raise DataError(f"{key}: {path.name}: not a JSON array of objects")
            for start in range(0, len(records), BATCH_ROWS):
                batch = _Batch(records[start:start + BATCH_ROWS], start)
                for i, record in enumerate(batch.records):
                    if not isinstance(record, dict):
                        raise DataError(f"{key}: {path.name}: {batch.where(i)}: not a JSON object")
                yield batch
            return
        with open(path, "rb") as f:
            batch = _Batch([], 0, [])
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip(b"\r\n"))
                except ValueError as e:  # UnicodeDecodeError included
                    reason = f"{e.msg}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                    raise DataError(f"{key}: {path.name}: line {number}: not valid JSON ({reason})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{key}: {path.name}: line {number}: not a JSON object")
                batch.records.append(record)
                batch.lines.append(number)
                if len(batch.records) == BATCH_ROWS:
                    yield batch
                    batch = _Batch([], batch.first_row + BATCH_ROWS, [])
            if batch.records:
                yield batch
    except OSError as e:
        raise _open_error(key, path, e) from None


def _parquet_batches(path: Path, key: str) -> Iterator[_Batch]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - a malformed file is the user's input
        raise DataError(f"{key}: {path.name}: not a readable Parquet file ({e})") from None
    first = 0
    try:
        for record_batch in file.iter_batches(batch_size=BATCH_ROWS):
            table = pa.Table.from_batches([record_batch])
            yield _Batch(None, first, None, table)
            first += table.num_rows
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{key}: {path.name}: row {first}..: not a readable Parquet file ({e})") from None


def concat(tables: list[pa.Table], where: str) -> pa.Table:
    """Batches (or files) as one table; nested types that do not agree (e.g. a message field that
    is a number in one batch, a string in another) are a DataError."""
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise DataError(f"{where}: the rows' column types do not agree ({' '.join(str(e).split())[:200]})") from None


def _kind(value: object) -> str | None:
    """The JSON kind of a value (None for null): what must agree down a column and across files."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _arrow_kind(kind: pa.DataType) -> str | None:
    if pa.types.is_null(kind):
        return None
    if pa.types.is_boolean(kind):
        return "a boolean"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return "a number"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "a string"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return "a list"
    return "an object" if pa.types.is_struct(kind) or pa.types.is_map(kind) else str(kind)


def check_prompt(prompt: object) -> str | None:
    """Why `prompt` cannot be a prompt (a string, or chat messages each with a role and content),
    or None. The chat template sees the messages as they are; this catches what a permissive
    template would render silently (a message without content)."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return f"neither a string nor a list of chat messages: {prompt!r:.80}"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"message {i} has no role: {message!r:.80}"
        if message.get("content") is None and not message.get("tool_calls"):
            return f"message {i} (role {message['role']!r}) has no content"
    return None


class _Scan:
    """One pass over a dataset's files: every record checked (columns, kinds, nulls, prompt) and
    tokenized once; the checked rows and their tokens kept as the run's table."""

    def __init__(self, config: DataConfig, tokenizer, key: str, required: Sequence[str] = ()) -> None:
        self.config, self.tokenizer, self.key = config, tokenizer, key
        self.required = [config.prompt_key, *(c for c in required if c != config.prompt_key)]
        self.kinds: dict[str, tuple[str, str]] = {}  # column -> (kind, where it was first seen)
        self.columns: list[str] | None = None
        self.rows = 0
        self.started = self.last_report = time.monotonic()

    def file(self, path: Path, label: str) -> pa.Table:
        name = path.name
        batches = _parquet_batches(path, self.key) if path.name.endswith(PARQUET_SUFFIXES) else \
            _record_batches(path, self.key)
        if path.name.endswith(PARQUET_SUFFIXES):
            self._file_columns(path, file_columns(path, self.key))
        tables = []
        for batch in batches:
            if batch.table is None:
                self._check_records(batch, name)
            else:
                self._check_table(batch, name)
            tokens = self._encode(batch, name)
            table = batch.table if batch.table is not None else self._to_table(batch, name)
            ids = [f"{label}:{batch.first_row + i:06d}" for i in range(len(batch))]
            tables.append(table.add_column(0, "prompt_id", pa.array(ids, pa.string()))
                          .append_column("prompt_tokens", pa.array(tokens, pa.list_(pa.int32()))))
            self.rows += len(batch)
            self._progress(name)
        if not tables:
            raise DataError(f"{self.key}: {name}: no rows (the file is empty)")
        return concat(tables, f"{self.key}: {name}")

    def _file_columns(self, path: Path, names: list[str]) -> None:
        check_columns(names, self.config.prompt_key, self.key, path.name)
        if self.columns is None:
            self.columns = list(names)
        elif set(names) != set(self.columns):
            raise DataError(f"{self.key}: {path.name} has columns {sorted(names)}, the first file has "
                            f"{sorted(self.columns)}")

    def _check_kind(self, column: str, kind: str | None, where: str) -> None:
        if kind is None:
            return
        first = self.kinds.setdefault(column, (kind, where))
        if first[0] != kind:
            raise DataError(f"{self.key}: {where}: column {column!r} is {kind}, but {first[0]} at {first[1]} "
                            "(a column has one type in every row and file)")

    def _check_records(self, batch: _Batch, name: str) -> None:
        if self.columns is None or batch.first_row == 0:
            self._file_columns(Path(name), list(batch.records[0]))
        for i, record in enumerate(batch.records):
            where = f"{name}: {batch.where(i)}"
            if len(record) != len(self.columns) or any(c not in record for c in self.columns):
                extra = [c for c in record if c not in self.columns]
                missing = [c for c in self.columns if c not in record]
                what = f"column {missing[0]!r} is missing" if missing else f"column {extra[0]!r} is not in the " \
                    "other rows"
                raise DataError(f"{self.key}: {where}: {what} (every row needs the same columns)")
            for column, value in record.items():
                if value is None and column in self.required:
                    raise self._null(where, column)
                self._check_kind(column, _kind(value), where)
            self._check_prompt(record[self.config.prompt_key], where)

    def _check_table(self, batch: _Batch, name: str) -> None:
        table = batch.table
        for field in table.schema:
            self._check_kind(field.name, _arrow_kind(field.type), f"{name}")
            column = table[field.name]
            if column.null_count and field.name in self.required:
                i = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise self._null(f"{name}: {batch.where(i)}", field.name)
        for i, prompt in enumerate(batch.column(self.config.prompt_key)):
            self._check_prompt(prompt, f"{name}: {batch.where(i)}")

    def _null(self, where: str, column: str) -> DataError:
        reward = self.required[1:]
        which = f"{self.config.prompt_key!r} (the prompt)" + (
            f" and {', '.join(map(repr, reward))} (the reward's)" if reward else "")
        return DataError(f"{self.key}: {where}: column {column!r} is null; required in every row: {which}; "
                         "other columns may be null")

    def _check_prompt(self, prompt: object, where: str) -> None:
        problem = check_prompt(prompt)
        if problem is not None:
            raise DataError(f"{self.key}: {where}: column {self.config.prompt_key!r}: {problem}")

    def _to_table(self, batch: _Batch, name: str) -> pa.Table:
        try:
            return pa.Table.from_pylist(batch.records)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. messages whose fields differ in type
            raise DataError(f"{self.key}: {name}: {batch.where(0)}..{batch.where(len(batch) - 1)}: the "
                            f"rows do not form one table ({e})") from None

    def _encode(self, batch: _Batch, name: str) -> list[list[int]]:
        from trajflow.engines.tokenizer import encode_prompts

        prompts = batch.column(self.config.prompt_key)
        try:
            return encode_prompts(self.tokenizer, prompts, self.config.apply_chat_template)
        except Exception:  # noqa: BLE001 - the user's chat template may raise anything: find the row
            pass
        for i, prompt in enumerate(prompts):
            try:
                encode_prompts(self.tokenizer, [prompt], self.config.apply_chat_template)
            except Exception as e:  # noqa: BLE001
                message = " ".join(str(e).split())[:200]
                raise DataError(f"{self.key}: {name}: {batch.where(i)}: column {self.config.prompt_key!r}: the "
                                f"tokenizer rejected the prompt ({type(e).__name__}: {message})") from None
        raise DataError(f"{self.key}: {name}: {batch.where(0)}..: the prompts do not tokenize together")

    def _progress(self, name: str) -> None:
        now = time.monotonic()
        if now - self.started >= PROGRESS_AFTER_SECONDS and now - self.last_report >= PROGRESS_EVERY_SECONDS:
            self.last_report = now
            print(f"trajflow: checking {self.key}: {self.rows} rows read and tokenized ({name}, "
                  f"{now - self.started:.0f}s)", flush=True)


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
    def load(cls, config: DataConfig, files: Sequence[Path], tokenizer,
             key: str = "data.train_files", required: Sequence[str] = ()) -> "PromptDataset":
        """Read every row of `files` once (streamed in batches; a JSON array is read whole), check
        it and tokenize its prompt; any problem is a DataError naming the file, row (line) and
        column. `required`: columns besides the prompt that no row may leave null (the reward's).
        Rows with more than `max_prompt_tokens` tokens are dropped and counted."""
        labels = file_labels(files)
        scan = _Scan(config, tokenizer, key, required)
        raw = concat([scan.file(path, label) for path, label in zip(files, labels)], key)
        columns = [c for c in scan.columns if c != config.prompt_key]
        lengths = pc.list_value_length(raw["prompt_tokens"]).to_numpy(zero_copy_only=False)
        keep = lengths <= config.max_prompt_tokens if config.max_prompt_tokens else np.ones(len(lengths), bool)
        if not keep.any():
            shortest = int(np.argmin(lengths))
            raise DataError(f"data.max_prompt_tokens: all {len(lengths)} prompts of {key} are longer than "
                            f"{config.max_prompt_tokens} tokens (shortest: {lengths[shortest]} tokens, row "
                            f"{raw['prompt_id'][shortest].as_py()})")
        table = pa.table({
            "prompt_id": raw["prompt_id"],
            "prompt": raw[config.prompt_key],
            "prompt_tokens": raw["prompt_tokens"],
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


_CHECKED: dict[tuple, PromptDataset] = {}
_CHECKED_KEEP = 4  # datasets kept per process (train and test files of a config or two)


def checked_dataset(config: DataConfig, files: Sequence[Path], tokenizer,
                    key: str = "data.train_files", required: Sequence[str] = ()) -> PromptDataset:
    """`PromptDataset.load`, once per process for the same files (path, size, mtime), tokenizer
    (loaded from the same directory, unchanged) and settings: the config's validation reads and
    tokenizes every row before Ray starts, and the run's prompt source takes those rows and tokens
    instead of reading the files again."""
    source = getattr(tokenizer, "name_or_path", "") or ""
    if not source or not Path(source).is_dir():  # a tokenizer built in memory: nothing to key on
        return PromptDataset.load(config, files, tokenizer, key, required)
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                  for f in [*files, *sorted(Path(source).glob("*token*")), *sorted(Path(source).glob("*.jinja"))])
    ident = (key, stamp, config.prompt_key, config.apply_chat_template, config.max_prompt_tokens, tuple(required))
    if ident not in _CHECKED:
        dataset = PromptDataset.load(config, files, tokenizer, key, required)
        while len(_CHECKED) >= _CHECKED_KEEP:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[ident] = dataset
    return _CHECKED[ident]


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
