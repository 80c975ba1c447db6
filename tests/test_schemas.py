"""Schema v1: validation errors, conform, Parquet I/O, polars views. Fast; no Ray."""

from __future__ import annotations

import math
import os

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.schemas import (
    COLUMNS,
    NULLABLE_COLUMNS,
    OPTIONAL_COLUMNS,
    PER_TOKEN_COLUMNS,
    SamplingSemantics,
    SchemaError,
    conform,
    empty_table,
    from_rows,
    nonfinite_rows,
    read_parquet,
    sampling_semantics,
    token_view,
    trajectory_schema,
    trajectory_view,
    validate,
    write_parquet,
)

SAMPLING = SamplingSemantics(temperature=0.7, top_p=0.9, top_k=20)


def rows() -> list[dict]:
    return [
        dict(trajectory_id="t0", group_id="g0", prompt_id="p0", prompt_tokens=[1, 4, 5],
             response_tokens=[7, 8, 2], loss_mask=[True, True, True],
             inference_logprobs=[-0.5, -1.0, -0.25], versions=[3, 3, 4],
             old_logprobs=[-0.4, -1.1, -0.2], finish_reason="stop", reward=1.0, advantage=0.5),
        dict(trajectory_id="t1", group_id="g0", prompt_id="p0", prompt_tokens=[1, 4, 5],
             response_tokens=[9, 10], loss_mask=[True, False],
             inference_logprobs=[-2.0, 0.0], versions=[5, 5],
             old_logprobs=None, finish_reason="length", reward=0.0, advantage=-0.5),
        dict(trajectory_id="t2", group_id="g1", prompt_id="p1", prompt_tokens=[1, 6],
             response_tokens=[11, 12, 13, 2], loss_mask=[True, True, False, True],
             inference_logprobs=[-0.1, -0.2, -0.3, -0.4], versions=[1, 2, 2, 3],
             old_logprobs=[-0.1, -0.2, -0.3, -0.4], finish_reason="stop", reward=None,
             advantage=None),
        dict(trajectory_id="t3", group_id="g1", prompt_id="p1", prompt_tokens=[1, 6],
             response_tokens=[], loss_mask=[], inference_logprobs=[], versions=[],
             old_logprobs=[], finish_reason="abort", reward=0.0, advantage=0.0),
    ]


@pytest.fixture
def table() -> pa.Table:
    return from_rows(rows(), SAMPLING)


def replace(table: pa.Table, name: str, values: list, type_: pa.DataType | None = None) -> pa.Table:
    type_ = type_ or table.schema.field(name).type
    i = table.column_names.index(name)
    field = pa.field(name, type_, nullable=table.schema.field(name).nullable)
    return table.set_column(i, field, pa.array(values, type=type_))


def with_row(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return replace(table, name, values)


# ---------------------------------------------------------------- valid tables


def test_valid_table_has_canonical_schema(table):
    validate(table)
    assert table.schema.equals(trajectory_schema(SAMPLING), check_metadata=True)
    assert table.column_names == COLUMNS
    assert sampling_semantics(table) == SAMPLING


def test_empty_table_is_valid():
    validate(empty_table())
    assert empty_table(SAMPLING).schema.equals(trajectory_schema(SAMPLING), check_metadata=True)
    assert token_view(empty_table()).height == 0


def test_nullable_columns_accept_nulls(table, tmp_path):
    """Exactly the columns later operators fill (old_logprobs, reward, advantage) may be null, and
    their nulls survive a Parquet round trip."""
    assert NULLABLE_COLUMNS == {"old_logprobs", "reward", "advantage"}
    for name in NULLABLE_COLUMNS:
        nulls = replace(table, name, [None] * table.num_rows)
        validate(nulls)
        back = read_parquet(write_parquet(nulls, tmp_path / f"{name}.parquet"))
        assert back.column(name).null_count == table.num_rows
        assert back.drop_columns([name]).equals(table.drop_columns([name]))


def test_extra_columns_pass_through():
    t = from_rows([{**r, "answer": str(i)} for i, r in enumerate(rows())])
    validate(t)
    assert t.column_names == COLUMNS + ["answer"]


def test_reward_error_is_an_optional_string_column(tmp_path):
    """`reward_error` (why a row's reward failed): typed when present, after the v1 columns; a log
    written before it existed (no such column) still reads back."""
    # the others: tests/test_verl_knobs.py (token_advantages), tests/test_distributions.py (the top-k),
    # test_the_critics_columns_are_validated_by_name below
    assert OPTIONAL_COLUMNS == ("reward_error", "token_advantages", "top_k_ids", "top_k_inference_logprobs",
                                "top_k_old_logprobs", "top_k_teacher_logprobs", "teacher_logprobs", "values",
                                "value_versions", "train_values", "returns", "agent", "token_agents")
    errors = [None, "ValueError: bad answer", None, "TimeoutError: too slow"]
    t = from_rows([{"answer": str(i), **r, "reward_error": e} for i, (r, e) in enumerate(zip(rows(), errors))])
    assert t.column_names == COLUMNS + ["answer", "reward_error"]
    assert t.schema.field("reward_error").type == pa.string()
    back = read_parquet(write_parquet(t, tmp_path / "new.parquet"))
    assert back.column_names == COLUMNS + ["reward_error", "answer"]  # canonical order, then extras
    assert back["reward_error"].to_pylist() == errors
    old = read_parquet(write_parquet(from_rows(rows()), tmp_path / "old.parquet"))
    assert "reward_error" not in old.column_names and old.num_rows == 4
    all_null = from_rows([{**r, "reward_error": None} for r in rows()])  # typed, not Arrow's null type
    assert all_null.schema.field("reward_error").type == pa.string()
    wrong = from_rows(rows()).append_column("reward_error", pa.array([1, 2, 3, 4]))
    with pytest.raises(SchemaError, match="column 'reward_error': type int64 != string"):
        validate(wrong)
    with pytest.raises(SchemaError, match="reward_error"):
        conform(wrong)


def test_the_critics_columns_are_validated_by_name(tmp_path):
    """`values`, `value_versions`, `train_values`, `returns` (PPO with a critic): one entry per
    response token, finite, versions >= 0; a NaN quarantines the row; they read back."""
    from trajflow.schemas import nonfinite_rows

    base = rows()
    good = from_rows([{**r, "values": [0.5] * len(r["response_tokens"]),
                       "value_versions": [3] * len(r["response_tokens"]),
                       "returns": [1.0] * len(r["response_tokens"])} for r in base])
    validate(good)
    back = read_parquet(write_parquet(good, tmp_path / "critic.parquet"))
    assert back["value_versions"].to_pylist() == good["value_versions"].to_pylist()
    with pytest.raises(SchemaError, match="column 'values' row 0: length 1 != len\\(response_tokens\\)"):
        validate(from_rows([{**r, "values": [0.5]} for r in base]))
    nan = from_rows([{**r, "returns": [float("nan")] * len(r["response_tokens"])} if i == 2 else r
                     for i, r in enumerate(base)], check=False)
    with pytest.raises(SchemaError, match="column 'returns' row 2: a non-finite value nan at token 0"):
        validate(nan)
    assert nonfinite_rows(nan).tolist() == [False, False, True, False]
    with pytest.raises(SchemaError, match="column 'value_versions' row 0: a negative version -1"):
        validate(from_rows([{**r, "value_versions": [-1] * len(r["response_tokens"])} for r in base]))


def test_missing_metadata_is_allowed(table, tmp_path):
    """A table without trajflow metadata (e.g. built by hand or by polars) is valid; it claims no
    sampling semantics, and writing it attaches the v1 metadata."""
    bare = table.replace_schema_metadata(None)
    validate(bare)
    assert bare.schema.metadata is None and sampling_semantics(bare) is None
    back = read_parquet(write_parquet(bare, tmp_path / "bare.parquet"))
    assert back.schema.metadata[b"trajflow.schema_version"] == b"1" and sampling_semantics(back) is None
    assert sampling_semantics(conform(bare, SAMPLING)) == SAMPLING


# ---------------------------------------------------------------- bad tables


@pytest.mark.parametrize("name", COLUMNS)
def test_missing_column(table, name):
    with pytest.raises(SchemaError, match=f"column '{name}': missing column") as e:
        validate(table.drop_columns([name]))
    assert (e.value.column, e.value.row) == (name, None)


@pytest.mark.parametrize(
    "name, type_",
    [
        ("trajectory_id", pa.large_string()),
        ("prompt_tokens", pa.list_(pa.int64())),
        ("response_tokens", pa.large_list(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("inference_logprobs", pa.list_(pa.float64())),
        ("versions", pa.list_(pa.int64())),
        ("old_logprobs", pa.large_list(pa.float32())),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
    ],
)
def test_wrong_type(table, name, type_):
    values = table.column(name).to_pylist()
    if name == "loss_mask":
        values = [None if v is None else [int(x) for x in v] for v in values]
    with pytest.raises(SchemaError, match=rf"column '{name}': type .* call .*conform\(\)") as e:
        validate(replace(table, name, values, type_))
    assert (e.value.column, e.value.row) == (name, None)


def test_list_field_name_is_not_a_type_difference(table):
    """list<element: int32> (Parquet's naming) is list<item: int32>; the element type still counts."""
    values = table.column("versions").to_pylist()
    renamed = replace(table, "versions", values, pa.list_(pa.field("element", pa.int32())))
    assert renamed.schema.field("versions").type.value_field.name == "element"
    validate(renamed)
    assert conform(renamed).column("versions").to_pylist() == values
    with pytest.raises(SchemaError, match="column 'versions': type"):
        validate(replace(table, "versions", values, pa.list_(pa.field("element", pa.int64()))))


@pytest.mark.parametrize("name", sorted(set(COLUMNS) - NULLABLE_COLUMNS))
def test_null_in_non_nullable(table, name):
    with pytest.raises(SchemaError, match=f"column '{name}' row 2: null") as e:
        validate(with_row(table, name, 2, None))
    assert (e.value.column, e.value.row) == (name, 2)


def test_null_element_inside_list(table):
    with pytest.raises(SchemaError, match="column 'versions' row 2: null element") as e:
        validate(with_row(table, "versions", 2, [1, None, 2, 3]))
    assert (e.value.column, e.value.row) == ("versions", 2)


@pytest.mark.parametrize("name", PER_TOKEN_COLUMNS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_length_mismatch(table, name, delta):
    value = table.column(name)[2].as_py()
    value = value[:-1] if delta < 0 else value + value[:1]
    with pytest.raises(SchemaError) as e:
        validate(with_row(table, name, 2, value))
    assert (e.value.column, e.value.row) == (name, 2)
    assert str(e.value) == f"column '{name}' row 2: length {4 + delta} != len(response_tokens) 4"


@pytest.mark.parametrize("name, bad", [("inference_logprobs", math.nan), ("inference_logprobs", math.inf),
                                       ("inference_logprobs", -math.inf), ("old_logprobs", math.nan),
                                       ("old_logprobs", math.inf)])
def test_nonfinite_logprobs(table, name, bad):
    t = with_row(table, name, 2, [-0.1, -0.2, bad, -0.4])
    with pytest.raises(SchemaError, match=f"column '{name}' row 2: non-finite value .* at token 2") as e:
        validate(t)
    assert (e.value.column, e.value.row) == (name, 2)
    validate(t, allow_nonfinite=True)
    assert nonfinite_rows(t).tolist() == [False, False, True, False]
    assert nonfinite_rows(table).tolist() == [False] * 4


def test_old_logprob_outside_the_sampling_support_is_valid(table):
    # -inf old log-prob: the token lies outside top-k/top-p under training numerics (a valid value
    # the train step takes out of the loss), unlike NaN, +inf, or -inf for the sampled log-prob
    t = with_row(table, "old_logprobs", 2, [-0.1, -0.2, -math.inf, -0.4])
    validate(t)
    assert nonfinite_rows(t).tolist() == [False] * 4


def test_bad_finish_reason(table):
    with pytest.raises(SchemaError, match="column 'finish_reason' row 1: 'done' not one of") as e:
        validate(with_row(table, "finish_reason", 1, "done"))
    assert (e.value.column, e.value.row) == ("finish_reason", 1)


def test_wrong_schema_version(table):
    meta = {**table.schema.metadata, b"trajflow.schema_version": b"2"}
    bad = table.replace_schema_metadata(meta)
    with pytest.raises(SchemaError, match="schema_version '2'") as e:
        validate(bad)
    assert e.value.column is None
    with pytest.raises(SchemaError, match="schema_version"):
        conform(bad)


def test_error_rows_are_global_in_chunked_and_sliced_tables(table):
    bad = with_row(table, "finish_reason", 1, "done")
    chunked = pa.concat_tables([table, bad])
    assert chunked.column("finish_reason").num_chunks == 2
    with pytest.raises(SchemaError) as e:
        validate(chunked)
    assert e.value.row == 5
    with pytest.raises(SchemaError) as e:
        validate(chunked.slice(3))
    assert e.value.row == 2
    nan = with_row(table, "inference_logprobs", 2, [-0.1, math.nan, -0.3, -0.4])
    assert nonfinite_rows(pa.concat_tables([table, nan]).slice(1)).tolist() == [
        False, False, False, False, False, True, False]


# ---------------------------------------------------------------- conform


def test_polars_round_trip_then_conform(table):
    df = pl.from_arrow(table.append_column("answer", pa.array(["a", "b", "c", "d"])))
    arrow = df.to_arrow()
    assert pa.types.is_large_list(arrow.schema.field("response_tokens").type)
    with pytest.raises(SchemaError, match="conform"):
        validate(arrow)
    fixed = conform(arrow, SAMPLING)
    validate(fixed)
    assert fixed.select(COLUMNS).schema.equals(trajectory_schema(SAMPLING), check_metadata=True)
    assert fixed.column_names == COLUMNS + ["answer"]
    assert fixed.select(COLUMNS).equals(table)


def test_conform_reorders_casts_and_keeps_sampling(table):
    shuffled = table.append_column("answer", pa.array(["a", "b", "c", "d"])).select(
        ["answer"] + COLUMNS[::-1])
    shuffled = replace(shuffled, "reward", shuffled.column("reward").to_pylist(), pa.float64())
    shuffled = replace(shuffled, "versions", shuffled.column("versions").to_pylist(),
                       pa.large_list(pa.int64()))
    fixed = conform(shuffled)  # sampling=None keeps the existing sampling metadata
    assert fixed.column_names == COLUMNS + ["answer"]
    assert sampling_semantics(fixed) == SAMPLING
    assert fixed.select(COLUMNS).equals(table)
    assert fixed.select(COLUMNS).schema.equals(trajectory_schema(SAMPLING), check_metadata=True)


def test_conform_all_null_old_logprobs(table):
    t = replace(table, "old_logprobs", [None] * 4, pa.null())
    fixed = conform(t)
    validate(fixed)
    assert fixed.schema.field("old_logprobs").type == pa.list_(pa.float32())


@pytest.mark.parametrize(
    "name, values, type_",
    [
        ("reward", ["x", "y", "z", "w"], pa.string()),
        ("versions", [[0.5, 1, 2]] * 4, pa.list_(pa.float64())),
        ("versions", [[2**40]] * 4, pa.list_(pa.int64())),
    ],
)
def test_conform_refuses_lossy_casts(table, name, values, type_):
    with pytest.raises(SchemaError) as e:
        conform(replace(table, name, values, type_))
    assert e.value.column == name


# ---------------------------------------------------------------- Parquet


def test_parquet_round_trip_keeps_types_and_metadata(table, tmp_path):
    path = write_parquet(table, tmp_path / "sub" / "traj.parquet")
    back = read_parquet(path)
    assert back.schema.equals(trajectory_schema(SAMPLING), check_metadata=True)
    assert back.equals(table)
    assert os.listdir(path.parent) == ["traj.parquet"]


def test_write_parquet_attaches_metadata(table, tmp_path):
    write_parquet(table.replace_schema_metadata(None), tmp_path / "t.parquet")
    schema = pq.read_schema(tmp_path / "t.parquet")
    assert schema.metadata[b"trajflow.schema_version"] == b"1"


def test_invalid_write_leaves_nothing(table, tmp_path):
    path = tmp_path / "t.parquet"
    with pytest.raises(SchemaError, match="finish_reason"):
        write_parquet(with_row(table, "finish_reason", 0, "done"), path)
    assert os.listdir(tmp_path) == []
    write_parquet(table, path)
    with pytest.raises(SchemaError):
        write_parquet(table.drop_columns(["loss_mask"]), path)
    assert os.listdir(tmp_path) == ["t.parquet"]
    assert read_parquet(path).equals(table)  # the old file is untouched


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_parquet_names_the_file(table, tmp_path, damage):
    path = write_parquet(table, tmp_path / "bad.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not parquet" * 10)
    with pytest.raises(SchemaError, match=r"bad\.parquet.*not a readable Parquet file"):
        read_parquet(path)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_parquet(tmp_path / "nope.parquet")


def test_read_parquet_error_names_file_and_column(table, tmp_path):
    path = tmp_path / "foreign.parquet"
    pq.write_table(with_row(table, "loss_mask", 1, [True]), path)
    with pytest.raises(SchemaError, match=r"foreign\.parquet: column 'loss_mask' row 1") as e:
        read_parquet(path)
    assert (e.value.column, e.value.row) == ("loss_mask", 1)


def test_read_parquet_conforms_polars_output(table, tmp_path):
    path = tmp_path / "pl.parquet"
    pl.from_arrow(table).write_parquet(path)  # large types, no trajflow metadata
    back = read_parquet(path)
    assert back.equals(table)
    assert back.schema.equals(trajectory_schema(), check_metadata=True)


# ---------------------------------------------------------------- views


def test_token_view_lines_up(table):
    tv = token_view(table)
    assert tv.height == 3 + 2 + 4 + 0
    assert tv.columns == ["trajectory_id", "group_id", "prompt_id", "position", "token", "loss_mask",
                          "inference_logprob", "old_logprob", "version", "reward", "advantage"]
    assert tv["trajectory_id"].to_list() == ["t0"] * 3 + ["t1"] * 2 + ["t2"] * 4
    assert tv["group_id"].to_list() == ["g0"] * 5 + ["g1"] * 4
    assert tv["position"].to_list() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert tv["token"].to_list() == [7, 8, 2, 9, 10, 11, 12, 13, 2]
    assert tv["loss_mask"].to_list() == [True] * 4 + [False] + [True, True, False, True]
    assert tv["inference_logprob"].to_list() == pytest.approx(
        [-0.5, -1.0, -0.25, -2.0, 0.0, -0.1, -0.2, -0.3, -0.4])
    old = tv["old_logprob"].to_list()
    assert old[3:5] == [None, None]
    assert old[:3] + old[5:] == pytest.approx([-0.4, -1.1, -0.2, -0.1, -0.2, -0.3, -0.4])
    assert tv["version"].to_list() == [3, 3, 4, 5, 5, 1, 2, 2, 3]
    assert tv["reward"].to_list() == [1.0] * 3 + [0.0] * 2 + [None] * 4
    assert tv["advantage"].to_list() == [0.5] * 3 + [-0.5] * 2 + [None] * 4
    assert tv.schema["token"] == pl.Int32 and tv.schema["inference_logprob"] == pl.Float32


def test_token_view_row_count_on_random_table():
    rng = np.random.default_rng(0)
    rs = []
    for i in range(50):
        n = int(rng.integers(0, 20))
        rs.append(dict(trajectory_id=f"t{i}", group_id=f"g{i // 4}", prompt_id=f"p{i // 4}",
                       prompt_tokens=[1], response_tokens=rng.integers(4, 50, n).tolist(),
                       loss_mask=(rng.random(n) < 0.8).tolist(),
                       inference_logprobs=(-rng.random(n)).tolist(),
                       versions=[i] * n, old_logprobs=None if i % 3 else [0.0] * n,
                       finish_reason="length"))
    t = from_rows(rs)
    tv = token_view(t)
    assert tv.height == sum(len(r["response_tokens"]) for r in rs)
    assert tv["token"].to_list() == [x for r in rs for x in r["response_tokens"]]
    assert tv["old_logprob"].null_count() == sum(len(r["response_tokens"]) for r in rs
                                              if r["old_logprobs"] is None)


def test_trajectory_view(table):
    v = trajectory_view(table)
    assert v["trajectory_id"].to_list() == ["t0", "t1", "t2", "t3"]
    assert v["response_len"].to_list() == [3, 2, 4, 0]
    assert v["n_loss_tokens"].to_list() == [3, 1, 3, 0]
    assert v["min_version"].to_list() == [3, 5, 1, None]
    assert v["max_version"].to_list() == [4, 5, 3, None]
    assert v["version_span"].to_list() == [1, 0, 2, None]
    assert v["mean_logprob"].to_list()[:3] == pytest.approx([-1.75 / 3, -2.0, -0.7 / 3])
    assert v["mean_logprob"][3] is None
    assert v["has_old_logprobs"].to_list() == [True, False, True, True]


def test_from_rows_validates():
    bad = rows()
    bad[0]["loss_mask"] = [True]
    with pytest.raises(SchemaError, match="column 'loss_mask' row 0"):
        from_rows(bad)
    assert from_rows(bad, check=False).num_rows == 4
