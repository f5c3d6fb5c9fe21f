"""A reader that follows a stream holds bounded memory, real Lance tables.

Many write / query / flush / merge cycles through one table object: the caches of
MemTables already flushed are dropped (not kept until 64 of them pile up), merged
generations leave the per-generation caches, and the base table's Lance session (index
and metadata caches, shared by every version the table checks out) stays within its
configured bound however many base versions the merges write.
"""

from __future__ import annotations

from typing import Any

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import lancecache
from memwal_query.maintain.policy import MaintenancePolicy
from memwal_query.read.sources import GENERATION_CACHE
from memwal_query.search.caches import clear_caches
from memwal_query.storage.cache import (
    CACHE_SIZE_BYTES,
    CACHE_SIZE_ENV,
    cache_size_bytes,
    cached_bytes,
    named_caches,
    set_cache_size_bytes,
)

from helpers import basic_rows, clear_read_caches, pk_schema

LANCE_BOUND_MB = 0.125  # index and metadata cache each
BOUND = 2 * (1 << 17)
RENEW_MB = 0.25


def test_reader_caches_stay_bounded_over_write_flush_merge_cycles(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMWAL_LANCE_INDEX_CACHE_MB", str(LANCE_BOUND_MB))
    monkeypatch.setenv("MEMWAL_LANCE_METADATA_CACHE_MB", str(LANCE_BOUND_MB))
    assert sum(lancecache.cache_bounds()) == BOUND
    # the caches are process-wide: start without other tests' entries
    clear_caches()
    GENERATION_CACHE.clear()
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(100)), uri)
    ds = lance.dataset(uri)
    ds.create_scalar_index("name", "INVERTED", name="name_idx")
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"])
    merge = MaintenancePolicy(merge_over_generations=0, gc=False, compact_fragments=None)
    peaks: dict[str, int] = {}
    for cycle in range(10):
        ids = list(range(cycle * 10, cycle * 10 + 10)) + [1000 + cycle]
        t.write(basic_rows(ids, val=[float(cycle)] * len(ids)))  # the table's writer
        # queries that index the live MemTable (token postings, key hashes)
        got = t.lookup(pa.array([cycle * 10, 1000 + cycle], pa.int64()), columns=["id", "val"])
        assert got.column("val").to_pylist() == [float(cycle)] * 2
        assert t.fts_search("name", f"n{1000 + cycle}", k=3).column("id").to_pylist() == [
            1000 + cycle
        ]
        t.flush()
        if cycle % 2:
            t.maintenance.maintain(merge)  # new base versions each time
        use = mq.memory_usage(t)
        for k, v in use.items():
            peaks[k] = max(peaks.get(k, 0), v)
    # one region: its newest MemTable and the one before it at most (not one per cycle)
    assert peaks["memtable_token_indexes"] <= 2, peaks
    assert peaks["memtable_key_indexes"] <= 2, peaks
    # merged generations leave the caches; at most the two flushed since the last merge
    assert peaks["open_generations"] <= 2, peaks
    # many base versions later, the Lance caches are within their bound (on a default
    # session they grow with every version: new manifests, data files, index segments;
    # the bound is approximate: Lance's cache evicts shortly after an insert)
    assert len(lance.dataset(uri).versions()) >= 20
    assert peaks["lance_cache_bytes"] <= 1.25 * BOUND, peaks
    assert peaks["lance_cache_limit_bytes"] == BOUND
    # and the answer is right after all that
    final = t.to_table(columns=["id", "val"]).sort_by("id")
    expect = [float(i // 10) for i in range(100)] + [float(c) for c in range(10)]
    assert final.column("val").to_pylist() == expect
    t.close()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e400"])
def test_a_bad_lance_cache_bound_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MEMWAL_LANCE_INDEX_CACHE_MB", value)
    with pytest.raises(mq.MemWalError, match="MEMWAL_LANCE_INDEX_CACHE_MB"):
        lancecache.new_session()
    monkeypatch.delenv("MEMWAL_LANCE_INDEX_CACHE_MB")
    monkeypatch.setenv("MEMWAL_LANCE_RENEW_MB", value)
    with pytest.raises(mq.MemWalError, match="MEMWAL_LANCE_RENEW_MB"):
        lancecache.SessionRenewal()


def _within_budget() -> bool:
    """The budgeted caches hold at most the budget, or each holds one entry at most
    (its newest, always kept)."""
    budgeted = [c for c in named_caches().values() if c.budgeted]
    return cached_bytes() <= cache_size_bytes() or all(len(c) <= 1 for c in budgeted)


def test_read_caches_stay_within_the_process_budget_across_base_versions(
    tmp_path: Any,
) -> None:
    import datafusion
    import numpy as np

    clear_caches()
    clear_read_caches()  # what earlier tests of this process left (their newest entries)
    GENERATION_CACHE.clear()
    uri = str(tmp_path / "t")
    n = 20_000
    schema = pk_schema(pa.field("v", pa.float64()))
    rows = pa.table({"id": pa.array(np.arange(n), pa.int64()), "v": np.zeros(n)}, schema=schema)
    lance.write_dataset(rows, uri)
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    t = mq.MemWalTable.initialize(
        uri, region_spec=mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 4)
    )
    model = np.zeros(n + 100_000)
    live = np.zeros(len(model), dtype=bool)
    live[:n] = True
    budget = 1 << 19
    merge = MaintenancePolicy(merge_over_generations=0, gc=False, compact_fragments=None)
    rng = np.random.default_rng(5)
    peak = 0
    evicted = mq.memory_usage()["cache_budget_evictions"]
    set_cache_size_bytes(budget)
    try:
        for cycle in range(12):
            ids = np.unique(
                np.concatenate([rng.integers(0, n, 4000), n + cycle * 1000 + np.arange(1000)])
            )
            val = np.full(len(ids), float(cycle + 1))
            t.write(pa.table({"id": pa.array(ids, pa.int64()), "v": val}, schema=schema))
            model[ids], live[ids] = val, True
            gone = rng.integers(0, n, 50)
            t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
            live[gone] = False
            if cycle % 3 != 2:
                t.flush()
            if cycle % 2:
                t.maintenance.maintain(merge)  # a new base version
            ctx = datafusion.SessionContext()
            ctx.register_table("t", t.provider())
            count = ctx.sql("SELECT count(*) AS c FROM t").to_arrow_table()
            assert count.column("c")[0].as_py() == int(live.sum())
            got = ctx.sql("SELECT sum(v) AS s FROM t WHERE id % 7 = 3").to_arrow_table()
            sel = live & (np.arange(len(model)) % 7 == 3)
            assert got.column("s")[0].as_py() == pytest.approx(float(model[sel].sum()))
            keys = rng.integers(0, n + cycle * 1000, 10)
            found = t.lookup(pa.array(keys, pa.int64()), columns=["id", "v"])
            want = {int(k): float(model[k]) for k in keys if live[k]}
            assert dict(zip(found.column("id").to_pylist(), found.column("v").to_pylist())) == want
            assert _within_budget(), mq.memory_usage(t)
            peak = max(peak, cached_bytes())
        assert len(lance.dataset(uri).versions()) >= 10
        assert peak <= budget
        # the budget binds: it evicted entries each cache's own bound would have kept
        assert mq.memory_usage()["cache_budget_evictions"] > evicted
        final = t.to_table(columns=["id", "v"]).sort_by("id")
        assert final.column("id").to_numpy().tolist() == np.flatnonzero(live).tolist()
        assert final.column("v").to_numpy().tolist() == model[live].tolist()
    finally:
        set_cache_size_bytes(None)
        t.close()


def test_the_cache_budget_is_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_SIZE_ENV, "12.5")
    assert cache_size_bytes() == int(12.5 * (1 << 20))
    for bad in ("abc", "0", "-1", "nan", "inf", "-inf", "1e400"):
        monkeypatch.setenv(CACHE_SIZE_ENV, bad)
        with pytest.raises(mq.MemWalError, match=CACHE_SIZE_ENV):
            cache_size_bytes()
    monkeypatch.setenv(CACHE_SIZE_ENV, "1e-9")  # positive: at least one byte, never 0
    assert cache_size_bytes() == 1
    monkeypatch.delenv(CACHE_SIZE_ENV)
    assert cache_size_bytes() == CACHE_SIZE_BYTES
    for bad_size in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="size_bytes"):
            set_cache_size_bytes(bad_size)  # type: ignore[arg-type]


def test_a_reader_following_the_base_renews_its_lance_session(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Superseded entries go with a renewed session: a reader that follows many base
    versions holds far less in its session than the same reader without renewals, and
    every answer stays right (datasets checked out before a renewal included)."""
    import numpy as np

    uri = str(tmp_path / "t")
    n = 20_000
    schema = pk_schema(pa.field("v", pa.float64()))
    rows = pa.table({"id": pa.array(np.arange(n), pa.int64()), "v": np.zeros(n)}, schema=schema)
    lance.write_dataset(rows, uri, max_rows_per_file=4096)
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    t = mq.MemWalTable.initialize(
        uri, region_spec=mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 4)
    )
    monkeypatch.setenv("MEMWAL_LANCE_RENEW_MB", str(RENEW_MB))
    renewing = mq.MemWalTable.open(uri)
    monkeypatch.setenv("MEMWAL_LANCE_RENEW_MB", "1e6")  # never
    keeping = mq.MemWalTable.open(uri)
    model = np.zeros(n)
    merge = MaintenancePolicy(merge_over_generations=0, gc=False, compact_fragments=None)
    rng = np.random.default_rng(11)
    sessions: list[lance.Session] = []
    peaks = {"renewing": 0, "keeping": 0}
    pinned = []
    for cycle in range(16):
        ids = np.unique(rng.integers(0, n, 3000))
        model[ids] = cycle + 1.0
        t.write(pa.table({"id": pa.array(ids, pa.int64()), "v": model[ids]}, schema=schema))
        t.flush()
        # a new base version; its primary-key segments merged now and then (new pages)
        t.maintenance.maintain(merge)
        ds = renewing.catalog.dataset()
        pinned.append((ds, model.copy()))
        if not any(ds.session().is_same_as(s) for s in sessions):
            sessions.append(ds.session())
        keys = rng.integers(0, n, (5, 50))
        for name, reader in (("renewing", renewing), ("keeping", keeping)):
            for k in keys:  # lookups read B-tree pages of the index segments
                found = reader.lookup(pa.array(k, pa.int64()), columns=["id", "v"])
                got = dict(zip(found.column("id").to_pylist(), found.column("v").to_pylist()))
                assert got == {int(key): float(model[key]) for key in k}
            size = reader.catalog.dataset().session().size_bytes()
            peaks[name] = max(peaks[name], size)
    assert len(sessions) >= 2, peaks  # renewed as the base moved on
    assert keeping.catalog.dataset().session().is_same_as(sessions[0]) is False
    assert peaks["renewing"] <= 0.6 * peaks["keeping"], peaks
    # datasets checked out before a renewal still read their own version
    for ds, want in pinned[:: len(pinned) // 4]:
        got = ds.to_table(columns=["id", "v"]).sort_by("id")
        assert got.column("v").to_numpy().tolist() == want.tolist()
    for table in (t, renewing, keeping):
        table.close()


def test_a_session_is_not_renewed_while_the_base_stays(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However much a session holds, the same version keeps it: the renewal only drops
    entries when the table has moved on (queries between merges keep their warm pages)."""
    monkeypatch.setenv("MEMWAL_LANCE_RENEW_MB", "1e-6")
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(1000)), uri)
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    t = mq.MemWalTable.initialize(uri)
    first = t.catalog.dataset().session()
    for i in range(20):
        assert t.lookup(pa.array([i], pa.int64()), columns=["id"]).num_rows == 1
        assert t.catalog.dataset().session().is_same_as(first)
    assert first.size_bytes() > 1  # above the renewal size, and still kept
    t.close()


def test_a_reader_keeps_two_flushed_views_per_table(tmp_path: Any) -> None:
    """Every flush makes a new set of generations; a reader that follows them keeps the
    views of the newest two sets per table, not one per flush until the cache's bound,
    and answers as a cold reader."""
    import datafusion
    import numpy as np

    from memwal_query.read import newer

    clear_caches()
    newer.FLUSHED_VIEWS.clear()
    uris = []
    for name in ("a", "b"):
        uri = str(tmp_path / name)
        lance.write_dataset(basic_rows(range(100)), uri)
        mq.MemWalTable.initialize(
            uri, region_spec=mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 4)
        )
        uris.append(uri)
    writers = [mq.MemWalTable.open(u) for u in uris]
    readers = [mq.MemWalTable.open(u) for u in uris]
    model = [{i: float(i) for i in range(100)} for _ in uris]
    rng = np.random.default_rng(3)
    for cycle in range(8):
        for w, r, m in zip(writers, readers, model, strict=True):
            ids = [int(i) for i in rng.integers(0, 150, 20)]
            w.write(basic_rows(ids, val=[float(cycle)] * len(ids)))
            m.update(dict.fromkeys(ids, float(cycle)))
            w.flush()  # a new set of generations
            ctx = datafusion.SessionContext()
            ctx.register_table("t", r.provider())
            got = ctx.sql("SELECT count(*) AS c, sum(val) AS s FROM t").to_arrow_table()
            assert got.column("c")[0].as_py() == len(m)
            assert got.column("s")[0].as_py() == pytest.approx(sum(m.values()))
        for uri in uris:
            held = [k for k, _ in newer.FLUSHED_VIEWS.items() if f"{uri}/" in repr(k)]
            assert len(held) <= newer.FLUSHED_VIEWS_PER_TABLE, (cycle, len(held))
    for uri in uris:  # both tables' newest views are kept: one does not push out the other
        assert any(f"{uri}/" in repr(k) for k, _ in newer.FLUSHED_VIEWS.items())
    for w, r, m, uri in zip(writers, readers, model, uris, strict=True):
        got = mq.MemWalTable.open(uri).to_table(columns=["id", "val"]).sort_by("id")
        assert dict(zip(got.column("id").to_pylist(), got.column("val").to_pylist())) == m
        w.close()
        r.close()
