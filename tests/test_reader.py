import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_query as mq
from memwal_query.io import LocalFileIO

from helpers import PK, basic_rows


def test_filter_applies_to_newest_version_only(tmp_path):
    """base id=1 x=10, generation 1 id=1 x=0: WHERE x > 5 returns nothing."""
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": [1], "x": [10]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        w.put(pa.table({"id": [1], "x": [0]}))
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong")
    assert ctx.sql("SELECT * FROM t WHERE x > 5").to_arrow_table().num_rows == 0
    assert ctx.sql("SELECT * FROM t WHERE x < 5").to_arrow_table().to_pydict() == {
        "id": [1],
        "x": [0],
    }
    # and the reverse: the old value does not match, the new one does
    with t.writer(w.region_id) as w:
        w.put(pa.table({"id": [1], "x": [50]}))
    assert ctx.sql("SELECT id FROM t WHERE x > 5").to_arrow_table().column(0).to_pylist() == [1]


def test_meta_columns_and_projection(table):
    w = table.writer()
    w.put(basic_rows([1, 500]))
    w.flush()
    w.put(basic_rows([1], val=[-1.0]))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w], meta_columns=True))
    got = ctx.sql("SELECT id, val, _gen FROM t WHERE id IN (1, 2, 500) ORDER BY id")
    assert got.to_arrow_table().to_pydict() == {
        "id": [1, 2, 500],
        "val": [-1.0, 2.0, 500.0],
        "_gen": [2, 0, 1],
    }
    ctx.register_table("plain", table.provider(writers=[w]))
    assert ctx.sql("SELECT * FROM plain").schema().names == ["id", "val", "name"]
    assert ctx.sql("SELECT count(*) AS n FROM plain").to_arrow_table().column(0)[0].as_py() == 101
    w.close()


def test_aggregation_and_join(table):
    w = table.writer()
    w.put(basic_rows([1, 2], val=[100.0, 200.0], name=["a", "a"]))
    w.delete(pa.table({"id": [3]}))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w]))
    ctx.from_pydict({"name": ["a", "n5"], "label": ["A", "five"]}, name="labels")
    got = ctx.sql(
        "SELECT l.label, sum(t.val) AS s FROM t JOIN labels l ON t.name = l.name "
        "GROUP BY l.label ORDER BY l.label"
    ).to_arrow_table()
    assert got.to_pydict() == {"label": ["A", "five"], "s": [300.0, 5.0]}
    total = ctx.sql("SELECT sum(val) FROM t").to_arrow_table().column(0)[0].as_py()
    assert total == sum(range(100)) - 1 - 2 - 3 + 300
    w.close(flush=False)


def test_limit(table):
    w = table.writer()
    w.put(basic_rows(range(1000, 1100)))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w]))
    assert ctx.sql("SELECT * FROM t LIMIT 7").to_arrow_table().num_rows == 7
    w.close(flush=False)


def test_unknown_path_and_corrupt_manifest(table, tmp_path):
    with pytest.raises(mq.TableNotFoundError) as e:
        mq.MemWalTable.open(str(tmp_path / "nope"))
    assert "nope" in str(e.value)
    w = table.writer()
    w.put(basic_rows([1]))
    w.flush()
    store_path = w._store.path(w.manifest().version)
    w.close(flush=False)
    LocalFileIO().write(store_path, b"\x08\x01garbage")
    with pytest.raises(mq.ManifestCorruptError) as e:
        table.to_table()
    assert store_path in str(e.value)


def test_merged_generation_still_listed_gives_no_duplicates(table):
    w = table.writer()
    w.put(basic_rows([1, 1000], val=[-1.0, 1000.0]))
    w.flush()
    w.close()
    expected = table.to_table().sort_by("id")
    table.merge()
    # The generation is merged but still listed in the region manifest (no GC yet).
    assert table.region_manifest(w.region_id).flushed_generations
    assert table.to_table().sort_by("id").equals(expected)


# -- differential test against a dict model -------------------------------------------
N_REGIONS = 3
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "delete", "flush", "reopen"]),
        st.lists(st.integers(0, 40), min_size=0, max_size=6),
        st.integers(-1000, 1000),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_differential_against_model(tmp_path_factory, ops):
    uri = str(tmp_path_factory.mktemp("diff") / "t")
    lance.write_dataset(basic_rows(range(0, 40, 3)), uri)
    t = mq.MemWalTable.initialize(uri)
    model = {k: (float(k), f"n{k}") for k in range(0, 40, 3)}
    writers = [t.writer() for _ in range(N_REGIONS)]
    for op, keys, value in ops:
        by_region: dict[int, list[int]] = {}
        for k in keys:
            by_region.setdefault(k % N_REGIONS, []).append(k)
        if op == "put":
            for r, ks in by_region.items():
                writers[r].put(basic_rows(ks, val=[float(value)] * len(ks), name=["v"] * len(ks)))
                for k in ks:
                    model[k] = (float(value), "v")
        elif op == "delete":
            for r, ks in by_region.items():
                writers[r].delete(pa.table({"id": pa.array(ks, pa.int64())}))
                for k in ks:
                    model.pop(k, None)
        elif op == "flush":
            writers[value % N_REGIONS].flush()
        else:  # a new writer takes over the region (recovery from the WAL)
            r = value % N_REGIONS
            writers[r].close(flush=False)
            writers[r] = t.writer(writers[r].region_id)

    def view(tbl: pa.Table) -> dict:
        rows = tbl.to_pylist()
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)), "duplicate keys"
        return {r["id"]: (r["val"], r["name"]) for r in rows}

    ctx = datafusion.SessionContext()
    ctx.register_table("w", t.provider(writers=writers))
    assert view(ctx.sql("SELECT * FROM w").to_arrow_table()) == model
    expected = {k: v for k, v in model.items() if v[0] is not None and v[0] > 10}
    assert view(ctx.sql("SELECT * FROM w WHERE val > 10").to_arrow_table()) == expected
    total = ctx.sql("SELECT count(*), sum(val) FROM w").to_arrow_table().to_pylist()[0]
    assert total["count(*)"] == len(model)
    # Without the writers: only flushed data; equal to the model once all flushed.
    for w in writers:
        w.flush()
    assert view(t.to_table()) == model
    t.refresh_snapshots()
    assert view(t.to_table(consistency="eventual")) == model
    assert view(t.to_table(filter=pc.field("val") > 10)) == expected
    t.merge()
    assert view(t.to_table()) == model
    for w in writers:
        w.close(flush=False)
