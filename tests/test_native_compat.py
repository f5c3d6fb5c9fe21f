"""Files are readable both ways: pylance's native MemWAL and memwal_query."""

import uuid

import datafusion
import lance
import pyarrow as pa
from lance.mem_wal import LsmPointLookupPlanner, LsmScanner

import memwal_query as mq
from memwal_query.format.manifest import RegionManifestStore
from memwal_query.format.wal import Wal

from helpers import PK
from helpers import native_snapshot as snapshot

SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.float64())])


def rows(t: pa.Table) -> dict:
    out = {r["id"]: r["v"] for r in t.to_pylist()}
    assert len(out) == t.num_rows
    return out


def test_native_written_regions_read_by_our_provider(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": range(10), "v": [0.0] * 10}, schema=SCHEMA), uri)
    ds = lance.dataset(uri)
    ds.initialize_mem_wal()
    shards = [str(uuid.uuid4()) for _ in range(2)]
    for s, shard in enumerate(shards):
        with ds.mem_wal_writer(shard, max_memtable_rows=8) as w:
            for i in range(4):
                ids = [k for k in range(i, 20, 3) if k % 2 == s]
                w.put(pa.table({"id": ids, "v": [float(i * 10 + s)] * len(ids)}, schema=SCHEMA))
            w.delete(pa.table({"id": pa.array([s, 2 + s], pa.int64())}))
    t = mq.MemWalTable.open(uri)
    assert sorted(t.catalog.region_ids()) == sorted(shards)
    for shard in shards:  # manifests and WAL decode with our code
        m = RegionManifestStore(t.catalog.io, t.uri, shard).load_latest()
        assert m.flushed_generations and m.writer_epoch >= 1
        wal = Wal(t.catalog.io, f"{t.uri}/_mem_wal/{shard}/wal", shard)
        assert all(e.writer_epoch == m.writer_epoch for e in wal.replay(0, m.writer_epoch))
    native = LsmScanner.from_snapshots(lance.dataset(uri), [snapshot(t, s) for s in shards])
    expected = rows(native.to_table())
    assert expected and rows(t.to_table()) == expected
    # and through DataFusion SQL, both consistency modes
    ctx = datafusion.SessionContext()
    mq.register(ctx, "strong", uri, consistency="strong")
    assert rows(ctx.sql("SELECT * FROM strong").to_arrow_table()) == expected
    t.maintenance.refresh_snapshots()
    mq.register(ctx, "eventual", uri)
    assert rows(ctx.sql("SELECT * FROM eventual").to_arrow_table()) == expected
    got = ctx.sql("SELECT count(*) AS n, sum(v) AS s FROM eventual WHERE v > 5").to_arrow_table()
    assert got.column("n")[0].as_py() == sum(1 for v in expected.values() if v > 5)


def test_our_regions_read_by_native_scanner_and_lookup(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": range(10), "v": [0.0] * 10}, schema=SCHEMA), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": [1, 2, 50], "v": [1.0, 2.0, 50.0]}, schema=SCHEMA))
    w.flush()
    w.put(pa.table({"id": [2, 60], "v": [22.0, 60.0]}, schema=SCHEMA))
    w.delete(pa.table({"id": pa.array([3, 50], pa.int64())}))
    w.flush()
    w.close()
    ours = rows(t.to_table())
    snap = snapshot(t, w.region_id)
    base = lance.dataset(uri)
    assert rows(LsmScanner.from_snapshots(base, [snap]).to_table()) == ours
    planner = LsmPointLookupPlanner(base, [snap])
    for key in [1, 2, 3, 50, 60, 7]:
        got = planner.plan_lookup(pa.array([key], pa.int64())).to_table()
        assert rows(got) == ({key: ours[key]} if key in ours else {})
    # pylance reads our MemWAL index details too
    assert lance.dataset(uri).mem_wal_index_details() is not None


def test_native_writer_continues_our_region(tmp_path):
    """A region we created and flushed can be claimed by pylance's writer, and back."""
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": range(5), "v": [0.0] * 5}, schema=SCHEMA), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    # writes of a stream's batches (as the Spark sink's): our extra WAL entry metadata
    # and region manifest field are ignored by pylance
    w._put_routed(pa.table({"id": [1], "v": [1.0]}, schema=SCHEMA), batch=("q", 1))
    w.flush()
    w._put_routed(pa.table({"id": [2], "v": [2.0]}, schema=SCHEMA), batch=("q", 2))  # WAL only
    w.close(flush=False)
    assert t.catalog.region_manifest(w.region_id).stream_batches == (("q", 1),)
    with lance.dataset(uri).mem_wal_writer(w.region_id) as nw:
        nw.put(pa.table({"id": [3], "v": [3.0]}, schema=SCHEMA))
    w2 = t.writer(w.region_id)
    got = rows(t.to_table(writers=[w2]))
    assert got[1] == 1.0 and got[2] == 2.0 and got[3] == 3.0
    w2.close()
    snap = snapshot(t, w.region_id)
    assert rows(LsmScanner.from_snapshots(lance.dataset(uri), [snap]).to_table()) == got


def test_native_unsharded_table_written_by_us(tmp_path):
    """A table pylance initialized with ``unsharded=True`` (transform 'unsharded', no
    source) is opened, written, queried with pruning predicates and merged by us, and
    our region reads the same through the native scanner."""
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": range(5), "v": [0.0] * 5}, schema=SCHEMA), uri)
    lance.dataset(uri).initialize_mem_wal(unsharded=True)
    t = mq.MemWalTable.open(uri)
    assert t.region_spec.fields[0].transform == "unsharded"
    written = t.write(pa.table({"id": [1, 20], "v": [1.0, 20.0]}))
    assert list(written.values()) == [2]
    t.delete(pa.table({"id": [2]}))
    t.close()
    ours = rows(t.to_table())
    assert ours == {0: 0.0, 1: 1.0, 3: 0.0, 4: 0.0, 20: 20.0}
    snaps = [snapshot(t, r) for r in t.catalog.region_ids()]
    assert rows(LsmScanner.from_snapshots(lance.dataset(uri), snaps).to_table()) == ours
    ctx = datafusion.SessionContext()
    mq.register(ctx, "e", uri, consistency="strong")
    assert rows(ctx.sql("SELECT * FROM e WHERE id IN (1, 2, 20)").to_arrow_table()) == {
        1: 1.0,
        20: 20.0,
    }
    t.maintenance.merge()
    assert rows(lance.dataset(uri).to_table()) == ours
