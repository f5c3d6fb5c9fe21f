"""Region pruning happens before storage is read: a point lookup routed to one region of
64 reads that region's manifest or WAL only (read/view.py ``_wanted``; a default reader
that knows the region's manifest reads the WAL position after it instead).

Storage accesses are counted on the real local FileIO of a real table.
"""

from __future__ import annotations

import os
import re

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.storage.io import LocalFileIO

from helpers import basic_rows

REGIONS = 64
_REGION_OF = re.compile(r"/_mem_wal/([0-9a-f-]{36})/(manifest|wal)")


@pytest.fixture
def bucketed(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(10)), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", REGIONS)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    t.write(basic_rows(range(1000, 1000 + 40 * REGIONS)))
    t.flush()
    t.close()
    return uri


def _manifest_regions(monkeypatch) -> set[str]:
    """The regions whose manifest or WAL directory any FileIO call touches from now on."""
    seen: set[str] = set()
    for name in ("read", "read_buffer", "exists", "size", "list", "is_dir"):
        real = getattr(LocalFileIO, name)

        def counted(self, path, *a, _real=real, **k):
            m = _REGION_OF.search(str(path))
            if m is not None:
                seen.add(m.group(1))
            return _real(self, path, *a, **k)

        monkeypatch.setattr(LocalFileIO, name, counted)
    return seen


def test_lookup_in_one_region_of_64_reads_one_manifest(bucketed, monkeypatch):
    t = mq.MemWalTable(bucketed)
    regions = [d for d in os.listdir(os.path.join(bucketed, "_mem_wal")) if len(d) == 36]
    assert len(regions) == REGIONS
    key = 1000 + 7
    warm = t.lookup(pa.array([key], pa.int64()))  # the regions' values are read once
    assert warm.column("id").to_pylist() == [key]
    seen = _manifest_regions(monkeypatch)
    got = t.lookup(pa.array([key], pa.int64()))
    assert got.column("id").to_pylist() == [key]
    assert len(seen) == 1, f"{len(seen)} regions' manifests or WALs read for a one-region lookup"
    seen.clear()
    both = t.lookup(pa.array([key, key + 1], pa.int64()))
    assert sorted(both.column("id").to_pylist()) == [key, key + 1]
    assert 1 <= len(seen) <= 2
