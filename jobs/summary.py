"""What a run says: the status line of each step, the summary table at its end (held-out mean
reward before and after, reward errors), and placement.json, the record of where each stage ran."""

from __future__ import annotations

from trajflow.engines import checkpoint as ckpt
from trajflow.jobs.console import WIDTH, format_table, wrap
from trajflow.jobs.recorder import RunPaths, read_metrics
from trajflow.pipelines.colocation import NODE_AREA

NODE_PREFIX = f"{NODE_AREA}/"  # metrics-row columns naming the node of a stage's process

# (label, metrics key, format) of a status line, in the order they are dropped last to first
STATUS_KEYS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("mask", "mask/token_kept_frac", "{:.3f}"),
    ("clip", "clip/frac", "{:.3f}"),
    ("k3", "mismatch/k3", "{:.1e}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("loss", "loss", "{:+.4f}"),
)

# (header, metrics key, format) of the summary table
SUMMARY_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("trained", "rows_trained", "{:d}"),
    ("reward errors", "reward/errors", "{:d}"),  # shown when the reward failed on some row
    ("mask", "mask/token_kept_frac", "{:.3f}"),
    ("clip", "clip/frac", "{:.3f}"),
    ("k3", "mismatch/k3", "{:.1e}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("stale max", "staleness/max", "{:.0f}"),
    ("loss", "loss", "{:+.4f}"),
    ("train s", "seconds/train", "{:.2f}"),
)


def status_line(row: dict, steps: int, seconds: float | None = None) -> str:
    """`step 4 (25%) | reward 0.219 | 1.2s | rows 16/32 | mask ...` within WIDTH columns: the
    step index, the share of the run done, the step's numbers (`reward errors N` when the reward
    failed on N rows), the wall time since the previous line (for the first line: since the run
    started, so it shows the start-up)."""
    step = int(row["step"])
    parts = [f"step {step:>{len(str(steps - 1))}} ({100 * (step + 1) // steps:>3}%)"]
    fields = [f"reward {row['reward/mean']:.3f}"] if row.get("reward/mean") is not None else []
    fields.append(f"rows {row.get('rows_trained', 0)}/{row.get('rows', 0)}")
    if row.get("reward/errors"):
        fields.append(f"reward errors {row['reward/errors']}")
    fields += [f"{label} {fmt.format(row[key])}" for label, key, fmt in STATUS_KEYS[1:] if row.get(key) is not None]
    if seconds is not None:
        fields.insert(2, f"{seconds:.1f}s")
    line = parts[0]
    for field in fields:
        if len(line) + 3 + len(field) > WIDTH:
            break
        line += " | " + field
    return line


def record_placement(paths: RunPaths, placement: dict[str, list[str]], row: dict) -> bool:
    """Add the nodes a metrics row reports to `placement` ({stage class: [node ids]}): each
    stage-group actor reports its node in the `node/<stage class>` columns of the row of its first
    batch (pipelines/colocation.py). When that adds a node, placement.json is rewritten with the
    nodes' custom resources, e.g. {"stages": {"Generate": [node]}, "nodes": {node: {...}}}, and
    True returned. (Not Ray's state API: it needs the dashboard, and an embedded Ray has none.)"""
    import json

    import ray

    changed = False
    for key, node in row.items():
        if not (key.startswith(NODE_PREFIX) and node):
            continue
        where = placement.setdefault(key.removeprefix(NODE_PREFIX), [])
        if node not in where:
            where.append(node)
            changed = True
    if changed:
        nodes = {n["NodeID"]: {"address": n.get("NodeManagerAddress"), "resources": n.get("Resources", {})}
                 for n in ray.nodes() if n.get("Alive")}
        ckpt.atomic_write_text(paths.root / "placement.json",
                               json.dumps({"stages": placement, "nodes": nodes}, indent=1, sort_keys=True))
    return changed


def heldout_metric(metrics) -> tuple[str, str] | None:
    """(the held-out metric's key, what it is) in a run's metrics: `heldout/accuracy` (every reward
    0 or 1) or `heldout/mean_reward`; None without an evaluation."""
    for key, what in (("heldout/accuracy", "accuracy"), ("heldout/mean_reward", "mean reward")):
        if key in metrics.columns or f"{key}_start" in metrics.columns:
            return key, what
    return None


def heldout_line(metrics, prompts: int) -> str | None:
    """The held-out score (accuracy, or mean reward) of the starting weights (version 0) and of the
    last version evaluated, with the standard error sqrt(p (1 - p) / n) over the n held-out
    prompts (exact for a 0/1 reward, an upper bound for rewards in [0, 1]); of the change,
    sqrt(se0² + se1²) (the same prompts both times, so conservative). None without an
    evaluation. `metrics`: polars, by step."""
    import math

    def se(p: float | None) -> float | None:
        return math.sqrt(p * (1 - p) / prompts) if p is not None and 0.0 <= p <= 1.0 else None

    def last(column: str):
        values = metrics.select("version", column).drop_nulls() if column in metrics.columns else metrics.clear()
        return (float(values[column][-1]), int(values["version"][-1])) if values.height else (None, None)

    found = heldout_metric(metrics)
    if found is None:
        return None
    key, what = found
    start, _ = last(f"{key}_start")
    end, version = last(key)
    if start is not None and end is not None:
        errors = (se(start), se(end))
        interval = f" ± {math.hypot(*errors):.3f} (s.e.)" if None not in errors else ""
        text = f"{start:.3f} at version 0 -> {end:.3f} at version {version}, {end - start:+.3f}{interval}"
    elif start is not None or end is not None:
        p = start if start is not None else end
        text = f"{p:.3f}" + (f" ± {se(p):.3f} (s.e.)" if se(p) is not None else "") + \
            f" at version {0 if start is not None else version}"
    else:
        return None
    return f"held-out {what} on {prompts} prompts: {text}"


def reward_errors_line(metrics) -> str | None:
    """`reward errors: 12 of 96 rows, in 3 of 6 steps; first: ValueError: ...`, or None when the
    reward never failed. `metrics`: polars, by step."""
    if "reward/errors" not in metrics.columns or not metrics["reward/errors"].sum():
        return None
    errors = metrics["reward/errors"].fill_null(0)
    first = metrics["reward/first_error"].drop_nulls() if "reward/first_error" in metrics.columns else []
    return (f"reward errors: {int(errors.sum())} of {int(metrics['rows'].sum())} rows, in {int((errors > 0).sum())} "
            f"of {metrics.height} steps" + (f"; first: {first[0]}" if len(first) else ""))


def summary_table(paths: RunPaths, steps: int, first_step: int, session_seconds: float,
                  step_seconds: list[float], heldout_prompts: int = 0, replay: str | None = None) -> str:
    """Every step of a short run, or about 10 evenly spaced ones and the last; then the reward
    at both ends, the rows whose reward failed (if any), held-out accuracy before and after
    (over `heldout_prompts`), the time per step, the checkpoints, whether the run can be replayed
    (`replay`: pipelines.replay.replay_support) and the run dir."""
    metrics = read_metrics(paths)
    if metrics.is_empty():
        return "no steps were trained"
    rows = metrics.to_dicts()
    shown = rows if len(rows) <= 12 else [rows[i] for i in sorted({*range(0, len(rows), len(rows) // 10), len(rows) - 1})]
    rewards = metrics["reward/mean"]
    n = min(5, len(rewards))
    checkpoints = [c.path.name for c in ckpt.list_checkpoints(paths.checkpoints)]
    timing = f"this session: steps {first_step}..{steps - 1} in {session_seconds:.1f}s"
    if step_seconds:
        timing += f" ({step_seconds[0]:.1f}s to the first step"
        if len(step_seconds) > 1:
            rest = step_seconds[1:]
            timing += f", then {sum(rest) / len(rest):.2f}s per step"
        timing += ")"
    errors = reward_errors_line(metrics)
    columns = [c for c in SUMMARY_COLUMNS if errors or c[1] != "reward/errors"]
    lines = [
        format_table(shown, columns),
        f"steps logged: {metrics.height} of {steps} | reward: mean of the first {n} steps "
        f"{rewards.head(n).mean():.3f}, of the last {n} {rewards.tail(n).mean():.3f}",
    ]
    if errors:
        lines.append(wrap(errors))
    heldout = heldout_line(metrics, heldout_prompts) if heldout_prompts else None
    if heldout is not None:
        lines.append(wrap(heldout))
    lines += [
        timing,
        f"checkpoints kept: {', '.join(checkpoints) or 'none'}",
        *([wrap(replay)] if replay else []),
        f"run dir: {paths.root}",
    ]
    return "\n".join(lines)
