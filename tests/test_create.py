"""Creating a table from data with the key given at call time, and naming the key of an
existing Lance table when initializing it: through the public API and the CLI."""

from __future__ import annotations

import datetime as dt

import lance
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from click.testing import CliRunner

import memwal_query as mq
from memwal_query.cli import main
from memwal_query.format.schema import primary_key_columns


def _sql(t: mq.MemWalTable, query: str) -> list[dict]:
    import datafusion

    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    return ctx.sql(query).to_arrow_table().to_pylist()


def test_pandas_frame_to_sql(tmp_path):
    df = pd.DataFrame({"id": [1, 2, 3], "amount": [10.0, 20.0, 30.0], "who": ["a", "b", "c"]})
    t = mq.MemWalTable.create(tmp_path / "t", df, primary_key="id")
    assert t.primary_key == ["id"]
    assert t.schema.field("id").nullable is False
    assert b"pandas" not in (t.schema.metadata or {})
    t.write(pd.DataFrame({"id": [2, 4], "amount": [21.0, 40.0], "who": ["B", "d"]}))
    rows = _sql(t, "SELECT id, amount, who FROM t ORDER BY id")
    assert rows == [
        {"id": 1, "amount": 10.0, "who": "a"},
        {"id": 2, "amount": 21.0, "who": "B"},
        {"id": 3, "amount": 30.0, "who": "c"},
        {"id": 4, "amount": 40.0, "who": "d"},
    ]
    # the key index was built, as initialize builds it
    assert len(t.catalog.dataset().describe_indices()) == 2  # key BTREE + MemWAL index


def test_a_frame_indexed_by_its_key(tmp_path):
    df = pd.DataFrame({"id": [1, 2], "v": [1.0, 2.0]}).set_index("id")
    t = mq.MemWalTable.create(tmp_path / "t", df, primary_key="id")
    assert t.schema.names == ["id", "v"]
    assert t.to_table().sort_by("id").to_pylist() == [{"id": 1, "v": 1.0}, {"id": 2, "v": 2.0}]


def test_composite_key_and_polars(tmp_path):
    pl = pytest.importorskip("polars")
    df = pl.DataFrame({"tenant": ["x", "x", "y"], "id": [1, 2, 1], "v": [1.0, 2.0, 3.0]})
    t = mq.MemWalTable.create(str(tmp_path / "t"), df, primary_key=["tenant", "id"])
    assert t.primary_key == ["tenant", "id"]
    t.write(pl.DataFrame({"tenant": ["y", "z"], "id": [1, 1], "v": [30.0, 4.0]}))
    got = sorted(t.to_table().to_pylist(), key=lambda r: (r["tenant"], r["id"]))
    assert got == [
        {"tenant": "x", "id": 1, "v": 1.0},
        {"tenant": "x", "id": 2, "v": 2.0},
        {"tenant": "y", "id": 1, "v": 30.0},
        {"tenant": "z", "id": 1, "v": 4.0},
    ]


def test_schema_gives_an_empty_table(tmp_path):
    schema = pa.schema([("id", pa.string()), ("at", pa.timestamp("us")), ("n", pa.int32())])
    t = mq.MemWalTable.create(tmp_path / "t", schema, primary_key="id")
    assert t.count_rows() == 0
    t.write(pa.table({"id": ["k"], "at": [dt.datetime(2024, 1, 1)], "n": [1]}))
    assert t.to_table().to_pylist() == [{"id": "k", "at": dt.datetime(2024, 1, 1), "n": 1}]


@pytest.mark.parametrize(
    "frame, key, message",
    [
        (pd.DataFrame({"id": [1, 2]}), "nope", "'nope'"),
        (pd.DataFrame({"id": [1, 2]}), ["id", "nope"], "'nope'"),
        (pd.DataFrame({"id": [1, 2]}), [], "names no column"),
        (pd.DataFrame({"id": [1, 2]}), ["id", "id"], "twice"),
        (pa.table({"id": pa.array([[1], [2]])}), "id", "'id' is list"),
        (
            pa.table({"id": pa.array(np.array([0.0, 1.0], np.float16))}),
            "id",
            "'id' is halffloat: a primary-key column must be an integer, 32- or 64-bit float",
        ),
        (pa.table({"id": pa.array([1, None]), "v": [1, 2]}), "id", "1 NULL"),
        (pd.DataFrame({"id": [1, 2, 1], "v": [1, 2, 3]}), "id", "value 1 occurs in 2 rows"),
        (
            pd.DataFrame({"a": ["x", "x"], "b": [1, 1], "v": [1, 2]}),
            ["a", "b"],
            "{'a': 'x', 'b': 1} occurs in 2 rows",
        ),
    ],
)
def test_bad_keys_are_refused_and_nothing_is_written(tmp_path, frame, key, message):
    uri = tmp_path / "t"
    with pytest.raises(mq.PrimaryKeyError, match=message.replace("[", r"\[").replace("{", r"\{")):
        mq.MemWalTable.create(uri, frame, primary_key=key)
    assert not uri.exists()


def test_existing_table_is_refused_unless_overwritten(tmp_path):
    uri = tmp_path / "t"
    mq.MemWalTable.create(uri, pd.DataFrame({"id": [1], "v": [1.0]}), primary_key="id")
    with pytest.raises(mq.AlreadyExistsError, match="overwrite"):
        mq.MemWalTable.create(uri, pd.DataFrame({"id": [2], "v": [2.0]}), primary_key="id")
    assert mq.MemWalTable.open(uri).to_table().to_pylist() == [{"id": 1, "v": 1.0}]
    t = mq.MemWalTable.create(
        uri, pd.DataFrame({"id": [2], "v": [2.0]}), primary_key="id", mode="overwrite"
    )
    assert t.to_table().to_pylist() == [{"id": 2, "v": 2.0}]


def test_region_spec_that_does_not_fit_leaves_no_table(tmp_path):
    from memwal_query.regions.spec import RegionField, RegionSpec

    field = RegionField("b", [999], "bucket", None, "int32", {"num_buckets": "4"})
    spec = RegionSpec(1, [field])
    uri = tmp_path / "t"
    with pytest.raises(mq.RegionSpecError):
        mq.MemWalTable.create(uri, pd.DataFrame({"id": [1]}), primary_key="id", region_spec=spec)
    assert not uri.exists()


def test_vector_columns_from_pandas_arrays(tmp_path):
    vecs = [np.full(4, i, dtype=np.float32) for i in range(20)]
    df = pd.DataFrame({"id": range(20), "vec": vecs})
    t = mq.MemWalTable.create(tmp_path / "t", df, primary_key="id", vector_columns=["vec"])
    assert t.schema.field("vec").type == pa.list_(pa.float32(), 4)
    t.write(pd.DataFrame({"id": [100], "vec": [np.full(4, 7.5, dtype=np.float32)]}))
    top = t.vector_search("vec", np.full(4, 7.6, dtype=np.float32), 2)
    assert top.column("id").to_pylist() == [100, 8]
    with pytest.raises(mq.SchemaError, match="row 1 has 3 values, but .* vectors of 4"):
        mq.MemWalTable.create(
            tmp_path / "u",
            pd.DataFrame({"id": [1, 2], "vec": [np.ones(4), np.ones(3)]}),
            primary_key="id",
            vector_columns={"vec": 4},
        )
    with pytest.raises(mq.SchemaError, match="3 to 4 values"):
        mq.MemWalTable.create(
            tmp_path / "u",
            pd.DataFrame({"id": [1, 2], "vec": [np.ones(4), np.ones(3)]}),
            primary_key="id",
            vector_columns=["vec"],
        )
    assert not (tmp_path / "u").exists()


def test_initialize_names_the_key_of_a_plain_lance_table(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(pd.DataFrame({"k": [1, 2], "v": ["a", "b"]}), uri)
    with pytest.raises(mq.PrimaryKeyError, match="primary_key="):
        mq.MemWalTable.initialize(uri)
    t = mq.MemWalTable.initialize(uri, primary_key="k")
    assert t.primary_key == ["k"]
    assert primary_key_columns(lance.dataset(uri).schema) == ["k"]
    t.write(pd.DataFrame({"k": [2], "v": ["B"]}))
    assert sorted(t.to_table().to_pylist(), key=lambda r: r["k"]) == [
        {"k": 1, "v": "a"},
        {"k": 2, "v": "B"},
    ]


def test_initialize_refuses_another_key_and_bad_data_unchanged(tmp_path):
    declared = str(tmp_path / "declared")
    mq.MemWalTable.create(declared, pd.DataFrame({"id": [1], "v": [1]}), primary_key="id")
    lance.dataset(declared)  # a second initialize is refused first (already initialized)
    plain = str(tmp_path / "plain")
    lance.write_dataset(pd.DataFrame({"k": [1, 1, 2], "v": [1, 2, 3]}), plain)
    version = lance.dataset(plain).version
    with pytest.raises(mq.PrimaryKeyError, match="value 1 occurs in 2 rows"):
        mq.MemWalTable.initialize(plain, primary_key="k")
    with pytest.raises(mq.PrimaryKeyError, match="not in the table"):
        mq.MemWalTable.initialize(plain, primary_key="nope")
    assert lance.dataset(plain).version == version
    keyed = str(tmp_path / "keyed")
    pk = {"lance-schema:unenforced-primary-key": "true"}
    schema = pa.schema([pa.field("a", pa.int64(), False, pk), pa.field("b", pa.int64(), False)])
    lance.write_dataset(pa.table({"a": [1], "b": [2]}, schema=schema), keyed)
    with pytest.raises(mq.PrimaryKeyError, match=r"primary key is \['a'\], not \['b'\]"):
        mq.MemWalTable.initialize(keyed, primary_key="b")
    assert mq.MemWalTable.initialize(keyed, primary_key=["a"]).primary_key == ["a"]


def test_cli_init_uses_the_same_checks(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(pd.DataFrame({"k": [1, 1], "v": [1, 2]}), uri)
    runner = CliRunner()
    bad = runner.invoke(main, ["init", uri, "--primary-key", "k"])
    assert bad.exit_code == 1
    assert "PrimaryKeyError" in bad.output and "value 1 occurs in 2 rows" in bad.output
    lance.write_dataset(pd.DataFrame({"k": [1, 2], "j": ["a", "a"]}), uri, mode="overwrite")
    ok = runner.invoke(main, ["init", uri, "--primary-key", "k,j"])
    assert ok.exit_code == 0, ok.output
    assert mq.MemWalTable.open(uri).primary_key == ["k", "j"]
