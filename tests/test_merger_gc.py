"""Index catch-up vs concurrent merges, GC of WAL entries, merge retries (real tables)."""

import datetime as dt
import os

import lance
import pytest

import memwal_query as mq
from memwal_query.exceptions import CommitConflictError
from memwal_query.format.manifest import RegionManifestStore
from memwal_query.format.naming import WAL_SUFFIX, from_bit_reversed
from memwal_query.maintain import merger
from memwal_query.storage import paths

from helpers import basic_rows


# -- M4: catch-up records only what the rebuilt index covers ---------------------------
def test_catch_up_does_not_record_a_merge_it_did_not_index(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(50)), uri)
    lance.dataset(uri).create_scalar_index("name", "BTREE", name="name_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"])
    w = t.writer()
    w.put(basic_rows([100], name=["a"]))
    w.flush()
    w.put(basic_rows([200], name=["b"]))
    w.flush()
    w.close()
    region = w.region_id
    t.maintenance.merge(max_generations=1)
    other = mq.MemWalTable.open(uri)
    real = t.catalog.dataset
    fired = []

    def dataset(version=None):
        ds = real(version)
        if version is None and not fired:  # catch-up's read; then another merger lands
            fired.append(other.maintenance.merge().by_region())
        return ds

    t.catalog.dataset = dataset
    progress = t.maintenance.catch_up_indexes()
    assert fired == [{region: [2]}]
    assert progress == {"name_idx": {region: 1}}
    # The index really covers generation 1's fragment but not generation 2's.
    ds = lance.dataset(uri)
    (idx,) = [i for i in ds.describe_indices() if i.name == "name_idx"]
    covered = {f for s in idx.segments for f in s.fragment_ids}
    assert covered != {f.fragment_id for f in ds.get_fragments()}
    # So GC keeps generation 2 (the indexed read plan still needs it).
    t.catalog.dataset = real
    t.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    gens = os.listdir(paths.region_dir(uri, region))
    assert any(g.endswith("_gen_2") for g in gens)
    assert not any(g.endswith("_gen_1") for g in gens)


# -- M6: GC never deletes WAL entries of unmerged generations ---------------------------
def _wal_positions(table, region):
    wal = paths.wal_dir(table.uri, region)
    return sorted(
        from_bit_reversed(n) for n in table.catalog.io.list(wal) if n.endswith(WAL_SUFFIX)
    )


def _three_stages(table):
    """Generation 1 merged, generation 2 flushed (unmerged), one unflushed WAL entry."""
    w = table.writer()
    w.put(basic_rows([1001]))
    w.put(basic_rows([1002]))
    w.flush()
    w.put(basic_rows([2001]))
    w.flush()
    w.put(basic_rows([3001]))  # unflushed MemTable, in the WAL only
    table.maintenance.merge(regions=[w.region_id], max_generations=1)
    store = RegionManifestStore(table.catalog.io, table.uri, w.region_id)
    flushed_1 = next(
        store.load(v)
        for v in range(1, store.latest_version() + 1)
        if store.load(v).current_generation == 2
    )
    return w, store, flushed_1.replay_after_wal_entry_position


def test_gc_deletes_wal_of_merged_generations_only(table):
    w, store, p1 = _three_stages(table)
    before = _wal_positions(table, w.region_id)
    table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    assert _wal_positions(table, w.region_id) == [p for p in before if p > p1]
    w.close(flush=False)


def test_gc_with_unreadable_manifest_version_keeps_unmerged_wal(table):
    w, store, p1 = _three_stages(table)
    before = _wal_positions(table, w.region_id)
    # The manifest version that recorded the flush of generation 1 becomes unreadable.
    version = next(
        v for v in range(1, store.latest_version() + 1) if store.load(v).current_generation == 2
    )
    table.catalog.io.write(store.path(version), b"\x00garbage\xff" * 3)
    table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    left = _wal_positions(table, w.region_id)
    assert [p for p in before if p > p1] == [p for p in left if p > p1]  # none lost
    assert set(left) <= set(before)
    w.close(flush=False)


# -- M6: merge retries: bounded per generation, with backoff ---------------------------
def _generations(table, n):
    w = table.writer()
    for g in range(n):
        w.put(basic_rows([500 + g]))
        w.flush()
    w.close()
    return w.region_id


def test_merge_retry_bound_is_per_generation_with_backoff(table, monkeypatch):
    from lance.dataset import MergeInsertBuilder

    region = _generations(table, 3)
    real = MergeInsertBuilder.execute
    calls = []
    sleeps: list[float] = []

    def racy(self, data, **kw):
        calls.append(1)
        if len(calls) % 4:  # lose 3 races on every generation, then win
            raise OSError("Too many concurrent writers. Attempted 0 retries.")
        return real(self, data, **kw)

    monkeypatch.setattr(MergeInsertBuilder, "execute", racy)
    monkeypatch.setattr(merger.time, "sleep", sleeps.append)
    done = merger.merge(table.catalog, region, max_retries=3, batch_rows=0)
    assert [r.generation for r in done] == [1, 2, 3]  # 9 lost races in all, 3 per generation
    assert len(sleeps) == 9 and all(0 < s <= merger.BACKOFF_MAX_SECONDS for s in sleeps)
    assert len(set(sleeps)) > 1  # jittered


def test_merge_gives_up_after_max_retries_on_one_generation(table, monkeypatch):
    region = _generations(table, 1)

    def always(*a, **k):
        raise OSError("Too many concurrent writers. Attempted 0 retries.")

    monkeypatch.setattr(merger, "_commit_generation", always)
    monkeypatch.setattr(merger.time, "sleep", lambda s: None)
    with pytest.raises(CommitConflictError):
        merger.merge(table.catalog, region, max_retries=2, batch_rows=0)


def test_conflicts_are_recognised_by_type_first():
    from lance.commit import CommitConflictError as LanceConflict

    assert merger._is_conflict(LanceConflict("x", retryable=True))
    assert not merger._is_conflict(LanceConflict("concurrent", retryable=False))
    assert merger._is_conflict(OSError("Too many concurrent writers. Attempted 0 retries."))
    assert not merger._is_conflict(OSError("No such file or directory"))
    assert not merger._is_conflict(ValueError("conflict"))


def test_gc_reports_progress(tmp_path):
    """``gc(progress=...)`` is called once per deleted path with (done, total): the
    CLI's progress bar of ``memwal gc``."""
    import datetime as dt

    import lance

    import memwal_query as mq

    from helpers import basic_rows

    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    t = mq.MemWalTable.initialize(uri)
    for i in range(3):
        t.write(basic_rows([100 + i]))
        t.flush()
    t.close()
    t.maintenance.merge()
    calls = []
    removed = t.maintenance.gc(
        cleanup_older_than=dt.timedelta(0), progress=lambda d, n: calls.append((d, n))
    )
    assert removed and calls == [(i + 1, len(removed)) for i in range(len(removed))]
