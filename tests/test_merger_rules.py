"""Merger and GC rules on real Lance tables: GC keep/delete cases, readers opened before GC,
index catch-up of vector/FTS/scalar indexes, snapshot storage, status fields."""

from __future__ import annotations

import datetime as dt
import os

import lance
import numpy as np
import pyarrow as pa
import pytest
from test_merger import make_generations, view

import memwal_query as mq
from memwal_query.exceptions import GenerationGoneError
from memwal_query.format import index as mwindex
from memwal_query.format import snapshots as fsnap
from memwal_query.maintain import snapshots
from memwal_query.read import sources
from memwal_query.regions.spec import expression_spec
from memwal_query.storage import paths

from helpers import PK, basic_rows, expr_table


def _gen_dirs(table, region):
    return sorted(n for n in os.listdir(paths.region_dir(table.uri, region)) if "_gen_" in n)


# -- GC: index catch-up per region ----------------------------------------------------
@pytest.mark.parametrize("recorded", [True, False])
def test_gc_keeps_generations_of_a_region_the_index_has_not_caught_up(
    tmp_path, monkeypatch, recorded
):
    """An index caught up for region A only: region B's merged generation must stay
    (the base index does not cover it); after catch-up it may go."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(300)), uri)
    lance.dataset(uri).create_scalar_index("name", "BTREE", name="name_idx")
    spec = expression_spec(lance.dataset(uri), ["id"], "col0 / 1000", "int64", field_id="r")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"], region_spec=spec)
    a = t.writer(region_values={"r": 1})
    a.put(basic_rows([1000], name=["a"]))
    a.flush()
    a.close()
    t.maintenance.merge()
    assert t.maintenance.catch_up_indexes() == {"name_idx": {a.region_id: 1}}
    b = t.writer(region_values={"r": 2})
    b.put(basic_rows([2000], name=["b"]))
    b.flush()
    b.close()
    assert t.maintenance.merge().by_region() == {b.region_id: [1]}
    assert t.catalog.index().index_catchup()["name_idx"].get(b.region_id, 0) == 0
    if not recorded:
        # A record that does not name region B at all (Lance adds B at 0 itself; another
        # tool's record may not): B still counts as not caught up.
        real = mwindex.MemWalIndex.index_catchup
        without_b = {"name_idx": {a.region_id: 1}}
        monkeypatch.setattr(mwindex.MemWalIndex, "index_catchup", lambda self: without_b)
        assert t.catalog.index().index_catchup() == without_b
    removed = t.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    if not recorded:
        monkeypatch.setattr(mwindex.MemWalIndex, "index_catchup", real)
    assert _gen_dirs(t, a.region_id) == []  # merged and caught up: deleted
    assert len(_gen_dirs(t, b.region_id)) == 1  # merged, index behind: kept
    assert not any(b.region_id in p for p in removed)
    assert t.maintenance.catch_up_indexes() == {"name_idx": {a.region_id: 1, b.region_id: 1}}
    assert any(b.region_id in p for p in t.maintenance.gc(cleanup_older_than=dt.timedelta(0)))
    assert _gen_dirs(t, b.region_id) == []
    got = t.to_table().to_pylist()
    assert {r["id"] for r in got} == set(range(300)) | {1000, 2000}


def test_gc_without_maintained_indexes_needs_only_merge_and_retention(table):
    """The other two rules, keep and delete: unmerged kept, time travel kept."""
    region, model = make_generations(table, n=2)
    table.maintenance.merge(max_generations=1)
    assert table.maintenance.gc(dry_run=True) == []  # base versions before the merge are retained
    would = table.maintenance.gc(dry_run=True, cleanup_older_than=dt.timedelta(0))
    assert would == []  # dry run: cleanup_old_versions was not run either
    removed = table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    dirs = _gen_dirs(table, region)
    assert [d.endswith("_gen_2") for d in dirs] == [True]  # 1 deleted, 2 kept (unmerged)
    assert any(p.endswith("_gen_1") for p in removed)
    assert view(table) == model


# -- GC vs a reader that opened before it ---------------------------------------------
@pytest.mark.parametrize("warm", [True, False])
def test_scan_planned_before_merge_and_gc_gets_rows_or_typed_error(table, warm):
    region, model = make_generations(table, n=2)
    sources.GENERATION_CACHE.clear()
    p = table.provider()
    if warm:
        assert len(p.to_table()) == len(model)  # generation data cached by this reader
    parts = p.get_fragments()  # read plan: base version + generations 1, 2
    assert table.maintenance.merge().by_region() == {region: [1, 2]}
    assert table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    assert _gen_dirs(table, region) == []
    if not warm:
        sources.GENERATION_CACHE.clear()
    try:
        batches = [b for part in parts for b in part.scanner(p.schema).to_batches()]
    except GenerationGoneError as e:
        assert not warm and "generation" in str(e)
        return
    assert warm, "a cold reader cannot have read a deleted generation"
    rows = pa.Table.from_batches(batches, schema=p.schema).to_pylist()
    assert {r["id"]: (r["val"], r["name"]) for r in rows} == model


# -- index catch-up: vector, FTS and scalar -------------------------------------------
DIM = 8


def _vec_rows(ids, rng):
    ids = list(ids)
    vecs = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    return pa.table(
        {
            "id": ids,
            "text": [f"word{i % 7} common" for i in ids],
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), DIM),
        },
        schema=schema,
    )


def _covered(ds, name):
    (idx,) = [i for i in ds.describe_indices() if i.name == name]
    return {f for s in idx.segments for f in s.fragment_ids}


def test_catch_up_extends_vector_fts_and_scalar_indexes(tmp_path):
    rng = np.random.default_rng(7)
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(_vec_rows(range(512), rng), uri)
    ds.create_index("vec", "IVF_FLAT", num_partitions=2, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    names = ["vec_idx", "text_idx", "id_idx"]
    t = mq.MemWalTable.initialize(uri, maintained_indexes=names)
    w = t.writer()
    w.put(_vec_rows([5, 600], rng))
    w.flush()
    w.put(_vec_rows([6, 601], rng))
    w.flush()
    w.close()
    rid = w.region_id
    assert t.maintenance.merge().by_region() == {rid: [1, 2]}
    base = t.catalog.dataset()
    frags = {f.fragment_id for f in base.get_fragments()}
    for name in names:
        assert _covered(base, name) != frags  # merged rows sit in unindexed fragments
    progress = t.maintenance.catch_up_indexes()
    assert progress == {name: {rid: 2} for name in names}
    base = t.catalog.dataset()
    for name in names:
        assert _covered(base, name) == {f.fragment_id for f in base.get_fragments()}
    assert t.catalog.index().index_catchup() == progress  # what readers see
    # The indexed read plan is back on the base indexes: no gap generations.
    dbg: dict = {}
    # (no refine step: its KNNVectorDistance re-ranks candidates, it is not a flat scan)
    got = t.vector_search("vec", np.zeros(DIM, np.float32), k=3, debug=dbg, refine_factor=None)
    assert got.num_rows == 3
    assert all(not r.gap for r in dbg["plan"].regions.values())
    base_plan = dbg["base_lance_plan"]
    assert "ANNSubIndex" in base_plan  # the base index answers ...
    assert "KNNVectorDistance" not in base_plan  # ... with no flat scan of merged rows
    assert t.maintenance.catch_up_indexes(["id_idx"]) == progress  # idempotent


# -- region snapshots -----------------------------------------------------------------
def test_snapshots_inline_up_to_the_threshold(base_uri):
    n = snapshots.INLINE_THRESHOLD
    table = expr_table(base_uri, f"col0 % {n}")
    writers = [table.writer(region_values={"r": (5000 + r) % n}) for r in range(n)]
    writers[0].put(basic_rows([5000]))
    writers[0].flush()
    table.maintenance.refresh_snapshots()
    idx = table.catalog.refresh_index()
    assert idx.details.num_regions == snapshots.INLINE_THRESHOLD
    assert idx.details.HasField("inline_snapshots")
    assert not os.path.exists(os.path.join(table.uri, "_indices", idx.uuid, "index.lance"))
    snap = fsnap.from_lance_bytes(idx.details.inline_snapshots, "inline")
    assert snap.num_rows == snapshots.INLINE_THRESHOLD
    assert snap.schema.field("region_id").type == pa.binary(16)
    assert 5000 in set(table.to_table(consistency="eventual").column("id").to_pylist())
    for w in writers:
        w.close(flush=False)


def test_snapshot_schema_has_region_field_columns(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"id": [0], "v": [0]}, schema=schema), uri)
    field_id = lance.dataset(uri).lance_schema.field("id").id()
    spec = mq.RegionSpec(
        1, [mq.RegionField("b", [field_id], "bucket", parameters={"num_buckets": "3"})]
    )
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    t.write(pa.table({"id": list(range(1, 30)), "v": list(range(1, 30))}, schema=schema))
    t.flush()
    t.maintenance.refresh_snapshots()
    idx = t.catalog.refresh_index()
    snap = fsnap.from_lance_bytes(idx.details.inline_snapshots, "inline")
    assert snap.schema.names == [f.name for f in snapshots.BASE_FIELDS] + ["region_field_b"]
    assert snap.schema.field("region_field_b").type == pa.int32()
    assert sorted(snap.column("region_field_b").to_pylist()) == [0, 1, 2]
    assert snap.schema.field("flushed_generations").type == pa.list_(
        pa.struct([pa.field("generation", pa.uint64()), pa.field("path", pa.string())])
    )
    got = t.to_table(consistency="eventual")
    assert sorted(got.column("id").to_pylist()) == list(range(30))
    t.close(flush=False)


# -- status ---------------------------------------------------------------------------
def test_status_fields_wal_span_and_sizes(table):
    region, _ = make_generations(table, n=2)
    table.maintenance.merge(max_generations=1)
    w = table.writer(region)
    w.put(basic_rows([77777]))
    r = table.maintenance.status().to_dict()["regions"][region]
    assert r["writer_epoch"] == 2 and r["manifest_version"] >= 4
    assert (r["flushed_generations"], r["merged_generation"]) == ([1, 2], 1)
    assert r["wal_first_position"] == 1
    assert r["wal_last_position"] == r["replay_after_wal_entry_position"] + 1
    assert r["wal_entries"] == r["wal_last_position"]
    assert (r["unflushed_wal_entries"], r["unflushed_rows"]) == (1, 1)
    assert r["generation_bytes"] > 0 and r["wal_bytes"] > 0
    table.maintenance.gc(cleanup_older_than=dt.timedelta(0))  # generation 1 and its WAL entries go
    after = table.maintenance.status().to_dict()["regions"][region]
    assert after["wal_first_position"] > 1
    assert after["wal_entries"] < r["wal_entries"]
    assert after["wal_last_position"] == r["wal_last_position"]
    assert 0 < after["wal_bytes"] < r["wal_bytes"]
    w.close(flush=False)


def test_status_wal_span_is_empty_when_every_entry_was_collected(table):
    region, _ = make_generations(table, n=2)
    table.maintenance.merge()
    table.maintenance.gc(cleanup_older_than=dt.timedelta(0))  # every generation and WAL entry goes
    r = table.maintenance.status().to_dict()["regions"][region]
    assert r["wal_entries"] == 0 and r["wal_bytes"] == 0
    # "entries in storage; 0 when none": no span made of the replay position
    assert (r["wal_first_position"], r["wal_last_position"]) == (0, 0)
    assert (r["unflushed_wal_entries"], r["unflushed_rows"]) == (0, 0)
    assert r["replay_after_wal_entry_position"] > 0
