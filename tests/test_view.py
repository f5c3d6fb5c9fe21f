"""The pinned view (memwal_query.read.view): every reader answers from one consistent view.

- A key written to two regions: SQL, lookup and search pick the same version.
- A bloom filter with a cleared bit: lookup still equals SQL.
- Torn reads: a query and a lookup are paused at *every* storage access they make
  (FileIO calls and Lance dataset opens/reads, counted in the reader's thread), while
  another table object merges, garbage collects (the old base version too) and flushes;
  the answer is the state before or after, or a typed error: never a mix. The same for
  another process's default reader (``consistency="latest"``: the durable WAL tail, also while
  it is flushed, merged and its entries collected) and for exact
  vector search and FTS.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import threading

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import BaseVersionGoneError, GenerationGoneError
from memwal_query.format.bloom import BloomFilter, hash_keys
from memwal_query.maintain import snapshots
from memwal_query.read import parallel, waltail
from memwal_query.search import BLOOM_FILE
from memwal_query.storage.io import LocalFileIO

from helpers import basic_rows


def _init(tmp_path, ids=range(20), name="t") -> mq.MemWalTable:
    uri = str(tmp_path / name)
    lance.write_dataset(basic_rows(ids), uri)
    return mq.MemWalTable.initialize(uri)


def _rows(ids, vals) -> pa.Table:
    return basic_rows(ids, [float(v) for v in vals], [f"v{v}" for v in vals])


def _as_dict(t: pa.Table) -> dict[int, float]:
    return dict(zip(t.column("id").to_pylist(), t.column("val").to_pylist()))


def _sql(t: mq.MemWalTable, **kw) -> dict[int, float]:
    return _as_dict(t.to_table(**kw))


def _lookup(t: mq.MemWalTable, ids, **kw) -> dict[int, float]:
    return _as_dict(t.lookup(pa.array(list(ids), pa.int64()), **kw))


# -- a key in two regions -------------------------------------------------------------
def test_key_in_two_regions_every_reader_agrees(tmp_path):
    import uuid

    from memwal_query.write.writer import RegionWriter

    t = _init(tmp_path)
    # Two regions that may hold any key: only an older table (manual regions) or another
    # library's writers get there; our writers derive one region per key. Built with the
    # writer class directly, as such a table's writers would have.
    a, b = (
        RegionWriter(t.catalog, str(uuid.uuid4()), region_values={"bucket": 0}, region_spec_id=1)
        for _ in range(2)
    )
    rank = {r: i for i, r in enumerate(sorted([a.region_id, b.region_id]))}
    later, earlier = (a, b) if rank[a.region_id] > rank[b.region_id] else (b, a)
    model = {i: float(i) for i in range(20)}
    ids = list(range(25))

    def check(writers=None):
        want = {k: v for k, v in model.items()}
        kw = {} if writers is None else {"writers": writers}
        assert _sql(t, **kw) == want
        assert _lookup(t, ids, **kw) == want
        for i in ids:  # one key at a time too (the point-lookup fast paths)
            assert _lookup(t, [i], **kw) == ({i: want[i]} if i in want else {})

    # generation 1 in both regions: the later region (rank) wins
    earlier.put(_rows([1, 2, 21], [100, 200, 2100]))
    later.put(_rows([1, 22], [101, 2201]))
    earlier.delete(pa.table({"id": pa.array([3], pa.int64())}))
    later.put(_rows([3], [301]))  # the later region's put beats the earlier delete
    model.update({1: 101.0, 2: 200.0, 21: 2100.0, 22: 2201.0, 3: 301.0})
    check(writers=[a, b])  # MemTables
    earlier.flush()
    check(writers=[a, b])  # one flushed, one MemTable
    later.flush()
    check()  # both flushed, generation 1 each
    # generation 2 of the earlier region beats generation 1 of the later one
    earlier.put(_rows([1], [102]))
    earlier.delete(pa.table({"id": pa.array([22], pa.int64())}))
    model[1] = 102.0
    del model[22]
    check(writers=[a, b])
    earlier.flush()
    check()
    # (Merging such keys is the merger's business: it merges region by region, so the
    # base may end up with another version than the readers' rule picks: not tested.)


# -- bloom filter corruption ----------------------------------------------------------
def test_cleared_bloom_bit_lookup_equals_sql(tmp_path):
    from memwal_query import search

    t = _init(tmp_path)
    w = t.writer()
    w.put(_rows([7, 8], [700, 800]))
    w.flush()
    w.close()
    (gen_dir,) = [
        os.path.join(root, d)
        for root, dirs, _ in os.walk(os.path.join(t.uri, "_mem_wal"))
        for d in dirs
        if "_gen_" in d
    ]
    path = os.path.join(gen_dir, BLOOM_FILE)
    with open(path, "rb") as f:
        bf = BloomFilter.from_bytes(f.read())
    h = hash_keys(pa.table({"id": pa.array([7], pa.int64())}))
    assert bf.might_contain_hashes(h).all()
    words = bf.words.copy()
    # clear one bit that key 7 needs
    for i in np.flatnonzero(words.reshape(-1)):
        flat = words.reshape(-1)
        for bit in range(32):
            if not flat[i] >> bit & 1:
                continue
            flat[i] &= ~np.uint32(1 << bit)
            if not BloomFilter(words).might_contain_hashes(h).all():
                break
            flat[i] |= np.uint32(1 << bit)
        else:
            continue
        break
    assert not BloomFilter(words).might_contain_hashes(h).all()
    with open(path, "wb") as f:
        f.write(BloomFilter(words).to_bytes())
    search.clear_caches()
    want = _sql(t)
    assert want[7] == 700.0
    assert _lookup(t, [7]) == {7: 700.0}
    assert _lookup(t, range(20)) == {k: v for k, v in want.items() if k < 20}


# -- torn reads: pause at every storage access ----------------------------------------
class _Pauser:
    """Counts the storage accesses of one thread; pauses at the ``target``-th."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.tid: int | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.where = ""

    def hit(self, what: str) -> None:
        if threading.get_ident() != self.tid:
            return
        i = self.count
        self.count += 1
        if i == self.target:
            self.where = what
            self.paused.set()
            assert self.resume.wait(60)


@pytest.fixture
def pauser(monkeypatch):
    box: dict[str, _Pauser] = {}

    def hook(owner, name):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            p = box.get("p")
            if p is not None:
                p.hit(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    for name in ("read", "exists", "list", "is_dir", "size"):
        hook(LocalFileIO, name)
    hook(lance, "dataset")
    for name in ("checkout_version", "to_table", "scanner", "take", "count_rows"):
        hook(lance.LanceDataset, name)
    # The pauser counts one thread's accesses: read the partitions of MemWalDataset.scanner
    # one after the other in the reader's thread (concurrent_streams has its own tests).
    monkeypatch.setattr(parallel, "concurrent_streams", _one_after_the_other)
    return box


def _one_after_the_other(streams, depth=2):
    for make in streams:
        yield from make()


BASE = {i: float(i) for i in range(20)}
GEN1 = ([3, 100], [300, 100], [5])  # puts (ids, vals), deletes
GEN2 = ([4, 101], [400, 101])


def _apply(state, puts, deletes=()):
    out = dict(state)
    out.update({i: float(v) for i, v in zip(*puts)})
    for d in deletes:
        out.pop(d, None)
    return out


BEFORE = _apply(BASE, GEN1[:2], GEN1[2])
AFTER = _apply(BEFORE, GEN2)


def _template(tmp_path, external: bool, search: bool = False) -> tuple[str, str]:
    """Base + generation 1 flushed (snapshot refreshed) + generation 2 in the WAL
    (``search``: the search table of :func:`_search_init`)."""
    t = _search_init(tmp_path) if search else _init(tmp_path, name="template")
    make = _search_rows if search else _rows
    w = t.writer()
    w.put(make(*GEN1[:2]))
    w.delete(pa.table({"id": pa.array(GEN1[2], pa.int64())}))
    w.flush()
    if external:
        old = snapshots.INLINE_THRESHOLD
        snapshots.INLINE_THRESHOLD = 0
        try:
            t.maintenance.refresh_snapshots()
        finally:
            snapshots.INLINE_THRESHOLD = old
    else:
        t.maintenance.refresh_snapshots()
    w.put(make(*GEN2))  # durable: in the WAL, replayed by the next writer
    return t.uri, w.region_id


def _search_rows(ids, vals) -> pa.Table:
    """Rows of the search schema: ``x`` holds the value, the vector depends on both,
    every text contains ``common``."""
    from test_search import DIM
    from test_search import rows as search_rows

    vecs = [np.full(DIM, i * 0.01 + v * 0.001, np.float32) for i, v in zip(ids, vals)]
    return search_rows(ids, vecs, x=list(vals), text=[f"common w{v}" for v in vals])


def _search_init(tmp_path) -> mq.MemWalTable:
    """Base rows 0..19 (``x`` = id) with a vector (IVF_FLAT) and an INVERTED index (not
    maintained: merged rows are searched unindexed)."""
    uri = str(tmp_path / "template")
    ds = lance.write_dataset(_search_rows(range(20), range(20)), uri)
    ds.create_index("vec", "IVF_FLAT", num_partitions=4, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    return mq.MemWalTable.initialize(uri)


def _x_dict(t: pa.Table) -> dict[int, float]:
    return {i: float(x) for i, x in zip(t.column("id").to_pylist(), t.column("x").to_pylist())}


def _vector(t: mq.MemWalTable, **kw) -> dict[int, float]:
    # every partition probed, k above the row count: exact, every live row
    from test_search import DIM

    q = np.zeros(DIM, np.float32)
    return _x_dict(t.vector_search("vec", q, k=200, nprobes=4, columns=["id", "x"], **kw))


def _fts(t: mq.MemWalTable, **kw) -> dict[int, float]:
    return _x_dict(t.fts_search("text", "common", k=200, columns=["id", "x"], **kw))


_OPS = {
    "sql": _sql,
    "lookup": lambda t, **kw: _lookup(t, range(110), **kw),
    "vector": _vector,
    "fts": _fts,
}


def _race(tmp_path, pauser, template, region_id, mode, op, target, meanwhile=None, warm=False):
    """One run paused at access ``target``; returns (answer or error, paused?).

    ``meanwhile(uri, w)`` runs while the reader is paused (default: merge generation 1,
    collect garbage, flush generation 2). ``warm``: the reader answered once before (it
    knows the region manifests)."""
    uri = str(tmp_path / f"run{target}")
    shutil.copytree(template, uri)
    writer_table = mq.MemWalTable.open(uri)
    # replays generation 2 into its MemTable; flushes on the test's clock only (on a
    # loaded machine the replayed rows could otherwise pass the default age meanwhile)
    w = writer_table.writer(region_id, max_memtable_age=3600.0)
    reader = mq.MemWalTable.open(uri)
    consistency = {"ryw": "strong", "eventual_external": "eventual"}.get(mode, mode)
    kw = {"consistency": consistency, "writers": [w] if mode == "ryw" else []}
    if mode == "default":
        kw.pop("consistency")
    if warm:
        _OPS[op](reader, **kw)
    p = _Pauser(target)
    out: dict = {}

    def run():
        p.tid = threading.get_ident()
        try:
            out["answer"] = _OPS[op](reader, **kw)
        except (BaseVersionGoneError, GenerationGoneError) as e:
            out["error"] = e
        except BaseException as e:  # noqa: BLE001 - reported below
            out["unexpected"] = e
        finally:
            p.paused.set()

    pauser["p"] = p
    th = threading.Thread(target=run)
    th.start()
    assert p.paused.wait(60)
    paused = "answer" not in out and "error" not in out and "unexpected" not in out
    if paused:
        (meanwhile or _merge_gc_flush)(uri, w)
    p.resume.set()
    th.join(60)
    pauser.pop("p")
    w.close(flush=False)
    shutil.rmtree(uri)
    if "unexpected" in out:
        raise AssertionError(f"{mode}/{op} paused at access {target} ({p.where})") from out[
            "unexpected"
        ]
    return out, paused, p.where


def _merge_gc_flush(uri: str, w) -> None:
    other = mq.MemWalTable.open(uri)
    assert other.maintenance.merge().merged
    other.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
    assert w.flush() is not None


def _flush_merge_gc(uri: str, w) -> None:
    """Flush generation 2 (the reader's WAL tail), merge everything, then collect
    garbage: the WAL entries the paused reader is reading are deleted."""
    assert w.flush() is not None
    other = mq.MemWalTable.open(uri)
    assert other.maintenance.merge().merged
    other.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
    region = other.maintenance.status().regions[w.region_id]
    assert region.wal_entries == 0 and region.merged_generation == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strong", "ryw", "eventual", "eventual_external"])
def test_paused_reader_sees_before_or_after(tmp_path, pauser, mode):
    template, region_id = _template(tmp_path, external=mode == "eventual_external")
    allowed = [AFTER] if mode == "ryw" else [BEFORE, AFTER]
    _pause_everywhere(tmp_path, pauser, template, region_id, mode, ("sql", "lookup"), allowed)


@pytest.mark.slow
def test_paused_latest_reader_sees_the_acknowledged_state(tmp_path, pauser):
    # Another process's reader with consistency="latest": generation 2 is acknowledged
    # (durable in the WAL) before the query starts, so the only right answer is AFTER,
    # whether it is read from the WAL tail or, once flushed meanwhile, from generation 2.
    template, region_id = _template(tmp_path, external=False)
    _pause_everywhere(tmp_path, pauser, template, region_id, "latest", ("sql", "lookup"), [AFTER])


@pytest.mark.slow
def test_paused_search_sees_before_or_after(tmp_path, pauser):
    # Exact vector search and FTS (every live row) paused at every storage access.
    # (Found: the base index lookup of a search plan on a version cleaned up meanwhile
    # raised Lance's ValueError instead of BaseVersionGoneError, so no re-plan.)
    template, region_id = _template(tmp_path, external=False, search=True)
    allowed = [BEFORE, AFTER]
    _pause_everywhere(tmp_path, pauser, template, region_id, "strong", ("vector", "fts"), allowed)


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_paused_default_reader_reads_the_wal_tail_while_it_is_flushed_merged_and_collected(
    tmp_path, pauser, warm
):
    # The default reader (no consistency given: every acknowledged write) paused at
    # every storage access, the WAL tail's included, while another writer flushes the
    # tail into generation 2, a maintainer merges it and GC deletes its WAL entries.
    # Generation 2 was acknowledged before the query started: AFTER is the only answer
    # (or a typed error). A warm reader knows the manifest that lists generation 1 only
    # and probes the WAL position after it first.
    template, region_id = _template(tmp_path, external=False)
    _pause_everywhere(
        tmp_path,
        pauser,
        template,
        region_id,
        "default",
        ("sql", "lookup"),
        [AFTER],
        meanwhile=_flush_merge_gc,
        warm=warm,
    )


def _pause_everywhere(
    tmp_path, pauser, template, region_id, mode, ops, allowed, meanwhile=None, warm=False
) -> None:
    """Run each of ``ops`` paused at access 0, 1, 2, ... until a run does not pause."""
    for op in ops:
        target = 0
        while True:
            out, paused, where = _race(
                tmp_path, pauser, template, region_id, mode, op, target, meanwhile, warm
            )
            if "answer" in out:
                got = out["answer"]
                assert got in allowed, (
                    f"{mode}/{op} paused at access {target} ({where}): "
                    f"{sorted(set(got.items()) ^ set(BEFORE.items()))} differ from before"
                )
            if not paused:
                break
            target += 1
        assert target > 5  # the reader did touch storage that often


def test_eventual_snapshot_older_than_max_staleness_reads_manifests(tmp_path):
    t = _init(tmp_path)
    w = t.writer()
    w.put(_rows([1], [100]))
    w.flush()
    t.maintenance.refresh_snapshots()
    w.put(_rows([2], [200]))
    w.flush()  # not in the snapshot
    fresh = mq.MemWalTable.open(t.uri)
    assert fresh.provider("eventual").to_table().num_rows == 20  # the snapshot's state
    assert _sql(fresh, consistency="eventual")[2] == 2.0
    stale = fresh.provider("eventual", max_staleness=0.0)  # every snapshot is too old
    assert _as_dict(stale.to_table())[2] == 200.0
    w.close()


def test_a_warm_default_reader_reads_entries_after_a_collected_gap(tmp_path):
    # The reader knows the manifest of generation 1. Then generation 2 is flushed,
    # merged and its WAL entries collected, and entry 3 is acknowledged: the position
    # after the known manifest is missing (collected), not the end of the WAL.
    t = _init(tmp_path)
    w = t.writer()
    w.put(_rows([1], [10]))
    w.flush()
    w.put(_rows([2], [20]))
    reader = mq.MemWalTable.open(t.uri)
    assert _sql(reader)[2] == 20.0 and _lookup(reader, [2]) == {2: 20.0}
    w.flush()
    other = mq.MemWalTable.open(t.uri)
    assert other.maintenance.merge().merged
    other.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
    assert other.maintenance.status().regions[w.region_id].wal_entries == 0
    w.put(_rows([3], [30]))
    waltail.forget()  # entry 2 as another process sees it: gone, not cached
    assert _sql(reader)[3] == 30.0
    assert _lookup(mq.MemWalTable.open(t.uri), [3]) == {3: 30.0}
    reader2 = mq.MemWalTable.open(t.uri)
    _sql(reader2)
    w.put(_rows([4], [40]))
    assert _lookup(reader, [3, 4]) == {3: 30.0, 4: 40.0}
    w.close(flush=False)
