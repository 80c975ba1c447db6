"""The accounting every train (or diagnose) step does before its update: the staleness bound
where tokens are trained, and the step's row counts (rows in, trained, filtered per reason, the
rows whose reward failed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.schemas.columns import REWARD_ERROR, filter_reasons, mark_filtered, padded, replace_column


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
        "staleness/over_stale_tokens": stale_tokens,
        "reward/mean": pc.mean(batch["reward"]).as_py(),  # over the rows that scored
    }
    if metrics["reward/mean"] is None:  # none did (numpy's nanmean would warn in the worker)
        metrics["reward/mean"] = float("nan")
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
