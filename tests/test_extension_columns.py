"""A column of a Python extension type whose schema does not hash (Lance's ``bfloat16``)
is read like any other, from every source: the read path's caches key it by its
serialized schema."""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.arrow import bfloat16_array

import memwal_query as mq
from memwal_query.format.schema import cache_key


def _rows(ids: list[int], value: float) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "b": bfloat16_array([value + i for i in range(len(ids))]),
        }
    )


def _as_dict(table: pa.Table) -> dict[int, float]:
    values = [v.as_float() for v in table.column("b").to_pylist()]
    return dict(zip(table.column("id").to_pylist(), values, strict=True))


def test_cache_key_of_a_schema_that_does_not_hash():
    schema = _rows([1], 1.0).schema
    try:
        hash(schema)
    except TypeError:
        pass
    else:  # pragma: no cover - a pylance whose bfloat16 hashes needs no other key
        assert cache_key(schema) is schema
        return
    key = cache_key(schema)
    assert isinstance(key, bytes) and key == cache_key(_rows([2], 5.0).schema)
    assert key != cache_key(pa.schema([("id", pa.int64()), ("b", pa.float32())]))
    plain = pa.schema([("id", pa.int64())])
    assert cache_key(plain) is plain


def test_a_bfloat16_column_is_read_from_every_source(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(list(range(10)), 1.0), uri)
    t = mq.MemWalTable.initialize(uri, primary_key=["id"])
    model = _as_dict(_rows(list(range(10)), 1.0))

    def check(table: mq.MemWalTable, **read: object) -> None:
        got = table.to_table(**read)
        assert got.schema.field("b").type == _rows([1], 1.0).schema.field("b").type
        assert _as_dict(got) == model
        low = table.to_table(filter=pc.field("id") >= 5, **read)
        assert _as_dict(low) == {k: v for k, v in model.items() if k >= 5}
        ctx = datafusion.SessionContext()
        ctx.register_table("t", table.provider(**read))
        n = ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().column(0)[0].as_py()
        assert n == len(model)
        keys = pa.array(sorted(model)[:3] + [99], pa.int64())
        assert _as_dict(table.lookup(keys, **read)) == {k: model[k] for k in sorted(model)[:3]}

    t.write(_rows([3, 20], 10.0))  # the MemTable, and the WAL for another table object
    model.update(_as_dict(_rows([3, 20], 10.0)))
    check(t)
    check(mq.MemWalTable.open(uri))
    t.flush()  # a flushed generation
    t.write(_rows([4, 21], 30.0))
    t.flush()
    model.update(_as_dict(_rows([4, 21], 30.0)))
    check(t)
    check(mq.MemWalTable.open(uri), consistency="strong")
    t.maintenance.merge()  # the base
    check(mq.MemWalTable.open(uri))
    assert _as_dict(lance.dataset(uri).to_table())[21] == 31.0


def test_search_over_a_table_with_a_bfloat16_column(tmp_path):
    """Vector and full-text search, and the change feed, of a table with a bfloat16
    column, from every level."""
    uri = str(tmp_path / "t")
    n = 300
    rng = np.random.default_rng(0)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 8), pa.float32()), 8)
    rows = _rows(list(range(n)), 1.0)
    rows = rows.append_column("vec", vec).append_column(
        "txt", pa.array([f"word{i}" for i in range(n)])
    )
    lance.write_dataset(rows, uri).create_scalar_index("txt", "INVERTED")
    t = mq.MemWalTable.initialize(uri, primary_key=["id"])
    t.write(rows.slice(0, 5))
    t.flush()
    t.write(rows.slice(5, 5))
    query = rng.random(8).astype(np.float32)
    vectors = vec.flatten().to_numpy().reshape(n, 8)
    nearest = int(np.argmin(((vectors - query) ** 2).sum(axis=1)))
    for table in (t, mq.MemWalTable.open(uri)):
        found = table.vector_search("vec", query, k=3)
        assert found.num_rows == 3 and set(found.column("id").to_pylist()) <= set(range(n))
        assert found.column("id")[0].as_py() == nearest
        for word, key in (("word3", 3), ("word7", 7), ("word200", 200)):
            hit = table.fts_search("txt", word, k=3)
            assert hit.column("id").to_pylist()[:1] == [key]
            assert hit.column("b")[0].as_py().as_float() == _as_dict(rows.slice(key, 1))[key]
    changed = t.changes().table
    assert sorted(changed.column("id").to_pylist()) == list(range(10))
    assert _as_dict(changed) == _as_dict(rows.slice(0, 10))
