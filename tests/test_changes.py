"""The change feed (memwal_query.read.changes): every acknowledged change exactly once,
in per-region order, while writers flush and merge and GC runs; typed errors when GC
removed what a cursor needs. Real Lance tables on disk."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import ChangesGoneError, CursorError, MemWalError
from memwal_query.read.changes import SEQ_SHIFT, Cursor, change_schema

from helpers import basic_rows, parity_spec

NOW = dt.timedelta(0)


def _table(tmp_path, n: int = 20) -> mq.MemWalTable:
    uri = str(tmp_path / "base")
    lance.write_dataset(basic_rows(range(n)), uri)
    return mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))


def _gc_all(t: mq.MemWalTable, **kw: Any) -> list[str]:
    """GC that may remove everything merged (old base versions cleaned at once)."""
    return t.maintenance.gc(cleanup_older_than=NOW, min_age=NOW, **kw)


def _region(t: mq.MemWalTable, key: int) -> str:
    return t.catalog.region_id_for({"p": key % 2})


def _rows(changes: pa.Table) -> list[tuple]:
    return list(
        zip(
            changes.column("_region").to_pylist(),
            changes.column("id").to_pylist(),
            changes.column("val").to_pylist(),
            changes.column("_change_type").to_pylist(),
        )
    )


def test_feed_rows_types_and_cursor(tmp_path):
    t = _table(tmp_path)
    t.write(basic_rows([1, 2, 3], val=[10.0, 20.0, 30.0]))
    t.delete(pa.table({"id": [2]}))
    t.write(basic_rows([3], val=[33.0]))
    assert t.changes(consistency="strong").num_rows == 0  # nothing flushed yet
    got = t.changes()  # default: every acknowledged change
    assert got.num_rows == 5
    assert got.table.schema == change_schema(t.schema)
    by_region: dict[str, list] = {}
    for r, i, v, kind in _rows(got.table):
        by_region.setdefault(r, []).append((i, v, kind))
    assert by_region == {
        _region(t, 1): [(1, 10.0, "upsert"), (3, 30.0, "upsert"), (3, 33.0, "upsert")],
        _region(t, 2): [(2, 20.0, "upsert"), (2, None, "delete")],
    }
    deleted = got.table.filter(pa.compute.equal(got.table.column("_change_type"), "delete"))
    assert deleted.column("name").to_pylist() == [None]
    for region in by_region:
        seq = got.table.filter(pa.compute.equal(got.table.column("_region"), region))
        seqs = seq.column("_seq").to_numpy()
        assert (np.diff(seqs) > 0).all() and seqs[0] >> SEQ_SHIFT == 1
    # the cursor continues exactly after what was returned
    assert t.changes(since=got.cursor, consistency="latest").num_rows == 0
    t.write(basic_rows([4]))
    more = t.changes(since=got.cursor, consistency="latest")
    assert _rows(more.table) == [(_region(t, 4), 4, 4.0, "upsert")]
    # strong sees the flushed changes only, with the generation they went to
    t.flush()
    strong = t.changes(consistency="strong")
    assert strong.num_rows == 6 and set(strong.table.column("_gen").to_pylist()) == {1}
    assert Cursor.decode(strong.cursor) == Cursor.decode(more.cursor)
    t.close()


def test_since_version_timestamp_and_max_rows(tmp_path):
    t = _table(tmp_path)
    t.write(basic_rows([1, 2]))
    t.flush()
    t.maintenance.merge()
    merged_version = t.catalog.dataset().version
    time.sleep(0.02)
    moment = dt.datetime.now()
    t.write(basic_rows([5, 6], val=[5.5, 6.5]))
    t.flush()
    for since in (merged_version, str(merged_version), moment, moment.isoformat()):
        assert sorted(t.changes(since=since).table.column("id").to_pylist()) == [5, 6]
    assert sorted(t.changes(since=1).table.column("id").to_pylist()) == [1, 2, 5, 6]
    first = t.changes(since=1, max_rows=1)
    assert first.num_rows == 1 and not first.complete
    rest = t.changes(since=first.cursor)
    assert first.num_rows + rest.num_rows == 4 and rest.complete
    t.close()


def test_bad_cursors_are_typed_errors(tmp_path):
    t = _table(tmp_path)
    for bad in ("nonsense", "mwc1.!!!", "mwc1.e30", 1.5, True):
        with pytest.raises(CursorError):
            t.changes(since=bad)
    other = Cursor({}, "another-lineage").encode()
    with pytest.raises(CursorError, match="another table"):
        t.changes(since=other)
    with pytest.raises(MemWalError):
        t.changes(consistency="eventual")
    with pytest.raises(CursorError):
        t.consumers.register("bad/name")
    t.close()


def test_gc_keeps_what_a_registered_consumer_needs(tmp_path):
    t = _table(tmp_path)
    t.write(basic_rows([1, 2]))
    t.flush()
    first = t.changes()
    t.consumers.register("etl", first.cursor)
    t.write(basic_rows([3, 4]))
    t.flush()
    t.maintenance.merge()
    removed = _gc_all(t)
    # generation 1 (consumed) is collected, generation 2 (not consumed yet) is kept
    assert any("_gen_1" in p for p in removed) and not any("_gen_2" in p for p in removed)
    got = t.changes(since=first.cursor)
    assert sorted(got.table.column("id").to_pylist()) == [3, 4]
    # an unregistered consumer at the start lost what GC removed: a typed error
    with pytest.raises(ChangesGoneError) as err:
        t.changes(since=Cursor({}, t.catalog.lineage).encode())
    assert err.value.position == 1 and err.value.path.endswith(".arrow")
    # the consumer commits its progress: GC may now collect generation 2
    t.consumers.register("etl", got.cursor)
    assert any("_gen_2" in p for p in _gc_all(t))
    assert t.changes(since=got.cursor).num_rows == 0
    t.consumers.drop("etl")
    assert t.consumers.list() == {}
    t.close()


def test_corrupt_consumer_record_stops_gc(tmp_path):
    t = _table(tmp_path)
    t.write(basic_rows([1]))
    t.flush()
    t.maintenance.merge()
    t.consumers.register("etl")
    path = f"{t.uri}/_mem_wal/_consumers/etl.json"
    t.catalog.io.write(path, b"{not json")
    with pytest.raises(CursorError, match="etl.json"):
        _gc_all(t)
    assert t.changes(since=1).num_rows == 1  # nothing was removed
    t.close()


def test_writers_mode_reads_their_regions_unflushed_changes(tmp_path):
    t = _table(tmp_path)
    with t.writer(region_values={"p": 1}) as w:
        w.put(basic_rows([1, 3]))
        t.write(basic_rows([2]))  # another region, not flushed, not read in strong mode
        got = t.changes(writers=[w], consistency="strong")
        assert _rows(got.table) == [
            (_region(t, 1), 1, 1.0, "upsert"),
            (_region(t, 1), 3, 3.0, "upsert"),
        ]
    t.close(flush=False)


class _Model:
    """Acknowledged changes per region, in order, and what was flushed."""

    def __init__(self, t: mq.MemWalTable, base: dict[int, float]) -> None:
        self.t = t
        self.base = dict(base)
        self.seq: dict[str, list[tuple[int, float | None]]] = {}
        self.flushed: dict[str, int] = {}

    def record(self, ids: list[int], vals: list[float | None]) -> None:
        for i, v in zip(ids, vals):
            self.seq.setdefault(_region(self.t, i), []).append((i, v))

    def flush(self) -> None:
        self.flushed = {r: len(s) for r, s in self.seq.items()}

    def flushed_state(self) -> dict[int, float]:
        state = dict(self.base)
        for r, s in self.seq.items():
            for i, v in s[: self.flushed.get(r, 0)]:
                if v is None:
                    state.pop(i, None)
                else:
                    state[i] = v
        return state


class _Consumer:
    """Calls ``changes`` from its previous cursor and commits it (registered)."""

    def __init__(self, t: mq.MemWalTable, name: str, consistency: str) -> None:
        self.t, self.name, self.consistency = t, name, consistency
        self.cursor = t.consumers.register(name)
        self.seen: dict[str, list[tuple[int, float | None]]] = {}

    def poll(self) -> None:
        got = self.t.changes(since=self.cursor, consistency=self.consistency)
        seqs: dict[str, int] = {}
        for r, i, v, _kind in _rows(got.table):
            self.seen.setdefault(r, []).append((i, v))
        for r, s in zip(got.table.column("_region").to_pylist(), got.table["_seq"].to_pylist()):
            assert s > seqs.get(r, -1)
            seqs[r] = s
        self.cursor = self.t.consumers.register(self.name, got.cursor)


@pytest.mark.slow
def test_model_changes_and_time_travel(tmp_path):
    """Random puts, deletes, flushes, merges and GC in two regions; after every step the
    concatenated feed equals the model's acknowledged changes per region (latest) and
    its flushed prefix (strong), and ``as_of`` earlier versions equals the model then."""
    rng = np.random.default_rng(22)
    t = _table(tmp_path, n=10)
    model = _Model(t, {i: float(i) for i in range(10)})
    expected: dict[int, dict[int, float]] = {
        v["version"]: dict(model.base) for v in t.catalog.dataset().versions()
    }
    latest = _Consumer(t, "latest", "latest")
    strong = _Consumer(t, "strong", "strong")
    lazy = _Consumer(t, "lazy", "latest")  # polls now and then: GC must wait for it
    moments: list[tuple[dt.datetime, dict[int, float]]] = []
    removed = 0
    gone_versions = 0
    for step in range(36):
        op = rng.choice(["put", "put", "delete", "flush", "merge", "merge", "gc", "gc", "gc_keep"])
        if op == "put":
            ids = sorted(set(rng.integers(0, 14, size=4).tolist()))
            vals = rng.integers(0, 1000, size=len(ids)).astype(float).tolist()
            t.write(basic_rows(ids, val=vals))
            model.record(ids, vals)
        elif op == "delete":
            ids = sorted(set(rng.integers(0, 14, size=2).tolist()))
            t.delete(pa.table({"id": pa.array(ids, pa.int64())}))
            model.record(ids, [None] * len(ids))
        elif op == "flush":
            t.flush()
            model.flush()
            time.sleep(0.015)  # a moment after the flush, before anything else
            moments.append((dt.datetime.now(), model.flushed_state()))
            time.sleep(0.015)
        elif op == "merge":
            before = t.catalog.dataset().version
            time.sleep(0.015)  # manifest times and version times must not share a tick
            t.maintenance.merge()
            time.sleep(0.015)
            for v in range(before + 1, t.catalog.dataset().version + 1):
                expected[v] = model.flushed_state()
        else:
            keep = dt.timedelta(hours=1) if op == "gc_keep" else None
            removed += len(_gc_all(t, retain_versions_for=keep))
        latest.poll()
        strong.poll()
        if step % 18 == 17:
            lazy.poll()
            assert lazy.seen == model.seq
        assert latest.seen == model.seq
        for r, s in model.seq.items():
            got = strong.seen.get(r, [])
            assert got == s[: len(got)] and len(got) >= model.flushed.get(r, 0)
        kept = [v["version"] for v in t.catalog.dataset().versions()]
        version = int(rng.choice(kept))
        _check_as_of(t, version, expected)
    for v in expected:
        if v in {x["version"] for x in t.catalog.dataset().versions()}:
            _check_as_of(t, v, expected)
        else:
            gone_versions += 1
            with pytest.raises(mq.VersionGoneError):
                t.provider(as_of=v).to_table()
    for moment, state in moments:  # flushed generations not merged yet are read too
        try:
            got = t.provider(as_of=moment).to_table(columns=["id", "val"])
        except mq.VersionGoneError:
            gone_versions += 1
            continue
        assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == state, moment
    assert gone_versions > 0  # some versions were cleaned up, and their as_of says so
    assert removed > 0  # GC did remove generations and WAL entries the consumers had read
    t.close(flush=False)


def _check_as_of(t: mq.MemWalTable, version: int, expected: dict[int, dict[int, float]]) -> None:
    got = t.provider(as_of=version).to_table(columns=["id", "val"])
    assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == expected[version], version


class _PausingIO:
    """Delegates to a FileIO; calls ``hook(path)`` before each storage read."""

    def __init__(self, inner: Any, hook: Any) -> None:
        self.inner, self.hook = inner, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read(self, path: str) -> bytes:
        self.hook(path)
        return self.inner.read(path)

    def exists(self, path: str) -> bool:
        self.hook(path)
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[str]:
        self.hook(prefix)
        return self.inner.list(prefix)


@pytest.mark.slow
@pytest.mark.parametrize("registered", [True, False])
def test_pause_at_each_storage_access(tmp_path, registered):
    """Deterministic: the consumer is paused at its k-th storage access while a writer
    flushes, merges and GC removes everything merged; then it continues. A registered
    consumer gets exactly the new changes every time; an unregistered one gets them
    exactly or a ChangesGoneError, never a shorter answer."""
    writer = _table(tmp_path)
    consumer = mq.MemWalTable.open(writer.uri)
    state: dict[str, Any] = {"k": -1, "n": 0}

    def hook(path: str) -> None:
        state["n"] += 1
        if state["n"] == state["k"]:
            writer.flush()
            writer.maintenance.merge()
            _gc_all(writer)

    consumer.catalog.io = _PausingIO(consumer.catalog.io, hook)  # type: ignore[assignment]
    cursor = consumer.consumers.register("c") if registered else consumer.changes().cursor
    outcomes = {"exact": 0, "gone": 0}
    k, key = 1, 100
    while True:
        rows = [key, key + 1]
        writer.write(basic_rows(rows))
        key += 2
        state["k"], state["n"] = k, 0
        try:
            got = consumer.changes(since=cursor, consistency="latest")
        except ChangesGoneError:
            assert not registered
            outcomes["gone"] += 1
            writer.flush()
            cursor = consumer.changes().cursor  # resynchronise from what is left
        else:
            assert sorted(got.table.column("id").to_pylist()) == rows
            outcomes["exact"] += 1
            cursor = got.cursor
            if registered:
                consumer.consumers.register("c", cursor)
        if state["n"] < k:  # the pause point was beyond every access: all covered
            break
        k += 1
    assert outcomes["exact"] > 0
    assert registered or outcomes["gone"] > 0
    writer.close(flush=False)
