import os
import subprocess
import sys
import textwrap
import threading

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import bloom
from memwal_query.format.wal import Wal
from memwal_query.storage import paths

from helpers import BASIC_SCHEMA, basic_rows, default_region


def tree(path: str) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def live(t: mq.MemWalTable, writers=None) -> dict[int, tuple]:
    rows = t.to_table(writers=writers).to_pylist()
    return {r["id"]: (r["val"], r["name"]) for r in rows}


def test_put_delete_flush_round_trip(table):
    w = table.writer()
    w.put(basic_rows([1, 2, 200], val=[10.0, 20.0, 2000.0]))
    w.delete(pa.table({"id": [2, 3]}))
    w.put(basic_rows([1], val=[11.0]))
    assert live(table, [w])[1] == (11.0, "n1")
    assert 2 not in live(table, [w]) and 3 not in live(table, [w])
    gen = w.flush()
    assert gen == 1
    m = w.manifest()
    assert m.current_generation == 2
    assert [g.generation for g in m.flushed_generations] == [1]
    assert m.flushed_generations[0].physical_rows == 6
    assert m.flushed_generations[0].primary_key_bytes == 6 * 8
    assert m.replay_after_wal_entry_position == 3  # three WAL entries, positions 1..3
    gen_dir = paths.generation_path(table.uri, w.region_id, m.flushed_generations[0].path)
    ds = lance.dataset(gen_dir)
    got = ds.to_table(with_row_address=True)
    assert got.column("id").to_pylist() == [1, 2, 200, 2, 3, 1]  # write order
    assert got.column("_tombstone").to_pylist() == [False, False, False, True, True, False]
    assert got.column("_rowaddr").to_pylist() == list(range(6))
    assert [i.name for i in ds.describe_indices()]  # primary-key BTREE index
    bf = bloom.BloomFilter.from_bytes(open(os.path.join(gen_dir, "bloom_filter.bin"), "rb").read())
    assert bf.might_contain(pa.table({"id": pa.array([1, 2, 3, 200], pa.int64())})).all()
    # Without the writer (flushed data only) the view is the same.
    w.close()
    view = live(table)
    assert view[1] == (11.0, "n1") and view[200] == (2000.0, "n200")
    assert 2 not in view and 3 not in view and len(view) == 99


def test_group_commit_from_threads(table):
    w = table.writer()
    n_threads, per_thread = 8, 40
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                k = 1000 + t * per_thread + i
                w.put(basic_rows([k]))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    total = n_threads * per_thread
    assert w.stats.put_rows == total
    # Concurrent puts shared WAL entries (group commit) ...
    assert w.stats.wal_entries < total
    # ... and every acknowledged row is in the WAL exactly once.
    wal = Wal(table.catalog.io, paths.wal_dir(table.uri, w.region_id), w.region_id)
    ids = [i for e in wal.replay(0, w.epoch) for i in e.table.column("id").to_pylist()]
    assert sorted(ids) == list(range(1000, 1000 + total))
    w.close()
    assert len(live(table)) == 100 + total


def test_recovery_replays_unflushed_wal(table):
    w = table.writer()
    w.put(basic_rows([500, 501]))
    w.flush()
    w.put(basic_rows([502]))
    w.delete(pa.table({"id": [500]}))
    w.close(flush=False)
    w2 = table.writer(w.region_id)
    assert w2.stats.replayed_entries == 2
    assert w2.generation == 2
    view = live(table, [w2])
    assert 502 in view and 500 not in view and 501 in view
    w2.flush()
    w2.close()
    view = live(table)
    assert 502 in view and 500 not in view and 501 in view


def test_two_writers_one_region_fencing(table):
    a = table.writer()
    a.put(basic_rows([700]))
    b = table.writer(a.region_id)  # claims the region: epoch + 1, replays a's entry
    assert b.epoch == a.epoch + 1
    b.put(basic_rows([701]))
    with pytest.raises(mq.FencedError):
        a.put(basic_rows([702]))  # its next WAL position is taken by b
    with pytest.raises((mq.FencedError, mq.WriterClosedError)):
        a.flush()
    b.flush()
    b.close()
    view = live(table)
    assert 700 in view and 701 in view and 702 not in view


def test_fenced_writer_flush_is_rejected(table):
    a = table.writer()
    a.put(basic_rows([800]))
    b = table.writer(a.region_id)
    with pytest.raises(mq.FencedError):
        a.flush()  # the epoch check before the manifest update
    b.close()
    assert 800 in live(table)  # a's acknowledged write was replayed by b


def test_auto_flush_by_rows(table):
    w = table.writer(max_memtable_rows=10)
    for i in range(5):
        w.put(basic_rows(range(1000 + i * 10, 1010 + i * 10)))
    w.flush()
    gens = [g.generation for g in w.manifest().flushed_generations]
    assert gens == [1, 2, 3, 4, 5]
    w.close()
    assert len(live(table)) == 150


def test_non_durable_mode_and_sync(table):
    w = table.writer(durable=False, wal_flush_interval=60)
    w.put(basic_rows([900]))
    assert 900 in live(table, [w])  # visible to read-your-writes at once
    wal = Wal(table.catalog.io, paths.wal_dir(table.uri, w.region_id), w.region_id)
    assert wal.last_position() == 0  # not yet in the WAL
    w.sync()
    assert wal.last_position() == 1
    w.close(flush=False)
    w2 = table.writer(w.region_id)
    assert 900 in live(table, [w2])
    w2.close()


def test_pandas_and_reader_inputs(table):
    import pandas as pd

    w = table.writer()
    w.put(pd.DataFrame({"id": [1001], "val": [1.5], "name": ["p"]}))
    w.put(basic_rows([1002]).to_batches()[0])
    w.put(pa.RecordBatchReader.from_batches(BASIC_SCHEMA, basic_rows([1003]).to_batches()))
    with pytest.raises(mq.SchemaError, match="missing"):
        w.put(pa.table({"id": [1004]}))  # an upsert replaces the whole row
    w.put(pa.table({"id": [1004]}), partial=True)  # a new key: missing columns NULL
    view = live(table, [w])
    assert view[1001] == (1.5, "p") and 1002 in view and 1003 in view
    assert view[1004] == (None, None)
    w.close()


@pytest.mark.parametrize(
    "bad, error",
    [
        (pa.table({"id": [1], "val": [1.0], "name": ["x"], "extra": [1]}), mq.SchemaError),
        (pa.table({"val": [1.0]}), mq.PrimaryKeyError),
        (pa.table({"id": pa.array([1, None], pa.int64())}), mq.PrimaryKeyError),
        (pa.table({"id": ["not-a-number"]}), mq.SchemaError),
        (pa.table({"id": [1], "val": ["x"]}), mq.SchemaError),
        ("a string", mq.SchemaError),
    ],
)
def test_bad_input_changes_nothing(table, bad, error):
    w = table.writer()
    w.put(basic_rows([1]))
    before = tree(table.uri)
    with pytest.raises(error) as e:
        w.put(bad)
    assert tree(table.uri) == before
    if error is mq.SchemaError and isinstance(bad, pa.Table) and "extra" in bad.column_names:
        assert "extra" in str(e.value)
    w.close(flush=False)


def test_bad_delete_keys(table):
    w = table.writer()
    before = tree(table.uri)
    with pytest.raises(mq.PrimaryKeyError):
        w.delete(pa.table({"val": [1.0]}))
    with pytest.raises(mq.PrimaryKeyError):
        w.delete(pa.table({"id": pa.array([None], pa.int64())}))
    assert tree(table.uri) == before
    w.close(flush=False)


def test_closed_writer_rejects(table):
    w = table.writer()
    w.close()
    with pytest.raises(mq.WriterClosedError):
        w.put(basic_rows([1]))


def test_initialize_errors(tmp_path):
    uri = str(tmp_path / "nopk")
    lance.write_dataset(pa.table({"id": [1]}), uri)
    with pytest.raises(mq.PrimaryKeyError):
        mq.MemWalTable.initialize(uri)
    with pytest.raises(mq.TableNotFoundError):
        mq.MemWalTable.initialize(str(tmp_path / "missing"))
    with pytest.raises(mq.NotInitializedError):
        mq.MemWalTable.open(uri)


def test_initialize_twice(base_uri):
    mq.MemWalTable.initialize(base_uri)
    with pytest.raises(mq.AlreadyInitializedError):
        mq.MemWalTable.initialize(base_uri)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, pyarrow as pa, memwal_query as mq
    t = mq.MemWalTable.open(sys.argv[1])
    w = t.writer(max_memtable_rows=int(sys.argv[3]))
    assert w.region_id == sys.argv[2]
    i = 0
    while True:
        ids = list(range(i * 10, i * 10 + 10))
        w.put(pa.table({"id": pa.array(ids, pa.int64()), "val": [float(i)] * 10,
                        "name": ["k"] * 10}))
        print(i, flush=True)  # acknowledged: durable in the WAL
        i += 1
    """
)


@pytest.mark.parametrize("memtable_rows", [10_000_000, 35])
def test_sigkill_mid_stream_loses_no_acknowledged_put(table, tmp_path, memtable_rows):
    region = default_region()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, table.uri, region, str(memtable_rows)],
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 40:
            break
    proc.kill()
    proc.wait()
    # Any output after the last line we read may also be acknowledged; take all.
    rest = proc.stdout.read().split()
    if rest:
        acked = max(acked, int(rest[-1]))
    w = table.writer(region)
    # Physically, not only in the deduplicated view: every key was put once, so it must
    # be stored once across the referenced generations and the recovered MemTable.
    stored = [m.to_table().column("id") for m in w.memtables()]
    for g in w.manifest().flushed_generations:
        gen_uri = paths.generation_path(table.uri, region, g.path)
        stored.append(lance.dataset(gen_uri).to_table(columns=["id"]).column("id"))
    physical = [k for c in stored for k in c.to_pylist()]
    assert len(physical) == len(set(physical)), "a row is stored twice"
    rows = table.to_table(writers=[w]).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))  # nothing twice
    assert set(range((acked + 1) * 10)) <= set(physical)
    view = {r["id"]: r["val"] for r in rows}
    for i in range(acked + 1):  # every acknowledged put is there, with its value
        for k in range(i * 10, i * 10 + 10):
            assert view[k] == float(i), (i, k)
    w.close()


def test_appendix1_writer_fencing_example(table):
    """The spec's Appendix 1 step by step, with two real writers on one region."""
    from memwal_query.format.manifest import RegionManifest, RegionManifestStore
    from memwal_query.format.schema import storage_schema, with_tombstone

    region = default_region()  # the table's one region
    store = RegionManifestStore(table.catalog.io, table.uri, region)
    # Initial state: manifest v1, epoch 5, entries up to 10 flushed, 11 and 12 in the WAL.
    initial = RegionManifest(
        region,
        1,
        5,
        region_spec_id=1,
        region_field_entries=table.catalog.field_entries({"bucket": 0}),
        replay_after_wal_entry_position=10,
        wal_entry_position_last_seen=12,
    )
    assert store.try_commit(initial)
    wal = Wal(table.catalog.io, paths.wal_dir(table.uri, region), region)
    rows_schema = storage_schema(table.schema)
    for pos in (11, 12):
        wal.append(pos, with_tombstone(basic_rows([1000 + pos]), False).cast(rows_schema), 5, 1)

    a = table.writer(region)  # steps 1-2: loads v1 (epoch 5), commits v2 with epoch 6
    assert (a.epoch, store.latest_version()) == (6, 2)
    for pos in (13, 14, 15):  # step 3: one durable put per WAL entry
        a.put(basic_rows([1000 + pos]))
    assert wal.last_position(10) == 15

    b = table.writer(region)  # steps 4-5: loads v2 (epoch 6), commits v3 with epoch 7
    assert (b.epoch, store.latest_version()) == (7, 3)
    assert b.stats.replayed_entries == 5  # 11..15: a's entries are replayed, not lost
    for pos in (16, 17):  # step 6
        b.put(basic_rows([1000 + pos]))

    with pytest.raises(mq.FencedError) as e:  # steps 7-9: a's flush sees epoch 7 > 6
        a.flush()
    assert (e.value.local_epoch, e.value.stored_epoch) == (6, 7)
    with pytest.raises(mq.FencedError):
        a.put(basic_rows([9999]))  # fenced: every later operation aborts
    assert store.latest_version() == 3  # a committed nothing

    # Recovery reads 11.. until a position is missing (18) and accepts epochs <= 7.
    epochs = [(en.position, en.writer_epoch) for en in wal.replay(10, b.epoch)]
    assert epochs[:7] == [(11, 5), (12, 5), (13, 6), (14, 6), (15, 6), (16, 7), (17, 7)]
    b.put(basic_rows([1018]))  # step 10: b continues normally
    assert b.flush() == 1
    m = store.load_latest()
    assert (m.version, m.writer_epoch, m.replay_after_wal_entry_position) == (4, 7, 18)
    b.close()
    view = live(table)
    assert all(1000 + pos in view for pos in range(11, 19))
    assert 9999 not in view


def test_flush_does_not_block_puts(table, monkeypatch):
    """While a generation is being written, puts only wait for the MemTable swap."""
    import memwal_query.write.flush as flush_mod

    started, release = threading.Event(), threading.Event()
    orig = flush_mod.write_generation

    def slow_write_generation(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return orig(*args, **kwargs)

    monkeypatch.setattr(flush_mod, "write_generation", slow_write_generation)
    # below the backpressure bound (max_unflushed_memtables) puts never wait for a flush
    w = table.writer(max_memtable_rows=5, max_unflushed_memtables=10)
    w.put(basic_rows(range(1000, 1005)))  # reaches the limit: sealed, flush in background
    assert started.wait(30)
    flusher = threading.Thread(target=w.flush)  # an explicit flush() waits too
    flusher.start()
    putter = threading.Thread(
        target=lambda: [w.put(basic_rows([2000 + i])) for i in range(20)], daemon=True
    )
    try:
        putter.start()  # 20 durable puts, 3 more seals, while the flush is stuck
        putter.join(30)
        assert not putter.is_alive(), "puts waited for the flush"
        assert w.stats.flushed_generations == [] and w.stats.put_rows == 25
        assert all(2000 + i in live(table, [w]) for i in range(20))
    finally:
        release.set()
    flusher.join(60)
    assert not flusher.is_alive()
    assert w.stats.flushed_generations[:1] == [1]
    w.close()
    view = live(table)
    assert all(k in view for k in [*range(1000, 1005), *range(2000, 2020)])


def test_initialize_writes_the_index_as_pylance_does(tmp_path):
    """Same index entry as pylance's ``initialize_mem_wal``, readable both ways."""
    from memwal_query.format import index as mwindex

    uris = [str(tmp_path / name) for name in ("native", "ours")]
    for uri in uris:
        lance.write_dataset(basic_rows(range(10)), uri)
        lance.dataset(uri).create_scalar_index("val", "BTREE", name="val_idx")
    lance.dataset(uris[0]).initialize_mem_wal(
        maintained_indexes=["val_idx"], bucket_column="id", num_buckets=4
    )
    spec = mq.bucket_spec(lance.dataset(uris[1]).lance_schema, "id", 4)
    mq.MemWalTable.initialize(uris[1], region_spec=spec, maintained_indexes=["val_idx"])
    entries = []
    for uri in uris:
        ds = lance.dataset(uri)
        (entry,) = [i for i in ds.describe_indices() if i.name == mwindex.INDEX_NAME]
        entries.append((entry.name, entry.index_type))
        details = ds.mem_wal_index_details()  # pylance decodes both
        assert details["maintained_indexes"] == ["val_idx"]
        (native_spec,) = details["sharding_specs"]
        assert native_spec["fields"][0]["transform"] == "bucket"
        assert native_spec["fields"][0]["parameters"]["num_buckets"] == "4"
        ours = mwindex.read_index(mq.MemWalTable.open(uri).catalog.io, ds)  # and so do we
        assert list(ours.details.maintained_indexes) == ["val_idx"]
        (field,) = mq.RegionSpec.from_proto(ours.details.region_specs[0]).fields
        assert (field.transform, field.source_ids, field.parameters) == (
            "bucket",
            [0],
            {"num_buckets": "4"},
        )
    assert entries[0] == entries[1] == (mwindex.INDEX_NAME, "MemWal")
