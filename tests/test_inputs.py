"""What users hand to put / delete / write / lookup: accepted losslessly, or a typed
error naming the column, before anything is written."""

import os

import lance
import pandas as pd
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import pk_schema

SCHEMA = pk_schema(pa.field("name", pa.string()), pa.field("flag", pa.bool_()))


@pytest.fixture
def t(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(
        pa.table({"id": [1, 2], "name": ["a", "b"], "flag": [True, False]}, schema=SCHEMA), uri
    )
    table = mq.MemWalTable.initialize(uri)
    yield table
    table.close(flush=False)


def files(path: str) -> set[str]:
    return {os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs}


def live(t, writers) -> dict:
    return {r["id"]: (r["name"], r["flag"]) for r in t.to_table(writers=writers).to_pylist()}


def test_pandas_index_named_like_the_key_is_the_key(t):
    df = pd.DataFrame({"name": ["x", "y"]}, index=pd.Index([2, 3], name="id"))
    with t.writer() as w:
        w.put(df, partial=True)  # no "flag" column: kept for key 2, NULL for the new key 3
        assert live(t, [w]) == {1: ("a", True), 2: ("x", False), 3: ("y", None)}
        w.delete(pd.DataFrame({"other": [0]}, index=pd.Index([3], name="id")))
        assert sorted(live(t, [w])) == [1, 2]
        assert t.lookup(pd.DataFrame(index=pd.Index([2], name="id")), writers=[w]).column(
            "name"
        ).to_pylist() == ["x"]
    t.write(pd.DataFrame({"name": ["z"]}, index=pd.Index([4], name="id")), partial=True)
    assert live(t, t.writers())[4] == ("z", None)
    # an unnamed or unrelated index is still dropped
    t.write(
        pd.DataFrame({"id": [5], "name": ["q"]}, index=pd.Index([99], name="row")), partial=True
    )
    assert live(t, t.writers())[5] == ("q", None)


def test_unconvertible_pandas_column_is_a_schema_error(t):
    w = t.writer()
    before = files(t.uri)
    with pytest.raises(mq.SchemaError, match="name"):
        w.put(pd.DataFrame({"id": [3, 4], "name": ["a", 3]}))
    assert files(t.uri) == before
    w.close(flush=False)


@pytest.mark.parametrize(
    "values", [pa.array([2], pa.int64()), pa.array([0.5]), pa.array([-1], pa.int8())]
)
def test_numeric_to_bool_must_be_lossless(t, values):
    w = t.writer()
    with pytest.raises(mq.SchemaError, match="flag"):
        w.put(pa.table({"id": [3], "flag": values}), partial=True)
    w.put(pa.table({"id": [3, 4, 5], "flag": pa.array([1, 0, None], values.type)}), partial=True)
    assert {k: v[1] for k, v in live(t, [w]).items() if k > 2} == {3: True, 4: False, 5: None}
    w.close(flush=False)


def test_lookup_keys_of_any_form(t):
    reader = pa.RecordBatchReader.from_batches(
        pa.schema([("id", pa.int64())]), [pa.record_batch({"id": [2]})]
    )
    assert t.lookup(reader).column("id").to_pylist() == [2]
    assert t.lookup(pa.scalar(1)).column("id").to_pylist() == [1]
    with pytest.raises(mq.SchemaError, match="'id'"):
        t.lookup(None)
    with pytest.raises(mq.SchemaError, match="'id'"):
        t.lookup([1, "x"])
    with pytest.raises(mq.PrimaryKeyError, match="lookup keys"):
        t.lookup({"key": [1]})


@pytest.mark.parametrize(
    "column, values",
    [
        ("id", pa.array(["7", "8"])),  # text into an integer key
        ("name", pa.array([12, 13])),  # numbers into a string column
        ("flag", pa.array(["true", "false"])),  # text into bool
        ("id", pa.array([0, 1], pa.timestamp("us"))),  # datetimes into an integer key
    ],
)
def test_values_of_another_kind_are_a_schema_error(t, column, values):
    """pyarrow would parse or print them ("7" -> 7, 12 -> "12"): refused, naming the column."""
    data = {"id": pa.array([7, 8]), "name": pa.array(["x", "y"]), "flag": [True, False]}
    data[column] = values
    w = t.writer()
    before = files(t.uri)
    with pytest.raises(mq.SchemaError, match=repr(column)):
        w.put(pa.table(data))
    if column == "id":
        with pytest.raises(mq.SchemaError, match=repr(column)):
            t.lookup(values)
    assert files(t.uri) == before
    w.close(flush=False)


def test_lossless_casts_within_a_kind_are_accepted(t):
    with t.writer() as w:
        w.put(
            pa.table(
                {
                    "id": pa.array([7], pa.int32()),
                    "name": pa.array(["x"]).dictionary_encode(),
                    "flag": pa.array([1], pa.int8()),
                }
            )
        )
        w.put(pa.table({"id": pa.array([8], pa.uint8()), "name": pa.nulls(1)}), partial=True)
        assert live(t, [w])[7] == ("x", True) and live(t, [w])[8] == (None, None)


def test_timestamp_with_a_time_of_day_into_a_date_column_is_refused(tmp_path):
    import datetime as dt

    schema = pk_schema(pa.field("d", pa.date32()))
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": [1], "d": [dt.date(2020, 1, 1)]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        late = pa.array([dt.datetime(2021, 6, 1, 23, 30)], pa.timestamp("us"))
        with pytest.raises(mq.SchemaError, match="'d'.*time of day"):
            w.put(pa.table({"id": [2], "d": late}))
        midnight = pa.array([dt.datetime(2021, 6, 1)], pa.timestamp("us"))
        w.put(pa.table({"id": [3], "d": midnight}))  # lossless: accepted
        got = t.to_table(writers=[w]).sort_by("id").to_pydict()
    assert got == {"id": [1, 3], "d": [dt.date(2020, 1, 1), dt.date(2021, 6, 1)]}


def test_initialize_refuses_a_spec_the_table_cannot_evaluate(tmp_path):
    """truncate of a float key: refused at initialize (it would fail on every write)."""
    from memwal_query.regions.spec import truncate_spec

    schema = pk_schema(pa.field("v", pa.int64()), key_type=pa.float64())
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(pa.table({"id": [1.0], "v": [1]}, schema), uri)
    before = files(uri)
    with pytest.raises(mq.RegionSpecError, match="truncate is not defined for floating-point"):
        mq.MemWalTable.initialize(uri, region_spec=truncate_spec(ds.lance_schema, "id", 100))
    assert files(uri) == before


def _dict_values(values, index=None, value=None):
    index, value = index or pa.int32(), value or pa.string()
    return pa.array(values, value).dictionary_encode().cast(pa.dictionary(index, value))


@pytest.mark.parametrize(
    "kind, make",
    [
        (
            pa.dictionary(pa.int32(), pa.string()),
            lambda v: _dict_values([v, v]),
        ),
        (
            pa.dictionary(pa.int64(), pa.large_string()),
            lambda v: _dict_values([v, None], pa.int64(), pa.large_string()),
        ),
        (
            pa.list_(pa.dictionary(pa.int32(), pa.string())),
            lambda v: pa.ListArray.from_arrays(pa.array([0, 2, 2]), _dict_values([v, None])),
        ),
        (
            pa.struct([("s", pa.dictionary(pa.int32(), pa.string()))]),
            lambda v: pa.StructArray.from_arrays([_dict_values([v, None])], names=["s"]),
        ),
    ],
    ids=["string", "large_string with nulls", "list of dictionaries", "struct of a dictionary"],
)
def test_dictionary_columns_flush_writes_with_different_dictionaries(tmp_path, kind, make):
    """Writes (and a delete) whose dictionaries differ, NULLs among them, dictionaries
    inside lists and structs: one generation flushed (its rows sidecar one dictionary
    per field), read back and merged as written."""
    schema = pk_schema(pa.field("d", kind))
    uri = str(tmp_path / "t")

    def rows(ids, value):
        return pa.table({"id": ids, "d": make(value)}, schema)

    lance.write_dataset(rows([1, 2], "a"), uri)
    t = mq.MemWalTable.initialize(uri)
    t.write(rows([3, 5], "b"))
    t.write(rows([2, 4], "c"))
    t.delete(pa.table({"id": [1]}))
    want = {}
    for batch in (rows([1, 2], "a"), rows([3, 5], "b"), rows([2, 4], "c")):
        want.update({r["id"]: r["d"] for r in batch.to_pylist()})
    del want[1]
    t.close()  # flushes the MemTable: one generation of three batches
    t = mq.MemWalTable.open(uri)
    assert {r["id"]: r["d"] for r in t.to_table().to_pylist()} == want
    t.maintenance.merge()
    got = lance.dataset(uri).to_table().to_pylist()
    assert {r["id"]: r["d"] for r in got} == want
    t.close()
