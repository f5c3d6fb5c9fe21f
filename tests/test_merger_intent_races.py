"""``repair`` racing the merger whose intent it settles (a merger whose lock was lost
goes on after another pass took over): the intent removed between the listing and its
read, and the undo of a rebased Update committed by both. Each time the pass goes on
and every key is once. (``REWRITE_MIN_BASE_ROWS`` is 0 so a small base takes the
merger's own Update.)
"""

from __future__ import annotations

import lance
import pytest
from lance.dataset import LanceOperation
from test_merger_lost_lease import _assert_model, _keys_twice, _killed_after_update, _table
from test_merger_sentinel import record_intents

import memwal_query as mq
from memwal_query.maintain import mergeintent, merger


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)


def test_an_intent_removed_before_it_is_read_is_settled(tmp_path, rewrite, monkeypatch):
    """The intent's merger settles and removes it after repair listed it, before repair
    reads it: nothing is left to settle, and the merge goes on."""
    t, region, model = _table(str(tmp_path / "base"))
    with monkeypatch.context() as mp:
        kept = record_intents(mp)
        t.maintenance.merge()
    (intent,) = kept
    path = mergeintent._intent_path(t.uri, intent.txn)
    io = t.catalog.io
    io.write(path, intent.to_json())
    real_read = io.read

    def read(p):
        if p == path:
            io.delete(p)  # the other merger, done with it
        return real_read(p)

    monkeypatch.setattr(io, "read", read)
    assert mergeintent.repair(t.catalog) == []
    _assert_model(t, region, model)


def test_an_undo_committed_meanwhile_by_the_killed_mergers_twin(tmp_path, monkeypatch):
    """Repair settles a rebased Update (its rows twice) while the merger that made it,
    still running, commits the same undo first: repair's undo finds nothing left to
    remove, the intent goes, and the merge pass goes on."""
    t, region, model = _killed_after_update(str(tmp_path / "base"), "lost")
    commit = lance.LanceDataset.commit
    twins: list[int] = []

    def undo_first(base, operation, *args, **kwargs):
        op = operation
        if not twins and isinstance(op, LanceOperation.Update) and op.removed_fragment_ids:
            if not op.new_fragments and not op.updated_fragments:
                latest = lance.dataset(t.uri)
                twins.append(commit(latest, op, read_version=latest.version).version)
        return commit(base, operation, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(undo_first))
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    mq.MemWalTable.open(t.uri).maintenance.merge()
    assert twins  # the twin's undo landed first
    assert _keys_twice(t.uri) == []
    _assert_model(t, region, model)
