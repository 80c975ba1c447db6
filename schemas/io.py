"""Parquet I/O for v1 trajectory tables: validated, atomic writes; checked reads."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .trajectory import SchemaError, conform, validate


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Run `write(tmp)` on a temp file beside `path`, fsync it, rename it over `path`, fsync the
    directory. A failure (or a kill) leaves `path` as it was and no temp file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def write_parquet(table: pa.Table, path: str | os.PathLike) -> Path:
    """Validate `table`, then write it atomically (temp file in the same dir + os.replace).

    v1 metadata is always attached. An invalid table raises SchemaError and writes nothing.
    """
    validate(table)
    table = conform(table)
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def read_parquet(path: str | os.PathLike, *, allow_nonfinite: bool = False) -> pa.Table:
    """Read a v1 Parquet file, conform and validate it; errors name the file (and column).
    `allow_nonfinite` accepts NaN/inf log-probs (for callers that quarantine those rows)."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"{path}: not a readable Parquet file (truncated or corrupt?): {e}") from e
    try:
        table = conform(table)
        validate(table, allow_nonfinite=allow_nonfinite)
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}", column=e.column, row=e.row) from e
    return table
