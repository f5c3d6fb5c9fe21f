"""Failures while the merger's own ``Update`` is prepared: its new fragments are written
in a thread of their own while the replaced rows' deletion files are written on the
caller's. Whichever fails, the merge fails with that error (the writer's when both do),
the base is unchanged, no intent is left, and a later merge makes the base the model.
(``REWRITE_MIN_BASE_ROWS`` is 0 so a small base takes that path.)
"""

from __future__ import annotations

import shutil
import threading

import lance
import pyarrow as pa
import pytest
from test_merger_lost_lease import ID_VAL, _assert_model, _table

import memwal_query as mq
from memwal_query.exceptions import GenerationGoneError, MergeFailedError
from memwal_query.maintain import mergeintent, merger


@pytest.mark.parametrize("fails", ["deletion files", "both"])
def test_a_failure_beside_the_fragment_writer(tmp_path, monkeypatch, fails):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    t, region, model = _table(str(tmp_path / "base"))
    version = lance.dataset(t.uri).version
    write = lance.fragment.write_fragments

    def refuse_deletions(*args, **kwargs):
        raise PermissionError("deletion files refused")

    def refuse_write(*args, **kwargs):
        raise OSError("No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(merger, "_delete_rows", refuse_deletions)
        if fails == "both":
            mp.setattr(lance.fragment, "write_fragments", refuse_write)
        with pytest.raises(MergeFailedError) as raised:
            t.maintenance.merge()
    (error,) = raised.value.errors.values()
    if fails == "both":
        assert type(error) is OSError and "No space left" in str(error)
    else:
        assert type(error) is PermissionError
    assert lance.fragment.write_fragments is write
    assert lance.dataset(t.uri).version == version
    assert mergeintent.pending(t.catalog) == []
    t.maintenance.merge()
    _assert_model(t, region, model)


def test_a_region_whose_rows_fail_while_the_writer_streams_them(tmp_path, monkeypatch):
    """The new fragments are written from the regions' rows as each region's are read:
    a region whose generation disappears after the writer has started fails the merge
    with that region's own typed error (not the writer's wrapping of it), nothing of
    the failed commit is left (no intent, no key twice), and the other regions are
    then merged one by one."""
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    uri = str(tmp_path / "base")
    rows = pa.table({"id": list(range(400)), "val": [float(i) for i in range(400)]}, ID_VAL)
    lance.write_dataset(rows, uri, max_rows_per_file=100)
    t = mq.MemWalTable.initialize(uri, region_spec=mq.bucket_spec(ID_VAL, "id", 4))
    t.write(pa.table({"id": list(range(0, 800, 3)), "val": [-1.0] * 267}, ID_VAL))
    t.flush()
    t.close()
    version = lance.dataset(uri).version

    writing = threading.Event()
    write, read_rows = lance.fragment.write_fragments, merger._upsert_rows
    calls: list[str] = []

    def write_started(*args, **kwargs):
        writing.set()
        return write(*args, **kwargs)

    def rows_of(table, refs, *args):
        calls.append(refs[0].uri)
        if len(calls) == 2:  # the second region, once the writer is streaming
            assert writing.wait(30)
            shutil.rmtree(refs[0].uri)
        return read_rows(table, refs, *args)

    t = mq.MemWalTable.open(uri)
    monkeypatch.setattr(lance.fragment, "write_fragments", write_started)
    monkeypatch.setattr(merger, "_upsert_rows", rows_of)
    with pytest.raises(MergeFailedError) as raised:
        t.maintenance.merge()
    assert writing.is_set()
    gone = calls[1]
    (region, error), *_ = raised.value.errors.items()
    assert list(raised.value.errors) == [region]
    assert type(error) is GenerationGoneError and gone in str(error), error
    # the regions' commit failed as a whole; the other three were then merged alone
    merged = mq.MemWalTable.open(uri).catalog.index().merged_generations()
    assert region not in merged and len(merged) == 3 and set(merged.values()) == {1}
    assert lance.dataset(uri).version > version
    assert mergeintent.pending(t.catalog) == []
    ids = lance.dataset(uri).to_table(columns=["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids))
