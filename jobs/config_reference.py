"""docs/configuration.md, generated from the settings' own declarations: every key of a job config
with its type, its default and the description it was declared with (a section's keys from its
settings dataclass, the top-level keys from PipelineConfig and JobConfig), and every registered
part (strategies, generation engines, advantage estimators, trackers: trajflow/registry.py) with
the settings it declares, so the reference cannot drift from the code
(tests/test_config_contract.py fails when the file is stale).

    python -m trajflow.jobs.config_reference            # rewrite docs/configuration.md
    python -m trajflow.jobs.config_reference --check    # exit 1 if it is stale
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from trajflow.algorithms.estimators import ESTIMATORS
from trajflow.engines.factory import ENGINES
from trajflow.jobs.config import JobConfig
from trajflow.jobs.trackers import TRACKERS
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.config.auto import (
    ACTIVATION_SHARE,
    SMALL_MODEL_PARAMETERS,
    Machine,
    ModelShape,
    auto_microbatch_tokens,
    auto_threads,
)
from trajflow.pipelines.config.pipeline import RunSettings
from trajflow.pipelines.config.sections import AdvantageSection, settings_section
from trajflow.registry import IMPORT_PATH, Registry

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
# each kind of part a config selects: its heading (the keys' descriptions point to it), its
# registry and the registry's name, and where a part's settings are given
PARTS: tuple[tuple[str, Registry, str, str], ...] = (
    ("Strategies", STRATEGIES, "STRATEGIES", "with settings: `strategy: {name: NAME, <its settings>}`"),
    ("Generation engines", ENGINES, "ENGINES", "with settings: `engine: {name: NAME, <its settings>}`, or the "
     "engine's own section (vllm: `vllm:`)"),
    ("Advantage estimators", ESTIMATORS, "ESTIMATORS", "its keys sit in the `advantage:` section beside "
     "`estimator` (a key another estimator reads is refused)"),
    ("Trackers", TRACKERS, "TRACKERS", "a list; they read the run options `tracker_project`, `wandb_mode` and "
     "`mlflow_tracking_uri`"),
)


@dataclass(frozen=True)
class Key:
    """One key of a job config, as declared."""

    name: str         # dotted, as in YAML and `--set` (e.g. correction.mask_c_seq)
    kind: str         # its type, as a reader writes it
    default: str      # its default, as YAML (required: "required")
    description: str  # what it was declared with ("" when undocumented: the contract test refuses it)
    section: type[BaseModel] | None  # the section's model when the key is a section


def keys(model: type[BaseModel] = JobConfig, prefix: str = "", defaults: BaseModel | None = None) -> Iterator[Key]:
    """Every key of `model` in declaration order, each section's keys after its own (with the
    defaults of the section's own default, `defaults`: the scorer's CPUs are not the generator's)."""
    for name, info in model.model_fields.items():
        section = _section(info.annotation)
        if defaults is not None:
            default = getattr(defaults, name)
        elif info.default_factory is not None:
            default = info.default_factory()
        else:
            default = info.default
        yield Key(f"{prefix}{info.alias or name}", _kind(info.annotation) + _bounds(model, name, info), _yaml(default),
                  " ".join((info.description or "").split()), section)
        if section is not None:
            yield from keys(section, f"{prefix}{info.alias or name}.", default if isinstance(default, BaseModel) else None)


def undocumented(model: type[BaseModel] = JobConfig) -> list[str]:
    """The keys declared without a description (a registered part's settings included)."""
    parts = [f"{registry.key}: {name}.{key.name}" for _, registry, _, _ in PARTS
             for name, cls in registry.parts().items() for key in part_keys(registry, cls) if not key.description]
    return [key.name for key in keys(model) if not key.description] + parts


def part_keys(registry: Registry, cls: type) -> list[Key]:
    """The keys a registered part declares: its `Settings`' fields (an estimator: the `advantage:`
    keys it reads); none when its settings are a section of the config (vllm's `vllm:`)."""
    if registry is ESTIMATORS:
        return [key for key in keys(AdvantageSection) if key.name in cls.keys]
    settings = registry.settings_class(cls)
    if settings is None or getattr(cls, "section", None):
        return []
    return list(keys(settings_section(settings, f"{settings.__name__}Section")))


def _section(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _bounds(model: type[BaseModel], name: str, info: Any) -> str:
    """`, >= 1`: the bounds a key was declared with (a settings dataclass's metadata, or the
    pydantic field's constraints)."""
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    settings = getattr(model, "settings", None)  # a section built from a settings dataclass
    if isinstance(settings, type) and dataclasses.is_dataclass(settings):
        declared = {f.name: f.metadata for f in dataclasses.fields(settings)}[name]
    else:
        declared = {k: getattr(m, k) for m in info.metadata for k in symbols if getattr(m, k, None) is not None}
    found = [f"{symbols[k]} {declared[k]:,}" if isinstance(declared[k], int) else f"{symbols[k]} {declared[k]:g}"
             for k in symbols if k in declared]
    return f", {' and '.join(found)}" if found else ""


def _kind(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _section(annotation) is not None:
        return "section" + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in args)
    if origin in (tuple, list):
        item = args[0] if (origin is list and args) or (len(args) == 2 and args[1] is Ellipsis) else None
        return "list" if item is None else f"list of {_kind(item)}"
    if dataclasses.is_dataclass(annotation):  # a list item with keys of its own (correction.rejection)
        return "{" + ", ".join(f.name for f in dataclasses.fields(annotation)) + "}"
    if origin is dict:
        return "mapping"
    names = {int: "integer", float: "number", bool: "true/false", str: "string", Path: "path", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _yaml(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return ""  # a section: its keys follow
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def render() -> str:
    """The text of docs/configuration.md."""
    lines = [
        "# Configuration: every key",
        "",
        "<!-- generated by `python -m trajflow.jobs.config_reference` from the settings' own",
        "     declarations; edit the descriptions where they are declared, not here -->",
        "",
        "A job config is YAML (`trajflow run my.yaml`, `--set key=value` for any key below); the same",
        "keys build a `trajflow.PipelineConfig` in Python, and each section is also a frozen settings",
        "dataclass a library user passes directly (`decoupled_loss(..., CorrectionConfig(...))`), with the",
        "same defaults. A wrong key, type or value is one line naming it, before Ray starts. Keys renamed",
        "in this release still work with a one-line notice.",
        "",
    ]
    sections: list[tuple[Key, list[Key]]] = []
    top: list[Key] = []
    run_options = set(JobConfig.model_fields) - set(PipelineConfig.model_fields)
    for key in keys():
        if "." in key.name:
            sections[-1][1].append(key)
        elif key.section is not None:
            sections.append((key, []))
        else:
            top.append(key)
    lines += ["## Top-level keys", "", *_table([k for k in top if k.name not in run_options]), "",
              "## Run options (`trajflow run`)", "", *_table([k for k in top if k.name in run_options]), ""]
    for section, fields in sections:
        doc = " ".join((section.section.__doc__ or "").split())
        lines += [f"## `{section.name}:`", "", section.description, "", *([doc, ""] if doc else []),
                  *_table(fields, prefix=f"{section.name}."), ""]
    lines += _auto()
    for heading, registry, registry_name, given in PARTS:
        lines += _parts(heading, registry, registry_name, given)
    return "\n".join(lines).rstrip() + "\n"


# the machine the examples of `auto` are computed for (this repository's test machine), and a
# real model's shape for them: SmolLM2-135M's config.json (jobs/configs/smollm2.yaml)
EXAMPLE_MACHINE = Machine(cpus=2, memory_bytes=24 * 2**30)
SMOLLM2_CONFIG = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
    "max_position_embeddings": 8192}
SMOLLM2_SHAPE = ModelShape.from_config(SMOLLM2_CONFIG)


def _auto() -> list[str]:
    """The `auto` settings: the rules (pipelines/config/auto.py) and what they give here."""
    from trajflow.jobs.config import load_job_config

    m = EXAMPLE_MACHINE
    quick = load_job_config("quickstart").pipeline_config()
    tiny = ModelShape.of(quick.model_path)
    rows = [("quickstart (its micro-batches set to 4,096)", RunSettings(quick, m).auto_choices())]
    for staleness in (0, 1):
        threads = ", ".join(f"{s} {auto_threads(s, SMOLLM2_SHAPE, m, staleness == 0)}"
                            for s in ("generator", "scorer", "trainer"))
        tokens = auto_microbatch_tokens(SMOLLM2_SHAPE, m, 32 * (160 + 96))  # its 32 rows x prompt + response
        rows.append((f"smollm2, max_staleness {staleness}", f"torch threads {threads}; micro-batches of {tokens} tokens"))
    return ["## `auto`: threads and micro-batches", "",
            "`torch_threads: auto` (generator, scorer, trainer) and `trainer.max_tokens_per_microbatch: auto`, the "
            "defaults, are chosen when the run is built, from the model's config.json, the CPUs and the memory "
            "(pipelines/config/auto.py says why each rule is what it is); an explicit number wins, and the run's "
            "header prints what was chosen. Threads: a model under "
            f"{SMALL_MODEL_PARAMETERS / 1e6:.0f}M parameters gets 1 per process; a larger one gets every CPU "
            "when synchronous (max_staleness 0: one process), and asynchronous every CPU for the trainer and "
            "half of them for the generator and scorer; a stage on a GPU the CPUs it reserves. Micro-batches: "
            f"the padded tokens whose activations fit in {ACTIVATION_SHARE:.3g} of the machine's memory (a power "
            "of two), or the whole update when the largest one fits; a GPU trainer: the whole update.", "",
            f"What they choose on a machine of {m.cpus} CPUs and {m.memory_bytes / 2**30:.0f} GiB (this "
            f"repository's test machine; SmolLM2-135M: {SMOLLM2_SHAPE.activation_bytes_per_token() / 1e6:.2f} MB "
            f"of activations per token, the quickstart's model {tiny.activation_bytes_per_token() / 1e3:.0f} KB):",
            "", "| config | auto chose |", "|---|---|", *[f"| {name} | {chosen} |" for name, chosen in rows], ""]


def _parts(heading: str, registry: Registry, registry_name: str, given: str) -> list[str]:
    """A kind of part: its registered names, what each is, and a table of each one's settings."""
    lines = [f"## {heading} (`{registry.key}`)", "",
             f"A registered name, or {IMPORT_PATH} of a subclass of `{registry.base.__name__}` "
             f"({registry.base.__module__}); "
             f"{given}. `{registry_name}.register(\"name\")` registers one of yours.", "",
             "| name | what it is | settings |", "|---|---|---|"]
    tables = []
    for name, cls in registry.parts().items():
        own = part_keys(registry, cls)
        section = getattr(cls, "section", None)
        settings = f"the `{section}:` section" if section else ", ".join(f"`{k.name}`" for k in own) or "none"
        lines.append(f"| `{name}` | {registry.summary(cls).replace('|', chr(92) + '|')} | {settings} |")
        if own:
            tables += ["", f"### {registry.kind} `{name}`", "", *_table(own)]
    return [*lines, *tables, ""]



def _table(keys: list[Key], prefix: str = "") -> list[str]:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key in keys:
        description = key.description.replace("|", "\\|")
        rows.append(f"| `{key.name.removeprefix(prefix)}` | {key.kind} | `{key.default}` | {description} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not REFERENCE.is_file() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run `python -m trajflow.jobs.config_reference`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
