"""`trajflow report` and `trajflow compare`: a summary table and one PNG of a run's (or several
runs') per-step metrics.

    runs = load_runs(["a/quick", "b/quick"])      # labels "a/quick", "b/quick": runs are paths
    print_table(comparison_table(runs))
    plot_runs(runs, "compare.png", smooth=5)

A run is identified by its resolved path, and labelled by the shortest tail of that path that
tells the runs apart; a run can also be read back from a tracker (a W&B run directory, offline
ones included, or `mlflow:RUN_ID`; jobs/tracked_runs.py). The plots draw the raw per-step values (an N-step rolling mean is an extra,
dashed line, only when asked for), with units on every y axis, a title naming the config(s) and
strategy(ies), and one legend. Also works on metrics DataFrames from a notebook
(`{"snapshot": df, ...}`), which have no path, config or timing.

Steps are the pipeline's step index (0-based, as in the metrics). `seconds_per_step` is the wall
time per step: the mean time between consecutive steps' metrics rows within a session (resumes
excluded), from `seconds/step_end`; `seconds_to_first_step` is the start-up of the first session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import yaml

from trajflow.jobs.console import WIDTH
from trajflow.jobs.recorder import RunPaths, current_metric_names, read_metrics, read_state
from trajflow.jobs.summary import heldout_metric

HELDOUT = "heldout"  # CURVES' stand-in for the run's held-out metric (jobs/summary.py heldout_metric)
# (metrics key, panel title, y-axis label)
CURVES = [
    ("reward/mean", "mean reward of the train batch", "reward"),
    # the greedy responses' mean reward: heldout/accuracy for 0/1 rewards, else heldout/mean_reward
    (HELDOUT, "held-out greedy mean reward", "mean reward (0/1: accuracy)"),
    ("mask/token_kept_frac", "train-infer mask: tokens kept", "fraction of tokens"),
    ("clip/frac", "PPO clip fraction", "fraction of tokens"),
    ("staleness/mean", "staleness (mean per token)", "versions behind"),
    ("seconds_per_step", "wall time per step", "seconds"),
]
# a run with a critic (PPO) adds these panels
CRITIC_CURVES = [
    ("critic/explained_variance", "critic: explained variance of the returns", "1 - Var(R - V) / Var(R)"),
    ("critic/value_loss", "critic: value loss (0.5 squared error, clipped)", "loss"),
    ("critic/value_staleness_mean", "critic: value staleness (mean per token)", "critic versions behind"),
]
FINAL_FRACTION = 5  # final_reward: the mean over the last fifth of the steps (at least 1)


class ReportError(ValueError):
    """A run dir cannot be reported; the message is one line naming it."""


@dataclass
class Run:
    metrics: pl.DataFrame
    path: Path | None = None  # resolved run dir (None: metrics from a notebook)
    config: dict = field(default_factory=dict)  # the run's config.yaml as plain data
    state: dict = field(default_factory=dict)  # its run.json

    @property
    def strategy(self) -> str:
        if "strategy" in self.metrics.columns and self.metrics.height:
            return str(self.metrics["strategy"][0])
        strategy = self.config.get("strategy", "?")  # a name, or {name: NAME, <its settings>}
        return str(strategy.get("name", "?") if isinstance(strategy, dict) else strategy)

    def session_starts(self) -> list[int]:
        return [int(s.get("first_step", 0)) for s in self.state.get("sessions", [])]


def load_run(run_dir: str | Path) -> Run:
    """A run dir, or a tracker's run (a W&B run directory, `mlflow:RUN_ID`: jobs/tracked_runs.py)."""
    from trajflow.jobs.tracked_runs import is_tracked_run, load_tracked_run

    if is_tracked_run(run_dir):
        try:
            return load_tracked_run(run_dir)
        except ValueError as e:
            raise ReportError(str(e)) from None
    root = Path(run_dir)
    if not root.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    metrics = read_metrics(RunPaths(root))
    if metrics.is_empty() and (root / "metrics.parquet").is_file():
        metrics = pl.read_parquet(root / "metrics.parquet")
    if metrics.is_empty():
        raise ReportError(f"{run_dir}: no metrics found (is it a trajflow run directory?)")
    try:
        config = yaml.safe_load((root / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    return Run(metrics, root.resolve(), config if isinstance(config, dict) else {}, read_state(RunPaths(root)))


def short_labels(paths: list[Path]) -> list[str]:
    """The shortest path tails that tell the paths apart: [a/x, b/x, b/y] -> [a/x, b/x, y]."""
    labels = []
    for path in paths:
        depth = 1
        while depth < len(path.parts) and sum(p.parts[-depth:] == path.parts[-depth:] for p in paths) > 1:
            depth += 1
        labels.append("/".join(path.parts[-depth:]))
    return labels


def learner_dirs(run_dir: str | Path) -> list[str | Path]:
    """A team run's learners' run dirs (RUN/agents/<learner>, jobs/team.py), so that its report
    is split by agent; any other run dir as it is."""
    agents = Path(run_dir) / "agents"
    if not agents.is_dir():
        return [run_dir]
    return sorted(p for p in agents.iterdir() if (p / "config.yaml").is_file()) or [run_dir]


def load_runs(run_dirs: list[str | Path]) -> dict[str, Run]:
    """{label: Run}, every dir read before anything is drawn (a team run: one per learner); the
    same dir twice is an error."""
    run_dirs = [d for given in run_dirs for d in learner_dirs(given)]
    runs = [load_run(d) for d in run_dirs]
    seen: dict[Path, str] = {}
    for run, given in zip(runs, run_dirs):
        if run.path in seen:
            raise ReportError(f"{given}: the same run as {seen[run.path]} (given twice)")
        seen[run.path] = str(given)
    return dict(zip(short_labels([r.path for r in runs]), runs))


def _as_runs(runs: dict[str, Run | pl.DataFrame]) -> dict[str, Run]:
    """Runs, a notebook's DataFrames among them under today's metric keys."""
    return {label: r if isinstance(r, Run) else Run(current_metric_names(r)) for label, r in runs.items()}


def step_seconds(run: Run) -> pl.DataFrame:
    """(step, seconds_per_step): wall time from the previous step's end to this one's, within a
    session; empty without `seconds/step_end` (runs from a notebook, or from before it was logged)."""
    m = run.metrics
    if "seconds/step_end" not in m.columns:
        return pl.DataFrame({"step": [], "seconds_per_step": []}, schema={"step": pl.Int64, "seconds_per_step": pl.Float64})
    starts = set(run.session_starts())
    m = m.select("step", "seconds/step_end").drop_nulls().sort("step")
    diffs = m.with_columns(seconds_per_step=pl.col("seconds/step_end").diff(),
                           consecutive=pl.col("step").diff() == 1)
    return diffs.filter(pl.col("consecutive") & ~pl.col("step").is_in(list(starts))).select("step", "seconds_per_step")


def summarize(label: str, run: Run | pl.DataFrame) -> dict:
    run = run if isinstance(run, Run) else Run(current_metric_names(run))
    m = run.metrics

    def col(name: str) -> pl.Series:
        return m[name].drop_nulls() if name in m.columns else pl.Series([], dtype=pl.Float64)

    def mean(name: str, digits: int):
        values = col(name)
        return round(float(values.mean()), digits) if len(values) else None

    heldout = heldout_metric(m)
    acc, start = (col(heldout[0]), col(f"{heldout[0]}_start")) if heldout else (col(""), col(""))
    tail = m.tail(max(1, m.height // FINAL_FRACTION))
    seconds = step_seconds(run)["seconds_per_step"]
    first_session = (run.state.get("sessions") or [{}])[0]
    first_end = m.filter(pl.col("step") == first_session.get("first_step", 0))
    to_first = None
    if first_session.get("started") and "seconds/step_end" in m.columns and first_end.height:
        to_first = round(float(first_end["seconds/step_end"][0]) - float(first_session["started"]), 1)
    return {
        "run": label,
        "path": str(run.path) if run.path else None,
        "config": run.config.get("name"),
        "strategy": run.strategy,
        "steps": m.height,
        "final_reward": round(float(tail["reward/mean"].mean()), 3),
        "final_reward_steps": tail.height,
        "reward_errors": int(col("reward/errors").sum()) if "reward/errors" in m.columns else None,
        "heldout": heldout[1] if heldout else None,
        "start_heldout": round(float(start[0]), 3) if len(start) else None,
        "best_heldout": round(float(acc.max()), 3) if len(acc) else None,
        "final_heldout": round(float(acc[-1]), 3) if len(acc) else None,
        "mask_kept": mean("mask/token_kept_frac", 4),
        "clip_frac": mean("clip/frac", 4),
        "mean_staleness": mean("staleness/mean", 2),
        "max_staleness": int(col("staleness/max").max()) if len(col("staleness/max")) else None,
        "seconds_per_step": round(float(seconds.mean()), 3) if len(seconds) else None,
        "seconds_to_first_step": to_first,
    }


def comparison_table(runs: dict[str, Run | pl.DataFrame]) -> pl.DataFrame:
    """One summary row per run; the best final held-out score (else reward) first."""
    table = pl.DataFrame([summarize(label, r) for label, r in _as_runs(runs).items()])
    key = "final_heldout" if table["final_heldout"].null_count() < table.height else "final_reward"
    return table.sort(key, descending=True, nulls_last=True)


# (row label, column of the comparison table, format) of the printed table
PRINTED = [
    ("strategy", "strategy", "{}"),
    ("steps", "steps", "{:d}"),
    ("final reward", "final_reward", "{:.3f}"),
    ("  = mean of last N steps, N", "final_reward_steps", "{:d}"),
    ("reward errors (rows)", "reward_errors", "{:d}"),
    ("held-out score is the", "heldout", "{}"),
    ("held-out score, version 0", "start_heldout", "{:.3f}"),
    ("held-out score, best", "best_heldout", "{:.3f}"),
    ("held-out score, final", "final_heldout", "{:.3f}"),
    ("mask: tokens kept (mean)", "mask_kept", "{:.4f}"),
    ("clip fraction (mean)", "clip_frac", "{:.4f}"),
    ("staleness, mean (versions)", "mean_staleness", "{:.2f}"),
    ("staleness, max (versions)", "max_staleness", "{:d}"),
    ("wall time per step (s)", "seconds_per_step", "{:.2f}"),
    ("start to first step (s)", "seconds_to_first_step", "{:.1f}"),
]


def print_table(table: pl.DataFrame) -> None:
    """Runs as columns, quantities as rows, in blocks of runs that fit WIDTH columns; then each
    run's path."""
    rows = table.to_dicts()
    head = max(len(label) for label, _, _ in PRINTED)
    printed = [(label, key, fmt) for label, key, fmt in PRINTED if any(r.get(key) is not None for r in rows)]

    def cell(value, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    widths = [max(len(r["run"]), *(len(cell(r.get(k), f)) for _, k, f in printed)) for r in rows]
    block: list[int] = []
    blocks = []
    for i, w in enumerate(widths):
        if block and head + sum(widths[j] + 2 for j in block) + w + 2 > WIDTH:
            blocks.append(block)
            block = []
        block.append(i)
    blocks.append(block)
    for n, block in enumerate(blocks):
        if n:
            print()
        print(" " * head + "".join("  " + rows[i]["run"][-widths[i]:].rjust(widths[i]) for i in block))
        for label, key, fmt in printed:
            print(label.ljust(head) + "".join("  " + cell(rows[i].get(key), fmt).rjust(widths[i]) for i in block))
    for r in rows:
        if r.get("path"):
            print(f"{r['run']}: {r['path']}")


def _title(runs: dict[str, Run]) -> str:
    configs = sorted({str(r.config["name"]) for r in runs.values() if r.config.get("name")})
    strategies = list(dict.fromkeys(r.strategy for r in runs.values()))
    parts = [f"config {', '.join(configs)}"] if configs else []
    parts.append(f"strategy {', '.join(strategies)}")
    return " | ".join(parts)


def plot_runs(runs: dict[str, Run | pl.DataFrame], path: str | Path, smooth: int = 1) -> Path:
    """One panel per curve (CURVES, and CRITIC_CURVES when a run has a critic), one line per run
    (raw values; with smooth > 1 also a dashed rolling mean), one legend for the figure; saved as
    PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = _as_runs(runs)
    data = {label: run.metrics.join(step_seconds(run), on="step", how="left") for label, run in runs.items()}
    curves = CURVES + (CRITIC_CURVES if any(CRITIC_CURVES[0][0] in m.columns for m in data.values()) else [])
    cols = 3
    rows = (len(curves) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.3 * rows + 1.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = {}
    for ax, (column, title, unit) in zip(axes.flat, curves):
        missing = []
        for i, (label, m) in enumerate(data.items()):
            key = (heldout_metric(m) or ("",))[0] if column == HELDOUT else column
            values = m.select("step", key).drop_nulls() if key in m.columns else pl.DataFrame()
            if values.is_empty():
                missing.append(label)
                continue
            steps, ys = values["step"].to_list(), values[key].to_list()
            color = colors[i % len(colors)]
            few = len(steps) <= 40
            (line,) = ax.plot(steps, ys, color=color, lw=1.2, marker="o" if few else None, ms=2.5, label=label)
            handles[label] = line
            if smooth > 1 and len(steps) > smooth:
                ax.plot(steps, values[column].rolling_mean(smooth, min_samples=1).to_list(), color=color, lw=2.2,
                        ls="--", alpha=0.8)
        if missing and len(missing) < len(data):  # said in the title: a note inside the axes would hide data
            title += "\nnone for: " + ", ".join(missing)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("train step")
        ax.set_ylabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not as offsets from a constant
        ax.grid(alpha=0.3)
        if len(missing) == len(data):
            reason = {HELDOUT: "evaluation off (eval_every: 0)", "": "evaluation off (eval_every: 0)",
                      "seconds_per_step": "no step timestamps\n(runs from a notebook or older runs)"}
            ax.text(0.5, 0.5, reason.get(column, "no data"), ha="center", va="center", transform=ax.transAxes,
                    color="0.35")
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    subtitle = "raw per-step values" + (f"; dashed: rolling mean over {smooth} steps" if smooth > 1 else "")
    fig.suptitle(f"{_title(runs)}\n{subtitle}", fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4), fontsize=9,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07 if len(handles) <= 4 else 0.12, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
