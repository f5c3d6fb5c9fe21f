"""Dictionary-encoded (pandas categorical) columns: every acknowledged write flushes,
merges into the base and reads back; a write whose dictionary cannot be stored is
refused before anything is written."""

from __future__ import annotations

import os

import lance
import pandas as pd
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.maintain.basefiles import compact_base

from helpers import pk_schema

WIDE = pa.dictionary(pa.int32(), pa.string())
NARROW = pa.dictionary(pa.int8(), pa.string())


def files(path: str) -> set[tuple[str, int]]:
    """Every file under ``path`` with its size."""
    return {
        (os.path.join(r, f), os.path.getsize(os.path.join(r, f)))
        for r, _, fs in os.walk(path)
        for f in fs
    }


def frame(ids, values) -> pd.DataFrame:
    """Rows ``id``, ``c`` (a pandas categorical of exactly the categories used)."""
    return pd.DataFrame({"id": list(ids), "c": pd.Categorical(values)})


def dict_rows(ids, values, categories, index: pa.DataType = WIDE.index_type) -> pa.Table:
    """Rows whose ``c`` dictionary is ``categories`` (may hold a NULL value) and whose
    values are ``values`` (None: a NULL index)."""
    pos = {v: i for i, v in enumerate(categories)}
    idx = pa.array([None if v is None else pos[v] for v in values], index)
    c = pa.DictionaryArray.from_arrays(idx, pa.array(categories, pa.string()))
    return pa.table({"id": pa.array(list(ids), pa.int64()), "c": c})


def as_dict(rows) -> dict:
    return {r["id"]: r["c"] for r in rows}


def check(uri: str, t: mq.MemWalTable, want: dict) -> None:
    """The table reads ``want`` now, after a flush, after a merge into the base (the
    base itself too, with plain Lance), after a compaction and after reopening."""
    assert as_dict(t.to_table().to_pylist()) == want
    t.flush()
    assert as_dict(t.to_table().to_pylist()) == want
    t.maintenance.merge()
    assert as_dict(lance.dataset(uri).to_table().to_pylist()) == want
    compact_base(t._catalog)
    assert as_dict(lance.dataset(uri).to_table().to_pylist()) == want
    t.close()
    t2 = mq.MemWalTable.open(uri)
    assert as_dict(t2.to_table().to_pylist()) == want
    df = t2.to_table().to_pandas()
    assert isinstance(df["c"].dtype, pd.CategoricalDtype)
    assert {i: None if pd.isna(c) else c for i, c in zip(df["id"], df["c"])} == want
    t2.close()


def test_pandas_categoricals_get_32_bit_indices_and_any_number_of_values(tmp_path):
    """A table made from a pandas categorical (int8 indices in Arrow) stores 32-bit
    indices, so writes with 300 different categories in all, NULLs among them, flush,
    merge into the base, compact and read back as written."""
    uri = str(tmp_path / "t")
    t = mq.MemWalTable.create(uri, frame([0, 1], ["a", None]), primary_key="id")
    assert t.schema.field("c").type == WIDE
    want = {0: "a", 1: None}
    for w in range(3):
        ids = range(10 + 100 * w, 110 + 100 * w)
        values = [f"w{w}v{i}" if i % 7 else None for i in range(100)]
        t.write(frame(ids, values))
        want.update(zip(ids, values, strict=True))
    t.write(frame([0, 10], ["w2v5", "b"]))  # an update, a category seen in another write
    want.update({0: "w2v5", 10: "b"})
    check(uri, t, want)


def test_dictionary_with_a_null_value_is_stored_as_null_indices(tmp_path):
    """A dictionary whose values hold a NULL (Arrow cannot unify those) is accepted:
    the rows pointing at it are NULL, and every write flushes and merges."""
    uri = str(tmp_path / "t")
    t = mq.MemWalTable.create(uri, dict_rows([0], ["x"], ["x"]), primary_key="id")
    t.write(dict_rows([1, 2, 3, 4], ["a", None, "b", None], ["a", None, "b"]))
    t.write(dict_rows([5, 6], [None, "a"], [None, "a", "z"]))
    t.write(dict_rows([7], ["c"], ["c", None], pa.int8()))
    want = {0: "x", 1: "a", 2: None, 3: "b", 4: None, 5: None, 6: "a", 7: "c"}
    check(uri, t, want)


def test_initialize_refuses_a_narrow_dictionary_column(tmp_path):
    """A Lance table whose dictionary column has int8 indices is not turned into a
    MemWAL table (it could take only 127 values in all): a SchemaError naming the
    column, and the table unchanged."""
    uri = str(tmp_path / "t")
    schema = pk_schema(pa.field("c", NARROW))
    lance.write_dataset(dict_rows([0], ["base"], ["base"], pa.int8()).cast(schema), uri)
    before = files(uri)
    with pytest.raises(mq.SchemaError, match=r"column 'c' is dictionary.*int32"):
        mq.MemWalTable.initialize(uri)
    assert files(uri) == before
    assert lance.dataset(uri).to_table().column("c").to_pylist() == ["base"]


@pytest.fixture
def narrow(tmp_path, monkeypatch):
    """A MemWAL table whose ``c`` is ``dictionary<int8, string>`` (as ``initialize``
    made it before it refused such columns)."""
    from memwal_query import table_init

    uri = str(tmp_path / "t")
    schema = pk_schema(pa.field("c", NARROW))
    lance.write_dataset(dict_rows([0], ["base"], ["base"], pa.int8()).cast(schema), uri)
    monkeypatch.setattr(table_init, "check_dictionary_types", lambda *_: None)
    t = mq.MemWalTable.initialize(uri)
    monkeypatch.undo()
    assert t.schema.field("c").type == NARROW
    yield uri, t
    t.close(flush=False)


@pytest.mark.parametrize("durable", [True, False])
def test_int8_dictionary_overflow_is_refused_before_anything_is_written(narrow, durable):
    """An int8-indexed column takes at most 127 distinct values per flushed file: a
    write that would bring more (alone, or with the rows not yet flushed) is a
    SchemaError naming the column, the WAL is unchanged, and every acknowledged row
    flushes, merges and reads back."""
    uri, t = narrow
    w = t.writer(durable=durable)
    first = [f"a{i}" for i in range(100)]
    w.put(frame(range(1, 101), first))
    w.sync()
    want = {0: "base", **dict(zip(range(1, 101), first, strict=True))}
    before = files(uri)
    with pytest.raises(mq.SchemaError, match=r"column 'c' is dictionary<values=string, ind"):
        w.put(frame(range(200, 400), [f"b{i}" for i in range(200)]))  # 200 in one write
    with pytest.raises(mq.SchemaError, match=r"at most 127 distinct values.*int32"):
        w.put(frame(range(200, 300), [f"b{i}" for i in range(100)]))  # 200 with the first
    w.sync()
    assert files(uri) == before
    assert as_dict(t.to_table(writers=[w]).to_pylist()) == want
    w.put(frame([1, 101], ["a5", "new"]))  # known values and a few new ones still fit
    want.update({1: "a5", 101: "new"})
    w.flush()
    # The flushed rows count too (reads, merges and compactions combine generations),
    # also for a writer opened later.
    with pytest.raises(mq.SchemaError, match="the table's rows with this write have 129"):
        w.put(frame(range(200, 227), [f"c{i}" for i in range(27)]))
    w.close()
    w = t.writer(durable=durable)
    with pytest.raises(mq.SchemaError, match="the table's rows with this write have 129"):
        w.put(frame(range(200, 227), [f"c{i}" for i in range(27)]))
    with pytest.raises(mq.SchemaError, match="the table's rows with this write have 128"):
        w.put(frame(range(200, 226), [f"c{i}" for i in range(26)]))
    w.put(frame(range(200, 225), [f"c{i}" for i in range(25)]))  # 127 values in all
    want.update(zip(range(200, 225), [f"c{i}" for i in range(25)], strict=True))
    w.close()
    check(uri, t, want)


def test_added_dictionary_columns_get_32_bit_indices(tmp_path):
    """A column added with int8 dictionary indices, or by a write of a pandas
    categorical with schema_mode="merge", is stored with int32 indices and takes more
    than 128 values."""
    uri = str(tmp_path / "t")
    t = mq.MemWalTable.create(uri, pd.DataFrame({"id": [0]}), primary_key="id")
    t.alter.add_columns({"c": NARROW})
    t.write(pd.DataFrame({"id": [1], "c": None, "d": pd.Categorical(["x"])}), schema_mode="merge")
    assert t.schema.field("c").type == WIDE
    assert t.schema.field("d").type == WIDE
    values = [f"v{i}" for i in range(200)]
    t.write(pd.DataFrame({"id": range(2, 202), "c": pd.Categorical(values), "d": None}))
    want = {0: None, 1: None, **dict(zip(range(2, 202), values, strict=True))}
    t.flush()
    t.write(frame(range(300, 400), [f"w{i}" for i in range(100)]).assign(d="y"))
    want.update(zip(range(300, 400), [f"w{i}" for i in range(100)], strict=True))
    check(uri, t, want)


def test_a_group_of_writes_refuses_only_those_that_do_not_fit():
    """Writes committed as one WAL entry are counted in order: one whose values do not
    fit with those before it is refused, the later ones that fit are not."""
    from memwal_query.format.schema import storage_schema, with_tombstone
    from memwal_query.write.memtable import MemTable

    schema = pk_schema(pa.field("c", NARROW))
    m = MemTable("r", 1, storage_schema(schema), {"c": pa.array(["base"])})

    def rows(prefix, n):
        t = dict_rows(
            range(n), [f"{prefix}{i}" for i in range(n)], [f"{prefix}{i}" for i in range(n)]
        )
        return with_tombstone(t, False).cast(storage_schema(schema))

    errors = m.dictionary_errors([rows("a", 100), rows("b", 100), rows("c", 26), rows("d", 1)])
    assert [e is None for e in errors] == [True, False, True, False]
    assert "column 'c'" in str(errors[1]) and "have 201" in str(errors[1])
    assert "have 128" in str(errors[3])
    assert len(m.dictionaries["c"]) == 1  # counting appends nothing
    # admitted writes are counted at once (another writer sharing the counts sees them)
    admitted = m.admit_dictionaries([rows("a", 100), rows("b", 100)])
    assert [e is None for e in admitted] == [True, False]
    assert len(m.dictionaries["c"]) == 101


def test_writers_of_two_regions_count_each_others_values(tmp_path, monkeypatch):
    """Writes routed to two regions of one table, each within the limit with the
    table's values but not together: the one that would pass it is refused, and the
    table reads, flushes, merges and compacts as acknowledged."""
    from memwal_query import table_init

    from helpers import expr_table

    uri = str(tmp_path / "t")
    schema = pk_schema(pa.field("c", NARROW))
    lance.write_dataset(dict_rows([0], ["base"], ["base"], pa.int8()).cast(schema), uri)
    monkeypatch.setattr(table_init, "check_dictionary_types", lambda *_: None)
    t = expr_table(uri)  # region r = id % 2
    monkeypatch.undo()
    t.write(frame([2, 3], ["base", "base"]))  # opens both regions' writers
    want = {0: "base", 2: "base", 3: "base"}
    even = [f"e{i}" for i in range(100)]
    t.write(frame(range(2, 202, 2), even))  # region 0: 101 values with the base's
    want.update(zip(range(2, 202, 2), even, strict=True))
    with pytest.raises(mq.SchemaError, match="column 'c'"):
        t.write(frame(range(1, 201, 2), [f"o{i}" for i in range(100)]))  # region 1: 201
    with pytest.raises(mq.SchemaError, match="have 128"):  # what Arrow can no longer read
        t.write(frame(range(1, 55, 2), [f"o{i}" for i in range(27)]))
    odd = [f"o{i}" for i in range(26)]
    t.write(frame(range(1, 53, 2), odd))  # 127 values in all
    want.update(zip(range(1, 53, 2), odd, strict=True))
    check(uri, t, want)
