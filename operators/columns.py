"""Small Arrow helpers shared by the operators."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FILTER_REASON = "filter_reason"  # null = kept for training; otherwise why the row is not trained
# the filter reason of a row whose reward failed, and the column saying why (schemas: OPTIONAL_COLUMNS)
REWARD_ERROR = "reward_error"
# pi_old as the train step's loss used it (every strategy; -inf: a token outside the sampling
# support). `old_logprobs` keeps its one meaning: what an upstream operator supplied (exact strategies).
PROXIMAL_COLUMN = "proximal_logprobs"
# the KL to a frozen reference (operators/reference.py): log pi_ref per token, and under
# `kl.in: reward` the per-row penalty the advantage subtracts from the reward
REFERENCE_COLUMN = "reference_logprobs"
KL_PENALTY_COLUMN = "kl_penalty"
# per-token advantages (REINFORCE++ with advantage.gamma < 1); `advantage` is then their mean
TOKEN_ADVANTAGE_COLUMN = "token_advantages"


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


def apply_staleness_bound(batch: pa.Table, trainer_version: int, max_staleness: int) -> tuple[pa.Table, np.ndarray, int]:
    """Take tokens older than `max_staleness` (trainer_version - token version) out of the loss;
    rows left without a loss token are filtered as `over_stale`.

    Returns (batch, indices of the rows to train on, number of tokens taken out).
    """
    width = max(1, max((len(v) for v in batch["versions"].to_pylist()), default=1))
    versions = padded(batch["versions"], width, trainer_version, np.int64)
    loss_mask = padded(batch["loss_mask"], width, False, bool)
    over = loss_mask & (trainer_version - versions > max_staleness)
    stale_tokens = int(over.sum())
    if stale_tokens:
        kept = loss_mask & ~over
        new_masks = [row[: len(v)].tolist() for row, v in zip(kept, batch["versions"].to_pylist())]
        batch = replace_column(batch, "loss_mask", pa.array(new_masks, pa.list_(pa.bool_())))
        batch = mark_filtered(batch, ~kept.any(axis=1) & loss_mask.any(axis=1), "over_stale")
    trained = np.flatnonzero(filter_reasons(batch) == None)  # noqa: E711
    return batch, trained, stale_tokens


def step_metrics(batch: pa.Table, step: int, rollout_step: int, trained: np.ndarray, stale_tokens: int) -> dict:
    """The accounting every train (or diagnose) step reports: rows in, trained, filtered per reason,
    the rows whose reward failed and (when some did) the first one's error."""
    metrics: dict = {
        "step": step,
        "rollout_step": rollout_step,
        "rows": batch.num_rows,
        "rows_trained": len(trained),
        "over_stale_tokens_dropped": stale_tokens,
        "reward_mean": pc.mean(batch["reward"]).as_py(),  # over the rows that scored
    }
    if metrics["reward_mean"] is None:  # none did (numpy's nanmean would warn in the worker)
        metrics["reward_mean"] = float("nan")
    reasons = filter_reasons(batch)
    for reason in sorted({r for r in reasons if r is not None}):
        metrics[f"filtered/{reason}"] = int((reasons == reason).sum())
    # always present (plottable): the rows the reward failed on, whatever else filtered them
    if REWARD_ERROR in batch.column_names:
        errors = batch[REWARD_ERROR].drop_null()
        metrics["reward/errors"] = len(errors)
        if len(errors):
            metrics["reward/first_error"] = errors[0].as_py()
    else:  # a log from before the column, or an environment's episodes
        metrics["reward/errors"] = int((reasons == REWARD_ERROR).sum())
    return metrics
