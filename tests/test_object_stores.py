"""The same guarantees on every object store as on local disk.

Every test taking the ``backend`` fixture runs on local disk and on each object store:
S3 (moto), Azure Blob Storage (Azurite) and Google Cloud Storage (the loopback stand-in),
started once per session by ``conftest.StorePool`` (see ``stores.py``). Tests taking the
``store`` fixture exercise what only object stores have (the lease lock, ambiguous-put
resolution) on each store; tests below the ``S3 only`` line cover S3 specifics (option
translation, moto's IAM and stores ignoring conditional puts).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import (
    AlreadyExistsError,
    FencedError,
    ObjectNotFoundError,
    StorageError,
    WriterClosedError,
)
from memwal_query.format.manifest import RegionManifestStore
from memwal_query.format.naming import from_bit_reversed, wal_entry_name
from memwal_query.read import deletions
from memwal_query.storage import paths
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import FileIO, join

from helpers import basic_rows

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3server import LocalS3Server, lock_worker, race_worker  # noqa: E402
from stores import STORES  # noqa: E402

from memwal_query.storage import objectstore  # noqa: E402
from memwal_query.storage.lease import LeaseLock  # noqa: E402
from memwal_query.storage.objectstore import ObjectStoreFileIO  # noqa: E402
from memwal_query.storage.options import (  # noqa: E402
    OPT_VERIFY_CONDITIONAL_PUT,
    ConditionalPutUnsupportedError,
    LockTimeoutError,
    register_commit_lock,
    store_settings,
)

BUCKET = "memwal-test"


@pytest.fixture(scope="session")
def s3_server(store_pool):
    """moto S3 on a free loopback port for the whole session, with one bucket."""
    return store_pool.get("s3").server


@dataclass
class Backend:
    """Where a test's tables live: a local directory or a fresh prefix in a bucket."""

    name: str
    root: str
    storage_options: dict[str, str] = field(default_factory=dict)

    def uri(self, *parts: str) -> str:
        return join(self.root, *parts)

    def io(self) -> FileIO:
        return file_io_for(self.root, self.storage_options)

    def base_table(self, ids=range(100), name: str = "base") -> str:
        uri = self.uri(name)
        lance.write_dataset(basic_rows(ids), uri, storage_options=self.storage_options or None)
        return uri

    def table(self, ids=range(100), name: str = "base") -> mq.MemWalTable:
        uri = self.base_table(ids, name)
        return mq.MemWalTable.initialize(uri, storage_options=self.storage_options)


def _params(slow: tuple[str, ...]) -> list:
    return [
        pytest.param(name, marks=pytest.mark.slow) if name in slow else name
        for name in ("local", *STORES)
    ]


# Local disk and S3 in the fast lane, Azure and GCS in the full run (the default).
ALL_BACKENDS = _params(slow=("azure", "gcs"))
# For a test whose object-store runs are slow: local in the fast lane only.
STORES_ARE_SLOW = pytest.mark.parametrize("backend", _params(slow=STORES), indirect=True)


@pytest.fixture(params=ALL_BACKENDS)
def backend(request, tmp_path, store_pool) -> Backend:
    """The same test on local disk and on each object store."""
    if request.param == "local":
        return Backend("local", str(tmp_path))
    server = store_pool.get(request.param)
    # memwal_lock_ttl also checks that Lance accepts (ignores) memwal_* options.
    opts = server.storage_options(memwal_lock_ttl="10")
    return Backend(request.param, f"{server.root(BUCKET)}/{uuid.uuid4().hex}", opts)


def live(t: mq.MemWalTable, writers=None) -> dict[int, float]:
    return {r["id"]: r["val"] for r in t.to_table(writers=writers).to_pylist()}


# -- FileIO contract ------------------------------------------------------------------------
def test_file_io_contract(backend):
    io = backend.io()
    obj = backend.uri("a/b/c.bin")
    assert not io.exists(obj)
    with pytest.raises(ObjectNotFoundError):
        io.read(obj)
    with pytest.raises(ObjectNotFoundError):
        io.size(obj)
    io.put_if_not_exists(obj, b"one")
    assert io.read(obj) == b"one" and io.size(obj) == 3 and io.exists(obj)
    with pytest.raises(AlreadyExistsError):
        io.put_if_not_exists(obj, b"two")
    assert io.read(obj) == b"one"
    io.write(obj, b"three")
    io.write(backend.uri("a/b/d/e.bin"), b"12")
    io.write(backend.uri("a/bb.bin"), b"x")  # a sibling sharing the prefix "a/b"
    assert io.read(obj) == b"three"
    assert io.list(backend.uri("a/b")) == ["c.bin", "d"]
    assert io.list(backend.uri("a")) == ["b", "bb.bin"]
    assert io.list(backend.uri("missing")) == []
    assert io.is_dir(backend.uri("a/b")) and io.is_dir(backend.uri("a/b/d"))
    assert not io.is_dir(backend.uri("a/b/c.bin")) and not io.is_dir(backend.uri("nope"))
    assert io.tree_size(backend.uri("a/b")) == 7
    io.delete(obj)
    io.delete(obj)  # idempotent
    assert not io.exists(obj)
    io.delete_tree(backend.uri("a/b"))
    io.delete_tree(backend.uri("a/b"))
    assert not io.is_dir(backend.uri("a/b"))
    assert io.read(backend.uri("a/bb.bin")) == b"x"  # the sibling survives


# -- put-if-not-exists races ----------------------------------------------------------------
def test_put_if_not_exists_race_threads(backend):
    io = backend.io()
    n = 12
    for round_ in range(3):
        path = backend.uri(f"race/{round_}.bin")
        barrier = threading.Barrier(n)
        payloads = [bytes([i]) * 8 + os.urandom(50_000) for i in range(n)]
        outcomes: list[tuple[str, bytes]] = []

        def racer(payload: bytes, path=path, barrier=barrier, outcomes=outcomes) -> None:
            barrier.wait()
            try:
                io.put_if_not_exists(path, payload)
                outcomes.append(("won", payload))
            except AlreadyExistsError:
                outcomes.append(("lost", payload))

        threads = [threading.Thread(target=racer, args=(p,)) for p in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [p for o, p in outcomes if o == "won"]
        assert len(outcomes) == n and len(winners) == 1
        assert io.read(path) == winners[0]  # whole, and the winner's


def test_put_if_not_exists_race_processes(backend):
    ctx = mp.get_context("forkserver")
    n = 5
    path = backend.uri("race-proc.bin")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    payloads = [bytes([i]) * 8 + os.urandom(200_000) for i in range(n)]
    procs = [
        ctx.Process(
            target=race_worker,
            args=(backend.root, backend.storage_options, path, p, barrier, results),
        )
        for p in payloads
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(30)
    winners = [tag for o, tag in outcomes if o == "won"]
    assert len(winners) == 1
    data = backend.io().read(path)
    assert data in payloads and data[:8] == winners[0]


def test_concurrent_claims_get_distinct_epochs(backend):
    """Manifest versions are put-if-not-exists: racing claims never share an epoch."""
    t = backend.table(range(10))
    region = str(uuid.uuid4())
    n = 6
    barrier = threading.Barrier(n)
    epochs: list[int] = []

    def claim() -> None:
        store = RegionManifestStore(t.catalog.io, t.uri, region)
        barrier.wait()
        epochs.append(store.claim().writer_epoch)

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(epochs) == list(range(1, n + 1))
    assert t.catalog.region_manifest(region).writer_epoch == n


# -- writer, reader, merger, GC -------------------------------------------------------------
def test_writer_put_delete_flush_recovery(backend):
    t = backend.table()
    w = t.writer()
    w.put(basic_rows([1, 200], val=[-1.0, 200.0]))
    w.delete(pa.table({"id": [2]}))
    assert w.flush() == 1
    w.put(basic_rows([300], val=[300.0]))
    w.close(flush=False)  # 300 stays in the WAL only
    wal_dir = paths.wal_dir(t.uri, w.region_id)
    assert t.catalog.io.list(wal_dir) == sorted(wal_entry_name(p) for p in (1, 2, 3))
    # A new writer claims the region and replays the unflushed entry.
    w2 = t.writer(w.region_id)
    assert w2.epoch == w.epoch + 1 and w2.stats.replayed_rows == 1
    with pytest.raises((FencedError, WriterClosedError)):
        w.put(basic_rows([301]))
    expected = {i: float(i) for i in range(100) if i != 2}
    expected.update({1: -1.0, 200: 200.0, 300: 300.0})
    assert live(t, [w2]) == expected
    assert w2.flush() == 2
    w2.close()
    m = t.catalog.region_manifest(w.region_id)
    assert [g.generation for g in m.flushed_generations] == [1, 2]
    for g in m.flushed_generations:
        gen_dir = paths.generation_path(t.uri, w.region_id, g.path)
        assert t.catalog.io.is_dir(gen_dir) and t.catalog.io.exists(
            join(gen_dir, "bloom_filter.bin")
        )
    reopened = mq.MemWalTable.open(t.uri, storage_options=backend.storage_options)
    assert live(reopened) == expected


def test_fencing(backend):
    t = backend.table(range(10))
    a = t.writer()
    a.put(basic_rows([700]))
    b = t.writer(a.region_id)  # epoch + 1, replays a's entry
    assert b.epoch == a.epoch + 1
    b.put(basic_rows([701]))
    with pytest.raises(FencedError):
        a.put(basic_rows([702]))  # its next WAL position is taken by b
    with pytest.raises((FencedError, WriterClosedError)):
        a.flush()
    b.close()
    view = live(t)
    assert 700 in view and 701 in view and 702 not in view


def test_reader_provider_and_sql(backend):
    t = backend.table()
    w = t.writer()
    w.put(basic_rows([5, 500], val=[50.0, 500.0], name=["five", "big"]))
    w.delete(pa.table({"id": [6]}))
    ctx = datafusion.SessionContext()
    ctx.register_table("live", t.provider(consistency="strong", writers=[w]))
    got = ctx.sql("SELECT count(*) AS n, sum(val) AS s FROM live").to_pydict()
    assert got == {"n": [100], "s": [sum(range(100)) - 5 - 6 + 50.0 + 500.0]}
    got = ctx.sql("SELECT id, name FROM live WHERE val >= 50 ORDER BY id DESC LIMIT 2").to_pydict()
    assert got == {"id": [500, 99], "name": ["big", "n99"]}
    w.flush()
    w.close()
    t.maintenance.refresh_snapshots()
    ctx2 = datafusion.SessionContext()
    mq.register(ctx2, "events", t.uri, storage_options=backend.storage_options)  # eventual
    got = ctx2.sql("SELECT id, val FROM events WHERE id IN (5, 6, 500) ORDER BY id").to_pydict()
    assert got == {"id": [5, 500], "val": [50.0, 500.0]}


@pytest.mark.parametrize("slash", ["", "/"])
def test_sidecars_are_read_from_the_generation_they_were_written_in(backend, slash):
    """Every sidecar a flush writes on a store names its generation directory as the
    reader finds it there (a table URI with or without a trailing slash): none is
    refused, and reads use them."""
    import warnings

    from memwal_query.format import keyfile, rowfile
    from memwal_query.read import sources
    from memwal_query.read import view as read_view

    uri = backend.base_table(range(20), "t") + slash
    t = mq.MemWalTable.initialize(uri, storage_options=backend.storage_options)
    t.write(basic_rows(range(10, 30), val=[-1.0] * 20))
    t.flush()
    t.close()
    io = backend.io()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        refs = read_view.resolve(t.catalog).generations
        assert refs
        for ref in refs:
            assert rowfile.read(io, ref.uri) is not None, ref.uri
            assert keyfile.read(io, ref.uri) is not None, ref.uri
            assert keyfile.read_index(io, ref.uri, None) is not None, ref.uri
        for cache in (sources.GENERATIONS_WITHOUT_SIDECAR, sources.GENERATIONS_WITHOUT_KEYS):
            cache.clear()
        again = mq.MemWalTable.open(uri.rstrip("/"), storage_options=backend.storage_options)
        assert live(again) == {k: (-1.0 if k >= 10 else float(k)) for k in range(30)}
    for ref in refs:
        assert ref.uri not in sources.GENERATIONS_WITHOUT_SIDECAR
        assert ref.uri not in sources.GENERATIONS_WITHOUT_KEYS


@STORES_ARE_SLOW
def test_merger_and_gc(backend):
    t = backend.table()
    w = t.writer()
    w.put(basic_rows([1, 1000], val=[10.0, 1000.0]))
    w.flush()
    w.delete(pa.table({"id": [3]}))
    w.put(basic_rows([1001], val=[1001.0]))
    w.flush()
    w.close()
    expected = live(t)
    m = t.catalog.region_manifest(w.region_id)
    gen_dirs = [paths.generation_path(t.uri, w.region_id, g.path) for g in m.flushed_generations]
    assert t.maintenance.merge().by_region() == {w.region_id: [1, 2]}
    assert t.catalog.index().merged_generations() == {w.region_id: 2}
    base = lance.dataset(t.uri, storage_options=backend.storage_options)
    rows = {r["id"]: r["val"] for r in base.to_table().to_pylist()}
    assert rows == expected  # the base table alone now holds everything
    # the merge's delete left a deletion file, which the reader can read (its runs)
    # from the store to choose its path (few deleted rows: the metadata decides here)
    (deleted,) = [f.deletion_file() for f in base.get_fragments() if f.deletion_file()]
    assert live(t) == expected
    read = t.catalog.io.read
    assert deletions._runs(t.uri, deleted, lambda p: read(f"{t.uri}/{p}")) >= 1
    assert t.maintenance.gc() == []  # older base versions still need the generations
    removed = t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))
    assert set(gen_dirs) <= set(removed)
    assert any(p.endswith(".arrow") for p in removed)
    for d in gen_dirs:
        assert not t.catalog.io.is_dir(d)
    assert live(t) == expected
    assert t.maintenance.status().to_dict()["regions"][w.region_id]["merged_generation"] == 2


def test_change_feed_and_time_travel(backend):
    """The change feed reads flushed generations on every store, and time travel to a
    moment finds the manifest of that moment by the objects' modification times."""
    t = backend.table(range(10))
    w = t.writer()
    w.put(basic_rows([100], val=[1.0]))
    w.flush()
    time.sleep(1.1)  # Last-Modified of object stores has a resolution of one second
    moment = dt.datetime.now()
    time.sleep(1.1)
    w.put(basic_rows([100], val=[2.0]))
    w.delete(pa.table({"id": pa.array([1], pa.int64())}))
    w.flush()
    w.close()
    feed = t.changes()
    got = [(r["id"], r["val"], r["_change_type"]) for r in feed.table.to_pylist()]
    assert got == [(100, 1.0, "upsert"), (100, 2.0, "upsert"), (1, None, "delete")]
    assert t.changes(since=feed.cursor).num_rows == 0
    then = {r["id"]: r["val"] for r in t.provider(as_of=moment).to_table().to_pylist()}
    assert then[100] == 1.0 and then[1] == 1.0
    now = live(t)
    assert now[100] == 2.0 and 1 not in now


@pytest.mark.slow
def test_abfss_uri_names_the_same_objects_as_az(store_pool):
    """An ``abfss://container@account.dfs.core.windows.net/path`` table (the account from
    the host name) is the ``az://container/path`` table, for Lance and for us."""
    server = store_pool.get("azure")
    opts = server.storage_options()
    prefix = uuid.uuid4().hex
    uri = f"abfss://{BUCKET}@devstoreaccount1.dfs.core.windows.net/{prefix}/t"
    lance.write_dataset(basic_rows(range(10)), uri, storage_options=opts)
    t = mq.MemWalTable.initialize(uri, storage_options=opts)
    with t.writer() as w:
        w.put(basic_rows([100], val=[-1.0]))
    assert t.maintenance.merge().by_region() == {w.region_id: [1]}
    same = mq.MemWalTable.open(f"az://{BUCKET}/{prefix}/t", storage_options=opts)
    assert live(same) == live(t) and live(same)[100] == -1.0


# -- WAL naming -------------------------------------------------------------------------------
def test_wal_entry_names_spread(backend):
    """Consecutive WAL entries differ in their first bits (bit-reversed positions)."""
    t = backend.table(range(10))
    w = t.writer()
    for i in range(16):
        w.put(basic_rows([1000 + i]))
    names = t.catalog.io.list(paths.wal_dir(t.uri, w.region_id))
    w.close(flush=False)
    positions = sorted(from_bit_reversed(n) for n in names)
    assert positions == list(range(1, 17))
    by_pos = {from_bit_reversed(n): n for n in names}
    for p in range(1, 16):
        assert by_pos[p][0] != by_pos[p + 1][0]  # neighbours never share the first bit
    # 16 consecutive entries cover all 16 four-bit prefixes: perfectly spread.
    assert len({by_pos[p][:4] for p in range(1, 17)}) == 16


# -- search, batched merge, catch-up, GC, snapshots, status against a model ------------------
DIM = 4


def _search_rows(ids, seed: int, text: str | None = None) -> pa.Table:
    ids = list(ids)
    vecs = np.random.default_rng(seed).standard_normal((len(ids), DIM)).astype(np.float32)
    texts = [text or f"w{i % 7} common" for i in ids]
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, {"lance-schema:unenforced-primary-key": "true"}),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    flat = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), DIM)
    return pa.table({"id": ids, "text": texts, "vec": flat}, schema=schema)


@STORES_ARE_SLOW
def test_search_merge_catch_up_gc_snapshots_match_a_model(backend):
    """Maintained indexes, searches, a batched merge, catch-up, GC and eventual reads
    give the same answers as a dict model, on local disk and on S3."""
    uri = backend.uri("search")
    opts = backend.storage_options or None
    ds = lance.write_dataset(_search_rows(range(200), 0), uri, storage_options=opts)
    ds.create_index("vec", "IVF_FLAT", num_partitions=2, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    t = mq.MemWalTable.initialize(
        uri, maintained_indexes=["vec_idx", "text_idx"], storage_options=backend.storage_options
    )
    model = {r["id"]: r for r in _search_rows(range(200), 0).to_pylist()}
    w = t.writer()
    for g in range(3):
        batch = _search_rows(range(g * 40, g * 40 + 50), g + 1, text=f"gen{g} special")
        w.put(batch)
        model.update({r["id"]: r for r in batch.to_pylist()})
        if g == 1:
            w.delete(pa.table({"id": [5, 6]}))
            del model[5], model[6]
        assert w.flush() == g + 1
    tail = _search_rows([1000], 9, text="memtable special")
    w.put(tail)
    model[1000] = tail.to_pylist()[0]

    def check(writers) -> None:
        keys = [0, 5, 45, 100, 139, 150, 1000, 9999]
        got = t.lookup(pa.array(keys), writers=writers).to_pylist()
        assert {r["id"]: r["text"] for r in got} == {
            k: model[k]["text"] for k in keys if k in model
        }
        q = np.zeros(DIM, np.float32)
        ids = np.array(sorted(model))
        vecs = np.array([model[i]["vec"] for i in ids], np.float32)
        nearest = ids[np.argsort(((vecs - q) ** 2).sum(axis=1), kind="stable")[:5]]
        got_vs = t.vector_search("vec", q, k=5, writers=writers)["id"].to_pylist()
        assert got_vs == nearest.tolist()
        special = {i for i, r in model.items() if "special" in r["text"]}
        got_fts = t.fts_search("text", "special", k=1000, writers=writers)["id"].to_pylist()
        assert sorted(got_fts) == sorted(special)
        assert t.count_rows(writers=writers) == len(model)

    check([w])
    w.close()  # flushes the MemTable: generation 4
    m = t.catalog.region_manifest(w.region_id)
    gen_dirs = [paths.generation_path(t.uri, w.region_id, g.path) for g in m.flushed_generations]
    assert len(gen_dirs) == 4
    for d in gen_dirs:  # every generation got the maintained indexes, on S3 too
        assert {"_indices", "bloom_filter.bin"} <= set(t.catalog.io.list(d))
    before = t.catalog.dataset().version
    assert t.maintenance.merge().by_region() == {w.region_id: [1, 2, 3, 4]}
    assert t.catalog.dataset().version == before + 1  # four generations, one commit
    assert t.maintenance.catch_up_indexes() == {
        n: {w.region_id: 4} for n in ("text_idx", "vec_idx")
    }
    check([])
    removed = t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))
    assert set(gen_dirs) <= set(removed)
    assert not any(t.catalog.io.is_dir(d) for d in gen_dirs)
    assert t.catalog.io.list(paths.wal_dir(t.uri, w.region_id)) == []
    assert "manifest" in t.catalog.io.list(join(paths.mem_wal_root(t.uri), w.region_id))
    check([])
    t.maintenance.refresh_snapshots()
    reopened = mq.MemWalTable.open(uri, storage_options=backend.storage_options)
    assert reopened.count_rows(consistency="eventual") == len(model)
    region = reopened.maintenance.status().to_dict()["regions"][w.region_id]
    assert region["merged_generation"] == 4 and region["unflushed_rows"] == 0
    # generations GC removed are not listed (the manifest still names them)
    assert region["flushed_generations"] == [] and region["wal_entries"] == 0


# -- index lock across processes -------------------------------------------------------------
def test_index_lock_excludes_processes(backend):
    ctx = mp.get_context("forkserver")
    uri = backend.uri("locked")
    counter = backend.uri("counter.txt")
    backend.io().write(counter, b"0")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=lock_worker, args=(uri, backend.storage_options, counter, 4, results))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    assert [results.get(timeout=60) for _ in procs] == ["done"] * 3
    for p in procs:
        p.join(30)
    assert backend.io().read(counter) == b"12"  # no lost update


@pytest.fixture(params=_params(slow=("azure", "gcs"))[1:])
def store(request, store_pool):
    """(ObjectStoreFileIO, root URI of a fresh prefix, storage_options) on each store."""
    server = store_pool.get(request.param)
    opts = server.storage_options()
    root = f"{server.root(BUCKET)}/{uuid.uuid4().hex}"
    return ObjectStoreFileIO.for_uri(root, opts), root, opts


def test_ambiguous_put_is_resolved_by_token(store, monkeypatch):
    io, root, _ = store
    io.put_if_not_exists(root + "/probe-first", b"")  # the one-off conditional-put probe
    real_put = objectstore.obstore.put

    def lost_response(store, key, data, **kwargs):
        real_put(store, key, data, **kwargs)  # it lands, but the client sees an error
        raise objectstore.obx.GenericError("connection reset")

    monkeypatch.setattr(objectstore.obstore, "put", lost_response)
    io.put_if_not_exists(root + "/a", b"mine")  # ours: success
    assert io.read(root + "/a") == b"mine"

    def retried(store, key, data, **kwargs):
        real_put(store, key, data, **kwargs)  # first attempt lands, the retry sees 412
        raise objectstore.obx.AlreadyExistsError("412")

    monkeypatch.setattr(objectstore.obstore, "put", retried)
    io.put_if_not_exists(root + "/b", b"mine")
    assert io.read(root + "/b") == b"mine"
    monkeypatch.setattr(objectstore.obstore, "put", real_put)
    with pytest.raises(AlreadyExistsError):  # someone else's object: a real loss
        io.put_if_not_exists(root + "/b", b"other")

    calls = []

    def flaky(store, key, data, **kwargs):
        calls.append(key)
        if len(calls) == 1:
            raise objectstore.obx.GenericError("503 slow down")  # did not land
        return real_put(store, key, data, **kwargs)

    monkeypatch.setattr(objectstore.obstore, "put", flaky)
    io.put_if_not_exists(root + "/c", b"c")
    assert io.read(root + "/c") == b"c" and len(calls) == 2


@contextlib.contextmanager
def _lease_attempts():
    """``(outcome, time.time() at its end)`` of every ``LeaseLock`` attempt in the block
    (outcome: ``"acquired"``, ``"retry"`` or the holder that made it wait)."""
    seen: list[tuple[str, float]] = []
    attempt = LeaseLock._attempt

    def spy(self):
        outcome = attempt(self)
        seen.append((outcome, time.time()))
        return outcome

    with pytest.MonkeyPatch.context() as m:
        m.setattr(LeaseLock, "_attempt", spy)
        yield seen


def _write_lease(io, path, owner, expires_in):
    lease = {"owner": owner, "expires_at": time.time() + expires_in, "ttl": 1, "released": False}
    io.write(path, json.dumps(lease).encode())


def test_lease_takeover_of_expired_lease(store):
    io, root, _ = store
    path = root + "/.index.lock"
    _write_lease(io, path, "crashed-holder", expires_in=-100)
    with LeaseLock(io, path, skew=0) as lock:
        assert lock.took_over == "crashed-holder"
        assert json.loads(io.read(path))["owner"] == lock.owner
    assert json.loads(io.read(path))["released"] is True
    # A live lease blocks until it expires (crashed holder: no renewal): the contender's
    # first attempts find it held, the one that takes it over ends after its expiry.
    _write_lease(io, path, "stalled-holder", expires_in=0.6)
    expires_at = json.loads(io.read(path))["expires_at"]
    with _lease_attempts() as attempts, LeaseLock(io, path, skew=0, poll=0.05) as lock:
        assert lock.took_over == "stalled-holder"
    assert attempts[0][0].startswith("stalled-holder (expires in "), attempts
    assert attempts[-1][0] == "acquired" and attempts[-1][1] > expires_at, attempts
    _write_lease(io, path, "live-holder", expires_in=30)
    with pytest.raises(LockTimeoutError, match="live-holder"):
        LeaseLock(io, path, timeout=0.3).acquire()


def test_lease_is_renewed_while_held(store):
    io, root, _ = store
    path = root + "/.index.lock"
    holder = LeaseLock(io, path, ttl=0.3, skew=0)
    holder.acquire()
    try:
        with pytest.raises(LockTimeoutError):  # 1 s > 3 lease periods: renewal works
            LeaseLock(io, path, ttl=0.3, skew=0, timeout=1.0).acquire()
        assert not holder.lost
    finally:
        holder.release()
    with _lease_attempts() as attempts, LeaseLock(io, path, skew=0) as lock:
        assert lock.took_over is None  # released, not expired
    assert [outcome for outcome, _ in attempts] == ["acquired"]  # no waiting for expiry


def test_lease_lost_is_detected(store):
    io, root, _ = store
    path = root + "/.index.lock"
    holder = LeaseLock(io, path, ttl=30)
    holder.acquire()
    _write_lease(io, path, "usurper", expires_in=30)  # someone overwrote it
    holder.release()
    assert holder.lost  # release did not clobber the usurper's lease
    assert json.loads(io.read(path))["owner"] == "usurper"


def test_lease_mutual_exclusion_threads(store):
    io, root, _ = store
    path = root + "/.index.lock"
    inside = 0
    peak = 0
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, peak
        for _ in range(3):
            with LeaseLock(io, path, poll=0.01, max_poll=0.05):
                with guard:
                    inside += 1
                    peak = max(peak, inside)
                time.sleep(0.01)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert peak == 1


def test_lance_concurrent_commits(store):
    """Lance commits through create-only puts on the store: no append is lost."""
    _, root, options = store
    uri = root + "/appends"
    lance.write_dataset(basic_rows(range(3)), uri, storage_options=options)
    errors: list[BaseException] = []

    def append(i: int) -> None:
        try:
            lance.write_dataset(
                basic_rows(range(100 * (i + 1), 100 * (i + 1) + 5)),
                uri,
                mode="append",
                storage_options=options,
            )
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    ds = lance.dataset(uri, storage_options=options)
    assert ds.count_rows() == 3 + 4 * 5 and ds.version == 5


# == S3 only ==================================================================================


def test_storage_options_translation():
    s = store_settings(
        "s3",
        {
            "aws_access_key_id": "AK",
            "AWS_SECRET_ACCESS_KEY": "SK",
            "aws_session_token": "T",
            "aws_endpoint": "http://127.0.0.1:9000",
            "aws_region": "eu-west-1",
            "allow_http": "true",
            "aws_virtual_hosted_style_request": "false",
            "timeout": "30s",
            "client_max_retries": "3",
            "block_size": "4096",  # a Lance-only option
            "memwal_lock_ttl": "5",
        },
    )
    assert s.config == {
        "access_key_id": "AK",
        "secret_access_key": "SK",
        "session_token": "T",
        "endpoint": "http://127.0.0.1:9000",
        "region": "eu-west-1",
        "virtual_hosted_style_request": False,
    }
    assert s.client_options == {"allow_http": True, "timeout": "30s"}
    assert s.retry_config == {"max_retries": 3, "retry_timeout": dt.timedelta(seconds=30)}
    assert s.ignored == ("block_size",) and s.lock_ttl == 5.0 and s.conditional_put
    assert store_settings("s3", {"endpoint": "http://h", "region": "r"}).config == {
        "endpoint": "http://h",
        "region": "r",
    }
    assert not store_settings("s3", {"aws_conditional_put": "disabled"}).conditional_put
    with pytest.raises(StorageError):
        store_settings("s3", {"allow_http": "maybe"})


def test_file_io_for_dispatch(s3_server):
    io = file_io_for(f"s3://{BUCKET}/x", s3_server.storage_options())
    assert isinstance(io, ObjectStoreFileIO) and io.conditional_put and io.kind == "s3"
    for uri, kind in [
        ("gs://bucket/x", "gcs"),
        ("az://container/x", "azure"),
        ("abfss://container@account.dfs.core.windows.net/x", "azure"),
    ]:
        io = file_io_for(uri, {"memwal_verify_conditional_put": "false"})
        assert isinstance(io, ObjectStoreFileIO) and io.kind == kind
    for uri in ("hdfs://nn/x", "abfs://c@a.dfs.core.windows.net/x"):  # Lance refuses both
        with pytest.raises(StorageError, match="not supported"):
            file_io_for(uri)


def test_one_options_dict_serves_every_store():
    """Each store takes its own keys (long and short forms, any case) from a dict that
    may hold the others' and Lance-only keys, which are left alone."""
    shared = {
        "aws_access_key_id": "AK",
        "GOOGLE_SERVICE_ACCOUNT_KEY": "{}",
        "azure_storage_account_name": "acct",
        "account_key": "S0VZ",
        "azure_storage_endpoint": "http://127.0.0.1:1/acct",
        "allow_http": "true",
        "timeout": "5s",
        "block_size": "4096",
    }
    s3 = store_settings("s3", shared)
    assert s3.config == {"access_key_id": "AK"} and s3.kind == "s3"
    gcs = store_settings("gcs", shared)
    assert gcs.config == {"service_account_key": "{}"}
    az = store_settings("azure", {**shared, "azure_storage_use_emulator": "false"})
    assert az.config == {
        "account_name": "acct",
        "account_key": "S0VZ",
        "endpoint": "http://127.0.0.1:1/acct",
        "use_emulator": False,
    }
    for settings in (s3, gcs, az):
        assert settings.client_options == {"allow_http": True, "timeout": "5s"}
        assert "block_size" in settings.ignored
    assert "aws_access_key_id" in az.ignored and "azure_storage_account_name" in gcs.ignored


def test_missing_bucket_is_a_storage_error(s3_server):
    io = file_io_for("s3://no-such-bucket/x", s3_server.storage_options())
    with pytest.raises(StorageError, match="no such bucket"):
        io.write("s3://no-such-bucket/x/a", b"1")
    with pytest.raises(StorageError, match="no such bucket"):
        io.put_if_not_exists("s3://no-such-bucket/x/b", b"1")
    assert not io.exists("s3://no-such-bucket/x/a")


@pytest.mark.slow  # ~5-8 s, mostly waiting: Lance tries a refused list six times
def test_open_errors_are_typed_and_name_the_uri(s3_server):
    """A missing bucket or refused credentials is a StorageError naming the URI, not
    TableNotFoundError ("no Lance table here"): the table may well exist."""
    from moto.core.authorization import enable_iam_authentication

    options = s3_server.storage_options()
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}/t"
    lance.write_dataset(basic_rows(range(5)), uri, storage_options=options)
    mq.MemWalTable.initialize(uri, storage_options=options)
    with pytest.raises(mq.TableNotFoundError):  # an existing bucket without the table
        mq.MemWalTable.open(uri + "-missing", storage_options=options)
    with pytest.raises(StorageError, match="no such bucket") as e:
        mq.MemWalTable.initialize("s3://no-such-bucket/t", storage_options=options)
    assert not isinstance(e.value, mq.TableNotFoundError)
    assert str(e.value).startswith("s3://no-such-bucket/t: ")
    with enable_iam_authentication():  # moto now refuses the test credentials (403)
        with s3_server.recording() as by_lance, pytest.raises((OSError, ValueError)):
            lance.dataset(uri, storage_options=options)
        with s3_server.recording() as by_open:
            with pytest.raises(StorageError, match="access denied") as e:
                mq.MemWalTable.open(uri, storage_options=options)
        assert not isinstance(e.value, mq.TableNotFoundError)
        assert str(e.value).startswith(f"{uri}: ") and "InvalidAccessKeyId" in str(e.value)
        # Refused at once, no retries of a 403: the open makes the requests of Lance's own
        # open and no more, and a put is sent once (the conditional-put probe of a new
        # FileIO; the object itself when the probe is off).
        assert by_open == by_lance and {status for *_, status in by_open} == {403}
        probing = file_io_for(uri, options)
        direct = file_io_for(uri, {**options, OPT_VERIFY_CONDITIONAL_PUT: "false"})
        for io, target in [(probing, "/.memwal-probe-"), (direct, "/x")]:
            with s3_server.recording() as log, pytest.raises(StorageError, match=uri):
                io.put_if_not_exists(uri + "/x", b"1")
            puts = [path for method, path, _ in log if method == "PUT"]
            assert len(puts) == 1 and target in puts[0], log


def test_put_while_the_store_is_down_raises_and_loses_nothing(tmp_path, monkeypatch):
    """The store stops between puts: the put raises a StorageError naming the WAL entry
    after a bounded number of attempts; once the store is back, the writer goes on and
    every acknowledged row is there."""
    server = LocalS3Server().start()
    try:
        server.create_bucket("down-bucket")
        options = server.storage_options(client_max_retries="0", client_retry_timeout="2")
        uri = f"s3://down-bucket/{uuid.uuid4().hex}/t"
        lance.write_dataset(basic_rows(range(10)), uri, storage_options=options)
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        w = t.writer()
        w.put(basic_rows([100]))
        port = server.port
        server.stop()
        attempts: list[str] = []
        real_put = objectstore.obstore.put

        def counted(store, key, *args, **kwargs):
            attempts.append(key)
            if len(attempts) > 50:  # unbounded retries: end them (the assert below fails)
                raise objectstore.obx.PermissionDeniedError("test: too many attempts")
            return real_put(store, key, *args, **kwargs)

        monkeypatch.setattr(objectstore.obstore, "put", counted)
        with pytest.raises(StorageError, match=r"wal/.*\.arrow"):
            w.put(basic_rows([101]))
        monkeypatch.setattr(objectstore.obstore, "put", real_put)
        assert 1 <= len(attempts) <= 5, attempts  # objectstore._PUT_ATTEMPTS
        assert all("/wal/" in key for key in attempts), attempts
        server = LocalS3Server(port=port).start()  # moto keeps its objects in memory
        w.put(basic_rows([102]))
        w.close()
        got = live(mq.MemWalTable.open(uri, storage_options=options))
        assert {100, 102} <= set(got) and 101 not in got  # 101 never reached the store
    finally:
        server.stop()


def test_put_landing_as_the_store_dies_is_adopted_not_lost():
    """The WAL entry lands but the store dies before answering: the put raises (outcome
    in doubt); once the store is back the writer adopts the entry, so its MemTable, the
    WAL and a fresh reader agree (the row is neither lost nor doubled)."""
    server = LocalS3Server().start()
    try:
        server.create_bucket("dying-bucket")
        options = server.storage_options(
            client_max_retries="0", client_retry_timeout="2", timeout="2s"
        )
        uri = f"s3://dying-bucket/{uuid.uuid4().hex}/t"
        lance.write_dataset(basic_rows(range(10)), uri, storage_options=options)
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        w = t.writer()
        w.put(basic_rows([100]))
        port, inner, wsgi = server.port, server._server.app, server._server
        doomed = server

        def die_after_wal_put(environ, start_response):
            body = inner(environ, start_response)
            if environ["REQUEST_METHOD"] == "PUT" and "/wal/" in environ["PATH_INFO"]:
                threading.Thread(target=doomed.stop).start()
                raise ConnectionResetError("the store died before answering")
            return body

        wsgi.app = die_after_wal_put
        with pytest.raises(StorageError):
            w.put(basic_rows([101], val=[-101.0]))
        server = LocalS3Server(port=port).start()
        w.put(basic_rows([102]))
        assert live(t, [w])[101] == -101.0  # adopted from the WAL, in WAL order
        w.close()
        got = live(mq.MemWalTable.open(uri, storage_options=options))
        assert got[101] == -101.0 and 100 in got and 102 in got and len(got) == 13
    finally:
        server.stop()


@pytest.mark.slow
def test_cli_on_s3_from_aws_environment(s3_server, tmp_path, monkeypatch):
    """The memwal CLI reaches S3 through AWS_* variables only (AWS_ENDPOINT as documented):
    ingest, sql, status --json, merge and gc agree with the rows written."""
    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}/t"
    lance.write_dataset(basic_rows(range(50)), uri, storage_options=s3_server.storage_options())
    for key, value in {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_ENDPOINT": s3_server.endpoint,
        "AWS_REGION": s3_server.region,
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(key, value)
    runner = CliRunner()

    def memwal(*args: str) -> str:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.stdout

    memwal("init", uri, "--primary-key", "id")
    (tmp_path / "a.csv").write_text("id,val,name\n1,-1.0,a\n100,100.0,b\n")
    assert "2 rows" in memwal("ingest", uri, str(tmp_path / "a.csv"))
    query = "SELECT count(*) AS n, sum(val) AS s FROM t"
    expected = {"n": 51, "s": sum(range(50)) - 2.0 + 100.0}
    assert json.loads(memwal("sql", uri, query, "--format", "json")) == expected
    status = json.loads(memwal("status", uri, "--json"))
    (region,) = status["regions"].values()
    assert region["flushed_generations"] == [1] and region["merged_generation"] == 0
    assert "merged [1]" in memwal("merge", uri)
    assert "_gen_1" in memwal("gc", uri, "--cleanup-older-than", "0s", "--verbose")
    assert json.loads(memwal("sql", uri, query, "--format", "json")) == expected
    status = json.loads(memwal("status", uri, "--json"))
    (region,) = status["regions"].values()
    assert status["base_rows"] == 51 and region["merged_generation"] == 1
    bad = runner.invoke(main, ["status", "s3://no-such-bucket/t"])
    assert bad.exit_code == 1 and "StorageError" in bad.output and "no such bucket" in bad.output


def test_conditional_put_disabled_requires_a_commit_lock(s3_server, tmp_path):
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    options = s3_server.storage_options(memwal_conditional_put="false")
    with pytest.raises(ConditionalPutUnsupportedError):
        file_io_for(root, options)
    lance.write_dataset(basic_rows(range(5)), root + "/t", storage_options=options)
    with pytest.raises(ConditionalPutUnsupportedError):
        mq.MemWalTable.initialize(root + "/t", storage_options=options)
    # With an external lock, check-then-put under the lock is atomic again.
    options["memwal_commit_lock"] = "file://" + str(tmp_path / "commit.lock")
    io = file_io_for(root, options)
    n = 8
    barrier = threading.Barrier(n)
    won: list[int] = []

    def racer(i: int) -> None:
        barrier.wait()
        try:
            io.put_if_not_exists(root + "/k", bytes([i]))
            won.append(i)
        except AlreadyExistsError:
            pass

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(won) == 1 and io.read(root + "/k") == bytes(won)
    t = mq.MemWalTable.initialize(root + "/t", storage_options=options)
    with t.writer() as w:
        w.put(basic_rows([42]))
    t.maintenance.merge()  # the index lock is the external lock here
    assert 42 in live(t)


def test_store_ignoring_if_none_match_is_refused():
    with LocalS3Server(strip_conditions=True) as server:
        io = file_io_for(f"s3://{BUCKET}/x", server.storage_options())
        server.create_bucket("ignores-conditions")
        with pytest.raises(ConditionalPutUnsupportedError):
            io.put_if_not_exists("s3://ignores-conditions/x/a", b"1")


def test_unknown_commit_lock_name_is_refused(s3_server):
    options = s3_server.storage_options(
        memwal_conditional_put="false", memwal_commit_lock="no-such-lock"
    )
    with pytest.raises(StorageError):
        file_io_for(f"s3://{BUCKET}/x", options)


def test_registered_commit_lock(s3_server):
    lock = threading.Lock()
    calls: list[str] = []

    class Lock:
        def __call__(self, name):
            calls.append(name)
            return lock

    register_commit_lock("test-lock", Lock())
    options = s3_server.storage_options(
        memwal_conditional_put="false", memwal_commit_lock="test-lock"
    )
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    io = file_io_for(root, options)
    io.put_if_not_exists(root + "/a", b"1")
    with pytest.raises(AlreadyExistsError):
        io.put_if_not_exists(root + "/a", b"2")
    assert calls == ["put", "put"]


def test_default_retries_are_bounded_and_overridable():
    """Without retry options the HTTP client retries 3 times within 30 s (obstore alone:
    10 within 180 s per request); the storage options still override it."""

    assert store_settings("s3", {}).retry_config == {
        "max_retries": 3,
        "retry_timeout": dt.timedelta(seconds=30),
    }
    own = store_settings("s3", {"client_max_retries": "0", "client_retry_timeout": "2"})
    own = own.retry_config
    assert own == {"max_retries": 0, "retry_timeout": dt.timedelta(seconds=2)}


def test_put_with_unknown_outcome_stops_trying_after_the_deadline(tmp_path, monkeypatch):
    """A conditional put whose outcome stays unknown is tried again only within its
    deadline: against a stopped store, one attempt when the deadline is 0."""
    from memwal_query.storage import objectstore

    server = LocalS3Server().start()
    try:
        server.create_bucket("deadline-bucket")
        options = server.storage_options(client_max_retries="0", client_retry_timeout="1")
        fio = objectstore.ObjectStoreFileIO(store_settings("s3", options))
        path = f"s3://deadline-bucket/{uuid.uuid4().hex}/x"
        fio.put_if_not_exists(path + ".a", b"a")
        server.stop()
        calls = []
        real_put = objectstore.obstore.put

        def counting(*args, **kwargs):
            calls.append(1)
            return real_put(*args, **kwargs)

        monkeypatch.setattr(objectstore.obstore, "put", counting)
        monkeypatch.setattr(objectstore, "_PUT_DEADLINE_SECONDS", 0.0)
        with pytest.raises(StorageError, match=r"x\.b"):
            fio.put_if_not_exists(path + ".b", b"b")
        assert len(calls) == 1  # without the deadline: _PUT_ATTEMPTS tries
    finally:
        server.stop()


def test_create_from_a_frame_and_add_a_column(backend):
    """create with storage options, its failure cleanup, and add_columns on each store."""
    import pandas as pd

    uri = backend.uri("created")
    df = pd.DataFrame({"id": [1, 2], "val": [1.0, 2.0]})
    with pytest.raises(mq.PrimaryKeyError, match="occurs in 2 rows"):
        mq.MemWalTable.create(
            uri, pd.concat([df, df]), primary_key="id", storage_options=backend.storage_options
        )
    t = mq.MemWalTable.create(uri, df, primary_key="id", storage_options=backend.storage_options)
    with pytest.raises(mq.AlreadyExistsError):
        mq.MemWalTable.create(uri, df, primary_key="id", storage_options=backend.storage_options)
    t.write(pd.DataFrame({"id": [3], "val": [3.0], "tag": ["c"]}), schema_mode="merge")
    t.close()
    again = mq.MemWalTable.open(uri, backend.storage_options)
    assert sorted(again.to_table().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "val": 1.0, "tag": None},
        {"id": 2, "val": 2.0, "tag": None},
        {"id": 3, "val": 3.0, "tag": "c"},
    ]
