"""The sentinel fragment of the merger's own ``Update`` on the bases it meets.

Every such Update also lists the base fragment with the lowest id, unchanged (see
``memwal_query/maintain/mergeintent.py``). Here the lowest fragment already has a
deletion file, is emptied by the same Update, is not fragment 0 (after a compaction), or
the schema evolved; each time the Update lists it exactly as the version it was planned
on has it (its files, deletion file and index coverage), an Update planned before is
refused, and the plain Lance table and the MemWAL view are the model. ``repair`` with
nothing pending costs one listing: no lock, no commit, nothing written.
(``REWRITE_MIN_BASE_ROWS`` is 0 so a small base takes that path.)
"""

from __future__ import annotations

import uuid

import lance
import pyarrow as pa
import pytest
from lance.commit import CommitConflictError
from lance.dataset import Transaction
from test_merger_lost_lease import _rows

import memwal_query as mq
from memwal_query.maintain import mergeintent, merger
from memwal_query.maintain.basefiles import compact_base

from helpers import PK

ID_VAL = pa.schema(
    [pa.field("id", pa.int64(), nullable=False, metadata=PK), pa.field("val", pa.float64())]
)


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)


def _table(uri: str, n: int = 100) -> tuple[mq.MemWalTable, dict]:
    """Keys 0..n-1 in fragments of 25 rows, BTREEs on ``id`` and ``val``."""
    rows = pa.table({"id": list(range(n)), "val": [float(i) for i in range(n)]}, ID_VAL)
    ds = lance.write_dataset(rows, uri, max_rows_per_file=25)
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("val", "BTREE")
    return mq.MemWalTable.initialize(uri), {i: float(i) for i in range(n)}


def _merge(t: mq.MemWalTable, model: dict, puts: list[int], deletes: list[int], val: float):
    """One flushed generation, merged through the Update; the Update's transaction."""
    w = t.writer()
    if puts:
        rows = pa.table({"id": puts, "val": [val] * len(puts)}, ID_VAL)
        for field in t.schema:  # columns added since: NULL
            if field.name not in rows.column_names:
                rows = rows.append_column(field, pa.nulls(len(puts), field.type))
        w.put(rows)
    if deletes:
        w.delete(pa.table({"id": pa.array(deletes, pa.int64())}))
    w.flush()
    w.close()
    model.update(dict.fromkeys(puts, val))
    for k in deletes:
        model.pop(k, None)
    before = lance.dataset(t.uri).version
    t.maintenance.merge()
    ds = lance.dataset(t.uri)
    assert ds.version == before + 2  # the Update, then the marker
    return ds.read_transaction(before + 1), lance.dataset(t.uri, version=before)


def record_intents(monkeypatch) -> list:
    """The intents :func:`mergeintent.settle` settles from now on, in order."""
    intents: list = []
    real = mergeintent.settle

    def settle(table, intent, version):
        intents.append(intent)
        return real(table, intent, version)

    monkeypatch.setattr(mergeintent, "settle", settle)
    return intents


def _check(t: mq.MemWalTable, model: dict) -> None:
    assert _rows(lance.dataset(t.uri).to_table(columns=["id", "val"])) == model
    assert _rows(mq.MemWalTable.open(t.uri).to_table(columns=["id", "val"])) == model
    assert mergeintent.pending(t.catalog) == []


def _meta(frag) -> tuple:
    d = frag.deletion_file
    return (
        frag.id,
        [f.path for f in frag.files],
        frag.physical_rows,
        None if d is None else (d.file_type, d.read_version, d.id, d.num_deleted_rows),
    )


def _sentinel_listed_unchanged(txn, planned: lance.LanceDataset) -> int:
    """The lowest fragment of ``planned`` is among the Update's updated fragments (as
    ``planned`` has it) or removed fragments; its id."""
    low = min(f.fragment_id for f in planned.get_fragments())
    updated = {f.id: f for f in txn.operation.updated_fragments}
    if low in txn.operation.removed_fragment_ids:
        assert low not in updated
    else:
        assert low in updated
        if low not in _touched_rows(txn, planned):
            assert _meta(updated[low]) == _meta(planned.get_fragment(low).metadata)
    return low


def _touched_rows(txn, planned) -> set[int]:
    """Fragments whose deletion file the Update changed."""
    return {
        f.id
        for f in txn.operation.updated_fragments
        if _meta(f) != _meta(planned.get_fragment(f.id).metadata)
    }


def _refused_when_planned_on(planned: lance.LanceDataset) -> None:
    """Another Update planned on ``planned`` with the same sentinel is refused."""
    low = min(planned.get_fragments(), key=lambda f: f.fragment_id).metadata
    op = lance.LanceOperation.Update(
        removed_fragment_ids=[], updated_fragments=[low], new_fragments=[]
    )
    with pytest.raises(CommitConflictError):
        lance.LanceDataset.commit(planned, Transaction(planned.version, op, str(uuid.uuid4())))


def _index_covers(uri: str, fragment: int) -> None:
    for d in lance.dataset(uri).describe_indices():
        if d.name in ("id_idx", "val_idx"):
            assert any(fragment in s.fragment_ids for s in d.segments), d


def test_sentinel_with_a_deletion_file(tmp_path, rewrite):
    """The lowest fragment got a deletion file from an earlier batch; a batch touching
    only another fragment lists it with that very deletion file."""
    t, model = _table(str(tmp_path / "base"))
    txn, planned = _merge(t, model, [500], [3], 1.0)
    assert 0 in _touched_rows(txn, planned)
    assert lance.dataset(t.uri).get_fragment(0).metadata.deletion_file is not None
    txn, planned = _merge(t, model, [90, 501], [], 2.0)
    assert _sentinel_listed_unchanged(txn, planned) == 0
    assert _touched_rows(txn, planned) == {3}
    _refused_when_planned_on(planned)
    _index_covers(t.uri, 0)
    _check(t, model)


def test_sentinel_emptied_by_the_same_update(tmp_path, rewrite, monkeypatch):
    """The batch deletes every row of the lowest fragment: the Update removes it (not
    also listed as updated), and the intent names it as its sentinel."""
    t, model = _table(str(tmp_path / "base"))
    intents = record_intents(monkeypatch)
    txn, planned = _merge(t, model, [600], list(range(25)), 1.0)
    assert txn.operation.removed_fragment_ids == [0]
    assert _sentinel_listed_unchanged(txn, planned) == 0
    assert [i.sentinel for i in intents] == [0]
    assert lance.dataset(t.uri).get_fragment(0) is None
    # the next batch's sentinel is the new lowest fragment
    txn, planned = _merge(t, model, [601], [], 2.0)
    assert _sentinel_listed_unchanged(txn, planned) == 1
    _refused_when_planned_on(planned)
    _check(t, model)


def test_sentinel_after_a_compaction(tmp_path, rewrite):
    """After a compaction the lowest fragment id is not 0: the sentinel is the lowest."""
    t, model = _table(str(tmp_path / "base"))
    _merge(t, model, [500], [1, 30, 60], 1.0)
    compact_base(t.catalog)
    low = min(f.fragment_id for f in lance.dataset(t.uri).get_fragments())
    assert low > 0
    txn, planned = _merge(t, model, [99, 502], [], 2.0)
    assert _sentinel_listed_unchanged(txn, planned) == low
    _refused_when_planned_on(planned)
    _check(t, model)


def test_sentinel_after_a_column_is_added(tmp_path, rewrite):
    """A column added since the lowest fragment was written (its data files lack it):
    the Update lists the fragment as the evolved version has it."""
    t, model = _table(str(tmp_path / "base"))
    t.alter.add_columns([pa.field("extra", pa.string())])
    t = mq.MemWalTable.open(t.uri)
    txn, planned = _merge(t, model, [90, 500], [], 1.0)
    assert _sentinel_listed_unchanged(txn, planned) == 0
    _refused_when_planned_on(planned)
    _check(t, model)
    assert lance.dataset(t.uri).to_table(columns=["extra"]).column(0).null_count == len(model)


def test_repair_with_nothing_pending_is_one_listing(tmp_path, rewrite, monkeypatch):
    """No intent: no lock, no commit, nothing written (the directory stays absent)."""
    t, model = _table(str(tmp_path / "base"))
    _merge(t, model, [500], [], 1.0)
    calls: list[str] = []
    io = t.catalog.io
    for name in ("list", "read", "write", "delete", "exists"):
        real = getattr(io, name)
        monkeypatch.setattr(
            io, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1]
        )
    monkeypatch.setattr(mergeintent, "index_lock", None)  # taking it would fail
    version = lance.dataset(t.uri).version
    assert mergeintent.repair(t.catalog) == []
    assert calls == ["list"]
    assert lance.dataset(t.uri).version == version
    _check(t, model)


MAINTAIN = """
import sys
import memwal_query as mq
from memwal_query.maintain import merger
from memwal_query.maintain.policy import MaintenancePolicy
merger.REWRITE_MIN_BASE_ROWS = 0
sys.stdin.readline()  # both processes start together
report = mq.MemWalTable.open(sys.argv[1]).maintenance.maintain(
    MaintenancePolicy(merge_over_generations=0)
)
assert not report.errors, report.errors
"""


@pytest.mark.slow
def test_two_processes_maintain_over_a_killed_mergers_rows_twice(tmp_path):
    """A merger whose lock was lost is killed right after its rebased Update (its rows
    in the base twice, its intent left); two processes then run maintain() at once:
    one settles the intent, the other finds none, and every key is once."""
    import subprocess
    import sys

    from test_merger_lost_lease import _assert_model, _killed_after_update

    t, region, model = _killed_after_update(str(tmp_path / "base"), "lost")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MAINTAIN, t.uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    _assert_model(t, region, model)
