"""The columns operators add to the trajectory record beyond schema v1, and small Arrow helpers
shared by the operators (filter reasons, padded per-token arrays, group codes)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FILTER_REASON = "filter_reason"  # null = kept for training; otherwise why the row is not trained
# the filter reason of a row whose reward failed, and the column saying why (schemas: OPTIONAL_COLUMNS)
REWARD_ERROR = "reward_error"
# pi_old as the train step's loss used it (every strategy; -inf: a token outside the sampling
# support). `old_logprobs` keeps its one meaning: what an upstream operator supplied (exact strategies).
LOSS_OLD_COLUMN = "loss_old_logprobs"
FORMER_LOSS_OLD_COLUMN = "proximal_logprobs"  # its name in logs written before: replay drops both
# the KL to a frozen reference (operators/reference.py): log pi_ref per token, and under
# `kl.in: reward` the per-row penalty the advantage subtracts from the reward
REFERENCE_COLUMN = "reference_logprobs"
KL_PENALTY_COLUMN = "kl_penalty"
# per-token advantages (REINFORCE++ with advantage.gamma < 1, GAE); `advantage` is then their mean
TOKEN_ADVANTAGE_COLUMN = "token_advantages"
# the critic's (operators/values.py, operators/trainer/critic.py): V(s_t) per token at behavior
# time and the critic version of each, the trainer's current critic's values, GAE's returns
VALUES_COLUMN = "values"
VALUE_VERSIONS_COLUMN = "value_versions"
TRAIN_VALUES_COLUMN = "train_values"
RETURNS_COLUMN = "returns"


def replace_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    """Set column `name` (replacing it in place if present, appending otherwise)."""
    index = table.schema.get_field_index(name)
    if index < 0:
        return table.append_column(name, values)
    field = table.schema.field(index).with_type(values.type)
    return table.set_column(index, field, values)


def group_codes(table: pa.Table, column: str = "group_id") -> np.ndarray:
    """Integer code per row of its group (0..G-1), vectorised via dictionary encoding."""
    encoded = pc.dictionary_encode(table[column]).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def filter_reasons(table: pa.Table) -> np.ndarray:
    """The filter_reason column as an object array (None = kept); all None if absent."""
    if FILTER_REASON not in table.column_names:
        return np.full(table.num_rows, None, dtype=object)
    return np.array(table[FILTER_REASON].to_pylist(), dtype=object)


def mark_filtered(table: pa.Table, drop: np.ndarray, reason: str) -> pa.Table:
    """Give rows in `drop` the filter reason `reason`, keeping any earlier reason."""
    reasons = filter_reasons(table)
    reasons[(reasons == None) & drop] = reason  # noqa: E711 - elementwise comparison
    return replace_column(table, FILTER_REASON, pa.array(reasons.tolist(), pa.string()))


def list_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column, without per-row Python."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def padded(column: pa.ChunkedArray | pa.Array, width: int, fill: float, dtype=np.float32) -> np.ndarray:
    """A list column as a right-padded [rows, width] array (null rows become all `fill`)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(array)
    out = np.full((rows, width), fill, dtype=dtype)
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    if array.null_count:
        lengths = np.where(array.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    values = array.values.to_numpy(zero_copy_only=False)
    row_idx = np.repeat(np.arange(rows), lengths)
    starts = np.repeat(offsets[:-1], lengths)
    col_idx = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[row_idx, col_idx] = values[starts + col_idx]
    return out


def nested_rows(column: pa.ChunkedArray | pa.Array) -> list[np.ndarray | None]:
    """A list<list<T>> column with K entries per token (a top-k column) as one [T, K] array per
    row (None for a null row), without per-token Python."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    tokens = pc.list_flatten(array)
    widths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    k = int(widths[0]) if len(widths) else 0
    values = pc.list_flatten(tokens).to_numpy(zero_copy_only=False)
    values = values.reshape(-1, k) if k else values.reshape(0, 0)
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return [values[starts[i]:starts[i + 1]] if valid[i] else None for i in range(len(array))]


def nested_array(rows: list[np.ndarray | None], value_type: pa.DataType, k: int) -> pa.ListArray:
    """One [T, K] array per row (None: a null row) as a list<list<value_type>> column."""
    lengths = np.array([0 if r is None else len(r) for r in rows], dtype=np.int32)
    present = [np.asarray(r).reshape(-1, k) for r in rows if r is not None]
    values = np.concatenate(present) if present else np.zeros((0, k))
    inner = pa.ListArray.from_arrays(pa.array(np.arange(len(values) + 1, dtype=np.int32) * k),
                                     pa.array(values.reshape(-1), type=value_type))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    mask = pa.array([r is None for r in rows], pa.bool_())
    return pa.ListArray.from_arrays(offsets, inner, type=pa.list_(pa.list_(value_type)), mask=mask)


def padded_nested(column: pa.ChunkedArray | pa.Array, width: int, fill: float, dtype=np.float32) -> np.ndarray:
    """A top-k column as a right-padded [rows, width, K] array (padding and null rows: `fill`)."""
    rows = nested_rows(column)
    k = next((r.shape[1] for r in rows if r is not None), 0)
    out = np.full((len(rows), width, k), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, : len(r)] = r
    return out
