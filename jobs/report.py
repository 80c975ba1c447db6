"""`trajflow report` and `trajflow compare`: terminal tables and PNG plots of run metrics.

The same curves for every run, side by side: reward (and held-out accuracy when evaluated),
train-infer mask fraction, clip fraction and staleness. Works on run directories written by
`trajflow run` (their per-step metrics) and on metrics DataFrames from a notebook.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from trajflow.jobs.recorder import RunPaths, read_metrics

CURVES = [
    ("reward_mean", "mean reward (train batch)"),
    ("heldout_accuracy", "held-out greedy accuracy"),
    ("mask/token_kept_frac", "train-infer mask: tokens kept"),
    ("clip/frac", "PPO clip fraction"),
    ("active_frac", "active fraction (kept, unclipped)"),
    ("staleness/mean", "staleness (versions, mean per token)"),
]
SUMMARY = ["steps", "final_reward", "best_heldout_accuracy", "final_heldout_accuracy", "mask_kept", "clip_frac",
           "mean_staleness", "max_staleness", "seconds_per_step"]


def load_run(run_dir: str | Path) -> tuple[str, pl.DataFrame]:
    """(label, metrics) of a run directory; the label is strategy@staleness plus the dir name."""
    run_dir = Path(run_dir)
    metrics = read_metrics(RunPaths(run_dir))
    if metrics.is_empty() and (run_dir / "metrics.parquet").is_file():
        metrics = pl.read_parquet(run_dir / "metrics.parquet")
    if metrics.is_empty():
        raise FileNotFoundError(f"{run_dir}: no metrics found (is it a trajflow run directory?)")
    return f"{run_dir.name}", metrics


def summarize(label: str, m: pl.DataFrame) -> dict:
    def col(name: str) -> pl.Series:
        return m[name].drop_nulls() if name in m.columns else pl.Series([], dtype=pl.Float64)

    acc = col("heldout_accuracy")
    tail = m.tail(max(1, m.height // 5))  # the last fifth of training, for noisy batch rewards
    return {
        "run": label,
        "strategy": m["strategy"][0] if "strategy" in m.columns else "?",
        "steps": m.height,
        "final_reward": round(float(tail["reward_mean"].mean()), 3),
        "best_heldout_accuracy": round(float(acc.max()), 3) if len(acc) else None,
        "final_heldout_accuracy": round(float(acc[-1]), 3) if len(acc) else None,
        "mask_kept": round(float(col("mask/token_kept_frac").mean()), 4) if len(col("mask/token_kept_frac")) else None,
        "clip_frac": round(float(col("clip/frac").mean()), 4) if len(col("clip/frac")) else None,
        "mean_staleness": round(float(col("staleness/mean").mean()), 2) if len(col("staleness/mean")) else None,
        "max_staleness": int(col("staleness/max").max()) if len(col("staleness/max")) else None,
        "seconds_per_step": round(float(col("train_seconds").mean()), 3) if len(col("train_seconds")) else None,
    }


def comparison_table(runs: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """One summary row per run; the best final held-out accuracy (else reward) first."""
    table = pl.DataFrame([summarize(label, m) for label, m in runs.items()])
    key = "final_heldout_accuracy" if table["final_heldout_accuracy"].null_count() < table.height else "final_reward"
    return table.sort(key, descending=True, nulls_last=True)


def plot_runs(runs: dict[str, pl.DataFrame], path: str | Path, smooth: int = 5) -> Path:
    """A grid of the CURVES for every run, one line per run; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [(c, t) for c, t in CURVES if any(c in m.columns and m[c].drop_nulls().len() for m in runs.values())]
    cols = 3
    rows = (len(curves) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (column, title) in zip(axes.flat, curves):
        for label, m in runs.items():
            if column not in m.columns:
                continue
            data = m.select("step", column).drop_nulls()
            values = data[column]
            if column != "heldout_accuracy" and smooth > 1:
                values = values.rolling_mean(smooth, min_samples=1)
            ax.plot(data["step"].to_list(), values.to_list(), label=label,
                    marker="o" if column == "heldout_accuracy" else None)
        ax.set_title(title)
        ax.set_xlabel("train step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(table: pl.DataFrame) -> None:
    with pl.Config(tbl_rows=table.height, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True):
        print(table)
