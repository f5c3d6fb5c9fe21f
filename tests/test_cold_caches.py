"""Cold start and cached state of searches (real Lance tables).

A first query reads each generation's rows sidecar (``memwal_rows.bin``) instead of
opening its Lance table, and repeated queries reuse parsed region manifests (one check
of the next version per region). These tests prove the shortcuts never change an answer:
the sidecar equals the Lance table; a missing or damaged sidecar falls back to Lance; a
generation that is gone is a typed error, never an empty part; and a reader whose caches
are warm sees a flush, a merge and a garbage collection made by another process or
writer at its next query.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import threading
import warnings

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query import search
from memwal_query.exceptions import GenerationGoneError
from memwal_query.format import rowfile
from memwal_query.format.schema import ROWADDR_COLUMN
from memwal_query.read import newer, sources, view
from memwal_query.storage import paths

from helpers import PK, clear_read_caches, damage_file, parity_spec

DIM = 4
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("cat", pa.int64()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)


def _rows(ids, rng: np.random.Generator, cat: int = 0) -> pa.Table:
    ids = np.asarray(ids, np.int64)
    vecs = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "cat": pa.array(np.full(len(ids), cat), pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM),
        },
        schema=SCHEMA,
    )


def _table(tmp_path, gens: int = 3) -> mq.MemWalTable:
    """Two regions (even / odd keys), ``gens`` flushes of updates, new keys and deletes
    each: ``2 * gens`` unmerged generations (the block path from 4 on)."""
    rng = np.random.default_rng(5)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(100), rng), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    for g in range(gens):
        t.write(_rows(rng.choice(140, 50, replace=False), rng, cat=g + 1))
        t.delete(pa.table({"id": pa.array(rng.choice(140, 5, replace=False), pa.int64())}))
        t.flush()
    t.close()
    return t


def _forget() -> None:
    """A fresh process's caches (generation columns, blocks, handles)."""
    search.clear_caches()
    sources.GENERATION_CACHE.clear()
    sources.GENERATIONS_WITHOUT_SIDECAR.clear()


def _generations(t: mq.MemWalTable) -> list[str]:
    return [g.uri for g in view.resolve(t.catalog).generations]


def _answer(t: mq.MemWalTable, q: np.ndarray) -> tuple[list, list, list]:
    got = t.vector_search("vec", q, k=20, columns=["id", "cat"])
    flt = t.vector_search("vec", q, k=20, filter="cat = 2", columns=["id", "cat"])
    rows = t.to_table(columns=["id", "cat"]).sort_by("id")
    return (
        list(zip(got["id"].to_pylist(), got["cat"].to_pylist())),
        flt["id"].to_pylist(),
        list(zip(rows["id"].to_pylist(), rows["cat"].to_pylist())),
    )


def test_the_rows_sidecar_equals_the_lance_table(tmp_path):
    t = _table(tmp_path, gens=2)
    for uri in _generations(t):
        side = rowfile.read(t.catalog.io, uri)
        assert side is not None
        lance_rows = lance.dataset(uri).to_table(with_row_address=True)
        assert side.column_names == lance_rows.column_names
        assert side.equals(lance_rows.cast(side.schema))
        assert side[ROWADDR_COLUMN].to_pylist() == lance_rows[ROWADDR_COLUMN].to_pylist()


def test_a_missing_or_damaged_sidecar_reads_the_lance_table(tmp_path):
    t = _table(tmp_path)
    q = np.ones(DIM, np.float32)
    _forget()
    want = _answer(t, q)
    gens = _generations(t)
    assert len(gens) >= 4
    os.remove(os.path.join(gens[0], rowfile.ROWS_FILE))  # as written by pylance
    path = os.path.join(gens[1], rowfile.ROWS_FILE)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # a flipped bit: the CRC catches it
    open(path, "wb").write(bytes(data))
    path = os.path.join(gens[2], rowfile.ROWS_FILE)
    open(path, "wb").write(open(path, "rb").read()[:100])  # truncated
    _forget()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _answer(t, q) == want
    damaged = [str(w.message) for w in seen if rowfile.ROWS_FILE in str(w.message)]
    assert any("CRC" in m for m in damaged) and len(damaged) >= 2


@pytest.mark.parametrize("read", ["full", "lookup", "search"])
def test_another_generations_rows_sidecar_is_not_used(tmp_path, read):
    """A rows sidecar of another generation (valid framing and CRC, another row count
    than its region manifest records): a warning naming it, the Lance table read, the
    same answers; never an index error or a key index blamed."""
    t = _table(tmp_path)
    q = np.ones(DIM, np.float32)
    clear_read_caches()
    want = (_answer(t, q), t.to_table().sort_by("id"), t.lookup(pa.array(range(150))))
    gens = _generations(t)
    rows = {g: rowfile.read(t.catalog.io, g).num_rows for g in gens}
    donor = next(g for g in gens if rows[g] != rows[gens[0]])
    path = os.path.join(gens[0], rowfile.ROWS_FILE)
    damage_file(path, "replaced", donor=os.path.join(donor, rowfile.ROWS_FILE))
    clear_read_caches()
    r = mq.MemWalTable.open(t.uri)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if read == "full":
            assert r.to_table().sort_by("id").equals(want[1])
        elif read == "lookup":
            assert r.lookup(pa.array(range(150))).equals(want[2])
        assert _answer(r, q) == want[0]
    assert any(rowfile.ROWS_FILE in str(w.message) for w in seen)


def test_an_unfiltered_read_keeps_the_newest_rows_not_every_generations_rows(tmp_path, monkeypatch):
    t = _table(tmp_path, gens=3)  # six generations
    gens = _generations(t)
    # the newest rows taken four generations at a time: a group boundary inside
    monkeypatch.setattr(newer, "TAKE_GENERATIONS", 4)
    clear_read_caches()
    got = t.to_table().sort_by("id")
    # every generation recorded as read, none of its columns kept
    assert [sources.GENERATION_CACHE.get(u) for u in gens] == [{}] * len(gens)
    # the same rows by the filtered route (the generations' rows read whole, cached)
    assert got.equals(t.to_table(filter=pc.field("id") >= 0).sort_by("id"))
    assert got.num_rows and got.column("cat").to_pylist() != [0] * got.num_rows
    clear_read_caches()
    sidecars: list[str] = []
    read = rowfile.read
    monkeypatch.setattr(rowfile, "read", lambda io, uri: sidecars.append(uri) or read(io, uri))
    assert t.to_table().sort_by("id").equals(got)
    assert sorted(sidecars) == sorted(gens)  # each generation's rows read once
    sidecars.clear()
    assert t.to_table().sort_by("id").equals(got)  # warm: from the newest rows kept
    assert sidecars == []


def test_a_gone_generation_is_a_typed_error_not_an_empty_part(tmp_path):
    t = _table(tmp_path)
    q = np.ones(DIM, np.float32)
    gone = _generations(t)[1]
    shutil.rmtree(gone)  # listed, not merged: its rows exist nowhere else
    _forget()
    with pytest.raises(GenerationGoneError) as e:
        t.vector_search("vec", q, k=5)
    assert gone in str(e.value)
    _forget()
    with pytest.raises(GenerationGoneError):
        t.vector_search("vec", q, k=5, filter="cat = 1")
    _forget()
    with pytest.raises(GenerationGoneError):
        t.to_table()


_OTHER_PROCESS = """
import sys
import numpy as np
import pyarrow as pa
import memwal_query as mq
t = mq.MemWalTable.open(sys.argv[1])
vec = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.float32)), 4)
t.write(pa.table({"id": pa.array([3, 1000], pa.int64()), "cat": [9, 9], "vec": vec},
                 schema=t.schema))
t.flush()
t.close()
"""


@pytest.mark.slow
def test_warm_caches_see_another_processes_flush_merge_and_gc(tmp_path):
    """A reader whose manifests, blocks and generation columns are cached sees, at its
    next strong query, a flush by another process, then a merge and a GC by another
    writer (no stale row, no row twice, nothing missing)."""
    t = _table(tmp_path)
    reader = mq.MemWalTable.open(t.uri)
    q = np.zeros(DIM, np.float32)
    before = reader.vector_search("vec", q, k=3, columns=["id", "cat"])
    assert 1000 not in before["id"].to_pylist()
    manifests = {r: reader.catalog.region_manifest(r).version for r in reader.catalog.region_ids()}

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _OTHER_PROCESS, t.uri], check=True, env=env)
    # the reader's cached manifests are behind now; its next query finds the new ones
    got = reader.vector_search("vec", q, k=2, columns=["id", "cat"])
    assert sorted(got["id"].to_pylist()) == [3, 1000] and got["cat"].to_pylist() == [9, 9]
    assert any(reader.catalog.region_manifest(r).version > v for r, v in manifests.items())
    filtered = reader.vector_search("vec", q, k=50, filter="cat = 9", columns=["id"])
    assert sorted(filtered["id"].to_pylist()) == [3, 1000]
    stale = reader.vector_search("vec", q, k=200, filter="cat != 9", columns=["id"])
    assert 3 not in stale["id"].to_pylist()  # key 3's older versions never match
    want = reader.to_table(columns=["id", "cat"]).sort_by("id")
    assert len(set(want["id"].to_pylist())) == want.num_rows

    other = mq.MemWalTable.open(t.uri)
    other.maintenance.merge()
    other.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
    other.close()
    assert not _generations(reader)  # merged and collected
    assert reader.to_table(columns=["id", "cat"]).sort_by("id").equals(want)
    again = reader.vector_search("vec", q, k=2, columns=["id", "cat"])
    assert sorted(again["id"].to_pylist()) == [3, 1000]


def test_manifests_are_read_concurrently_and_in_region_order(tmp_path, monkeypatch):
    """On an object store the view reads many regions' manifests on a few threads (on
    a local file system one after the other); the result is the same as reading them
    one by one."""

    t = _table(tmp_path, gens=1)
    ids = t.catalog.region_ids()
    threads: set[str] = set()
    real = type(t.catalog).region_manifest

    def spy(self, region_id):
        threads.add(threading.current_thread().name)
        return real(self, region_id)

    monkeypatch.setattr(type(t.catalog), "region_manifest", spy)
    assert not t.catalog.io.parallel_requests
    local = view._read_manifests(t.catalog, ids + ids + ids)
    assert threads == {threading.current_thread().name}
    monkeypatch.setattr(t.catalog.io, "parallel_requests", True)  # as an object store
    read = view._read_manifests(t.catalog, ids + ids + ids)  # more than two: the pool
    assert any(n.startswith("memwal-manifest") for n in threads)
    assert read == local
    assert [m.region_id for m in read.values()] == ids
    assert [read[r] for r in ids] == [t.catalog.region_manifest(r) for r in ids]
    gen_dir = read[ids[0]].flushed_generations[0].path
    assert view._gen_uri(t.uri, ids[0], gen_dir) == paths.generation_path(t.uri, ids[0], gen_dir)


def test_the_base_query_runs_while_the_block_is_read(tmp_path, monkeypatch):
    """Cold start: the base's first Lance query starts before the generations' block is
    read (the block's reads wait here until it has), and it is the one used: one query
    of the base per search, and the same answer as exact search over the live rows."""
    t = _table(tmp_path)
    _forget()
    base_asked = threading.Event()
    base_queries = []
    real_scanner = lance.LanceDataset.scanner

    def scanner(self, *args, **kwargs):
        if "nearest" in kwargs and os.path.samefile(self.uri, t.uri):
            base_queries.append(kwargs["nearest"]["k"])
            base_asked.set()
        return real_scanner(self, *args, **kwargs)

    real_read = sources._read_generation

    def read(*args, **kwargs):
        assert base_asked.wait(10), "the block was read before the base query started"
        return real_read(*args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "scanner", scanner)
    monkeypatch.setattr(sources, "_read_generation", read)
    q = np.full(DIM, 0.3, np.float32)
    got = t.vector_search("vec", q, k=5, columns=["id"])
    assert base_queries == [2 * 5 + 8]
    live = t.to_table(columns=["id", "vec"])
    mat = np.stack(live["vec"].to_numpy(zero_copy_only=False))
    want = live["id"].to_numpy()[np.argsort(((mat - q) ** 2).sum(1), kind="stable")[:5]]
    assert got["id"].to_pylist() == want.tolist()


def test_local_reads_of_a_missing_or_bad_object_are_typed(tmp_path):
    from memwal_query.exceptions import ObjectNotFoundError, StorageError
    from memwal_query.storage.io import LocalFileIO

    io = LocalFileIO()
    (tmp_path / "f").write_bytes(b"abc")
    assert io.read_buffer(str(tmp_path / "f")).to_pybytes() == b"abc"
    with pytest.raises(ObjectNotFoundError, match="no such object"):
        io.read_buffer(str(tmp_path / "missing"))
    with pytest.raises(StorageError, match=str(tmp_path)):
        io.read_buffer(str(tmp_path))
