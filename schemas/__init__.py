"""trajflow.schemas: the trajectory record (schema v1), its validation, Parquet I/O and polars views.

The polars views load on first use: the record and its I/O need only pyarrow (the in-process
loop runs where polars is not installed, scripts/gpu_check.sh)."""

from .io import atomic_write, read_parquet, write_parquet
from .trajectory import (
    COLUMNS,
    FINISH_REASONS,
    LIST_COLUMNS,
    DISTRIBUTION_LOGPROB_COLUMNS,
    LOGPROB_COLUMNS,
    META_SAMPLING_KEY,
    META_TOP_K_KEY,
    META_VERSION_KEY,
    NULLABLE_COLUMNS,
    OPTIONAL_COLUMNS,
    PER_TOKEN_COLUMNS,
    SCHEMA_VERSION,
    TOP_K_COLUMNS,
    SamplingSemantics,
    SchemaError,
    TopKSemantics,
    conform,
    empty_table,
    from_rows,
    nonfinite_rows,
    sampling_semantics,
    top_k_semantics,
    trajectory_schema,
    validate,
)


def __getattr__(name: str):
    if name in ("token_view", "trajectory_view"):
        from . import views

        return getattr(views, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "COLUMNS",
    "DISTRIBUTION_LOGPROB_COLUMNS",
    "FINISH_REASONS",
    "LIST_COLUMNS",
    "LOGPROB_COLUMNS",
    "META_SAMPLING_KEY",
    "META_TOP_K_KEY",
    "META_VERSION_KEY",
    "NULLABLE_COLUMNS",
    "OPTIONAL_COLUMNS",
    "PER_TOKEN_COLUMNS",
    "SCHEMA_VERSION",
    "SamplingSemantics",
    "SchemaError",
    "TOP_K_COLUMNS",
    "TopKSemantics",
    "conform",
    "empty_table",
    "from_rows",
    "nonfinite_rows",
    "read_parquet",
    "sampling_semantics",
    "token_view",
    "top_k_semantics",
    "trajectory_schema",
    "trajectory_view",
    "validate",
    "write_parquet",
    "atomic_write",
]
