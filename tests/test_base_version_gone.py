"""A base-table version cleaned up (``cleanup_old_versions``) while a read uses it.

Another process merging, compacting and running ``gc(cleanup_older_than=0)`` deletes the
data files of the version a reader planned on. Reads do not fail with Lance's bare
``OSError``/``ArrowInvalid: Not found``: scans raise the typed
``BaseVersionGoneError`` and lookups/searches re-plan once on the current version.
"""

from __future__ import annotations

import datetime as dt

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.search import pointlookup

from helpers import basic_rows


def _rewrite_and_clean(uri: str) -> None:
    """Rewrite every base fragment and delete the older versions' files."""
    ds = lance.dataset(uri)
    ds.optimize.compact_files(target_rows_per_fragment=1 << 20, materialize_deletions_threshold=0.0)
    lance.dataset(uri).cleanup_old_versions(older_than=dt.timedelta(0))


def _split_base(tmp_path) -> mq.MemWalTable:
    uri = str(tmp_path / "base")
    lance.write_dataset(basic_rows(range(50)), uri)
    lance.write_dataset(basic_rows(range(50, 100)), uri, mode="append")  # 2 fragments
    return mq.MemWalTable.initialize(uri)


def test_scan_of_a_cleaned_up_base_version_is_a_typed_error(tmp_path):
    t = _split_base(tmp_path)
    with t.writer() as w:
        w.put(basic_rows([5, 500], val=[-1.0, -2.0]))
        w.flush()
        provider = t.provider(consistency="eventual")
        fragments = provider.get_fragments()  # planned on the current base version
        _rewrite_and_clean(t.uri)
        with pytest.raises(mq.BaseVersionGoneError, match="cleaned up"):
            for frag in fragments:
                frag.scanner(columns=["id", "val"]).to_table()
        # the next query plans on the current version: right rows
        got = provider.to_table(columns=["id", "val"]).to_pydict()
        rows = dict(zip(got["id"], got["val"]))
        assert len(got["id"]) == 101 and rows[5] == -1.0 and rows[500] == -2.0


def test_lookup_replans_when_its_base_version_is_cleaned_up(tmp_path, monkeypatch):
    t = _split_base(tmp_path)
    original = pointlookup._base_lookup
    calls = []

    def racing(base, *args, **kwargs):
        if not calls:  # another process cleans up right after the plan was made
            _rewrite_and_clean(t.uri)
        calls.append(base.version)
        return original(base, *args, **kwargs)

    monkeypatch.setattr(pointlookup, "_base_lookup", racing)
    got = t.lookup(pa.array([3, 77, 1000], pa.int64()), columns=["id", "val"])
    assert got.to_pydict() == {"id": [3, 77], "val": [3.0, 77.0]}
    assert len(calls) == 2 and calls[1] > calls[0]  # re-planned on the newer version
