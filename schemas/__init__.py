"""trajflow.schemas: the trajectory record (schema v1), its validation, Parquet I/O and polars views."""

from .io import read_parquet, write_parquet
from .trajectory import (
    COLUMNS,
    FINISH_REASONS,
    LIST_COLUMNS,
    LOGPROB_COLUMNS,
    META_SAMPLING_KEY,
    META_VERSION_KEY,
    NULLABLE_COLUMNS,
    PER_TOKEN_COLUMNS,
    SCHEMA_VERSION,
    SamplingSemantics,
    SchemaError,
    conform,
    empty_table,
    from_rows,
    nonfinite_rows,
    sampling_semantics,
    trajectory_schema,
    validate,
)
from .views import token_view, trajectory_view

__all__ = [
    "COLUMNS",
    "FINISH_REASONS",
    "LIST_COLUMNS",
    "LOGPROB_COLUMNS",
    "META_SAMPLING_KEY",
    "META_VERSION_KEY",
    "NULLABLE_COLUMNS",
    "PER_TOKEN_COLUMNS",
    "SCHEMA_VERSION",
    "SamplingSemantics",
    "SchemaError",
    "conform",
    "empty_table",
    "from_rows",
    "nonfinite_rows",
    "read_parquet",
    "sampling_semantics",
    "token_view",
    "trajectory_schema",
    "trajectory_view",
    "validate",
    "write_parquet",
]
