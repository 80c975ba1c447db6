"""Bad input, as a new user would type it, over every subcommand of the real `trajflow` entry
point: each case must end with exit status 2 and exactly one stderr line, `trajflow: ...`, that
names the problem (the key, the flag, the file), with no traceback, and must write nothing.

Each case runs in its own empty working directory that must still be empty afterwards, except for
the inputs the case was given. None of them may start Ray: every name, every row of a dataset and
every file of a model is checked before Ray starts. Those cases call the entry point's `main` in
this process (output captured at the file descriptors, so a library writing past `sys.stderr` is
caught too) with `ray.init` replaced by a recorder, which is how "Ray did not start" is checked.
Only what only Ray can know (a request the cluster cannot hold) starts it: such a case runs as its
own `trajflow` process and must end in one line within RAY_CASE_SECONDS, before anything is written.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WARM = REPO / "artifacts" / "warm_start" / "addition"
BYO_MODEL = REPO / "artifacts" / "byo" / "model"
# the real entry point (`trajflow = trajflow.jobs.cli:main`), then one stdout line saying whether
# Ray was initialised in the process when the command returned
RUNNER = """
import sys
from trajflow.jobs.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
ray = sys.modules.get("ray")
print("ray: started" if ray is not None and ray.is_initialized() else "ray: not started", flush=True)
sys.exit(code)
"""
# a case that must start Ray ends within this: the CLI's imports, the config's checks, Ray's start
# (2-5 s here) and the check against it take ~20 s on an idle 2-core machine; without the check it
# would wait forever for resources that never come
RAY_CASE_SECONDS = 90.0


@dataclass
class Case:
    id: str
    args: list[str]
    expect: tuple[str, ...]  # fragments of the one error line
    files: dict[str, bytes | str] | None = None  # inputs written into the case's working dir first
    starts_ray: bool = False  # only Ray can tell: one line within RAY_CASE_SECONDS


def _config(**keys) -> str:
    return yaml.safe_dump({"name": "bad", "steps": 2, "prompts_per_step": 2, "group_size": 2, **keys})


def _run_dir_files(config: str, state: dict | None = None) -> dict[str, str]:
    files = {"old/config.yaml": config, "old/trajectories/step=000000/.keep": ""}
    if state is not None:
        files["old/run.json"] = json.dumps(state)
    return files


def _rows(n: int, bad_at: int | None = None, bad: object = None) -> list[dict]:
    """n word-problem rows (chat messages, an answer); row `bad_at` replaced by `bad`."""
    rows = [{"prompt": [{"role": "user", "content": f"Ann has {i} pens and gets 2 more. How many?"}],
             "answer": str(i + 2)} for i in range(n)]
    if bad_at is not None:
        rows[bad_at] = bad
    return rows


def _jsonl(rows: list, raw: dict[int, str] | None = None) -> str:
    """JSON lines; `raw` replaces the line of row i with text as given (a malformed line)."""
    return "".join(((raw or {}).get(i) or json.dumps(r)) + "\n" for i, r in enumerate(rows))


def _parquet(rows: list[dict], schema: pa.Schema | None = None) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return out.getvalue()


# a chat template that rejects roles it does not know (like many chat models' own)
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}<|im_start|>{{ m['role'] }}\n"
                   "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")
# a model dir with the byo tokenizer; weights are only looked for before Ray (an empty file)
MODEL_FILES = {f"m/{name}": (BYO_MODEL / name).read_text()
               for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")}
MODEL_FILES["m/model.safetensors"] = b""
FAR = 4500  # a row past the first two batches of the one-pass check (tasks/dataset.py BATCH_ROWS)
DATA = ["data.train_files=[train.jsonl]", "--set", "data.test_files=[]", "--set", "eval_every=0"]  # after --set

GOOD = _config()
RUN = ["run", "quickstart", "--run-dir", "out", "--set"]  # + one override
BYO = ["run", "byo", "--run-dir", "out", "--set"]  # + one override
CASES = [
    # -- the command line itself
    Case("no-command", [], ("required: COMMAND",)),
    Case("unknown-command", ["trian"], ("invalid choice: 'trian'",)),
    Case("configs-extra-argument", ["configs", "x"], ("unrecognized arguments: x",)),
    # -- run: config files
    Case("run-missing-file", ["run", "nope.yaml", "--run-dir", "out"], ("nope.yaml: no such config file",)),
    Case("run-empty-yaml", ["run", "empty.yaml", "--run-dir", "out"], ("empty.yaml", "holds no keys"),
         {"empty.yaml": "# nothing yet\n"}),
    Case("run-duplicate-key", ["run", "dup.yaml", "--run-dir", "out"], ("duplicate key 'steps'", "line 3"),
         {"dup.yaml": "steps: 5\nname: x\nsteps: 50\n"}),
    Case("run-non-utf8", ["run", "latin1.yaml", "--run-dir", "out"], ("not UTF-8", "byte 0xe9 at line 2"),
         {"latin1.yaml": b"steps: 2\nname: caf\xe9\n"}),
    Case("run-yaml-syntax", ["run", "broken.yaml", "--run-dir", "out"], ("invalid YAML", "line"),
         {"broken.yaml": "steps: 3\noptimizer: {lr: [1,\n"}),
    Case("run-top-level-list", ["run", "list.yaml", "--run-dir", "out"], ("top level must be a mapping",),
         {"list.yaml": "- steps\n- 3\n"}),
    Case("run-unknown-key", ["run", "typo.yaml", "--run-dir", "out"], ("optimiser: unknown key",),
         {"typo.yaml": _config(optimiser={"lr": 1e-3})}),
    Case("run-config-is-a-dir", ["run", "cfgdir", "--run-dir", "out"], ("cfgdir",), {"cfgdir/x": ""}),
    # -- run: values (--set)
    Case("run-task-unknown", [*RUN, "task=nope"], ("task: unknown task 'nope'", "addition")),
    Case("run-steps-bool", [*RUN, "steps=true"], ("steps: expected an integer, got the boolean true",)),
    Case("run-steps-huge", [*RUN, "steps=1000000000000"], ("steps: Input should be less than or equal to",)),
    Case("run-steps-zero", [*RUN, "steps=0"], ("steps: Input should be greater than or equal to 1",)),
    Case("run-steps-text", [*RUN, "steps=many"], ("steps: Input should be a valid integer", "'many'")),
    Case("run-group-size-1", [*RUN, "group_size=1"], ("group_size: 1 sample per prompt", "advantage 0")),
    Case("run-strategy-unknown", [*RUN, "strategy=exactish"], ("strategy:",)),
    Case("run-lr-negative", [*RUN, "optimizer.lr=-1"], ("optimizer.lr: must be > 0, got -1",)),
    Case("run-temperature-bool", [*RUN, "sampling.temperature=yes"], ("sampling.temperature: expected a number",)),
    Case("run-flag-not-bool", [*RUN, "tensorboard=1"], ("tensorboard: expected true or false, got 1",)),
    Case("run-model-missing", [*RUN, "model=/no/such/model"], ("model: /no/such/model is not a local model",)),
    Case("run-model-no-tokenizer", [*RUN, "model=m"], ("model: m has no tokenizer",), {"m/config.json": "{}"}),
    Case("run-set-no-equals", [*RUN, "steps"], ("--set 'steps': expected key=value",)),
    Case("run-set-bad-yaml", [*RUN, "sampling={a: [1"], ("sampling: --set value", "not valid YAML")),
    Case("run-set-duplicate-key", [*RUN, "sampling={top_k: 1, top_k: 2}"], ("duplicate key 'top_k'",)),
    Case("run-set-unknown-key", [*RUN, "sampling.temprature=1"], ("sampling.temprature: unknown key",)),
    Case("run-name-with-slash", [*RUN, "name=a/b"], ("name: String should match pattern",)),
    Case("run-ray-address-url", [*RUN, "ray_address=http://127.0.0.1:8265"], ("ray_address:",)),
    Case("run-minibatches", [*RUN, "optimizer.minibatches_per_step=5"], ("minibatches_per_step: 5 does not divide",)),
    Case("run-versions-fill-the-disk", ["run", "quickstart", "--run-dir", "out", "--set", "steps=1000000"],
         ("save_all_versions: 1000001 versions", "free")),
    Case("run-dir-not-empty", ["run", "quickstart", "--run-dir", "used"], ("run dir", "used", "not empty"),
         {"used/notes.txt": "mine"}),
    Case("run-no-config", ["run"], ("run: a CONFIG",)),
    # -- run: strategies, rewards, datasets (resolved in PipelineConfig, before Ray)
    Case("run-strategy-no-module", [*RUN, "strategy=no_such_module:MyStrategy"], ("strategy:", "no_such_module")),
    Case("run-strategy-file-missing", [*RUN, "strategy=mine.py:MyStrategy"], ("strategy:", "mine.py")),
    Case("run-strategy-not-a-strategy", [*RUN, "strategy=json:JSONDecoder"], ("strategy:", "JSONDecoder")),
    Case("run-strategy-option-unknown", [*RUN, "strategy={name: snapshot, bogus: 1}"],
         ("strategy.bogus: unknown key",)),
    Case("run-strategy-options-list", [*RUN, "strategy_options=[1, 2]"],
         ("strategy_options: expected a mapping of keys to values", "got a list [1, 2]")),
    Case("run-strategy-options-text", [*RUN, "strategy_options=abc"],
         ("strategy_options: expected a mapping of keys to values", "got the string 'abc'")),
    Case("run-m2po-threshold-negative", [*RUN, "strategy={name: m2po, m2_threshold: -1}"],
         ("strategy.m2_threshold: must be >= 0",)),
    Case("run-reward-no-module", [*RUN, "reward=no_such_module:score"], ("reward:", "no_such_module")),
    Case("run-reward-no-function", [*BYO, "reward=rewards.py:missing"], ("reward:", "missing"),
         {"rewards.py": "def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n"}),
    Case("run-reward-bad-signature", [*BYO, "reward=rewards.py:score"], ("reward:", "score"),
         {"rewards.py": "def score(completion):\n    return 0.0\n"}),
    Case("run-data-file-missing", [*BYO, "data.train_files=[nope.jsonl]"], ("data.train_files", "nope.jsonl")),
    Case("run-data-column-missing", [*BYO, "data.prompt_key=question"], ("question",)),
    Case("run-data-and-task", [*BYO, "task=addition"], ("task:", "data")),
    Case("run-env-no-module", [*RUN, "env=no_such_module:Env", "--set", "task=null"], ("env:", "no_such_module")),
    # -- run: a dataset's later rows (the whole dataset is read, templated and tokenized before Ray)
    Case("data-template-rejects-a-later-row", [*BYO, "model=m", "--set", *DATA],
         ("data.train_files: train.jsonl: line 4501: column 'prompt'", "unknown role: tool"),
         {**MODEL_FILES, "m/chat_template.jinja": STRICT_TEMPLATE,
          "train.jsonl": _jsonl(_rows(5000, FAR, {"prompt": [{"role": "tool", "content": "4"}], "answer": "4"}))}),
    Case("data-message-without-content", [*BYO, *DATA],
         ("train.jsonl: line 4501: column 'prompt': message 0 (role 'user') has no content",),
         {"train.jsonl": _jsonl(_rows(5000, FAR, {"prompt": [{"role": "user"}], "answer": "4"}))}),
    Case("data-malformed-jsonl-line", [*BYO, *DATA], ("train.jsonl: line 4501: not valid JSON",),
         {"train.jsonl": _jsonl(_rows(5000), raw={FAR: '{"prompt": [{"role": "user", "content": "x"}], "answer'})}),
    Case("data-null-field-in-a-later-row", [*BYO, *DATA], ("train.jsonl: line 4501: column 'answer' is null",),
         {"train.jsonl": _jsonl(_rows(5000, FAR, {**_rows(1)[0], "answer": None}))}),
    Case("data-types-differ-between-shards", [*BYO, "data.train_files=[a.parquet, b.parquet]", "--set",
                                              "data.test_files=[]", "--set", "eval_every=0"],
         ("b.parquet: column 'answer' is a number, but a string at a.parquet",),
         {"a.parquet": _parquet(_rows(10)), "b.parquet": _parquet([{**r, "answer": 3} for r in _rows(10)])}),
    Case("data-every-prompt-too-long", [*BYO, "data.max_prompt_tokens=2"],
         ("data.max_prompt_tokens: all 3000 prompts of data.train_files are longer than 2 tokens", "train.jsonl:")),
    Case("data-empty-jsonl", [*BYO, *DATA], ("data.train_files: train.jsonl: no rows",), {"train.jsonl": ""}),
    Case("data-empty-parquet", [*BYO, "data.train_files=[train.parquet]", "--set", "data.test_files=[]", "--set",
                                "eval_every=0"], ("data.train_files: train.parquet: no rows",),
         {"train.parquet": _parquet([], pa.schema([("prompt", pa.string()), ("answer", pa.string())]))}),
    Case("data-directory-as-file", [*BYO, "data.train_files=[shards]", "--set", "data.test_files=[]"],
         ("data.train_files: shards: is a directory",), {"shards/train.jsonl": _jsonl(_rows(4))}),
    # -- run: reserved column names (trajflow's own record, the reward function's arguments)
    Case("data-column-step-reserved", [*BYO, *DATA], ("train.jsonl: column(s) step are reserved",),
         {"train.jsonl": _jsonl([{**r, "step": 1} for r in _rows(4)])}),
    Case("data-column-prompt-reserved", [*BYO, *DATA, "--set", "data.prompt_key=question"],
         ("train.jsonl: column(s) prompt are reserved",),
         {"train.jsonl": _jsonl([{"question": r["prompt"], **r} for r in _rows(4)])}),
    # -- run: the model, its tokenizer, the engine
    Case("run-model-no-weights", [*RUN, "model=m"], ("model: m has no weights",),
         {"m/config.json": (WARM / "config.json").read_text(),
          "m/tokenizer.json": (WARM / "tokenizer.json").read_text()}),
    Case("run-model-unknown-architecture", [*RUN, "model=m"], ("model_type 'frobnicator'", "does not know"),
         {"m/config.json": json.dumps({"model_type": "frobnicator"}), "m/tokenizer.json": "{}"}),
    Case("run-tokenizer-json-corrupt", [*RUN, "model=m"], ("model:", "m/tokenizer.json: not valid JSON"),
         {**MODEL_FILES, "m/tokenizer.json": '{"version": "1.0", "truncation": nu'}),
    Case("run-only-tokenizer-config", [*RUN, "model=m"],
         ("model: m has no tokenizer", "tokenizer_config.json configures a tokenizer but does not hold one"),
         {k: v for k, v in MODEL_FILES.items() if not k.endswith("tokenizer.json")}),
    Case("run-seed-negative", [*RUN, "seed=-1"], ("seed: Input should be greater than or equal to 0",)),
    Case("run-eval-every-without-test-files", [*BYO, "data.test_files=[]"],
         ("eval_every: held-out evaluation of a dataset needs data.test_files",)),
    # -- run: resources the machine does not have
    Case("run-gpu-without-a-gpu", [*RUN, "trainer.num_gpus=1"], ("trainer.num_gpus: 1 GPU asked", "no GPU")),
    Case("run-more-trainer-workers-than-cpus", [*RUN, "trainer.num_workers=16"],
         ("resources: the run's actors ask", "CPU at once", "trainer.num_workers 15 x 0.5", "the Ray cluster has"),
         starts_ray=True),
    *([Case("run-engine-vllm-not-installed", [*RUN, "engine=vllm"], ("engine: vllm is not installed",))]
      if importlib.util.find_spec("vllm") is None else []),
    # -- run --resume
    Case("resume-missing-dir", ["run", "--resume", "gone"], ("gone: not a run dir",)),
    Case("resume-and-config", ["run", "quickstart", "--resume", "old"], ("either CONFIG or --resume",),
         _run_dir_files(GOOD)),
    Case("resume-and-run-dir", ["run", "--resume", "old", "--run-dir", "x"], ("--run-dir does not apply",),
         _run_dir_files(GOOD)),
    Case("resume-bad-config-in-run", ["run", "--resume", "old"], ("task: unknown task 'nope'",),
         _run_dir_files(_config(task="nope"))),
    Case("resume-bad-override", ["run", "--resume", "old", "--set", "steps=true"], ("steps: expected an integer",),
         _run_dir_files(GOOD)),
    # -- submit / status / stop
    Case("submit-address-no-scheme", ["submit", "quickstart", "--address", "127.0.0.1:1"],
         ("--address '127.0.0.1:1'", "http://127.0.0.1:1")),
    Case("submit-address-bad-port", ["submit", "quickstart", "--address", "http://127.0.0.1:99999"], ("port",)),
    Case("submit-bad-config", ["submit", "quickstart", "--address", "http://127.0.0.1:8265", "--set", "task=nope"],
         ("task: unknown task",)),
    Case("submit-no-address", ["submit", "quickstart"], ("--address",)),
    Case("status-address-no-scheme", ["status", "job1", "--address", "localhost:8265"], ("--address 'localhost:8265'",)),
    Case("stop-address-no-scheme", ["stop", "job1", "--address", "127.0.0.1:8265"], ("--address",)),
    Case("status-no-job", ["status", "--address", "http://127.0.0.1:8265"], ("job_id",)),
    Case("status-nobody-there", ["status", "job1", "--address", "http://127.0.0.1:1"],
         ("status: Failed to connect", "http://127.0.0.1:1")),
    Case("submit-nobody-there", ["submit", "quickstart", "--address", "http://127.0.0.1:1", "--run-dir", "out"],
         ("submit: Failed to connect",)),
    # -- replay
    Case("replay-missing-log", ["replay", "nolog", "--checkpoints", "old", "--strategy", "snapshot"],
         ("nolog: no such file or directory",)),
    Case("replay-unknown-strategy", ["replay", "old", "--checkpoints", "old", "--strategy", "nope"],
         ("unknown strategy",), _run_dir_files(GOOD)),
    Case("replay-no-parquet", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot"],
         ("no Parquet files",), _run_dir_files(GOOD)),
    Case("replay-corrupt-parquet", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot"],
         ("part-0.parquet", "not a readable Parquet file"),
         {**_run_dir_files(GOOD), "old/trajectories/step=000000/part-0.parquet": b"PAR1 garbage"}),
    Case("replay-missing-checkpoints", ["replay", "old", "--checkpoints", "nockpt", "--strategy", "snapshot"],
         ("--checkpoints nockpt: no such directory",), _run_dir_files(GOOD)),
    Case("replay-train-two-strategies", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot,ewma",
                                         "--train"], ("one strategy at a time",), _run_dir_files(GOOD)),
    Case("replay-run-without-trajectories", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot"],
         ("old: the run logged no trajectories",),
         {"old/config.yaml": GOOD, "old/run.json": "{}", "old/metrics/step=000000.parquet": _parquet([{"step": 0}])}),
    Case("replay-no-config", ["replay", "log", "--checkpoints", "log", "--strategy", "snapshot"],
         ("no config.yaml found",), {"log/x.parquet": b""}),
    Case("replay-out-not-empty", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot", "--out", "done"],
         ("--out done already exists",), {**_run_dir_files(GOOD), "done/metrics.parquet": b"x"}),
    Case("replay-diagnose-and-train", ["replay", "old", "--checkpoints", "old", "--strategy", "snapshot",
                                       "--diagnose", "--train"], ("not allowed with argument",), _run_dir_files(GOOD)),
    # -- report / compare
    Case("report-missing-dir", ["report", "gone"], ("gone: no such run directory",)),
    Case("report-not-a-run", ["report", "plain"], ("plain: no metrics found",), {"plain/readme.txt": "x"}),
    Case("report-smooth-zero", ["report", "plain", "--smooth", "0"], ("--smooth: must be at least 1",)),
    Case("compare-out-not-png", ["compare", "plain", "--out", "plots.pdf"], ("ending in .png",)),
    Case("compare-out-exists", ["compare", "plain", "--out", "mine.png"], ("mine.png already exists", "--overwrite"),
         {"mine.png": b"not yours"}),
    Case("compare-nothing", ["compare"], ("the following arguments are required: RUN",)),
    # -- generate / eval (no Ray)
    Case("generate-model-missing", ["generate", "--model", "/missing"], ("--model: /missing is not a local model",)),
    Case("generate-n-zero", ["generate", "--n", "0"], ("--n: must be at least 1, got 0",)),
    Case("generate-prompts-text", ["generate", "--prompts", "four"], ("--prompts: expected a whole number",)),
    Case("generate-temperature-negative", ["generate", "--temperature", "-1"], ("--temperature",)),
    Case("generate-task-unknown", ["generate", "--task", "nope"], ("--task: unknown task 'nope'",)),
    Case("generate-dtype", ["generate", "--inference-dtype", "fp4"], ("invalid choice: 'fp4'",)),
    Case("eval-task-unknown", ["eval", "--task", "nope"], ("--task: unknown task 'nope'",)),
    Case("eval-n-zero", ["eval", "--n", "0"], ("--n: must be at least 1",)),
    Case("eval-model-not-json", ["eval", "--model", "m"], ("config.json is not a JSON object",),
         {"m/config.json": "[1, 2]", "m/tokenizer.json": "{}"}),
]


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"") for p in sorted(root.rglob("*"))}


def _write_inputs(case: Case, root: Path) -> Path:
    cwd = root / case.id
    cwd.mkdir()
    for name, content in (case.files or {}).items():
        path = cwd / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return cwd


def _check_one_line(code: int, out: str, err: str, case: Case) -> None:
    explain = f"exit {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    assert code == 2, explain
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, explain
    assert lines[0].startswith("trajflow: "), explain
    assert "Traceback" not in out + err, explain
    for fragment in case.expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


@pytest.fixture
def no_ray_start(monkeypatch):
    """`ray.init` and `ray.is_initialized` replaced: a case that would start (or reuse) Ray is
    recorded instead. Returns the list of recorded starts."""
    import ray

    starts = []

    def refuse(*args, **kwargs):
        starts.append(kwargs)
        raise RuntimeError("this case must not start Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return starts


@pytest.fixture
def isolated_process_state(monkeypatch, tmp_path):
    """What `main` may change in the process for the next case: the environment, the warning
    hooks, user modules imported from the case's directory (a later case's file of the same name
    must be read anew)."""
    environ = dict(os.environ)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    yield
    os.environ.clear()
    os.environ.update(environ)
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c for c in CASES if not c.starts_ray],
                         ids=[c.id for c in CASES if not c.starts_ray])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capfd, monkeypatch, no_ray_start,
                                                        isolated_process_state):
    from trajflow.jobs.cli import main

    cwd = _write_inputs(case, tmp_path)
    before = _listing(cwd)
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    try:
        code = main(case.args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capfd.readouterr()
    _check_one_line(code, out, err, case)
    assert _listing(cwd) == before, f"the case wrote or changed files: {sorted(set(_listing(cwd)) ^ set(before))}"
    assert no_ray_start == [], "the case started Ray"


@pytest.mark.timeout(RAY_CASE_SECONDS * 2)
@pytest.mark.parametrize("case", [c for c in CASES if c.starts_ray], ids=[c.id for c in CASES if c.starts_ray])
def test_what_only_ray_can_tell_is_one_line_within_seconds(case, tmp_path):
    """Its own `trajflow` process: the real start of an embedded Ray, then the check against it."""
    cwd = _write_inputs(case, tmp_path)
    before = _listing(cwd)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", RUNNER, *case.args], cwd=cwd, capture_output=True, text=True,
                          timeout=RAY_CASE_SECONDS * 2, env=env)
    seconds = time.monotonic() - started
    _check_one_line(proc.returncode, proc.stdout, proc.stderr, case)
    assert _listing(cwd) == before, f"the case wrote or changed files: {sorted(set(_listing(cwd)) ^ set(before))}"
    assert proc.stdout.splitlines()[-1] == "ray: started"
    assert seconds < RAY_CASE_SECONDS, f"{seconds:.0f}s"


def test_reserved_columns_cover_every_column_trajflow_writes():
    """A dataset column named like one trajflow writes would be silently overwritten or misread, so
    each name the pipeline puts on a trajectory is reserved: the record's schema, every name that
    an operator, the generator, the recorder or replay sets (a literal or a module constant in the
    source, found here, so a new column cannot be forgotten), the log's `step=` partition key and
    the reward function's own arguments. `prompt` is reserved unless it is the prompt column."""
    import re

    from trajflow.schemas.trajectory import COLUMNS
    from trajflow.tasks.dataset import RESERVED_COLUMNS, reserved_columns

    setter = re.compile(r"(?:replace_column\(\s*\w+,|\.append_column\(|\.add_column\(\s*\d+,)\s*"
                        r"(?:\"(\w+)\"|([A-Z_]+)\b)|columns\[\"(\w+)\"\]")
    sources = [path.read_text() for folder in ("operators", "jobs", "pipelines", "tasks", "schemas")
               for path in sorted((REPO / folder).glob("*.py"))]
    constants = dict(m for text in sources for m in re.findall(r'^([A-Z_]+) = "(\w+)"', text, re.M))
    written = set(COLUMNS) | {"step", "prompts", "completions"}
    for text in sources:
        for literal, constant, key in setter.findall(text):
            written.add(constants[constant] if constant else literal or key)
    assert {"filter_reason", "trainer_version", "turns", "loss_old_logprobs", "kl_penalty", "rollout_step"} <= written
    assert sorted(written - set(RESERVED_COLUMNS) - {"prompt"}) == []
    assert "prompt" in reserved_columns("question") and "prompt" not in reserved_columns("prompt")
