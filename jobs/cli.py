"""The `trajflow` command line.

    trajflow run CONFIG [--set key=value ...]       a job on an embedded Ray; writes a run dir
    trajflow run --resume RUN_DIR                   continue a killed run from its last checkpoint
    trajflow submit CONFIG --address http://HOST:8265   the same job on a Ray cluster (Ray Jobs)
    trajflow status JOB_ID --address ...  /  trajflow stop JOB_ID --address ...
    trajflow replay TRAJECTORIES --checkpoints DIR --strategy NAME [--diagnose | --train]
    trajflow generate / trajflow eval               quick looks at a model (no Ray)

CONFIG is a YAML file or the name of a bundled one (`trajflow configs` lists them). Bad input
(config, Parquet, missing weights) ends with one `trajflow: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_generate(args: argparse.Namespace) -> int:
    """Generate a batch with a model, score it teacher-forced, print a table (no Ray needed)."""
    import numpy as np
    import polars as pl
    import torch

    from trajflow.engines import SamplingParams, TorchEngine, score
    from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
    from trajflow.engines.tokenizer import decode_response, encode_prompt
    from trajflow.tasks import get_task

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = Path(args.model or WARM_START_DIR)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    task = get_task(args.task)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    engine = TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, sampling=sampling,
                         inference_dtype=args.inference_dtype, seed=args.seed)
    stream = task.prompts("train", seed=args.seed)
    prompts = [next(stream) for _ in range(args.prompts)]
    prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    gens = engine.generate(prompt_tokens, n=args.n)
    scored = score(model, [prompt_tokens[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)
    rows = []
    for g, train_lp in zip(gens, scored):
        p = prompts[g.prompt_index]
        response = decode_response(tokenizer, g.response_tokens)
        inference_lp = np.asarray(g.logprobs)
        rows.append({
            "prompt": p.text,
            "answer": p.answer,
            "response": response,
            "reward": task.reward(p.text, p.answer, response),
            "tokens": len(g.response_tokens),
            "finish": g.finish_reason,
            "sum_logprob": float(inference_lp.sum()),
            "max_abs_old_minus_inf": float(np.abs(train_lp - inference_lp).max()),
        })
    df = pl.DataFrame(rows)
    with pl.Config(tbl_rows=len(rows), tbl_cols=-1, tbl_width_chars=160):
        print(df)
    print(f"model {model_dir} | inference_dtype {args.inference_dtype} | temperature {args.temperature} | "
          f"mean reward {df['reward'].mean():.3f} | mean |training - inference log-prob| "
          f"{float(np.mean(np.concatenate([np.abs(s - np.asarray(g.logprobs)) for g, s in zip(gens, scored)]))):.2e}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Greedy accuracy of a model on the task's held-out prompts."""
    import torch

    from trajflow.engines.models import WARM_START_DIR, load_model, load_tokenizer
    from trajflow.operators.evaluate import heldout_accuracy
    from trajflow.tasks import get_task

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = Path(args.model or WARM_START_DIR)
    accuracy = heldout_accuracy(load_model(model_dir), load_tokenizer(model_dir), get_task(args.task), args.n,
                                args.max_new_tokens)
    print(f"{args.task}: greedy accuracy {accuracy:.1%} on {args.n} held-out prompts ({model_dir})")
    return 0


class UsageError(ValueError):
    """Bad command-line input; reported as one line."""


def _cmd_configs(args: argparse.Namespace) -> int:
    from trajflow.jobs.config import CONFIGS_DIR, bundled_configs
    from trajflow.operators.strategies import format_strategies

    for name in bundled_configs():
        first = (CONFIGS_DIR / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{name:<12} {first}")
    print("\nstrategies (`strategy:` a name below, or your own as module:Class / file.py:Class):")
    print(format_strategies())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from trajflow.jobs.config import build_job_config, load_job_config, parse_config_text

    if args.resume:
        if args.config or args.config_b64:
            raise UsageError("run: give either CONFIG or --resume RUN_DIR, not both")
        from trajflow.jobs.run import resume_job

        resume_job(args.resume, args.set, progress=not args.no_progress)
        return 0
    if args.config_b64:
        import base64
        import zlib

        text = zlib.decompress(base64.urlsafe_b64decode(args.config_b64.encode())).decode()
        config = build_job_config(parse_config_text(text, "--config-b64"), args.set)
    elif args.config:
        config = load_job_config(args.config, args.set)
    else:
        raise UsageError("run: a CONFIG (file or bundled name, e.g. quickstart) or --resume RUN_DIR is required")
    if args.run_dir:
        config = config.model_copy(update={"run_dir": Path(args.run_dir)})
    from trajflow.jobs.run import run_job  # imported after validation: torch loads only for a valid config

    run_job(config, progress=not args.no_progress)
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from trajflow.jobs.config import load_job_config

    config = load_job_config(args.config, args.set)
    if args.run_dir:
        config = config.model_copy(update={"run_dir": Path(args.run_dir)})
    from trajflow.jobs.submit import submit

    return submit(config, args.address, wait=not args.no_wait, python=args.python,
                  submission_id=args.submission_id)


def _cmd_status(args: argparse.Namespace) -> int:
    from trajflow.jobs.submit import status

    return status(args.job_id, args.address)


def _cmd_stop(args: argparse.Namespace) -> int:
    from trajflow.jobs.submit import stop

    return stop(args.job_id, args.address)


def _find_run_config(trajectories: Path) -> Path | None:
    path = trajectories.resolve()
    for candidate in [path, *path.parents][:4]:
        if (candidate / "config.yaml").is_file():
            return candidate / "config.yaml"
    return None


def _cmd_replay(args: argparse.Namespace) -> int:
    import time

    import polars as pl

    from trajflow.engines import checkpoint as ckpt
    from trajflow.jobs.config import JobConfigError, load_job_config
    from trajflow.jobs.recorder import write_table_atomic
    from trajflow.jobs.run import quiet_ray_data, start_ray
    from trajflow.pipelines.replay import Replay

    trajectories = Path(args.trajectories)
    config_path = Path(args.config) if args.config else _find_run_config(trajectories)
    if config_path is None:
        raise JobConfigError(f"config error: no config.yaml found beside {trajectories}; pass --config FILE")
    config = load_job_config(config_path, args.set)
    strategies = [s for item in args.strategy for s in item.split(",") if s]
    mode = "train" if args.train else "diagnose"
    replay = Replay(config.pipeline_config(), trajectories, args.checkpoints, strategies, mode)  # checks all inputs

    run_root = config_path.parent
    out = Path(args.out) if args.out else run_root / "replay" / f"{mode}-{'+'.join(strategies)}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"replay: --out {out} already exists and is not empty")
    print(f"trajflow: replay ({mode}) of {len(replay.steps)} steps under {', '.join(strategies)}; "
          f"{len(replay.weights)} versions from {args.checkpoints}", flush=True)
    start_ray(config)
    quiet_ray_data()
    metrics = replay.run()

    # everything is written into a temp dir and renamed at the end: no half-written output
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    write_table_atomic(metrics.to_arrow(), tmp / "metrics.parquet")
    ckpt.atomic_write_text(tmp / "config.yaml", config.to_yaml())
    if mode == "train":
        ckpt.save_weights(replay.final_weights, tmp / "model.safetensors")
    if out.exists():
        out.rmdir()
    tmp.rename(out)

    keys = [k for k in ("step", "strategy", "rows_trained", "mask/token_kept_frac", "clip/frac", "active_frac",
                        "mismatch/k3", "is/ess", "staleness/mean", "loss") if k in metrics.columns]
    with pl.Config(tbl_rows=40, tbl_cols=-1, tbl_width_chars=200, float_precision=4,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(metrics.select(keys))
        means = [c for c in keys if c not in ("step", "strategy")]
        print(metrics.group_by("strategy", maintain_order=True).agg([pl.col(c).mean() for c in means]))
    _compare_with_logged(metrics, run_root, config.build_strategy().name, mode)
    print(f"trajflow: replay written to {out}")
    return 0


def _compare_with_logged(metrics, run_root: Path, logged_strategy: str, mode: str) -> None:
    """Diagnosing a run under its own strategy should reproduce its logged diagnostics: say how close."""
    import polars as pl

    from trajflow.jobs.recorder import RunPaths, read_metrics

    if mode != "diagnose" or "strategy" not in metrics.columns:
        return
    logged = read_metrics(RunPaths(run_root))
    mine = metrics.filter(pl.col("strategy") == logged_strategy)
    if logged.is_empty() or mine.is_empty():
        return
    prefixes = ("mask/", "clip/", "mismatch/", "is/", "staleness/", "active_frac", "loss")
    keys = [k for k in mine.columns if k.startswith(prefixes) and k in logged.columns]
    joined = mine.select("step", *keys).join(logged.select("step", *keys), on="step", suffix="_logged")
    worst = 0.0
    for k in keys:
        diff = (joined[k] - joined[f"{k}_logged"]).abs().max()
        worst = max(worst, float(diff or 0.0))
    print(f"trajflow: {logged_strategy} replay vs the run's logged diagnostics over {joined.height} steps, "
          f"{len(keys)} keys: max |difference| {worst:.2e}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate and score a batch with a model; print a table")
    gen.add_argument("--model", help="local model dir (default: the built-in warm start)")
    gen.add_argument("--task", default="addition")
    gen.add_argument("--prompts", type=int, default=4)
    gen.add_argument("--n", type=int, default=4, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--max-new-tokens", type=int, default=6)
    gen.add_argument("--inference-dtype", default="bfloat16", choices=["float32", "bfloat16", "fp8"])
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    ev = sub.add_parser("eval", help="greedy accuracy on held-out prompts")
    ev.add_argument("--model", help="local model dir (default: the built-in warm start)")
    ev.add_argument("--task", default="addition")
    ev.add_argument("--n", type=int, default=1000)
    ev.add_argument("--max-new-tokens", type=int, default=6)
    ev.set_defaults(func=_cmd_eval)

    def add_set(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (dotted path; the value is parsed as YAML), repeatable")

    run = sub.add_parser("run", help="run a job on an embedded Ray (or continue one with --resume)")
    run.add_argument("config", nargs="?", help="YAML job config, or a bundled name (quickstart, snapshot, ...)")
    add_set(run)
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its last checkpoint")
    run.add_argument("--run-dir", help="where to write the run (default: runs_root/NAME-STRATEGY-TIME)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (status lines only)")
    run.add_argument("--config-b64", help=argparse.SUPPRESS)  # inline config (used by `submit`)
    run.set_defaults(func=_cmd_run)

    sb = sub.add_parser("submit", help="submit a job to a Ray cluster (Ray Jobs API), stream its logs")
    sb.add_argument("config")
    add_set(sb)
    sb.add_argument("--address", required=True, help="the cluster's dashboard, e.g. http://127.0.0.1:8265")
    sb.add_argument("--run-dir", help="run dir on storage the cluster can write (default: runs_root/...)")
    sb.add_argument("--no-wait", action="store_true", help="return after submitting")
    sb.add_argument("--python", default="python", help="the cluster's Python with trajflow installed")
    sb.add_argument("--submission-id", help="job id to use (default: generated)")
    sb.set_defaults(func=_cmd_submit)

    st = sub.add_parser("status", help="status of a submitted job")
    st.add_argument("job_id")
    st.add_argument("--address", required=True)
    st.set_defaults(func=_cmd_status)

    sp = sub.add_parser("stop", help="stop a submitted job")
    sp.add_argument("job_id")
    sp.add_argument("--address", required=True)
    sp.set_defaults(func=_cmd_stop)

    rp = sub.add_parser("replay", help="replay a logged trajectory dataset under a strategy")
    rp.add_argument("trajectories", help="a run dir, its trajectories/ dir, or Parquet file(s)")
    rp.add_argument("--checkpoints", required=True,
                    help="dir with the versions' weights (a run dir, its versions/ or checkpoints/)")
    rp.add_argument("--strategy", action="append", required=True,
                    help="strategy to replay under (a name, or module:Class / file.py:Class); repeat "
                         "(or comma-separate) to compare in --diagnose")
    mode = rp.add_mutually_exclusive_group()
    mode.add_argument("--diagnose", action="store_true", help="correction diagnostics per step, no training (default)")
    mode.add_argument("--train", action="store_true", help="train on the logged data")
    rp.add_argument("--config", help="job config (default: the run's config.yaml beside the log)")
    add_set(rp)
    rp.add_argument("--out", help="output dir (default: RUN/replay/MODE-STRATEGY-TIME)")
    rp.set_defaults(func=_cmd_replay)

    cf = sub.add_parser("configs", help="list the bundled job configs and the strategies")
    cf.set_defaults(func=_cmd_configs)

    rep = sub.add_parser("report", help="summary table and PNG plots of one run")
    rep.add_argument("run_dir")
    rep.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")
    rep.set_defaults(func=_cmd_report)

    cmp_ = sub.add_parser("compare", help="side-by-side table and PNG plots of several runs")
    cmp_.add_argument("run_dirs", nargs="+")
    cmp_.add_argument("--out", default="compare.png", help="PNG path (default: compare.png)")
    cmp_.set_defaults(func=_cmd_compare)
    return parser


def _cmd_report(args: argparse.Namespace) -> int:
    return _report_runs([args.run_dir], args.out or str(Path(args.run_dir) / "report.png"))


def _cmd_compare(args: argparse.Namespace) -> int:
    return _report_runs(args.run_dirs, args.out)


def _report_runs(run_dirs: list[str], out: str) -> int:
    from trajflow.jobs.report import comparison_table, load_run, plot_runs, print_table

    runs = dict(load_run(d) for d in run_dirs)
    print_table(comparison_table(runs))
    print(f"plots: {plot_runs(runs, out)}")
    return 0


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


_BAD_INPUT = (
    ("trajflow.jobs.cli", "UsageError"),
    ("trajflow.jobs.config", "JobConfigError"),
    ("trajflow.jobs.run", "RunError"),
    ("trajflow.pipelines.replay", "ReplayError"),
    ("trajflow.schemas.trajectory", "SchemaError"),
    ("trajflow.engines.checkpoint", "CheckpointError"),
    ("trajflow.tasks.dataset", "DataError"),  # a dataset problem found while reading it (e.g. a null prompt)
    ("trajflow.tasks.rewards", "RewardSpecError"),
    ("builtins", "FileNotFoundError"),
)


def _is_bad_input(error: BaseException) -> bool:
    """An error about the user's input (not a bug): reported as one line. Only modules already
    imported are checked — an error cannot come from a module that was never loaded."""
    for module, name in _BAD_INPUT:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "eval", "configs"):
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("trajflow: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _is_bad_input(e):
            print(f"trajflow: {_one_line(e)}", file=sys.stderr)
            return 2
        if isinstance(e, getattr(sys.modules.get("trajflow.jobs.run"), "RunFailed", ())):  # resumable
            print(f"trajflow: {_one_line(e)}", file=sys.stderr)
            return 1
        if args.command in ("submit", "status", "stop") and isinstance(e, (ConnectionError, RuntimeError)):
            print(f"trajflow: {args.command}: {_one_line(e)}", file=sys.stderr)  # the cluster said no
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
