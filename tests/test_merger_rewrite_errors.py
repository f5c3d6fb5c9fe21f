"""Failures while the merger's own ``Update`` is prepared: its new fragments are written
in a thread of their own while the replaced rows' deletion files are written on the
caller's. Whichever fails, the merge fails with that error (the writer's when both do),
the base is unchanged, no intent is left, and a later merge makes the base the model.
(``REWRITE_MIN_BASE_ROWS`` is 0 so a small base takes that path.)
"""

from __future__ import annotations

import os
import shutil
import threading

import lance
import pyarrow as pa
import pytest
from test_merger_lost_lease import ID_VAL, _assert_model, _table

import memwal_query as mq
from memwal_query.exceptions import CorruptFileError, GenerationGoneError, MergeFailedError
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


def _one_region(uri: str, rows: int = 3) -> tuple[mq.MemWalTable, str]:
    """A 100-row base and one flushed generation of ``rows`` upserts in one region."""
    lance.write_dataset(
        pa.table({"id": list(range(100)), "val": [0.0] * 100}, ID_VAL), uri, max_rows_per_file=25
    )
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": [50 + i for i in range(rows)], "val": [1.0] * rows}, ID_VAL))
    w.flush()
    w.close()
    return mq.MemWalTable.open(uri), w.region_id


def _rows_once_the_writer_streams(monkeypatch, then) -> threading.Event:
    """Make a region's rows wait until the fragment writer has started, then call
    ``then(refs)`` before reading them; the event is the writer's start."""
    writing = threading.Event()
    write, read_rows = lance.fragment.write_fragments, merger._upsert_rows

    def write_started(*args, **kwargs):
        writing.set()
        return write(*args, **kwargs)

    def rows_of(table, refs, *args):
        assert writing.wait(30)
        then(refs)
        return read_rows(table, refs, *args)

    monkeypatch.setattr(lance.fragment, "write_fragments", write_started)
    monkeypatch.setattr(merger, "_upsert_rows", rows_of)
    return writing


@pytest.mark.parametrize("how", ["generation removed", "rows disagree"])
def test_a_part_failing_while_the_writer_streams_it_raises_its_own_error(
    tmp_path, monkeypatch, how
):
    """Lance passes a stream's error on as an ``OSError`` of its text: the merge raises
    the failed part's own typed error, as it does when the part fails before the
    writer starts."""
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    uri = str(tmp_path / "base")
    t, region = _one_region(uri)
    version = lance.dataset(uri).version

    def fail(refs):
        if how == "generation removed":
            shutil.rmtree(refs[0].uri)
        else:
            raise CorruptFileError(refs[0].uri, "its rows and keys disagree")

    writing = _rows_once_the_writer_streams(monkeypatch, fail)
    kind = GenerationGoneError if how == "generation removed" else CorruptFileError
    with pytest.raises(kind):
        merger.merge(t.catalog, region_id=region)
    assert writing.is_set()
    assert lance.dataset(uri).version == version
    assert mergeintent.pending(t.catalog) == []


def test_a_failure_beside_the_writer_stops_it_and_leaves_no_files(tmp_path, monkeypatch):
    """The base scan fails while the writer waits for a region's rows: the merge fails
    with the scan's error without waiting for the rows (the stream stops), and the
    files the writer had begun are gone."""
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    uri = str(tmp_path / "base")
    t, region = _one_region(uri, rows=50_000)
    data = set(os.listdir(os.path.join(uri, "data")))
    release = threading.Event()
    held: list[bool] = []

    def scan_failed(*args, **kwargs):
        raise OSError("Not found: a base data file")

    def hold(refs):
        held.append(not release.wait(30))  # True: released only after the merge failed

    monkeypatch.setattr(merger, "_base_addresses", scan_failed)
    _rows_once_the_writer_streams(monkeypatch, hold)
    try:
        with pytest.raises(OSError, match="Not found: a base data file"):
            merger.merge(t.catalog, region_id=region)
    finally:
        release.set()
    merger._ROW_READERS.submit(lambda: None).result()  # the rows task has ended
    assert held == [False]  # the merge did not wait for the rows
    assert set(os.listdir(os.path.join(uri, "data"))) == data
    assert mergeintent.pending(t.catalog) == []


@pytest.mark.parametrize("part_fails", [False, True])
def test_an_interrupt_beside_the_writer_is_raised_as_itself(tmp_path, monkeypatch, part_fails):
    """Ctrl-C during the base scan is neither delayed until the rows are read nor
    replaced by the writer's error."""
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
    t, region = _one_region(str(tmp_path / "base"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def rows(refs):
        if part_fails:
            raise CorruptFileError(refs[0].uri, "its rows and keys disagree")

    monkeypatch.setattr(merger, "_base_addresses", interrupted)
    _rows_once_the_writer_streams(monkeypatch, rows)
    with pytest.raises(KeyboardInterrupt):
        t.maintenance.merge()
