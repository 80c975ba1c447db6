"""Job configs: one YAML file = the pipeline's settings (PipelineConfig) + how to run it.

    # jobs/configs/quickstart.yaml
    strategy: snapshot
    steps: 20
    optimizer: {lr: 3.0e-4}
    checkpoint_every: 5

Pipeline keys sit at the top level (the fields of `PipelineConfig`: strategy, steps, sampling,
optimizer, generator/trainer resources, ...); the run options below sit beside them. Everything is
validated before Ray starts. `load_job_config(path, ["optimizer.lr=1e-3", ...])` applies `--set`
overrides (each value parsed as YAML: `generator.resources={gen_node: 0.1}`, never eval'd) and
turns any problem into one `JobConfigError` line that names the key, e.g.

    config error: optimizer.lr: Input should be greater than 0 (got -1)

YAML is read with safe_load semantics (plain data only), except that a key given twice in one
mapping is an error (PyYAML would keep the last value silently); a file must be UTF-8 and hold at
least one key.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from trajflow.deprecations import TrajflowDeprecation
from trajflow.pipelines.config import PipelineConfig, preflight
from trajflow.settings import MAPPING, described

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


class JobConfigError(ValueError):
    """A job config cannot be used; the message is one line naming the key."""


class JobConfig(PipelineConfig):
    """PipelineConfig + run options (run dir, checkpoints, logs, where Ray runs)."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100,
                      description="run dir name prefix (letters, digits, '.', '_', '-')")
    runs_root: Path = Field(Path("runs"), description="parent of new run dirs (when run_dir is not set)")
    run_dir: Path | None = Field(None, description="explicit run dir (must not exist yet, unless resuming)")
    checkpoint_every: int = Field(10, ge=0, description="checkpoint every k steps (0: only the final one, always written)")
    keep_checkpoints: int = Field(2, ge=1, description="retention: keep the newest k checkpoints")
    save_all_versions: bool = Field(False, description="keep the weights of every version (exact replay)")
    trajectory_log: bool = Field(True, description="log every trajectory (Parquet, partitioned by step)")
    report_to: list[str] = Field(
        default_factory=lambda: ["tensorboard"], description="where the config, every step's metrics, the summary "
        "and the run's PNGs also go (TRL's report_to): registered trackers (listed under 'Trackers' below: "
        "tensorboard in RUN/tensorboard/, wandb and mlflow with the extras trajflow[wandb], trajflow[mlflow]) or "
        "import paths module:Class / file.py:Class of a Tracker; [] for none (jobs/trackers.py)")
    tracker_project: str = Field("trajflow", min_length=1, description="the W&B project and MLflow experiment")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None, description="null: WANDB_MODE if set, else online when a W&B key is configured, else offline (a "
        "run in RUN/wandb/ that `wandb sync` uploads later)")
    mlflow_tracking_uri: str | None = Field(
        None, description="null: MLFLOW_TRACKING_URI if set, else a SQLite store in RUN/mlflow/ (artifacts beside it)")
    ray_address: str | None = Field(None, pattern=r"^(auto|(ray://)?[^\s:/]+:\d{1,5})$",
                                    description="None: embedded Ray; else ray.init(address=...): auto, HOST:PORT "
                                    "(the GCS) or ray://HOST:PORT")
    dashboard: bool = Field(False, description="embedded Ray: start the dashboard (bound to 127.0.0.1)")
    status_every: int = Field(1, ge=0, description="print a status line every k steps (0: never)")

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """`tensorboard: true/false` (before report_to) still works for one release, with a notice."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        value = data.pop("tensorboard")
        if not isinstance(value, bool):
            raise ValueError(f"tensorboard: expected true or false, got {value!r}")
        warnings.warn(f"tensorboard: use report_to: {'[tensorboard]' if value else '[]'}; the old key goes in the "
                      "next release", TrajflowDeprecation, stacklevel=2)
        if "report_to" not in data:
            data["report_to"] = ["tensorboard"] if value else []
        return data

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, report_to: list[str]) -> list[str]:
        from trajflow.jobs.trackers import TRACKERS, check_installed

        report_to = list(dict.fromkeys(TRACKERS.canonical(spec) for spec in report_to))  # each once, in order
        check_installed(report_to)  # unknown, or a missing package: one line naming it, before Ray starts
        return report_to

    def pipeline_config(self) -> PipelineConfig:
        fields = set(PipelineConfig.model_fields)
        return PipelineConfig(**{k: v for k, v in self.model_dump().items() if k in fields})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# -- loading -------------------------------------------------------------------------------------
def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def format_validation_error(error: ValidationError) -> str:
    """One line: `key.path: message (got VALUE)` for each error, joined with '; '."""
    parts = []
    for e in error.errors():
        key = _loc(e.get("loc", ()))
        msg = str(e.get("msg", "invalid"))
        kind = e.get("type", "")
        if kind == "extra_forbidden":
            msg = "unknown key"
        elif kind in MAPPING_ERRORS:  # a section or a dict-typed key given something else
            msg = f"expected {MAPPING}, got {described(e.get('input'))}"
        elif kind != "value_error" and isinstance(e.get("input"), (str, int, float)) and len(repr(e["input"])) < 40:
            msg += f" (got {e['input']!r})"
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        parts.append(f"{key}: {msg}" if key else msg)
    return "; ".join(parts).replace("\n", " ")


# pydantic's error types for a value that should be a mapping: a dict-typed key, or a section
MAPPING_ERRORS = ("dict_type", "model_type", "model_attributes_type", "dataclass_type")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load semantics (plain data only, never an object), but a key given twice in one
    mapping is an error instead of the last value silently winning."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first_line: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden: not a duplicate
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given at line {first_line[key] + 1})",
                    key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        except TypeError:  # an unhashable key: construct_mapping reports it
            break
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem}{where}"


def safe_yaml(text: str):
    """YAML text -> plain data (safe_load semantics; duplicate keys are an error)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _set_key(data: dict, assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise JobConfigError(f"config error: --set {assignment!r}: expected key=value (e.g. optimizer.lr=1e-3)")
    try:
        value = safe_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise JobConfigError(f"config error: {key}: --set value {raw!r} is not valid YAML ({_yaml_problem(e)})") from None
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise JobConfigError(f"config error: {'.'.join(parts[: i + 1])}: is not a mapping, cannot set {key}")
        node = child
    node[parts[-1]] = value


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A path, or the name of a bundled config (`quickstart`, `snapshot`, ...)."""
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (CONFIGS_DIR / p.name, CONFIGS_DIR / f"{p.name}.yaml"):
        if not p.parent.parts and candidate.is_file():
            return candidate
    raise JobConfigError(f"config error: {path}: no such config file (bundled: {', '.join(bundled_configs())})")


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def parse_config_text(text: str, source: str = "<config>") -> dict:
    try:
        data = safe_yaml(text)
    except yaml.YAMLError as e:
        raise JobConfigError(f"config error: {source}: invalid YAML: {_yaml_problem(e)}") from None
    if data is None:  # an empty file (or only comments) would silently run every default
        raise JobConfigError(f"config error: {source}: the file holds no keys (write at least one, e.g. `steps: 20`)")
    if not isinstance(data, dict):
        raise JobConfigError(f"config error: {source}: the top level must be a mapping of keys, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise JobConfigError(f"config error: {source}: key {bad[0]!r} is not a string")
    return data


def decode_config_bytes(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise JobConfigError(f"config error: {source}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, "
                             f"column {column})") from None


def build_job_config(data: dict[str, Any], overrides: list[str] | None = None) -> JobConfig:
    """The job config of `data` with `overrides` (`key=value`), validated, then preflighted
    (pipelines/config/preflight.py); any problem is one JobConfigError line."""
    data = dict(data)
    for assignment in overrides or []:
        _set_key(data, assignment)
    try:
        config = JobConfig(**data)
    except ValidationError as e:
        raise JobConfigError(f"config error: {format_validation_error(e)}") from None
    except TypeError as e:  # e.g. non-string keys in a nested mapping
        raise JobConfigError(f"config error: {e}") from None
    try:  # what needs the disk: the model directory, the tokenizer, every row of a dataset
        return preflight(config)
    except ValueError as e:
        raise JobConfigError(f"config error: {str(e).replace(chr(10), ' ')}") from None


def load_job_config(path: str | os.PathLike, overrides: list[str] | None = None) -> JobConfig:
    """Read, override and validate a job config; any problem is one JobConfigError line."""
    resolved = resolve_config_path(path)
    try:
        data = resolved.read_bytes()
    except OSError as e:
        raise JobConfigError(f"config error: {path}: cannot read ({e.strerror})") from None
    return build_job_config(parse_config_text(decode_config_bytes(data, str(path)), str(path)), overrides)
