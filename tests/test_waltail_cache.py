"""What a default reader keeps between queries of a table being written: each region's
WAL tail (continued from where the last read stopped) and each region's deduplicated
MemTable rows (extended by the rows added since). Every answer equals a reader that
starts cold, after puts, deletes, flushes, merges and garbage collection of the cached
pieces."""

from __future__ import annotations

import datetime as dt

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.read import newer, view, waltail
from memwal_query.storage.io import LocalFileIO

from helpers import basic_rows, default_region, parity_spec


@pytest.fixture(autouse=True)
def _cold_caches():
    waltail.forget()
    newer._REGION_ROWS.clear()
    newer._REGION_FLUSHED.clear()
    newer._MEMTABLE_VIEWS.clear()
    yield


def _table(tmp_path) -> mq.MemWalTable:
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(basic_rows(range(20)), uri)
    return mq.MemWalTable.initialize(uri, region_spec=parity_spec(ds))


def _rows(ids, val) -> pa.Table:
    return basic_rows(ids, [float(val)] * len(ids), [f"v{val}"] * len(ids))


def _answer(t: mq.MemWalTable) -> dict[int, float]:
    got = t.to_table(columns=["id", "val"])
    return dict(zip(got.column("id").to_pylist(), got.column("val").to_pylist()))


def _cold_answer(uri: str) -> dict[int, float]:
    """What a reader with no cached tail or MemTable rows answers (another process)."""
    caches = (waltail.TAILS, newer._REGION_ROWS, newer._REGION_FLUSHED, newer.FLUSHED_VIEWS)
    saved = [dict(c._items) for c in caches]
    for c in caches:
        c.clear()
    try:
        return _answer(mq.MemWalTable.open(uri))
    finally:
        for c, items in zip(caches, saved):
            for k, v in items.items():
                c.put(k, v)


class _CountingReads:
    """Counts the WAL entry reads of every FileIO (``paths``)."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[str] = []
        real = LocalFileIO.read

        def read(io, path, *a, **kw):
            if "/wal/" in path:
                self.paths.append(path)
            return real(io, path, *a, **kw)

        monkeypatch.setattr(LocalFileIO, "read", read)


def test_a_tail_read_again_reads_only_the_entries_written_since(tmp_path, monkeypatch):
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    reads = _CountingReads(monkeypatch)
    model = {i: float(i) for i in range(20)}
    for step in range(1, 6):
        ids = list(range(step * 3, step * 3 + 6))
        w.write(_rows(ids, 100 + step))
        model.update({i: 100.0 + step for i in ids})
        reads.paths.clear()
        assert _answer(reader) == model
        # one new entry per region, then the probe of the next (missing) position
        assert len(reads.paths) == 2 * 2, reads.paths
    w.close()


def test_entries_keep_their_batches_across_reads(tmp_path):
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    w.write(_rows([1, 2, 3], 7))
    first = view.resolve(t.catalog, "latest")
    w.write(_rows([4], 8))
    second = view.resolve(t.catalog, "latest")
    for a, b in zip(first.regions, second.regions):
        old = [x for m in a.memtables for x in m.batches]
        new = [x for m in b.memtables for x in m.batches]
        assert len(new) >= len(old) and all(x is y for x, y in zip(old, new))
    w.close()


def test_the_cached_tail_after_a_flush_merge_and_collection(tmp_path):
    # The reader caches a tail; the writer flushes it, a maintainer merges it and
    # collects its WAL entries, more rows are acknowledged: the answer is the newest.
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    model = {i: float(i) for i in range(20)}
    w.write(_rows([1, 2, 3, 4], 50))
    model.update({i: 50.0 for i in [1, 2, 3, 4]})
    assert _answer(reader) == model
    cached = dict(waltail.TAILS._items)
    assert cached and all(tail.end > tail.start for tail in cached.values())
    w.flush()
    assert _answer(reader) == model
    other = mq.MemWalTable.open(t.uri)
    assert other.maintenance.merge().merged
    other.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
    assert all(r.wal_entries == 0 for r in other.maintenance.status().regions.values())
    w.write(_rows([3, 30, 31], 60))
    w.delete(pa.table({"id": pa.array([4], pa.int64())}))
    model.update({3: 60.0, 30: 60.0, 31: 60.0})
    del model[4]
    assert _answer(reader) == model
    assert _answer(reader) == model == _cold_answer(t.uri)
    w.close()


def test_a_stale_cached_tail_of_an_old_manifest_is_not_read(tmp_path):
    # The region's tail is cached for manifest M; the writer flushes (replay position
    # moves past it) and writes again: the cached entries are below the new replay
    # position and must not be read again as unflushed rows (they are in a generation).
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    w.write(_rows([2, 4], 1))
    assert _answer(reader)[2] == 1.0
    w.flush()
    w.write(_rows([2], 2))
    got = reader.to_table(columns=["id", "val"])
    assert got.num_rows == 20
    assert _answer(reader)[2] == 2.0 and _answer(reader)[4] == 1.0
    # the tail itself holds only the entry written after the flush
    cat = reader.catalog
    schema = waltail.Probes(cat, []).schema
    for region_id in cat.region_ids():
        m = cat.region_manifest(region_id)
        rows = sum(s.num_rows for s in waltail.tail(cat, region_id, m, schema))
        assert rows == (1 if region_id == cat.region_id_for({"p": 0}) else 0)
    w.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_region_rows_built_step_by_step_equal_a_whole_build(tmp_path, seed):
    # Random puts and deletes into two regions, flushes now and then (the oldest
    # generation of a region's tail leaves it), merges of some regions (their oldest
    # generations leave the view), a reader after every step: the incrementally built
    # MemTable and flushed views equal the ones built from every row at once, and the
    # answer equals a cold reader's.
    rng = np.random.default_rng(seed)
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    schema, pk = t.catalog.schema, t.catalog.primary_key
    for step in range(16):
        ids = sorted({int(i) for i in rng.integers(0, 40, int(rng.integers(1, 8)))})
        w.write(_rows(ids, step))
        if rng.random() < 0.3:
            gone = [int(i) for i in rng.integers(0, 40, 2)]
            w.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        if rng.random() < 0.4:
            w.flush()
        if rng.random() < 0.3:  # the oldest generation of each region, or all of them
            most = 1 if rng.random() < 0.7 else None
            mq.MemWalTable.open(t.uri).maintenance.merge(max_generations=most)
        plan = view.resolve(t.catalog, "latest")
        got_f = newer._flushed_view(plan, schema, pk, None)
        newer.FLUSHED_VIEWS.clear()
        want_f = newer._flushed_view_whole(plan, schema, pk, None)
        assert got_f.num_rows == want_f.num_rows
        assert got_f.live == want_f.live
        assert got_f.keys.distinct() == want_f.keys.distinct()
        for name in ("winners", "regions", "gens", "tombstones"):
            assert np.array_equal(getattr(got_f, name), getattr(want_f, name)), name
        mems = [m for r in plan.regions for m in r.memtables]
        if mems:
            ranks = newer._ranks(plan)
            got = newer._memtable_view(t.uri, mems, schema, pk, ranks)
            newer._MEMTABLE_VIEWS.clear()
            want = newer._memtable_view_whole(t.uri, mems, schema, pk, ranks)
            for name, a, b in zip(("rows", "winners"), got[:2], want[:2]):
                if name == "rows":
                    assert a.equals(b)
                else:
                    assert np.array_equal(a, b)
            assert np.array_equal(got[3], want[3]) and np.array_equal(got[4], want[4])
        assert _answer(reader) == _cold_answer(t.uri)
    w.close()


def test_region_rows_rebuilt_when_a_snapshot_is_not_an_extension(tmp_path):
    # A cached region whose snapshots changed other than by appending (here: another
    # table's snapshots with the same region id) is built again, not extended.
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    w.write(_rows([2, 4, 6], 1))
    plan = view.resolve(t.catalog, "latest")
    mems = [m for r in plan.regions for m in r.memtables]
    ranks = newer._ranks(plan)
    schema, pk = t.catalog.schema, t.catalog.primary_key
    newer._memtable_view(t.uri, mems, schema, pk, ranks)
    from memwal_query.write.memtable import MemTableSnapshot

    other = [
        MemTableSnapshot(
            m.region_id,
            m.generation,
            tuple(pa.Table.from_batches(list(m.batches)).slice(0, 1).to_batches()),
            m.schema,
        )
        for m in mems
    ]
    got = newer._memtable_view(t.uri, other, schema, pk, ranks)
    newer._MEMTABLE_VIEWS.clear()
    want = newer._memtable_view_whole(t.uri, other, schema, pk, ranks)
    assert got[0].equals(want[0]) and np.array_equal(got[1], want[1])
    w.close()


def test_a_claiming_writer_s_rows_rank_above_the_sealed_generation_it_replayed(
    tmp_path, monkeypatch
):
    # Writer a seals generation 1 (its flush waits) and writes key 1 into generation 2;
    # writer b claims the region, replays both into generation 1 and writes key 1 again,
    # recording generation 1 in its entry. b's row is the newest: later in the WAL.
    import threading

    from memwal_query.write import flush as flush_mod

    go = threading.Event()
    real = flush_mod.write_generation

    def paused(*args, **kwargs):
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(flush_mod, "write_generation", paused)
    t = _table(tmp_path)
    a = t.writer(region_values={"p": 1}, max_memtable_rows=3)
    a.put(_rows([1, 3, 5], 10))  # full: sealed as generation 1, its flush waits
    a.put(_rows([1], 20))
    assert a.generation == 2
    b = t.writer(a.region_id, max_memtable_rows=100)
    assert b.generation == 1
    b.put(_rows([1], 30))
    reader = mq.MemWalTable.open(t.uri)
    assert reader.lookup(pa.table({"id": [1]}), ["val"]).column("val").to_pylist() == [30.0]
    assert _answer(reader)[1] == 30.0
    b.put(_rows([3], 40))  # read again: the cached tail is continued
    assert _answer(reader)[1] == 30.0 and _answer(reader)[3] == 40.0
    assert _cold_answer(t.uri) == _answer(reader)
    go.set()
    b.close(flush=False)
    with pytest.raises(mq.FencedError):
        a.close()


@pytest.mark.parametrize("key", [["id"], ["name"]], ids=["int key", "string key"])
def test_the_memtable_rows_kept_between_queries_are_counted_and_bounded(tmp_path, monkeypatch, key):
    # What a reader keeps of the unflushed rows (per region for an integer key, per
    # set of snapshots otherwise) is counted by the rows it holds, not only its keys,
    # and is evicted beyond its bound.
    monkeypatch.setattr(newer._REGION_ROWS, "max_bytes", 1 << 20)
    monkeypatch.setattr(newer._MEMTABLE_VIEWS, "max_bytes", 1 << 20)
    wide = "x" * 4096

    def rows(ids) -> pa.Table:  # ~400 KB a hundred
        return pa.table({"id": ids, "name": [f"{i}{wide}" for i in ids]})

    uri = str(tmp_path / "t")
    lance.write_dataset(rows([-1]), uri)
    t = mq.MemWalTable.initialize(uri, primary_key=key)
    for step in range(4):
        t.write(rows(list(range(step * 100, step * 100 + 100))))
        assert t.to_table(columns=["id"]).num_rows == 1 + 100 * (step + 1)
    region_rows = [r.rows.nbytes for r in newer._REGION_ROWS._items.values()]
    whole_rows = [v[1].nbytes for v in newer._MEMTABLE_VIEWS._items.values()]
    for cache, held in ((newer._REGION_ROWS, region_rows), (newer._MEMTABLE_VIEWS, whole_rows)):
        assert sum(held) <= cache.nbytes
        assert len(held) <= 1 or cache.nbytes <= 1 << 20
    assert region_rows if key == ["id"] else whole_rows
    t.close()


def test_memtable_rows_kept_for_one_schema_are_not_read_with_another(tmp_path):
    # Two table objects in one process, one opened before a column was added: the
    # rows kept for the older one's query are not extended for the newer one's.
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(basic_rows(range(20)), uri)
    older = mq.MemWalTable.initialize(uri, region_spec=parity_spec(ds))
    newer_t = mq.MemWalTable.open(uri)
    newer_t.alter.add_columns({"extra": "string"})
    w = newer_t.writer(region_values={"p": 1})
    w.put(pa.table({"id": [1, 3], "val": [5.0, 6.0], "name": ["a", "b"], "extra": ["e", "f"]}))
    assert older.to_table(writers=[w], columns=["id", "val"]).num_rows == 20
    got = newer_t.to_table(writers=[w], columns=["id", "extra"]).to_pydict()
    assert sorted(e for e in got["extra"] if e is not None) == ["e", "f"]
    w.close()


def test_two_unsharded_tables_read_in_turn_keep_each_other_s_cached_rows(tmp_path):
    # Every unsharded table has the same region id. Two of them, each with a WAL tail
    # and a flushed generation, read alternately: after the first round, a read with
    # nothing new reuses each table's own kept MemTable rows and flushed winners (the
    # same objects), and the answers stay each table's own.
    tables, writers, models = [], [], []
    for n, val in ((0, 1.0), (1, 2.0)):
        uri = str(tmp_path / f"t{n}")
        lance.write_dataset(basic_rows(range(10)), uri)
        t = mq.MemWalTable.initialize(uri)
        w = mq.MemWalTable.open(uri)
        w.write(_rows([1, 2], val))
        w.flush()
        w.write(_rows([2, 3, 11], val + 10))
        tables.append(mq.MemWalTable.open(uri))
        writers.append(w)
        model = {i: float(i) for i in range(10)}
        model.update({1: val, 2: val + 10, 3: val + 10, 11: val + 10})
        models.append(model)
    region = default_region()
    assert {r for t in tables for r in t.catalog.region_ids()} == {region}
    for t, model in zip(tables, models):
        assert _answer(t) == model
    kept = [(newer._REGION_ROWS.get((t.catalog.dataset().uri, region)), t) for t in tables]
    flushed = {k: v for k, v in newer._REGION_FLUSHED._items.items()}
    assert all(rows is not None for rows, _ in kept) and len(flushed) == 2
    for _ in range(2):
        for (rows, t), model in zip(kept, models):
            assert _answer(t) == model
            assert newer._REGION_ROWS.get((t.catalog.dataset().uri, region)) is rows
    assert all(newer._REGION_FLUSHED._items.get(k) is v for k, v in flushed.items())
    for t, model in zip(tables, models):
        assert _answer(t) == model == _cold_answer(t.uri)
    for w in writers:
        w.close()


def _batch(ids) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64())})


def test_the_entries_one_read_finds_become_one_batch_per_generation():
    # Ranks as WAL positions: an entry ranks in the highest generation recorded at or
    # before it and never below the manifest's (None: the manifest's). The entries
    # one read finds are joined per generation, in position order.
    schema = pa.schema([pa.field("id", pa.int64())])
    empty = waltail._Tail(5, 1, schema, 5, {}, 0)
    found = [
        (1, (_batch([1]),)),
        (None, (_batch([2, 3]),)),
        (1, (_batch([4]), _batch([5]))),
        (3, (_batch([6]),)),
        (2, (_batch([7]),)),  # a lower recorded generation after a higher one
        (None, ()),
    ]
    tail, rows = empty.extended(found, 0)
    assert tail.end == 11 and sorted(tail.by_gen) == [1, 3]
    assert [len(b) for b in tail.by_gen.values()] == [1, 1]
    assert tail.by_gen[1][0].column(0).to_pylist() == [1, 2, 3, 4, 5]
    assert tail.by_gen[3][0].column(0).to_pylist() == [6, 7]
    # each entry's rows, as views of the joined batches
    assert [[x for b in r for x in b.column(0).to_pylist()] for r in rows] == [
        [1],
        [2, 3],
        [4, 5],
        [6],
        [7],
        [],
    ]
    more, _ = tail.extended([(None, (_batch([8]),)), (4, (_batch([9]), _batch([10])))], 0)
    assert more.end == 13 and sorted(more.by_gen) == [1, 3, 4]
    assert more.by_gen[1] is tail.by_gen[1] or more.by_gen[1] == tail.by_gen[1]
    assert [b.column(0).to_pylist() for b in more.by_gen[3]] == [[6, 7], [8]]
    assert more.by_gen[3][0] is tail.by_gen[3][0]  # kept, not copied again
    assert [b.column(0).to_pylist() for b in more.by_gen[4]] == [[9, 10]]


def test_a_reader_keeps_one_batch_per_read_and_answers_as_a_cold_reader(tmp_path):
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    model = {i: float(i) for i in range(20)}

    def batches() -> list[int]:
        plan = view.resolve(reader.catalog, "latest")
        return sorted(len(m.batches) for r in plan.regions for m in r.memtables)

    for rounds, step in ((1, 0), (2, 10)):
        waltail.ENTRIES.clear()  # holds only the entries this round's read finds
        for i in range(step, step + 10):
            w.write(_rows([i % 7, 20 + i], i))
            model.update({i % 7: float(i), 20 + i: float(i)})
            w.delete(pa.table({"id": pa.array([5 + i % 2], pa.int64())}))
            model.pop(5 + i % 2, None)
        assert _answer(reader) == model
        assert batches() == [rounds, rounds]  # two regions, one batch per read each
        # the entry cache holds views of the tail's batches, not a second copy
        tails = [b for t in waltail.TAILS._items.values() for g in t.by_gen.values() for b in g]
        owned = {b.column(0).buffers()[1].address for b in tails}
        held = [
            b.column(0).buffers()[1].address
            for _, (_, batches), _ in waltail.ENTRIES._items.values()
            for b in batches
        ]
        assert len(held) > 20 and set(held) <= owned  # the read's batches, not copies
        assert _answer(reader) == model == _cold_answer(t.uri)
        keys = pa.table({"id": pa.array(list(range(40)), pa.int64())})
        got = reader.lookup(keys, columns=["id", "val"])
        assert dict(zip(got.column("id").to_pylist(), got.column("val").to_pylist())) == model
    w.close()


def test_a_damaged_entry_among_new_ones_is_a_typed_error_and_nothing_is_kept(tmp_path):
    from memwal_query.exceptions import WalCorruptError

    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    w.write(_rows([2], 1))
    assert _answer(reader)[2] == 1.0
    kept = dict(waltail.TAILS._items)
    for val in (2, 3, 4):  # three more entries of the even region
        w.write(_rows([2], val))
    region = t.catalog.region_id_for({"p": 0})
    cat = reader.catalog
    m = cat.region_manifest(region)
    wal_dir = waltail._wal_dir(t.uri, region)
    path = waltail._entry_path(wal_dir, m.replay_after_wal_entry_position + 3)
    io = LocalFileIO(fsync=False)
    good = io.read(path)
    bad = bytearray(good)
    bad[bad.rindex((2).to_bytes(8, "little"))] ^= 0x01  # key 2 -> 3: checksum mismatch
    io.write(path, bytes(bad))
    waltail.ENTRIES.clear()
    with pytest.raises(WalCorruptError, match="checksum") as e:
        reader.to_table(columns=["id", "val"])
    assert path.split("/")[-1] in str(e.value)
    assert dict(waltail.TAILS._items) == kept  # the cached tail was not extended
    io.write(path, good)
    assert _answer(reader)[2] == 4.0
    assert _answer(reader) == _cold_answer(t.uri)
    w.close()


def test_the_cache_budget_does_not_evict_wal_tails(tmp_path, monkeypatch):
    """Every read at the default consistency needs every WAL tail it reads again: when
    the views built from them pass the read caches' budget, the tails stay (bounded by
    their own size), and the next read and lookup read only the probe of the next
    position, not the entries again. Answers equal a cold reader's."""
    from memwal_query.storage.cache import set_cache_size_bytes

    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    model = {i: float(i) for i in range(20)}
    for step in range(3):  # several entries per region
        ids = list(range(step * 5, step * 5 + 8))
        w.write(_rows(ids, 70 + step))
        model.update({i: 70.0 + step for i in ids})
    reads = _CountingReads(monkeypatch)
    set_cache_size_bytes(1)  # every view stored evicts every other budgeted entry
    try:
        assert _answer(reader) == model
        assert {tail.end - tail.start for tail in waltail.TAILS._items.values()} == {3}
        reads.paths.clear()
        assert _answer(reader) == model
        got = reader.lookup([1, 12, 19], columns=["id", "val"])
        assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == {
            k: model[k] for k in (1, 12, 19)
        }
        # only the probe of each region's next (missing) position: no entry read again
        assert len(set(reads.paths)) == 2, reads.paths
        assert _answer(reader) == _cold_answer(t.uri)
    finally:
        set_cache_size_bytes(None)
        w.close()


def test_a_flush_drops_the_cached_entries_behind_the_replay_position(tmp_path):
    """Entries a flush put behind a region's replay position leave the entry cache when
    a reader next reads that region's tail (each holds a slice of the old tail's
    batches); the entries after it stay, and every answer is a cold reader's."""
    t = _table(tmp_path)
    w = mq.MemWalTable.open(t.uri)
    reader = mq.MemWalTable.open(t.uri)
    model = {i: float(i) for i in range(20)}
    for rnd in range(3):
        for i in range(6):  # six entries per region
            v = rnd * 10 + i
            w.write(_rows([2 * i, 2 * i + 1], v))
            model.update({2 * i: float(v), 2 * i + 1: float(v)})
        assert _answer(reader) == model
        before = {k[1] for k in waltail.ENTRIES._items}
        assert len(before) >= 12
        w.flush()
        w.write(_rows([40 + rnd], 100 + rnd))  # one entry after the flush, per round
        model[40 + rnd] = float(100 + rnd)
        assert _answer(reader) == model == _cold_answer(t.uri)
        held = {k[1] for k in waltail.ENTRIES._items}
        # the flushed entries are gone; the new one (after the replay position) is held
        assert not held & before, sorted(held & before)
        assert 1 <= len(held) <= 2, sorted(held)
    w.close()
