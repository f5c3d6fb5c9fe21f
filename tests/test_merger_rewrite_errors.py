"""Failures while the merger's own ``Update`` is prepared: its new fragments are written
in a thread of their own while the replaced rows' deletion files are written on the
caller's. Whichever fails, the merge fails with that error (the writer's when both do),
the base is unchanged, no intent is left, and a later merge makes the base the model.
(``REWRITE_MIN_BASE_ROWS`` is 0 so a small base takes that path.)
"""

from __future__ import annotations

import lance
import pytest
from test_merger_lost_lease import _assert_model, _table

from memwal_query.exceptions import MergeFailedError
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
