"""Reader regressions: uint64 keys, eventual reads with writers, region specs, errors."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import warnings

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import RegionSpecWarning
from memwal_query.read.dedup import KeySet, newest_indices
from memwal_query.storage import paths
from memwal_query.storage.io import LocalFileIO

from helpers import PK, expr_table

BIG = 2**63


# -- R4: uint64 primary keys over the full range -----------------------------------------
def test_uint64_keys_above_int64_range(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.uint64(), False, PK), pa.field("x", pa.int64())])
    ids = [0, 1, BIG - 1, BIG, BIG + 5, 2**64 - 1]
    lance.write_dataset(pa.table({"id": pa.array(ids, pa.uint64()), "x": [0] * 6}, schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": pa.array([BIG, 1], pa.uint64()), "x": [1, 1]}, schema))
    w.flush()
    w.put(pa.table({"id": pa.array([2**64 - 1, BIG, 7], pa.uint64()), "x": [2, 2, 2]}, schema))
    w.delete(pa.table({"id": pa.array([BIG + 5], pa.uint64())}))
    expected = {0: 0, 1: 1, BIG - 1: 0, BIG: 2, 2**64 - 1: 2, 7: 2}
    got = t.to_table(writers=[w])
    assert dict(zip(got.column("id").to_pylist(), got.column("x").to_pylist())) == expected
    assert got.num_rows == len(expected)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong", writers=[w])
    rows = ctx.sql(f"SELECT id, x FROM t WHERE id >= {BIG} ORDER BY id").to_arrow_table()
    assert rows.to_pydict() == {"id": [BIG, 2**64 - 1], "x": [2, 2]}
    w.close(flush=False)


@pytest.mark.parametrize("span", [10, 10**12, 2**63 - 1], ids=["dense", "packed", "argsort"])
def test_newest_indices_in_key_order(span):
    """``key_order``: the same newest rows, ordered by key (every int_runs path); other
    keys come in row order as without it."""
    rng = np.random.default_rng(span % 1000)
    keys = rng.integers(-(span // 2), span // 2, 2_000) if span > 10 else rng.integers(0, 10, 50)
    t = pa.table({"id": pa.array(keys, pa.int64())})
    plain = newest_indices(t, ["id"])
    ordered = newest_indices(t, ["id"], key_order=True)
    assert sorted(ordered.tolist()) == plain.tolist()
    assert (np.diff(keys[ordered]) > 0).all()
    s = pa.table({"id": pa.array([str(k) for k in keys])})
    assert newest_indices(s, ["id"], key_order=True).tolist() == newest_indices(s, ["id"]).tolist()


def test_keyset_and_newest_indices_on_uint64_bits():
    keys = pa.array([BIG + 1, 3, BIG + 1, 2**64 - 1, 3], pa.uint64())
    assert newest_indices(pa.table({"id": keys}), ["id"]).tolist() == [2, 3, 4]
    ks = KeySet(pa.table({"id": keys}))
    probe = pa.table({"id": pa.array([BIG + 1, BIG, 3, 2**64 - 2, 2**64 - 1], pa.uint64())})
    assert ks.contains(probe).tolist() == [True, False, True, False, True]
    dense = KeySet(pa.table({"id": pa.array([BIG, BIG + 2], pa.uint64())}))  # a small range
    probe = pa.table({"id": pa.array([BIG, BIG + 1, BIG + 2, 0], pa.uint64())})
    assert dense.contains(probe).tolist() == [True, False, True, False]
    chunked = pa.chunked_array([pa.array([BIG], pa.uint64()), pa.array([5], pa.uint64())])
    assert KeySet(pa.table({"id": chunked})).contains(probe).tolist() == [1, 0, 0, 0]


# -- R5: eventual consistency with writers ----------------------------------------------
def test_eventual_with_writer_reads_that_region_as_of_its_manifest(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": [1, 10], "x": [0, 0]}, schema=schema), uri)
    t = expr_table(uri, "col0 / 10")
    other = t.writer(region_values={"r": 1})  # without writer handed in: from the snapshot
    other.put(pa.table({"id": [10], "x": [10]}))
    other.flush()
    w = t.writer(region_values={"r": 0})
    w.put(pa.table({"id": [1], "x": [1]}))
    w.flush()  # generation 1
    t.maintenance.refresh_snapshots()  # the snapshot lists generation 1 of both regions
    w.delete(pa.table({"id": pa.array([1], pa.int64())}))
    w.flush()  # generation 2: id 1 deleted, not in the snapshot
    w.put(pa.table({"id": [2], "x": [2]}))  # generation 3, in memory
    other.put(pa.table({"id": [10], "x": [11]}))
    other.flush()  # not in the snapshot, and its writer is not handed in
    p = t.provider(consistency="eventual", writers=[w])
    got = p.to_table().sort_by("id").to_pydict()
    # w's region as of now (id 1 deleted, id 2 in memory); the other as of the snapshot
    assert got == {"id": [2, 10], "x": [2, 10]}
    region = next(r for r in p.last_plan.regions if r.region_id == w.region_id)
    assert [g.generation for g in region.generations] == [1, 2]
    assert [m.generation for m in region.memtables] == [3]
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="eventual", writers=[w])
    assert ctx.sql("SELECT id FROM t ORDER BY id").to_arrow_table().column(0).to_pylist() == [
        2,
        10,
    ]
    w.close(flush=False)
    other.close(flush=False)


# -- R6: region specs over non-key columns ------------------------------------------------
def _base(tmp_path, fields, name="t"):
    uri = str(tmp_path / name)
    schema = pa.schema(fields)
    lance.write_dataset(schema.empty_table(), uri)
    return uri, lance.dataset(uri).lance_schema


def test_initialize_warns_when_region_spec_reads_non_key_columns(tmp_path):
    key = pa.field("id", pa.int64(), False, PK)
    uri, ls = _base(tmp_path, [key, pa.field("cat", pa.string())])
    with pytest.warns(RegionSpecWarning, match=r"\['cat'\].*never change"):
        mq.MemWalTable.initialize(uri, region_spec=mq.identity_spec(ls, "cat"))
    # the time-range case keyed by (id, ts): regions on a key column, no warning
    ts = pa.field("ts", pa.timestamp("us"), False, PK)
    uri, ls = _base(tmp_path, [key, ts, pa.field("v", pa.float64())], "events")
    spec = mq.RegionSpec(1, [mq.RegionField("day", [ls.field("ts").id()], "day")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = mq.MemWalTable.initialize(uri, region_spec=spec)
    t.write(pa.table({"id": [1, 2], "ts": [dt.datetime(2026, 1, 1)] * 2, "v": [1.0, 2.0]}))
    t.flush()
    assert t.to_table().num_rows == 2
    t.close()
    uri, ls = _base(tmp_path, [key, pa.field("x", pa.int64())], "bucketed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mq.MemWalTable.initialize(uri, region_spec=mq.bucket_spec(ls, "id", 4))


# -- R7: typed errors ---------------------------------------------------------------------
def test_register_fails_fast_with_typed_errors(tmp_path):
    with pytest.raises(mq.TableNotFoundError):
        mq.register(datafusion.SessionContext(), "t", str(tmp_path / "nope"))
    nopk = str(tmp_path / "nopk")
    lance.write_dataset(pa.table({"id": [1]}), nopk)
    with pytest.raises(mq.PrimaryKeyError, match="no primary key") as e:
        mq.register(datafusion.SessionContext(), "t", nopk)
    assert nopk in str(e.value)
    # a region manifest corrupted before registration: the typed error at register
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": [1], "x": [1]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": [1], "x": [2]}))
    w.flush()
    version = w.manifest().version
    manifest_path = w._store.path(version)
    w.close(flush=False)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "ok", t, consistency="strong")
    LocalFileIO().write(manifest_path, b"\x08\x01garbage")
    with pytest.raises(mq.ManifestCorruptError) as e:
        mq.register(datafusion.SessionContext(), "t", uri, consistency="strong")
    assert manifest_path in str(e.value)
    # A registered table read that version before it was damaged (versions are
    # immutable: it is not read again); a corrupt *newer* version is found at query
    # time, and DataFusion wraps the error: type name and path are in the message.
    newer = w._store.path(version + 1)
    LocalFileIO().write(newer, b"\x08\x01garbage")
    with pytest.raises(Exception) as e:
        ctx.sql("SELECT * FROM ok").to_arrow_table()
    assert "ManifestCorruptError" in str(e.value) and newer in str(e.value)


def test_query_time_error_names_type_and_path(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": np.arange(3), "x": [1, 1, 1]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": [1], "x": [2]}))
    w.flush()
    w.close(flush=False)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong")
    gen = t.catalog.region_manifest(w.region_id).flushed_generations[0]
    gen_dir = paths.generation_path(t.uri, w.region_id, gen.path)
    shutil.rmtree(gen_dir)
    from memwal_query.read.sources import GENERATION_CACHE

    GENERATION_CACHE.clear()
    with pytest.raises(Exception) as e:
        ctx.sql("SELECT * FROM t").to_arrow_table()
    assert "GenerationGoneError" in str(e.value) and gen_dir in str(e.value)


# -- region pruning reads the filter's exact literals -------------------------------------
def test_pruning_is_not_fooled_by_quotes_in_string_literals(tmp_path):
    """pyarrow prints string literals unescaped: 'x", "y' in an IN list must not read as
    the two values x and y (which pruned the region holding 'x", "y': rows lost)."""
    uri = str(tmp_path / "t")
    schema = pa.schema(
        [pa.field("id", pa.int64(), False, PK), pa.field("s", pa.string(), False, PK)]
    )
    lance.write_dataset(pa.table({"id": [0], "s": ["q"]}, schema=schema), uri)
    spec = mq.identity_spec(lance.dataset(uri).lance_schema, "s")
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    values = ['x", "y', "x", "y", 'a\\"', "z"]
    t.write(pa.table({"id": range(1, 6), "s": values}, schema=schema))
    t.flush()
    ctx = datafusion.SessionContext()
    p = t.provider()
    ctx.register_table("t", p)
    for sql, want in [
        ("""SELECT id FROM t WHERE s IN ('x", "y', 'n1', 'n2', 'n3')""", [1]),
        ("""SELECT id FROM t WHERE s IN ('a\\"', 'n1', 'n2', 'n3')""", [4]),
        ("""SELECT id FROM t WHERE s = 'x", "y' OR s = 'n1'""", [1]),
    ]:
        assert ctx.sql(sql).to_arrow_table().column("id").to_pylist() == want, sql
        assert len(p.last_plan.regions) == 1 and len(p.last_plan.pruned) == 4, sql
    t.close(flush=False)


# -- projection pushdown: only the projected columns are read from Lance -----------------
def test_projection_reads_only_projected_columns_from_every_lance_table(tmp_path, monkeypatch):
    from memwal_query.read.sources import GENERATION_CACHE

    uri = str(tmp_path / "t")
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("val", pa.float64()),
            pa.field("big", pa.list_(pa.float32(), 8)),
            pa.field("note", pa.string()),
        ]
    )

    def rows(ids, v):
        n = len(ids)
        vec = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8 * n, np.float32)), 8)
        return pa.table({"id": ids, "val": [v] * n, "big": vec, "note": ["x"] * n}, schema)

    lance.write_dataset(rows(list(range(10)), 0.0), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(rows([1, 2, 20], 1.0))
    w.flush()
    w.put(rows([2, 30], 2.0))
    w.delete(pa.table({"id": pa.array([3], pa.int64())}))
    GENERATION_CACHE.clear()
    read: list[list[str]] = []
    scanner, to_table = lance.LanceDataset.scanner, lance.LanceDataset.to_table

    def spy_scanner(self, *args, columns=None, **kw):
        read.append(list(columns) if columns is not None else ["<all>"])
        return scanner(self, *args, columns=columns, **kw)

    def spy_to_table(self, *args, columns=None, **kw):
        read.append(list(columns) if columns is not None else ["<all>"])
        return to_table(self, *args, columns=columns, **kw)

    monkeypatch.setattr(lance.LanceDataset, "scanner", spy_scanner)
    monkeypatch.setattr(lance.LanceDataset, "to_table", spy_to_table)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    got = ctx.sql("SELECT id, val FROM t WHERE val > 0.5 ORDER BY id").to_arrow_table()
    assert got.to_pydict() == {"id": [1, 2, 20, 30], "val": [1.0, 2.0, 1.0, 2.0]}
    assert ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().column(0)[0].as_py() == 11
    assert read, "no Lance read observed"
    for cols in read:  # the base scans and the generation's reads
        assert set(cols) <= {"id", "val", "_tombstone"}, cols
    monkeypatch.undo()
    # and every column when asked for
    full = ctx.sql("SELECT * FROM t WHERE id = 20").to_arrow_table()
    assert full.column("note").to_pylist() == ["x"] and full.column("big")[0].as_py() == [0.0] * 8
    w.close(flush=False)


# -- hashed keys (strings, composite): overwritten base rows dropped by row address -------
@pytest.mark.parametrize("composite", [False, True])
def test_hashed_keys_drop_overwritten_base_rows_by_address(tmp_path, monkeypatch, composite):
    """String/composite keys: after a query has read the base table's keys once, later
    full scans drop overwritten base rows by row address (no hash-set rebuild per
    batch, no key columns read), with the same answers as the model."""
    from memwal_query.read import dedup, provider

    monkeypatch.setattr(provider, "BASE_BATCH_ROWS", 256)  # several base batches
    k2 = [pa.field("k2", pa.int32(), False, PK)] if composite else []
    schema = pa.schema([pa.field("k", pa.string(), False, PK), *k2, pa.field("v", pa.int64())])

    def rows(ids, v):
        data = {"k": [f"key-{i}" for i in ids], "v": [v + i for i in ids]}
        if composite:
            data["k2"] = [i % 3 for i in ids]
        return pa.table(data, schema)

    def key(i):
        return (f"key-{i}", i % 3) if composite else f"key-{i}"

    uri = str(tmp_path / "t")
    lance.write_dataset(rows(range(2000), 0), uri, max_rows_per_file=700)
    model = {key(i): i for i in range(2000)}
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(rows(range(1500, 2600), 10_000))  # updates and new keys
    w.delete(rows(range(0, 2000, 7), 0).drop_columns(["v"]))
    w.flush()
    w.put(rows(range(100, 160), 50_000))  # in the MemTable
    model.update({key(i): 10_000 + i for i in range(1500, 2600)})
    for i in range(0, 2000, 7):
        model.pop(key(i), None)
    model.update({key(i): 50_000 + i for i in range(100, 160)})
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(consistency="strong", writers=[w]))
    cols = "k, k2, v" if composite else "k, v"

    def view():
        got = ctx.sql(f"SELECT {cols} FROM t").to_arrow_table().to_pylist()
        out = {((r["k"], r["k2"]) if composite else r["k"]): r["v"] for r in got}
        assert len(out) == len(got)
        return out

    assert view() == model  # computes and caches the base addresses
    calls = []
    contains = dedup.KeySet.contains

    def counting(self, keys):
        callers = (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name)
        if "_batches" in callers:  # from the base scan (directly or via KeySetUnion)
            calls.append(self.hashed)
        return contains(self, keys)

    monkeypatch.setattr(dedup.KeySet, "contains", counting)
    assert view() == model
    count, total = (
        ctx.sql("SELECT count(*), sum(v) FROM t").to_arrow_table().to_pylist()[0].values()
    )
    assert (count, total) == (len(model), sum(model.values()))
    assert True not in calls  # no hash-set membership test on base batches
    one = ctx.sql("SELECT v FROM t WHERE k = 'key-1600'").to_arrow_table()
    assert one.column("v").to_pylist() == [11_600]
    w.close(flush=False)
