"""External region snapshots (> 100 regions) survive merges (real Lance tables).

A merge commit gives the MemWAL index a new uuid; eventual reads must still find the
external snapshot file (not look for ``_indices/{new uuid}/index.lance`` and fail with
ObjectNotFoundError).
"""

import datetime as dt
import os

import lance

from memwal_query.maintain import snapshots

from helpers import basic_rows, expr_table


def _regions(base_uri, n=snapshots.INLINE_THRESHOLD + 1):
    """A table with n regions (``id % n``); writers[0..2] own keys 5000, 6000, 7000."""
    table = expr_table(base_uri, f"col0 % {n}")
    first = [5000 % n, 6000 % n, 7000 % n]
    order = first + [r for r in range(n) if r not in first]
    writers = [table.writer(region_values={"r": r}) for r in order]
    writers[0].put(basic_rows([5000]))
    writers[0].flush()
    writers[1].put(basic_rows([6000]))
    writers[1].flush()
    return table, writers


def _eventual_ids(table):
    return set(table.to_table(consistency="eventual").column("id").to_pylist())


def _snapshot_file(table, uuid):
    return os.path.join(table.uri, "_indices", uuid, snapshots.SNAPSHOT_FILE)


def test_fresh_snapshot_uses_spec_layout(base_uri):
    table, writers = _regions(base_uri)
    table.maintenance.refresh_snapshots()
    idx = table.catalog.refresh_index()
    assert not idx.details.HasField("inline_snapshots")
    assert os.path.exists(_snapshot_file(table, idx.uuid))
    for w in writers:
        w.close(flush=False)


def test_eventual_reads_after_merges_and_cleanup(base_uri):
    table, writers = _regions(base_uri)
    table.maintenance.refresh_snapshots()
    before = table.catalog.refresh_index()
    assert {5000, 6000} <= _eventual_ids(table)
    merged = table.maintenance.merge(regions=[writers[0].region_id])
    assert merged.by_region() == {writers[0].region_id: [1]}
    after = table.catalog.index()
    assert after.uuid != before.uuid  # Lance gave the index a new uuid
    assert after.details.num_regions == before.details.num_regions
    # The merger carried the file forward: the spec layout holds for the new version.
    assert os.path.exists(_snapshot_file(table, after.uuid))
    assert {5000, 6000} <= _eventual_ids(table)
    table.maintenance.merge(regions=[writers[1].region_id])
    # Old versions (and Lance's copy under their uuids) cleaned up: still readable.
    table.catalog.dataset().cleanup_old_versions(older_than=dt.timedelta(0))
    assert not os.path.exists(_snapshot_file(table, before.uuid))
    assert {5000, 6000} <= _eventual_ids(table)
    for w in writers:
        w.close(flush=False)


def test_reader_finds_snapshot_when_merger_did_not_copy_it(base_uri, monkeypatch):
    """A merge committed by another merger (no copy): found under the refresh's uuid."""
    table, writers = _regions(base_uri)
    table.maintenance.refresh_snapshots()
    before = table.catalog.refresh_index()
    writers[2].put(basic_rows([7000]))  # flushed after the snapshot: not in it
    writers[2].flush()
    monkeypatch.setattr(snapshots, "carry_forward", lambda *a, **k: None)
    table.maintenance.merge(regions=[writers[0].region_id])
    after = table.catalog.index()
    assert after.uuid != before.uuid
    assert not os.path.exists(_snapshot_file(table, after.uuid))
    got = _eventual_ids(table)
    assert {5000, 6000} <= got and 7000 not in got  # read from the snapshot
    # ...and once Lance cleaned up the old uuid's directory, from the region manifests.
    lance.dataset(table.uri).cleanup_old_versions(older_than=dt.timedelta(0))
    assert not os.path.exists(_snapshot_file(table, before.uuid))
    assert {5000, 6000, 7000} <= _eventual_ids(table)
    for w in writers:
        w.close(flush=False)
