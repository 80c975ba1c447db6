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
META_TOP_K_KEY = b"trajflow.top_k"

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

_INT_LIST = pa.list_(pa.int32())
_FLOAT_LIST = pa.list_(pa.float32())
_INT_LISTS = pa.list_(_INT_LIST)
_FLOAT_LISTS = pa.list_(_FLOAT_LIST)

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
    # The distributions (`top_k_logprobs: K` > 0; metadata `trajflow.top_k`): per response token, K
    # entries on the sampler's K most likely ids under the processed distribution it sampled from.
    # A row may be null (not scored, e.g. filtered before an old log-prob operator).
    "top_k_ids": _INT_LISTS,                    # generate: the ids, most likely first
    "top_k_inference_logprobs": _FLOAT_LISTS,   # generate: mu on them
    "top_k_old_logprobs": _FLOAT_LISTS,         # the exact strategies: pi_old on them at each token's version
    "top_k_teacher_logprobs": _FLOAT_LISTS,     # the teacher (distillation) on them
    "teacher_logprobs": _FLOAT_LIST,            # the teacher's log-prob of each sampled token
    # PPO with a critic (`critic:`): per response token V(s_t) scored by the values stage and the
    # critic version that scored it; the trainer's current critic's values when it recomputes them
    # (`critic.values_at: train`, or a clip anchored at train time); GAE's returns. A row may be null.
    "values": _FLOAT_LIST,
    "value_versions": pa.list_(pa.int32()),
    "train_values": _FLOAT_LIST,
    "returns": _FLOAT_LIST,
    # Team episodes (tasks/team.py): the agent whose learner trains the row, and each response
    # token's producer (null: an environment token); loss tokens are the row's agent's own
    "agent": pa.string(),
    "token_agents": pa.list_(pa.string()),
}
# the critic's per-token columns (finite floats; versions >= 0)
VALUE_COLUMNS: tuple[str, ...] = ("values", "value_versions", "train_values", "returns")

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
TOP_K_COLUMNS: tuple[str, ...] = ("top_k_ids", "top_k_inference_logprobs", "top_k_old_logprobs",
                                  "top_k_teacher_logprobs")
# Every log-prob of a distribution may be -inf: an id outside the support of the sampling filter
# (top-k/top-p) under that side's numerics, or past the support when K exceeds it. A teacher's
# sampled-token log-prob may be -inf the same way (the train step takes such a token out).
TOP_K_LOGPROB_COLUMNS: tuple[str, ...] = TOP_K_COLUMNS[1:]
DISTRIBUTION_LOGPROB_COLUMNS: tuple[str, ...] = (*TOP_K_LOGPROB_COLUMNS, "teacher_logprobs")


def _invalid_values(flat: pa.Array, name: str) -> pa.Array:
    """Per element: NaN/inf that column `name` cannot hold (null for null elements)."""
    bad = pc.invert(pc.is_finite(flat))
    if name in NEG_INF_ALLOWED or name in DISTRIBUTION_LOGPROB_COLUMNS:
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


@dataclass(frozen=True)
class TopKSemantics:
    """What the top-k columns hold: K entries per token, ids of a vocabulary of `vocab_size`."""

    k: int
    vocab_size: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TopKSemantics:
        d = json.loads(text)
        return cls(int(d["k"]), int(d["vocab_size"]))


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


def _metadata(sampling: SamplingSemantics | None, top_k: TopKSemantics | None = None) -> dict[bytes, bytes]:
    meta = {META_VERSION_KEY: SCHEMA_VERSION.encode()}
    if sampling is not None:
        meta[META_SAMPLING_KEY] = sampling.to_json().encode()
    if top_k is not None:
        meta[META_TOP_K_KEY] = top_k.to_json().encode()
    return meta


def trajectory_schema(sampling: SamplingSemantics | None = None) -> pa.Schema:
    """The canonical v1 schema; sampling semantics go in the metadata when given."""
    fields = [pa.field(name, t, nullable=nullable) for name, (t, nullable) in _V1.items()]
    return pa.schema(fields, metadata=_metadata(sampling))


def _read_metadata(obj: pa.Table | pa.Schema, key: bytes, semantics: type):
    """`semantics.from_json` of the metadata entry `key` of a table or schema (None: absent)."""
    schema = obj.schema if isinstance(obj, pa.Table) else obj
    raw = (schema.metadata or {}).get(key)
    if raw is None:
        return None
    try:
        return semantics.from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise _error(None, None, f"bad {key.decode()} metadata {raw!r}: {e}") from e


def sampling_semantics(obj: pa.Table | pa.Schema) -> SamplingSemantics | None:
    """The sampling semantics recorded in a table's (or schema's) metadata, if any."""
    return _read_metadata(obj, META_SAMPLING_KEY, SamplingSemantics)


def top_k_semantics(obj: pa.Table | pa.Schema) -> TopKSemantics | None:
    """K and the vocabulary size of the top-k columns, from the metadata (None: not recorded)."""
    return _read_metadata(obj, META_TOP_K_KEY, TopKSemantics)


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
    top_k_semantics(table.schema)
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
    _validate_distributions(table, allow_nonfinite)
    _validate_values(table, allow_nonfinite)
    _validate_agents(table)

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


def _row_of(col: pa.ChunkedArray, flat_index: int) -> tuple[int, int]:
    """(row, position in the row) of element `flat_index` of list column `col`'s flattening."""
    parents = pc.list_parent_indices(col)
    row = parents[flat_index].as_py()
    return row, flat_index - _first_true(pc.equal(parents, row))


def _validate_distributions(table: pa.Table, allow_nonfinite: bool) -> None:
    """The top-k columns and teacher_logprobs, when present: per non-null row one entry per
    response token, K per token (the metadata's K, else the first token's), ids in the vocabulary
    (the metadata's size, else >= 0), a log-prob row only where the ids are, and no NaN/+inf."""
    names = set(table.column_names)
    n_resp = pc.list_value_length(table.column("response_tokens"))
    if "teacher_logprobs" in names:
        _check_row_lengths(table, "teacher_logprobs", n_resp)
        flat = pc.list_flatten(table.column("teacher_logprobs"))
        bad = None if allow_nonfinite else _first_true(_invalid_values(flat, "teacher_logprobs"))
        if bad is not None:
            row, position = _row_of(table.column("teacher_logprobs"), bad)
            raise _error("teacher_logprobs", row, f"non-finite value {flat[bad].as_py()} at token {position} "
                         "(-inf is allowed: a token outside the teacher's sampling support)")
    present = [c for c in TOP_K_COLUMNS if c in names]
    if present and "top_k_ids" not in names:
        raise _error(present[0], None, "needs the column top_k_ids (the ids its log-probs are of)")
    semantics = top_k_semantics(table.schema)
    k = semantics.k if semantics is not None else None
    for name in present:
        col = table.column(name)
        _check_row_lengths(table, name, n_resp)
        if name != "top_k_ids":
            orphan = _first_true(pc.and_(pc.is_valid(col), pc.is_null(table.column("top_k_ids"))))
            if orphan is not None:
                raise _error(name, orphan, "log-probs on a row without top_k_ids")
        tokens = pc.list_flatten(col)
        if tokens.null_count:
            row, position = _row_of(col, _first_true(pc.is_null(tokens)))
            raise _error(name, row, f"null entry at token {position}")
        widths = pc.list_value_length(tokens)
        if k is None and len(widths):
            k = widths[0].as_py()
        bad = _first_true(pc.not_equal(widths, k)) if k is not None else None
        if bad is not None:
            row, position = _row_of(col, bad)
            raise _error(name, row, f"{widths[bad].as_py()} entries at token {position}, expected K = {k}")
        values = pc.list_flatten(tokens)
        if values.null_count:
            raise _error(name, None, "null value inside a token's entries")
        if name == "top_k_ids":
            high = semantics.vocab_size if semantics is not None else None
            out = pc.less(values, 0) if high is None else pc.or_(pc.less(values, 0), pc.greater_equal(values, high))
            bad = _first_true(out)
            if bad is not None:
                raise _error(name, _row_of(col, bad // max(k, 1))[0],
                             f"id {values[bad].as_py()} outside the vocabulary [0, {high if high is not None else 'V'})")
        elif not allow_nonfinite:
            bad = _first_true(_invalid_values(values, name))
            if bad is not None:
                row, position = _row_of(col, bad // max(k, 1))
                raise _error(name, row, f"non-finite value {values[bad].as_py()} at token {position} "
                             "(-inf is allowed: an id outside the support)")


def _validate_values(table: pa.Table, allow_nonfinite: bool) -> None:
    """The critic's columns, when present: per non-null row one entry per response token, no
    NaN or inf (a value is a prediction, never -inf), versions >= 0."""
    n_resp = pc.list_value_length(table.column("response_tokens"))
    for name in (c for c in VALUE_COLUMNS if c in table.column_names):
        _check_row_lengths(table, name, n_resp)
        col = table.column(name)
        flat = pc.list_flatten(col)
        if name == "value_versions":
            bad = _first_true(pc.less(flat, 0))
            what = "a negative version"
        elif allow_nonfinite:
            continue
        else:
            bad = _first_true(pc.invert(pc.is_finite(flat)))
            what = "a non-finite value"
        if bad is not None:
            row, position = _row_of(col, bad)
            raise _error(name, row, f"{what} {flat[bad].as_py()} at token {position}")


def _validate_agents(table: pa.Table) -> None:
    """Team rows, when present: `token_agents` has one entry per response token, and every loss
    token of a row was produced by the row's `agent` (another agent's tokens are context)."""
    if "token_agents" not in table.column_names:
        return
    _check_row_lengths(table, "token_agents", pc.list_value_length(table.column("response_tokens")))
    if "agent" not in table.column_names:
        raise _error("token_agents", None, "needs the column agent (whose learner trains the row)")
    producers = pc.list_flatten(table.column("token_agents"))
    parents = pc.list_parent_indices(table.column("token_agents"))
    owner = pc.take(table.column("agent"), parents)
    foreign = pc.and_(pc.list_flatten(table.column("loss_mask")),
                      pc.fill_null(pc.not_equal(producers, owner), True))
    bad = _first_true(foreign)
    if bad is not None:
        row, position = _row_of(table.column("token_agents"), bad)
        raise _error("token_agents", row, f"loss token {position} was produced by {producers[bad].as_py()!r}, "
                     f"not the row's agent {owner[bad].as_py()!r}")


def _check_row_lengths(table: pa.Table, name: str, n_resp: pa.Array) -> None:
    """Each non-null row of per-token column `name` has one entry per response token."""
    n = pc.list_value_length(table.column(name))
    row = _first_true(pc.not_equal(n, n_resp))
    if row is not None:
        raise _error(name, row, f"length {n[row].as_py()} != len(response_tokens) {n_resp[row].as_py()}")


def nonfinite_rows(table: pa.Table) -> np.ndarray:
    """Bool mask of rows with NaN/inf in inference_logprobs or old_logprobs or the critic's float
    columns, or NaN/+inf in the distribution columns (-inf is valid in old_logprobs and those: an
    id outside the support)."""
    out = np.zeros(table.num_rows, dtype=bool)
    for name in (*LOGPROB_COLUMNS, *DISTRIBUTION_LOGPROB_COLUMNS, *(c for c in VALUE_COLUMNS if c != "value_versions")):
        if name not in table.column_names:
            continue
        col = table.column(name)
        tokens = pc.list_flatten(col)
        nested = pa.types.is_list(tokens.type)
        values = pc.list_flatten(tokens) if nested else tokens
        bad = pc.fill_null(_invalid_values(values, name), False)
        if not pc.any(bad).as_py():
            continue
        bad_idx = pc.indices_nonzero(bad)
        if nested:  # an entry -> its token -> its row
            bad_idx = pc.take(pc.list_parent_indices(tokens), bad_idx)
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


def conform(table: pa.Table, sampling: SamplingSemantics | None = None,
            top_k: TopKSemantics | None = None) -> pa.Table:
    """Cast v1 columns (and the optional ones present) back to their canonical types (large_list,
    large_string, float64, ...), put them first in canonical order then extras, and attach v1
    metadata.

    Existing sampling (and top-k) metadata is kept when `sampling` (`top_k`) is None. Missing columns are not
    invented (validate() reports them). Raises SchemaError for a cast that would change meaning
    or lose data (e.g. string -> float, int64 overflow), or for another schema_version.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    _check_version(table.schema)
    old_meta = dict(table.schema.metadata or {})
    if sampling is None:
        sampling = sampling_semantics(table.schema)
    if top_k is None:
        top_k = top_k_semantics(table.schema)
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
    meta = {**old_meta, **_metadata(sampling, top_k)}
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
