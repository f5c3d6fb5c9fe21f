"""A merger whose index lock was lost never leaves a batch's rows twice in the base.

The merger's own ``Update`` (on a large base with an integer key; here
``REWRITE_MIN_BASE_ROWS`` is 0) carries no progress marker, so Lance rebases it over
concurrent commits that touch none of its fragments. A merger whose lock was lost (a
lease taken over after it stalled) plans its Update, another merger merges the same
batch of new keys meanwhile, then the first commits. The other merger takes either path:
its own Update (both Updates rewrite the sentinel fragment: Lance refuses the second) or
``merge_insert`` (touches none of the first's fragments: Lance rebases the first, and the
merger removes its rows again, or, killed right after its commit, the next merge or
maintenance pass does, from the intent it recorded).

Every check compares the plain Lance table (``lance.dataset(uri).to_table()``) and the
MemWAL view with a dict model of the newest row per key.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys

import lance
import pyarrow as pa
import pytest
from lance.dataset import Transaction

import memwal_query as mq
from memwal_query.maintain import mergeintent, merger
from memwal_query.maintain.basefiles import compact_base
from memwal_query.maintain.policy import MaintenancePolicy

from helpers import PK

ID_VAL = pa.schema(
    [pa.field("id", pa.int64(), nullable=False, metadata=PK), pa.field("val", pa.float64())]
)
NEW_KEYS = [500, 501]


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)


def _table(uri: str) -> tuple[mq.MemWalTable, str, dict]:
    """A base of keys 0-99 in four fragments and one flushed generation of new keys;
    the table, its region and the model."""
    rows = pa.table({"id": list(range(100)), "val": [float(i) for i in range(100)]}, ID_VAL)
    lance.write_dataset(rows, uri, max_rows_per_file=25)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": NEW_KEYS, "val": [1.0] * len(NEW_KEYS)}, ID_VAL))
    w.flush()
    w.close()
    model = {i: float(i) for i in range(100)} | dict.fromkeys(NEW_KEYS, 1.0)
    return t, w.region_id, model


def _rows(rows: pa.Table) -> dict:
    """``{id: val}``; every key once."""
    out: dict = {}
    for r in rows.to_pylist():
        assert r["id"] not in out, f"key {r['id']} twice"
        out[r["id"]] = r["val"]
    return out


def _keys_twice(uri: str) -> list[int]:
    ids = lance.dataset(uri).to_table(columns=["id"]).column("id").to_pylist()
    return sorted({k for k in ids if ids.count(k) > 1})


def _assert_model(t: mq.MemWalTable, region: str, model: dict) -> None:
    assert mq.MemWalTable.open(t.uri).catalog.index().merged_generations() == {region: 1}
    assert _rows(lance.dataset(t.uri).to_table()) == model
    assert _rows(mq.MemWalTable.open(t.uri).to_table()) == model
    assert mergeintent.pending(t.catalog) == []


@pytest.mark.parametrize("other", ["update", "merge_insert"])
def test_a_merger_whose_lock_was_lost_does_not_apply_a_merged_batch_twice(
    tmp_path, rewrite, monkeypatch, other
):
    """The stalled merger commits after the other merged its batch: its Update is
    refused (the other's Update changed the sentinel fragment) or rebased and then
    removed again; either way a lost race, re-planned, and every key is once."""
    t, region, model = _table(str(tmp_path / "base"))
    held = merger.index_lock
    write = lance.fragment.write_fragments
    settled: list = []
    real_settle = mergeintent.settle

    def settle(*args, **kwargs):
        settled.append(real_settle(*args, **kwargs))
        return settled[-1]

    def stalled(*args, **kwargs):
        out = write(*args, **kwargs)
        with monkeypatch.context() as mp:  # the lease's new holder merges the batch
            mp.setattr(lance.fragment, "write_fragments", write)
            mp.setattr(merger, "index_lock", held)
            if other == "merge_insert":
                mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 10**9)
            mq.MemWalTable.open(t.uri).maintenance.merge()
        assert _keys_twice(t.uri) == []
        monkeypatch.setattr(lance.fragment, "write_fragments", write)
        return out

    monkeypatch.setattr(mergeintent, "settle", settle)
    monkeypatch.setattr(merger, "index_lock", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(lance.fragment, "write_fragments", stalled)
    before = lance.dataset(t.uri).version
    merged = t.maintenance.merge()
    assert merged.merged == []  # the other merger merged it
    if other == "update":
        assert settled == [None]  # the other's Update; ours refused before it landed
    else:
        assert len(settled) == 1 and settled[0] is not None  # rebased, then removed
        undo = lance.dataset(t.uri).read_transaction(settled[0])
        assert len(undo.operation.removed_fragment_ids) == 1
    assert lance.dataset(t.uri).version > before
    _assert_model(t, region, model)


KILLED_AFTER_UPDATE = """
import contextlib, sys
import lance
import memwal_query as mq
from memwal_query.maintain import merger
merger.REWRITE_MIN_BASE_ROWS = 0
uri, lost = sys.argv[1], sys.argv[2] == "lost"
held, write = merger.index_lock, lance.fragment.write_fragments

def stalled(*args, **kwargs):
    out = write(*args, **kwargs)
    lance.fragment.write_fragments = write
    merger.index_lock, merger.REWRITE_MIN_BASE_ROWS = held, 10**9
    mq.MemWalTable.open(uri).maintenance.merge()  # the lease's new holder: merge_insert
    merger.index_lock = lambda *a, **k: contextlib.nullcontext()
    merger.REWRITE_MIN_BASE_ROWS = 0
    return out

if lost:
    merger.index_lock = lambda *a, **k: contextlib.nullcontext()
    lance.fragment.write_fragments = stalled
mq.MemWalTable.open(uri).maintenance.merge()
print("not killed", flush=True)
"""


def _killed_after_update(uri: str, lock: str) -> tuple[mq.MemWalTable, str, dict]:
    """:func:`_table`, then a merger killed right after its Update (its lock ``"lost"``
    or ``"held"``), the state checked."""
    t, region, model = _table(uri)
    p = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_UPDATE, t.uri, lock],
        env={**os.environ, "MEMWAL_CRASH_AT": "merge.after_update"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    assert len(mergeintent.pending(t.catalog)) == 1
    if lock == "lost":  # the state the intent repairs: every new key twice
        assert _keys_twice(t.uri) == NEW_KEYS
        assert t.catalog.index().merged_generations() == {region: 1}
    else:
        assert _keys_twice(t.uri) == []
        assert t.catalog.index().merged_generations() == {}
    return t, region, model


@pytest.mark.parametrize("then", ["merge", "maintain", "compact"])
@pytest.mark.parametrize("lock", ["lost", "held"])
def test_a_merger_killed_right_after_its_update_leaves_no_row_twice(tmp_path, lock, then):
    """A merger killed (SIGKILL) right after its Update commits, before it checks it.
    With its lock lost, the Update was rebased over the other merger's merge of the same
    batch and its rows are in the base twice; the intent it recorded is left, and the
    next merge or maintenance pass removes them. With its lock held, the Update is the
    batch's own: the next pass keeps it and merges the batch again, every key once."""
    t, region, model = _killed_after_update(str(tmp_path / "base"), lock)
    t2 = mq.MemWalTable.open(t.uri)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
        if then == "merge":
            t2.maintenance.merge()
        elif then == "compact":  # before any merge: the rows are removed, not compacted
            compact_base(t2.catalog)
            assert _rows(lance.dataset(t.uri).to_table()) == model
            t2.maintenance.merge()
        else:
            report = t2.maintenance.maintain(MaintenancePolicy(merge_over_generations=0))
            assert not report.errors
    _assert_model(t, region, model)


@pytest.mark.parametrize("lock", ["lost", "held"])
def test_an_update_whose_version_was_cleaned_up_is_settled_by_its_rows(tmp_path, lock):
    """The killed merger's Update is no longer in the history (every older version
    cleaned up before the next pass): its rows tell whether it was applied over a merge
    of its batch (a key of theirs has another live row) and are removed if so."""
    t, region, model = _killed_after_update(str(tmp_path / "base"), lock)
    update = lance.dataset(t.uri).version
    lance.dataset(t.uri).create_scalar_index("val", "BTREE")  # a later version
    ds = lance.dataset(t.uri)
    ds.cleanup_old_versions(older_than=dt.timedelta(0))
    with pytest.raises(OSError):
        ds.read_transaction(update)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
        mq.MemWalTable.open(t.uri).maintenance.merge()
    _assert_model(t, region, model)


def test_an_update_still_in_flight_is_fenced_off(tmp_path, rewrite, monkeypatch):
    """Repair meets an intent whose Update has not committed (its merger stalled
    between recording it and committing): it commits the sentinel's no-op, so the
    Update, when it comes, is refused; the merger re-plans and merges the batch once."""
    t, region, model = _table(str(tmp_path / "base"))
    commit = lance.LanceDataset.commit
    fenced: list[int] = []

    def repair_first(base, operation, *args, **kwargs):
        if not fenced and isinstance(operation, Transaction):
            assert len(mergeintent.pending(t.catalog)) == 1
            assert mergeintent.repair(mq.MemWalTable.open(t.uri).catalog) == []
            assert mergeintent.pending(t.catalog) == []
            fenced.append(lance.dataset(t.uri).version)
        return commit(base, operation, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(repair_first))
    before = lance.dataset(t.uri).version
    merged = t.maintenance.merge()
    assert merged.by_region() == {region: [1]}
    assert fenced == [before + 1]  # the fence, then the batch's Update and marker
    fence = lance.dataset(t.uri).read_transaction(before + 1)
    assert fence.operation.new_fragments == [] and len(fence.operation.updated_fragments) == 1
    _assert_model(t, region, model)


def test_settling_again_changes_nothing(tmp_path, rewrite, monkeypatch):
    """An intent settled (its rows removed) but left (a merger killed before removing
    it) is settled again by the next pass without another commit."""
    t, region, model = _table(str(tmp_path / "base"))
    kept: list = []
    real_settle = mergeintent.settle

    def settle(table, intent, version):
        kept.append((intent, version))
        return real_settle(table, intent, version)

    monkeypatch.setattr(mergeintent, "settle", settle)
    t.maintenance.merge()
    ((intent, version),) = kept
    t.catalog.io.write(mergeintent._intent_path(t.uri, intent.txn), intent.to_json())
    after = lance.dataset(t.uri).version
    assert mergeintent.repair(t.catalog) == []
    assert lance.dataset(t.uri).version == after
    _assert_model(t, region, model)


def test_a_corrupt_intent_is_a_typed_error_naming_it(tmp_path, rewrite):
    t, _, _ = _table(str(tmp_path / "base"))
    path = mergeintent._intent_path(t.uri, "x")
    t.catalog.io.write(path, b"{not json")
    with pytest.raises(mq.exceptions.CorruptFileError, match="x.json"):
        mergeintent.repair(t.catalog)
