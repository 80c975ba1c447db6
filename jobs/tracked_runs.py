"""Reading a tracker's run back (`trajflow compare`, jobs/report.py): `load_tracked_run` takes a
W&B run directory (offline, RUN/wandb/offline-run-*: read from its transaction log, no network) or
`mlflow:RUN_ID` (on MLFLOW_TRACKING_URI or `mlflow:URI#RUN_ID`) and returns the metrics (under
today's keys: jobs/recorder.py's current_metric_name), config and summary as
jobs/report.py's `Run`. Writing to the trackers during a run is jobs/trackers.py.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trajflow.jobs.trackers import quiet_loggers

WANDB_BLOCK = 32768  # the .wandb transaction log: LevelDB's log format (32 KiB blocks, 7-byte record headers)
WANDB_HEADER = b":W&B"


def is_tracked_run(spec: str | os.PathLike) -> bool:
    """Whether `spec` names a tracker's run (`mlflow:...`, or a W&B run directory)."""
    text = str(spec)
    return text.startswith("mlflow:") or bool(_wandb_log(Path(text)))


def _wandb_log(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".wandb":
        return path
    found = sorted(path.glob("run-*.wandb")) if path.is_dir() else []
    return found[0] if found else None


def wandb_records(path: Path) -> Iterable[Any]:
    """The protobuf records of a .wandb transaction log (as `wandb sync` reads it), in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != WANDB_HEADER:
        raise ValueError(f"{path}: not a W&B run log (no :W&B header)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(body) < length or zlib.crc32(bytes([kind]) + body) != checksum:
            break  # the end (zero padding), or a record cut off by a run that is still writing
        pos += 7 + length
        pending = body if kind in (1, 2) else pending + body
        if kind in (1, 4):  # FULL, or the LAST part of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _item_key(item) -> str:
    return ".".join(item.nested_key) if item.nested_key else item.key


def load_wandb_run(path: Path):
    """A W&B run directory (or its .wandb file) as jobs/report.py's Run: every logged step's
    numbers, the config and the summary."""
    import polars as pl

    from trajflow.jobs.recorder import current_metric_names
    from trajflow.jobs.report import Run

    log = _wandb_log(path)
    config: dict = {}
    summary: dict = {}
    rows: dict[int, dict] = {}
    name = None
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name or record.run.run_id
            for item in record.run.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            values = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            step = int(values.pop("_step", record.history.step.num))
            rows.setdefault(step, {}).update({k: v for k, v in values.items() if not k.startswith("_")})
        elif kind == "summary":
            for item in record.summary.update:
                key = _item_key(item)
                if not key.startswith("_"):
                    summary[key] = json.loads(item.value_json)
    config.pop("_wandb", None)
    if not rows:
        raise ValueError(f"{path}: the W&B run logged no steps")
    metrics = pl.DataFrame([{"step": s, **r} for s, r in sorted(rows.items())], infer_schema_length=None)
    return Run(current_metric_names(metrics), log.parent.resolve(), config, {"summary": summary, "name": name})


def load_mlflow_run(spec: str):
    """`mlflow:RUN_ID` (tracking URI from MLFLOW_TRACKING_URI) or `mlflow:URI#RUN_ID` as Run:
    every metric's history by step, the params as the config, the summary."""
    import polars as pl
    from mlflow import MlflowClient

    from trajflow.jobs.recorder import current_metric_names
    from trajflow.jobs.report import Run

    body = spec.removeprefix("mlflow:")
    uri, _, run_id = body.rpartition("#")
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError(f"{spec}: give the tracking URI (mlflow:URI#RUN_ID) or set MLFLOW_TRACKING_URI")
    with quiet_loggers("mlflow", "alembic"):
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        rows: dict[int, dict] = {}
        for key in run.data.metrics:
            if key.startswith("summary/"):
                continue
            for m in client.get_metric_history(run_id, key):
                rows.setdefault(int(m.step), {})[key] = m.value
    config = {k: _param_value(v) for k, v in run.data.params.items()}
    summary = json.loads(run.data.tags.get("trajflow.summary", "{}"))
    metrics = pl.DataFrame([{"step": s, **r} for s, r in sorted(rows.items())], infer_schema_length=None)
    return Run(current_metric_names(metrics), Path(f"mlflow:{run_id}"), config,
               {"summary": summary, "name": run.info.run_name})


def _param_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_tracked_run(spec: str | os.PathLike):
    """A tracker's run (see `is_tracked_run`) as jobs/report.py's Run; ValueError naming it if unreadable."""
    text = str(spec)
    try:
        return load_mlflow_run(text) if text.startswith("mlflow:") else load_wandb_run(Path(text))
    except ImportError as e:
        name = "mlflow" if text.startswith("mlflow:") else "wandb"
        raise ValueError(f"{text}: reading it needs {name}: pip install 'trajflow[{name}]' ({e})") from None
    except Exception as e:  # noqa: BLE001 - a file or a store of the user's (MlflowException included)
        raise ValueError(f"{text}: not a readable tracker run ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                         ) from None

