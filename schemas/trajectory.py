"""Trajectory record, schema v1 (docs/design.md §2): Arrow schema, validation, conforming casts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = "1"
META_VERSION_KEY = b"trajflow.schema_version"
META_SAMPLING_KEY = b"trajflow.sampling"

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

_INT_LIST = pa.list_(pa.int32())
_FLOAT_LIST = pa.list_(pa.float32())

# name -> (canonical type, nullable)
_V1: dict[str, tuple[pa.DataType, bool]] = {
    "trajectory_id": (pa.string(), False),
    "group_id": (pa.string(), False),
    "prompt_id": (pa.string(), False),
    "prompt_tokens": (_INT_LIST, False),
    "response_tokens": (_INT_LIST, False),
    "loss_mask": (pa.list_(pa.bool_()), False),
    "inference_logprobs": (_FLOAT_LIST, False),
    "versions": (_INT_LIST, False),
    "old_logprobs": (_FLOAT_LIST, True),
    "finish_reason": (pa.string(), False),
    "reward": (pa.float32(), True),
    "advantage": (pa.float32(), True),
}

# Optional columns of v1: nullable, checked and conformed when present, absent from logs written
# before they were added (which still read back).
_OPTIONAL: dict[str, pa.DataType] = {
    # why the reward failed on the row: "Type: message", at most 200 characters (null: it scored)
    "reward_error": pa.string(),
    # one advantage per response token (REINFORCE++ with advantage.gamma < 1); absent otherwise
    "token_advantages": pa.list_(pa.float32()),
}

COLUMNS: list[str] = list(_V1)
OPTIONAL_COLUMNS: tuple[str, ...] = tuple(_OPTIONAL)
NULLABLE_COLUMNS: frozenset[str] = frozenset(c for c, (_, nullable) in _V1.items() if nullable)
LIST_COLUMNS: tuple[str, ...] = tuple(c for c, (t, _) in _V1.items() if pa.types.is_list(t))
# per-token columns: aligned element-wise with response_tokens
PER_TOKEN_COLUMNS: tuple[str, ...] = ("loss_mask", "inference_logprobs", "versions", "old_logprobs")
LOGPROB_COLUMNS: tuple[str, ...] = ("inference_logprobs", "old_logprobs")
# -inf is a valid old log-prob: the token lies outside the sampling filter's support (top-k/top-p)
# under training numerics. The train step takes such tokens out of the loss and counts them. A
# sampled token always lies inside its sampler's support, so inference log-probs must be finite.
NEG_INF_ALLOWED: frozenset[str] = frozenset({"old_logprobs"})


def _invalid_values(flat: pa.Array, name: str) -> pa.Array:
    """Per element: NaN/inf that column `name` cannot hold (null for null elements)."""
    bad = pc.invert(pc.is_finite(flat))
    if name in NEG_INF_ALLOWED:
        bad = pc.and_(bad, pc.not_equal(flat, float("-inf")))
    return bad


@dataclass(frozen=True)
class SamplingSemantics:
    """What distribution `inference_logprobs` were taken from; the trainer must match it."""

    temperature: float
    top_p: float
    top_k: int
    processed: bool = True  # log-probs of the processed (temperature/top-k/top-p) distribution

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> SamplingSemantics:
        d = json.loads(text)
        return cls(float(d["temperature"]), float(d["top_p"]), int(d["top_k"]), bool(d.get("processed", True)))


class SchemaError(ValueError):
    """A table does not match schema v1; `column`/`row` locate the problem when known."""

    def __init__(self, message: str, *, column: str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.column = column
        self.row = row


def _error(column: str | None, row: int | None, detail: str) -> SchemaError:
    where = "table" if column is None else f"column {column!r}"
    if row is not None:
        where += f" row {row}"
    return SchemaError(f"{where}: {detail}", column=column, row=row)


def _metadata(sampling: SamplingSemantics | None) -> dict[bytes, bytes]:
    meta = {META_VERSION_KEY: SCHEMA_VERSION.encode()}
    if sampling is not None:
        meta[META_SAMPLING_KEY] = sampling.to_json().encode()
    return meta


def trajectory_schema(sampling: SamplingSemantics | None = None) -> pa.Schema:
    """The canonical v1 schema; sampling semantics go in the metadata when given."""
    fields = [pa.field(name, t, nullable=nullable) for name, (t, nullable) in _V1.items()]
    return pa.schema(fields, metadata=_metadata(sampling))


def sampling_semantics(obj: pa.Table | pa.Schema) -> SamplingSemantics | None:
    """The sampling semantics recorded in a table's (or schema's) metadata, if any."""
    schema = obj.schema if isinstance(obj, pa.Table) else obj
    raw = (schema.metadata or {}).get(META_SAMPLING_KEY)
    if raw is None:
        return None
    try:
        return SamplingSemantics.from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise _error(None, None, f"bad {META_SAMPLING_KEY.decode()} metadata {raw!r}: {e}") from e


def _check_version(schema: pa.Schema) -> None:
    version = (schema.metadata or {}).get(META_VERSION_KEY)
    if version is not None and version != SCHEMA_VERSION.encode():
        raise _error(
            None, None, f"schema_version {version.decode(errors='replace')!r} != supported {SCHEMA_VERSION!r}"
        )


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first true entry (nulls count as false), or None."""
    idx = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if idx < 0 else idx


def _types_match(actual: pa.DataType, expected: pa.DataType) -> bool:
    # list<element: T> and list<item: T> are the same type; nothing else is relaxed
    if pa.types.is_list(expected):
        return pa.types.is_list(actual) and actual.value_type == expected.value_type
    return actual == expected


def validate(table: pa.Table, *, allow_nonfinite: bool = False) -> None:
    """Raise SchemaError naming the column (and row) if `table` is not a valid v1 table.

    Extra columns are allowed; an optional column (OPTIONAL_COLUMNS) may be missing. Missing schema
    metadata is allowed; a different version is not.
    """
    _check_version(table.schema)
    sampling_semantics(table.schema)
    names = set(table.column_names)
    for name, (expected, nullable) in _V1.items():
        if name not in names:
            raise _error(name, None, f"missing column (schema v{SCHEMA_VERSION} needs {COLUMNS})")
        actual = table.schema.field(name).type
        if not _types_match(actual, expected):
            raise _error(
                name, None, f"type {actual} != {expected}; call trajflow.schemas.conform() to cast"
            )
        col = table.column(name)
        if not nullable and col.null_count:
            raise _error(name, _first_true(pc.is_null(col)), "null in non-nullable column")
        if name in LIST_COLUMNS:
            flat = pc.list_flatten(col)
            if flat.null_count:
                bad = _first_true(pc.is_null(flat))
                row = pc.list_parent_indices(col)[bad].as_py()
                raise _error(name, row, "null element inside list")

    for name, expected in _OPTIONAL.items():
        if name in names and not _types_match(table.schema.field(name).type, expected):
            raise _error(name, None, f"type {table.schema.field(name).type} != {expected}; call "
                         "trajflow.schemas.conform() to cast")

    n_resp = pc.list_value_length(table.column("response_tokens"))
    for name in PER_TOKEN_COLUMNS:
        n = pc.list_value_length(table.column(name))
        row = _first_true(pc.not_equal(n, n_resp))
        if row is not None:
            raise _error(
                name, row, f"length {n[row].as_py()} != len(response_tokens) {n_resp[row].as_py()}"
            )

    if not allow_nonfinite:
        for name in LOGPROB_COLUMNS:
            col = table.column(name)
            flat = pc.list_flatten(col)
            bad = _first_true(_invalid_values(flat, name))
            if bad is not None:
                parents = pc.list_parent_indices(col)
                row = parents[bad].as_py()
                position = bad - _first_true(pc.equal(parents, row))
                raise _error(
                    name, row, f"non-finite value {flat[bad].as_py()} at token {position} "
                    "(pass allow_nonfinite=True or drop rows with nonfinite_rows())"
                )

    fr = table.column("finish_reason")
    row = _first_true(pc.invert(pc.is_in(fr, value_set=pa.array(FINISH_REASONS))))
    if row is not None:
        raise _error("finish_reason", row, f"{fr[row].as_py()!r} not one of {list(FINISH_REASONS)}")


def nonfinite_rows(table: pa.Table) -> np.ndarray:
    """Bool mask of rows with NaN/inf in inference_logprobs or old_logprobs (-inf is valid in
    old_logprobs: a token outside the sampling support)."""
    out = np.zeros(table.num_rows, dtype=bool)
    for name in LOGPROB_COLUMNS:
        if name not in table.column_names:
            continue
        col = table.column(name)
        bad = pc.fill_null(_invalid_values(pc.list_flatten(col), name), False)
        if not pc.any(bad).as_py():
            continue
        bad_idx = pc.indices_nonzero(bad)
        out[pc.take(pc.list_parent_indices(col), bad_idx).to_numpy()] = True
    return out


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Casts conform() performs: same kind of value, different physical type."""
    t = pa.types
    if t.is_null(src) or src == dst:
        return True
    if t.is_list(dst):
        is_listlike = (
            t.is_list(src) or t.is_large_list(src) or t.is_fixed_size_list(src)
            or t.is_list_view(src) or t.is_large_list_view(src)
        )
        return is_listlike and _castable(src.value_type, dst.value_type)
    if t.is_string(dst):
        if t.is_dictionary(src):
            return _castable(src.value_type, dst)
        return t.is_string(src) or t.is_large_string(src) or t.is_string_view(src)
    if t.is_floating(dst):
        return t.is_floating(src) or t.is_integer(src)
    if t.is_integer(dst):
        return t.is_integer(src)
    return False


def conform(table: pa.Table, sampling: SamplingSemantics | None = None) -> pa.Table:
    """Cast v1 columns (and the optional ones present) back to their canonical types (large_list,
    large_string, float64, ...), put them first in canonical order then extras, and attach v1
    metadata.

    Existing sampling metadata is kept when `sampling` is None. Missing columns are not
    invented (validate() reports them). Raises SchemaError for a cast that would change meaning
    or lose data (e.g. string -> float, int64 overflow), or for another schema_version.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    _check_version(table.schema)
    old_meta = dict(table.schema.metadata or {})
    if sampling is None:
        sampling = sampling_semantics(table.schema)
    fields, arrays = [], []
    canonical = {**_V1, **{name: (t, True) for name, t in _OPTIONAL.items()}}
    for name, (expected, nullable) in canonical.items():
        if name not in table.column_names:
            continue
        col = table.column(name)
        if col.type != expected:
            if not _castable(col.type, expected):
                raise _error(name, None, f"cannot conform type {col.type} to {expected}")
            try:
                col = col.cast(expected)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise _error(name, None, f"cannot cast {col.type} to {expected}: {e}") from e
        fields.append(pa.field(name, expected, nullable=nullable))
        arrays.append(col)
    for name in table.column_names:
        if name not in canonical:
            fields.append(table.schema.field(name))
            arrays.append(table.column(name))
    meta = {**old_meta, **_metadata(sampling)}
    # from_arrays does not check nullability; validate() reports nulls with their row
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def empty_table(sampling: SamplingSemantics | None = None) -> pa.Table:
    """A zero-row v1 table."""
    return trajectory_schema(sampling).empty_table()


def from_rows(
    rows: list[dict[str, Any]], sampling: SamplingSemantics | None = None, *, check: bool = True
) -> pa.Table:
    """Build a v1 table from dicts (for tests and operators).

    Missing nullable keys (old_logprobs, reward, advantage) become null; an optional column takes
    its type; other keys outside v1 become extra columns with inferred types. Validates unless
    check=False.
    """
    schema = trajectory_schema(sampling)
    extras = list(dict.fromkeys(k for r in rows for k in r if k not in _V1))
    arrays, fields = [], list(schema)
    for f in schema:
        try:
            arrays.append(pa.array([r.get(f.name) for r in rows], type=f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise _error(f.name, None, f"cannot build {f.type}: {e}") from e
    for name in extras:
        arr = pa.array([r.get(name) for r in rows], type=_OPTIONAL.get(name))
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))
    if check:
        validate(table)
    return table
