"""The `trajflow` command line.

    trajflow run CONFIG [--set key=value ...]       a job on an embedded Ray; writes a run dir
    trajflow run --resume RUN_DIR                   continue a killed run from its last checkpoint
    trajflow submit CONFIG --address http://HOST:8265   the same job on a Ray cluster (Ray Jobs)
    trajflow status JOB_ID --address ...  /  trajflow stop JOB_ID --address ...
    trajflow replay TRAJECTORIES --checkpoints DIR --strategy NAME [--diagnose | --train]
    trajflow report RUN_DIR  /  trajflow compare RUN_DIR...   summary table and a PNG of the curves
    trajflow generate / trajflow eval               quick looks at a model (no Ray)
    trajflow prepare smollm2                        build a packaged model's HF directory (once, cached)

CONFIG is a YAML file or the name of a bundled one (`trajflow configs` lists them). Bad input
(a command-line argument, a config key, a Parquet file, missing weights, an unreachable cluster)
ends with one `trajflow: ...` line that names the problem and exit status 2, before anything is
written or started. `--verbose` shows what a normal run keeps quiet (Ray's own notices, weight
loading bars).

One module on purpose: the argparse front end of every command and the one rule that turns any
bad input into one line and exit status 2; the commands' work lives in their own modules.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_generate(args: argparse.Namespace) -> int:
    """Generate a batch with a model, score it teacher-forced, print a table (no Ray needed)."""
    from trajflow.engines.paths import WARM_START_DIR

    model_dir = _checked_model_dir(args.model, WARM_START_DIR)  # checked before torch loads
    task_name = _checked_task(args.task)
    import numpy as np
    import torch

    from trajflow.engines import SamplingConfig, TorchEngine, score
    from trajflow.engines.models import load_model, load_tokenizer
    from trajflow.engines.tokenizer import decode_response, encode_prompt
    from trajflow.jobs.console import format_table
    from trajflow.tasks import get_task, is_environment

    task = get_task(task_name)
    if is_environment(task):
        raise UsageError(f"--task {task_name} is a multi-turn environment; `trajflow eval --task {task_name}` "
                         "plays its episodes")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    engine = TorchEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, sampling=sampling,
                         inference_dtype=args.inference_dtype, seed=args.seed)
    stream = task.prompts("train", seed=args.seed)
    prompts = [next(stream) for _ in range(args.prompts)]
    prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    gens = engine.generate(prompt_tokens, n=args.n)
    scored = score(model, [prompt_tokens[g.prompt_index] for g in gens], [g.response_tokens for g in gens], sampling)
    rows, gaps = [], []
    for g, train_lp in zip(gens, scored):
        p = prompts[g.prompt_index]
        response = decode_response(tokenizer, g.response_tokens)
        gap = np.abs(train_lp - np.asarray(g.logprobs))
        gaps.append(gap)
        rows.append({"prompt": p.text, "answer": p.answer, "response": response,
                     "reward": task.reward(p.text, p.answer, response), "tokens": len(g.response_tokens),
                     "finish": g.finish_reason, "sum_logprob": float(np.sum(g.logprobs)), "max_gap": float(gap.max())})
    print(format_table(rows, [("prompt", "prompt", "{}"), ("answer", "answer", "{}"), ("response", "response", "{!r}"),
                              ("reward", "reward", "{:.2f}"), ("tokens", "tokens", "{:d}"), ("finish", "finish", "{}"),
                              ("sum log-prob", "sum_logprob", "{:.3f}"),
                              ("max |train - inference|", "max_gap", "{:.1e}")]))
    print(f"model {model_dir}")
    print(f"inference_dtype {args.inference_dtype} | temperature {args.temperature} | mean reward "
          f"{np.mean([r['reward'] for r in rows]):.3f} | mean |train - inference log-prob| "
          f"{float(np.mean(np.concatenate(gaps))):.2e}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Greedy mean reward of a model on held-out prompts: a config's (its data.test_files and
    reward) or a built-in task's (jobs/evaluate.py)."""
    from trajflow.jobs.evaluate import EvalModelError, evaluate, resolve_model

    if args.config:
        if args.task:
            raise UsageError("give either --config or --task, not both")
        from trajflow.jobs.config import load_job_config

        config = load_job_config(args.config, args.set)
        workload = config.workload()
        if workload.data is not None and not workload.data.test_files:
            raise UsageError(f"--config {args.config}: data.test_files is empty (nothing held out to evaluate on)")
        n = args.n if args.n else (None if workload.data is not None else config.eval_prompts)
        what = "data.test_files" if workload.data is not None else f"the {workload.task_object().name} task"
        max_new_tokens, stop = args.max_new_tokens or config.sampling.max_new_tokens, tuple(config.sampling.stop)
    else:
        if args.set:
            raise UsageError("--set applies to --config")
        from trajflow.jobs.config import build_job_config

        config = build_job_config({"task": _checked_task(args.task or "addition")})
        workload, n, what = config.workload(), args.n or 1000, f"the {config.task} task"
        max_new_tokens, stop = args.max_new_tokens or 6, ()
    try:
        model = resolve_model(args.model, config)  # checked before torch loads
    except EvalModelError as e:
        raise UsageError(str(e)) from None
    result = evaluate(workload, model, n, max_new_tokens, stop)
    print(result.line(what, model.label))
    return 0


class UsageError(ValueError):
    """Bad command-line input; reported as one line."""


def _checked_model_dir(model: str | None, default: Path) -> Path:
    from trajflow.pipelines.config import check_model_dir

    path = Path(model) if model else default
    try:
        check_model_dir(path)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None
    return path


def _checked_task(task: str) -> str:
    from trajflow.pipelines.config import check_task

    try:
        return check_task(task)
    except ValueError as e:
        raise UsageError(f"--task: {e}") from None


def _checked_address(address: str) -> str:
    """The Ray dashboard's URL (http(s)://HOST:PORT). Without a scheme Ray would read the address
    as a GCS address and spend ~50 s trying to connect before trying another one."""
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--address {address!r}: give the Ray dashboard's URL with its scheme, "
                         f"e.g. http://{address if '://' not in address else '127.0.0.1:8265'}")
    try:
        parts.port
    except ValueError:
        raise UsageError(f"--address {address!r}: the port is not a number from 0 to 65535") from None
    return address


def _cmd_prepare(args: argparse.Namespace) -> int:
    from trajflow.engines.prepared import PrepareError, prepare

    try:
        print(prepare(args.name))
    except PrepareError as e:
        raise UsageError(str(e)) from None
    return 0


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
            raise UsageError("give either CONFIG or --resume RUN_DIR, not both")
        if args.run_dir:
            raise UsageError("--resume continues RUN_DIR in place; --run-dir does not apply")
        from trajflow.jobs.run import resume_job

        resume_job(args.resume, args.set, progress=not args.no_progress, verbose=args.verbose)
        return 0
    if args.config_b64:
        import base64
        import zlib

        try:
            text = zlib.decompress(base64.urlsafe_b64decode(args.config_b64.encode())).decode()
        except (ValueError, zlib.error):
            raise UsageError("--config-b64 is not a config written by `trajflow submit`") from None
        config = build_job_config(parse_config_text(text, "--config-b64"), args.set)
    elif args.config:
        config = load_job_config(args.config, args.set)
    else:
        raise UsageError("a CONFIG (file or bundled name, e.g. quickstart) or --resume RUN_DIR is required")
    if args.run_dir:
        config = config.model_copy(update={"run_dir": Path(args.run_dir)})
    from trajflow.jobs.run import run_job  # imported after validation: torch loads only for a valid config

    run_job(config, progress=not args.no_progress, verbose=args.verbose)
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from trajflow.jobs.config import load_job_config

    _checked_address(args.address)
    config = load_job_config(args.config, args.set)
    if args.run_dir:
        config = config.model_copy(update={"run_dir": Path(args.run_dir)})
    from trajflow.jobs.submit import submit

    return submit(config, args.address, wait=not args.no_wait, python=args.python,
                  submission_id=args.submission_id)


def _cmd_status(args: argparse.Namespace) -> int:
    from trajflow.jobs.submit import status

    return status(args.job_id, _checked_address(args.address))


def _cmd_stop(args: argparse.Namespace) -> int:
    from trajflow.jobs.submit import stop

    return stop(args.job_id, _checked_address(args.address))


def _cmd_replay(args: argparse.Namespace) -> int:
    from trajflow.jobs.replay import replay_job

    strategies = [s for item in args.strategy for s in item.split(",") if s]
    replay_job(args.trajectories, args.checkpoints, strategies, mode="train" if args.train else "diagnose",
               config=args.config, overrides=args.set, out=args.out,
               quarantine_nonfinite=args.quarantine_nonfinite, gradients=args.gradients,
               progress=not args.no_progress, verbose=args.verbose)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    default = Path(args.run_dir) / "report.png"  # the run's own report: regenerated in place
    out = Path(args.out) if args.out else default
    return _report_runs([args.run_dir], out, replace=args.overwrite or out == default, smooth=args.smooth)


def _cmd_compare(args: argparse.Namespace) -> int:
    import time

    out = Path(args.out) if args.out else _unique_path(Path(f"compare-{time.strftime('%Y%m%d-%H%M%S')}.png"))
    return _report_runs(args.run_dirs, out, replace=args.overwrite, smooth=args.smooth)


def _unique_path(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def _report_runs(run_dirs: list[str], out: Path, *, replace: bool, smooth: int) -> int:
    from trajflow.jobs.report import comparison_table, load_runs, plot_runs, print_table

    if out.suffix.lower() != ".png":
        raise UsageError(f"--out {out}: the plots are a PNG file; give a name ending in .png")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name ending in .png")
    existed = out.exists()
    if existed and not replace:
        raise UsageError(f"--out {out} already exists (--overwrite replaces it)")
    runs = load_runs(run_dirs)  # every run dir is read before anything is written
    print_table(comparison_table(runs))
    path = plot_runs(runs, out, smooth=smooth)
    print(f"trajflow: plots written to {path}" + (" (replaced the previous file)" if existed else ""))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one `trajflow: ...` line on stderr and exit status 2 (argparse
    would print the whole usage first)."""

    def error(self, message: str):
        command = self.prog.removeprefix("trajflow").strip()
        hint = f" (trajflow {command} --help)" if command else " (trajflow --help)"
        self.exit(2, f"trajflow: {command + ': ' if command else ''}{message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trajflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true",
                        help="show what a normal run keeps quiet (Ray's notices, weight loading bars)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    gen = command("generate", "generate and score a batch with a model; print a table (no Ray)")
    gen.add_argument("--model", help="local model dir (default: the built-in warm start)")
    gen.add_argument("--task", default="addition")
    gen.add_argument("--prompts", type=_positive_int, default=4)
    gen.add_argument("--n", type=_positive_int, default=4, help="samples per prompt")
    gen.add_argument("--temperature", type=_non_negative_float, default=1.0)
    gen.add_argument("--max-new-tokens", type=_positive_int, default=6)
    gen.add_argument("--inference-dtype", default="bfloat16", choices=["float32", "bfloat16", "fp8"])
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    def add_set(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (dotted path; the value is parsed as YAML), repeatable")

    ev = command("eval", "greedy mean reward (accuracy for a 0/1 reward) on held-out prompts (no Ray)")
    ev.add_argument("--config", help="a job config: its data.test_files (or task), reward and model")
    ev.add_argument("--model", help="a local HF model dir, a run's checkpoints/step-N, a run dir (its latest "
                    "checkpoint) or a run's versions/vNNNNNN.safetensors; default: the config's model")
    ev.add_argument("--task", help="a built-in task instead of --config (default: addition)")
    ev.add_argument("--n", type=_positive_int, help="the first N held-out prompts (default: every row of "
                    "data.test_files; eval_prompts of a task config; 1000 of --task)")
    ev.add_argument("--max-new-tokens", type=_positive_int, help="default: the config's sampling.max_new_tokens (6)")
    add_set(ev)
    ev.set_defaults(func=_cmd_eval)

    run = command("run", "run a job on an embedded Ray (or continue one with --resume)")
    run.add_argument("config", nargs="?", help="YAML job config, or a bundled name (quickstart, snapshot, ...)")
    add_set(run)
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its last checkpoint")
    run.add_argument("--run-dir", help="where to write the run (default: runs_root/NAME-STRATEGY-TIME)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (status lines only)")
    run.add_argument("--config-b64", help=argparse.SUPPRESS)  # inline config (used by `submit`)
    run.set_defaults(func=_cmd_run)

    sb = command("submit", "submit a job to a Ray cluster (Ray Jobs API), stream its logs")
    sb.add_argument("config")
    add_set(sb)
    sb.add_argument("--address", required=True, help="the cluster's dashboard, e.g. http://127.0.0.1:8265")
    sb.add_argument("--run-dir", help="run dir on storage the cluster can write (default: runs_root/...)")
    sb.add_argument("--no-wait", action="store_true", help="return after submitting")
    sb.add_argument("--python", default="python", help="the cluster's Python with trajflow installed")
    sb.add_argument("--submission-id", help="job id to use (default: generated)")
    sb.set_defaults(func=_cmd_submit)

    st = command("status", "status of a submitted job")
    st.add_argument("job_id")
    st.add_argument("--address", required=True, help="the cluster's dashboard, e.g. http://127.0.0.1:8265")
    st.set_defaults(func=_cmd_status)

    sp = command("stop", "stop a submitted job")
    sp.add_argument("job_id")
    sp.add_argument("--address", required=True, help="the cluster's dashboard, e.g. http://127.0.0.1:8265")
    sp.set_defaults(func=_cmd_stop)

    rp = command("replay", "replay a logged trajectory dataset under a strategy")
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
    rp.add_argument("--quarantine-nonfinite", action="store_true",
                    help="replay a log holding NaN/inf log-probs: such rows are counted, written to "
                         "OUT/quarantine.parquet, never trained (default: refuse the log)")
    rp.add_argument("--gradients", action="store_true",
                    help="--diagnose: each strategy's gradient vs the exact strategy's on the same batch "
                         "(cosine, relative error; give an exact strategy, e.g. snapshot)")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.set_defaults(func=_cmd_replay)

    pr = command("prepare", "build a model a package ships (e.g. smollm2) into an HF directory in the cache, "
                 "once; print its path")
    pr.add_argument("name", help="smollm2 (smollm2-135m-instruct-q4_1: SmolLM2-135M-Instruct, 4-bit-quantized "
                    "(Q4_1) weights dequantized to float32; needs the smollm2 extra)")
    pr.set_defaults(func=_cmd_prepare)

    cf = command("configs", "list the bundled job configs and the strategies")
    cf.set_defaults(func=_cmd_configs)

    def add_plot_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--smooth", type=_positive_int, default=1, metavar="N",
                       help="also draw an N-step rolling mean over the raw values (default: raw only)")
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")

    rep = command("report", "summary table and PNG plots of one run")
    rep.add_argument("run_dir")
    rep.add_argument("--out", help="PNG path (default: RUN_DIR/report.png, regenerated)")
    add_plot_options(rep)
    rep.set_defaults(func=_cmd_report)

    cmp_ = command("compare", "side-by-side table and PNG plots of several runs")
    cmp_.add_argument("run_dirs", nargs="+", metavar="RUN", help="a run dir, a W&B run directory (offline ones "
                      "too: RUN/wandb/offline-run-*) or mlflow:RUN_ID (MLFLOW_TRACKING_URI) / mlflow:URI#RUN_ID")
    cmp_.add_argument("--out", help="PNG path (default: a new compare-TIME.png in the current directory)")
    add_plot_options(cmp_)
    cmp_.set_defaults(func=_cmd_compare)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# a command-line argument that cannot be used: `trajflow: COMMAND: ...`
_BAD_ARGUMENT = (
    ("trajflow.jobs.cli", "UsageError"),
    ("trajflow.jobs.replay", "ReplayArgumentError"),
)
# any other input the user can fix: `trajflow: ...` (the message names what)
_BAD_INPUT = (
    ("trajflow.jobs.config", "JobConfigError"),
    ("trajflow.jobs.errors", "RunError"),
    ("trajflow.jobs.report", "ReportError"),
    ("trajflow.pipelines.replay", "ReplayError"),
    ("trajflow.schemas.trajectory", "SchemaError"),
    ("trajflow.engines.checkpoint", "CheckpointError"),
    ("trajflow.tasks.dataset", "DataError"),  # a dataset problem found while reading it (e.g. a null prompt)
    ("trajflow.user_code", "UserCodeError"),  # a reward, env or strategy import path (RewardSpecError too)
    ("trajflow.pipelines.ray.patches", "RayVersionError"),  # an unpinned Ray that would not stay on loopback
)
# a run that stopped or could not start for a reason that is not its input: one line, exit 1
_FAILED = (
    ("trajflow.jobs.errors", "RunFailed"),  # resumable with --resume
    ("trajflow.pipelines.ray.embedded", "RayStartError"),
)
# a path the user gave that cannot be used: `trajflow: PATH: reason`
_BAD_PATH = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)


def _is_one_of(error: BaseException, classes: tuple[tuple[str, str], ...]) -> bool:
    """Whether `error` is one of `classes` (module, name): `_BAD_INPUT` and the others above, each
    reported as one line. Only modules already imported are checked — an error cannot come from a
    module that was never loaded."""
    for module, name in classes:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def _bad_input_line(command: str, error: BaseException) -> str | None:
    """The one line for an error the user can fix, or None for a bug (which keeps its traceback)."""
    from pydantic import ValidationError

    if _is_one_of(error, _BAD_ARGUMENT):
        return f"{command}: {_one_line(error)}"
    if _is_one_of(error, _BAD_INPUT):
        return _one_line(error)
    if isinstance(error, ValidationError):  # a config built outside load_job_config
        from trajflow.jobs.config import format_validation_error

        return f"config error: {format_validation_error(error)}"
    if isinstance(error, _BAD_PATH) and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    if command in ("submit", "status", "stop"):
        auth = getattr(sys.modules.get("ray.exceptions"), "AuthenticationError", None)
        if auth is not None and isinstance(error, auth):
            return (f"{command}: the cluster refused the authentication token (set RAY_AUTH_TOKEN to the "
                    f"cluster's token): {_one_line(error).split('. ')[0]}")
        if isinstance(error, ConnectionError):
            return f"{command}: {_one_line(error)} (is the cluster's dashboard running there?)"
        if isinstance(error, RuntimeError) and "status code 404" in str(error):
            return f"{command}: no such job on the cluster"
    return None


def _one_line_warnings() -> None:
    """A renamed config key (trajflow.deprecations.TrajflowDeprecation) is one `trajflow:` line, not
    Python's two-line warning with the source line."""
    import warnings

    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if category.__name__ == "TrajflowDeprecation":
            print(f"trajflow: deprecated: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _one_line_warnings()
    args = build_parser().parse_args(argv)
    # before transformers is imported: its weight-loading bars follow this variable
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "0" if args.verbose else "1")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("trajflow: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = _bad_input_line(args.command, e)
        if line is None:
            if _is_one_of(e, _FAILED):
                print(f"trajflow: {_one_line(e)}", file=sys.stderr)
                return 1
            if args.command in ("submit", "status", "stop") and isinstance(e, RuntimeError):
                print(f"trajflow: {args.command}: {_one_line(e)}", file=sys.stderr)  # the cluster said no
                return 1
            raise
        print(f"trajflow: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m trajflow.jobs.cli`: the module's own classes, not __main__'s copies
    from trajflow.jobs.cli import main as cli_main

    sys.exit(cli_main())
