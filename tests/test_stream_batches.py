"""A write of one batch of a stream records the batch: in its WAL entry, and, once
flushed, in the region manifest; a writer knows which batch of each stream its region
already holds (:meth:`RegionWriter.applied_batch`), whether replayed, written or
flushed. Spark's streaming sink builds its physical exactly-once on it (test_spark)."""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import WalCorruptError
from memwal_query.format.manifest import MAX_STREAM_BATCHES, merged_stream_batches
from memwal_query.format.wal import Wal, decode_entry, encode_entry
from memwal_query.storage import paths

from helpers import BASIC_SCHEMA, basic_rows


def new_table(tmp_path) -> mq.MemWalTable:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(10)), uri)
    return mq.MemWalTable.initialize(uri)


def wal_batches(t: mq.MemWalTable, region_id: str) -> list:
    wal = Wal(t.catalog.io, paths.wal_dir(t.uri, region_id), region_id)
    return [wal.read(p).batch for p in wal.positions()]


def test_applied_batch_from_the_wal_the_writer_and_the_manifest(tmp_path):
    t = new_table(tmp_path)
    w = t.writer()
    assert w.applied_batch("q") is None
    w._put_routed(basic_rows([1, 2]), batch=("q", 3))
    w.put(basic_rows([4]))  # not a stream's write: records nothing
    assert w.applied_batch("q") == 3 and w.applied_batch("other") is None
    w.close(flush=False)
    assert wal_batches(t, w.region_id) == [("q", 3), None]

    w = t.writer()  # replays both entries
    assert w.applied_batch("q") == 3
    w._delete_routed(pa.table({"id": pa.array([1], pa.int64())}), batch=("r:x", 0))
    w.flush()
    manifest = t.catalog.region_manifest(w.region_id)
    assert manifest.stream_batches == (("q", 3), ("r:x", 0))
    assert manifest.stream_batch("r:x") == 0
    w.close()

    w = t.writer()  # nothing left to replay: the manifest says it
    assert w.stats.replayed_entries == 0
    assert w.applied_batch("q") == 3 and w.applied_batch("r:x") == 0
    w._put_routed(basic_rows([5]), batch=("q", 4))
    assert w.applied_batch("q") == 4
    w.close()  # flushes: q moves to 4 and becomes the newest stream
    assert t.catalog.region_manifest(w.region_id).stream_batches == (("r:x", 0), ("q", 4))
    # a manifest update that is not a flush (a claim) keeps the record
    t.writer().close(flush=False)
    assert t.catalog.region_manifest(w.region_id).stream_batch("q") == 4
    assert sorted(t.to_table()["id"].to_pylist()) == [0, 2, 3, 4, 5, 6, 7, 8, 9]


def test_group_commit_writes_one_batch_per_entry(tmp_path):
    """Concurrent puts of different batches never share a WAL entry."""
    from memwal_query.write.routing import concurrently

    t = new_table(tmp_path)
    w = t.writer()
    puts = [(i, ("q" if i % 2 else "r", i)) for i in range(8)]
    concurrently(lambda p: w._put_routed(basic_rows([100 + p[0]]), batch=p[1]), puts)
    w.close(flush=False)
    wal = Wal(t.catalog.io, paths.wal_dir(t.uri, w.region_id), w.region_id)
    for position in wal.positions():
        entry = wal.read(position)
        ids = [i - 100 for i in entry.table["id"].to_pylist()]
        assert all(dict(puts)[i] == entry.batch for i in ids), (ids, entry.batch)


def test_a_racing_attempt_of_the_same_batch_is_adopted_not_written_again(tmp_path):
    """Attempt B claims the region before attempt A's entry lands (so B's replay does
    not see it), then A writes it at B's next position and is fenced: B's put of the
    same batch adopts A's entry and writes nothing; a put of another batch adopts and
    writes its own entry after it."""
    t = new_table(tmp_path)
    t.writer().close(flush=False)  # the region exists
    a = t.writer()
    b = t.writer()  # fences a; replays nothing
    with pytest.raises(mq.FencedError):
        a._put_routed(basic_rows([1, 2]), batch=("q", 5))  # durable, not acknowledged
    assert b.applied_batch("q") is None  # b cannot know yet
    b._put_routed(basic_rows([1, 2]), batch=("q", 5))
    assert b.stats.adopted_entries == 1 and b.stats.wal_entries == 0
    assert b.applied_batch("q") == 5 and b.unflushed_rows == 2
    b._put_routed(basic_rows([3]), batch=("q", 6))
    assert b.stats.wal_entries == 1
    b.close()
    assert wal_batches(t, b.region_id) == [("q", 5), ("q", 6)]
    (gen,) = t.catalog.region_manifest(b.region_id).flushed_generations
    assert gen.physical_rows == 3  # each row stored once


def test_stream_batches_are_bounded_newest_streams_kept():
    recorded: tuple = ()
    for i in range(MAX_STREAM_BATCHES + 6):
        recorded = merged_stream_batches(recorded, {f"s{i}": i})
    assert len(recorded) == MAX_STREAM_BATCHES
    assert recorded[0] == ("s6", 6) and recorded[-1] == (f"s{MAX_STREAM_BATCHES + 5}", 69)
    # a batch number never goes back; the stream written last comes last
    recorded = merged_stream_batches((("a", 5), ("b", 1)), {"a": 3})
    assert recorded == (("b", 1), ("a", 5))
    assert merged_stream_batches(recorded, {}) == recorded


def test_malformed_batch_metadata_is_a_typed_error():
    rows = basic_rows([1]).append_column("_tombstone", pa.array([False]))
    good = encode_entry(rows, 1, 1, ("q", 7))
    assert decode_entry("e", 1, good).batch == ("q", 7)
    for bad in (b"q", b"q:", b":7", b"q:-1", b"q:x"):
        table = rows.replace_schema_metadata({b"writer_epoch": b"1", b"memwal_batch": bad})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:  # no checksum, as pylance's
            writer.write_table(table)
        with pytest.raises(WalCorruptError, match="memwal_batch"):
            decode_entry("e", 1, sink.getvalue().to_pybytes())
    assert BASIC_SCHEMA.names == ["id", "val", "name"]


def test_a_racing_attempt_of_a_batch_written_as_several_entries_keeps_its_order(
    tmp_path, monkeypatch
):
    """A batch written to a region as several entries (``partial=True`` with upserts
    then deletes: one entry per run, the last records the batch). Attempt B claims the
    region between attempt A's two entries, so B replays A's upsert only; A's delete
    entry then lands (A is fenced). B's upsert run finds A's delete entry at its
    position, adopts it (so the region now holds the batch) and writes its upsert after
    it: B must then write its delete run too (stored twice), never skip it (the key
    would stay upserted: the batch's delete lost)."""
    from memwal_query.spark.ingest_tasks import _RegionSink
    from memwal_query.write.writer import RegionWriter

    t = new_table(tmp_path)
    t.writer().close(flush=False)  # the region exists
    (region,) = t.catalog.region_ids()
    options = {
        "uri": t.uri,
        "storage_options": {},
        "mode": "upsert",
        "delete_column": "gone",
        "order": [],
        "ignore": ["gone"],
        "flush": True,
        "buffer_rows": 20,
        "writer_options": {},
        "partial": True,
        "stream_batch": ("q", 4),
    }
    rows = basic_rows([1, 2, 3, 1]).append_column(
        "gone", pa.array([False, False, False, True])
    )  # upsert 1..3, then delete 1
    attempt_b = _RegionSink(t, region, options)
    delete = RegionWriter._delete_routed

    def b_claims_first(self, *args, **kwargs):  # A, between its upsert and its delete
        if attempt_b.writer is None:
            attempt_b.writer = attempt_b._open(rows.slice(0, 1).drop_columns("gone"), False)
        return delete(self, *args, **kwargs)

    attempt_a = _RegionSink(t, region, options)
    with monkeypatch.context() as m:
        m.setattr(RegionWriter, "_delete_routed", b_claims_first)
        attempt_a.add(rows)
        attempt_a.drain()  # its delete is fenced, claims again, finds the batch: skips
    attempt_a.abort()
    attempt_b.add(rows)
    attempt_b.finish()
    got = {r["id"] for r in mq.MemWalTable.open(t.uri).to_table().to_pylist()}
    assert got == set(range(10)) - {1}
