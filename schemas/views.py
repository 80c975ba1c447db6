"""Polars views of v1 trajectory tables for analysis (expects a valid v1 table)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

_ID_COLUMNS = ["trajectory_id", "group_id", "prompt_id"]
# exploded per-token column -> name in the token view
_TOKEN_COLUMNS = {
    "response_tokens": "token",
    "loss_mask": "loss_mask",
    "inference_logprobs": "inference_logprob",
    "old_logprobs": "old_logprob",
    "versions": "version",
}


def token_view(table: pa.Table) -> pl.DataFrame:
    """One row per response token: trajectory_id, group_id, prompt_id, position, token,
    loss_mask, inference_logprob, old_logprob (null where the row has none), version,
    reward, advantage."""
    cols = _ID_COLUMNS + list(_TOKEN_COLUMNS) + ["reward", "advantage"]
    df = pl.from_arrow(table.select(cols))
    assert isinstance(df, pl.DataFrame)
    length = pl.col("response_tokens").list.len()
    df = (
        df.filter(length > 0)  # exploding an empty list would yield a null row in some versions
        .with_columns(
            pl.int_ranges(0, length, dtype=pl.Int32).alias("position"),
            pl.col("old_logprobs").is_not_null().alias("_has_old"),
            # a null list cannot be exploded alongside the others: fill, then null it again
            pl.col("old_logprobs").fill_null(pl.col("inference_logprobs")),
        )
        .explode(["position", *_TOKEN_COLUMNS])
        .with_columns(
            pl.when(pl.col("_has_old")).then(pl.col("old_logprobs")).alias("old_logprobs")
        )
        .rename(_TOKEN_COLUMNS)
    )
    return df.select(
        *_ID_COLUMNS, "position", "token", "loss_mask", "inference_logprob", "old_logprob",
        "version", "reward", "advantage",
    )


def trajectory_view(table: pa.Table) -> pl.DataFrame:
    """One row per trajectory: ids, finish_reason, reward, advantage, response_len,
    n_loss_tokens, min_version, max_version, version_span (max - min), mean_logprob
    (mean inference log-prob over loss-mask tokens; null if none), has_old_logprobs."""
    mask_col = table.column("loss_mask")
    parents = pc.list_parent_indices(mask_col).to_numpy()
    mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False).astype(np.float64)
    lp = pc.list_flatten(table.column("inference_logprobs")).to_numpy(zero_copy_only=False)
    n = table.num_rows
    n_loss = np.bincount(parents, weights=mask, minlength=n)
    lp_sum = np.bincount(parents, weights=lp.astype(np.float64) * mask, minlength=n)
    mean_lp = pa.array((lp_sum / np.maximum(n_loss, 1)).astype(np.float32), mask=n_loss == 0)

    df = pl.from_arrow(
        table.select(_ID_COLUMNS + ["finish_reason", "reward", "advantage", "response_tokens",
                                    "versions", "old_logprobs"])
    )
    assert isinstance(df, pl.DataFrame)
    return df.select(
        *_ID_COLUMNS,
        "finish_reason",
        "reward",
        "advantage",
        pl.col("response_tokens").list.len().cast(pl.Int32).alias("response_len"),
        pl.Series("n_loss_tokens", n_loss.astype(np.int32)),
        pl.col("versions").list.min().alias("min_version"),
        pl.col("versions").list.max().alias("max_version"),
        (pl.col("versions").list.max() - pl.col("versions").list.min()).alias("version_span"),
        pl.Series("mean_logprob", mean_lp),
        pl.col("old_logprobs").is_not_null().alias("has_old_logprobs"),
    )
