"""A reader that follows a stream holds bounded memory, real Lance tables.

Many write / query / flush / merge cycles through one table object: the caches of
MemTables already flushed are dropped (not kept until 64 of them pile up), merged
generations leave the per-generation caches, and the base table's Lance session (index
and metadata caches, shared by every version the table checks out) stays within its
configured bound however many base versions the merges write.
"""

from __future__ import annotations

from typing import Any

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import lancecache
from memwal_query.maintain.policy import MaintenancePolicy
from memwal_query.read.sources import GENERATION_CACHE
from memwal_query.search.caches import clear_caches

from helpers import basic_rows

LANCE_BOUND_MB = 0.125  # index and metadata cache each
BOUND = 2 * (1 << 17)


def test_reader_caches_stay_bounded_over_write_flush_merge_cycles(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMWAL_LANCE_INDEX_CACHE_MB", str(LANCE_BOUND_MB))
    monkeypatch.setenv("MEMWAL_LANCE_METADATA_CACHE_MB", str(LANCE_BOUND_MB))
    assert sum(lancecache.cache_bounds()) == BOUND
    # the caches are process-wide: start without other tests' entries
    clear_caches()
    GENERATION_CACHE.clear()
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(100)), uri)
    ds = lance.dataset(uri)
    ds.create_scalar_index("name", "INVERTED", name="name_idx")
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"])
    merge = MaintenancePolicy(merge_over_generations=0, gc=False, compact_fragments=None)
    peaks: dict[str, int] = {}
    for cycle in range(10):
        ids = list(range(cycle * 10, cycle * 10 + 10)) + [1000 + cycle]
        t.write(basic_rows(ids, val=[float(cycle)] * len(ids)))  # the table's writer
        # queries that index the live MemTable (token postings, key hashes)
        got = t.lookup(pa.array([cycle * 10, 1000 + cycle], pa.int64()), columns=["id", "val"])
        assert got.column("val").to_pylist() == [float(cycle)] * 2
        assert t.fts_search("name", f"n{1000 + cycle}", k=3).column("id").to_pylist() == [
            1000 + cycle
        ]
        t.flush()
        if cycle % 2:
            t.maintenance.maintain(merge)  # new base versions each time
        use = mq.memory_usage(t)
        for k, v in use.items():
            peaks[k] = max(peaks.get(k, 0), v)
    # one region: its newest MemTable and the one before it at most (not one per cycle)
    assert peaks["memtable_token_indexes"] <= 2, peaks
    assert peaks["memtable_key_indexes"] <= 2, peaks
    # merged generations leave the caches; at most the two flushed since the last merge
    assert peaks["open_generations"] <= 2, peaks
    # many base versions later, the Lance caches are within their bound (on a default
    # session they grow with every version: new manifests, data files, index segments;
    # the bound is approximate: Lance's cache evicts shortly after an insert)
    assert len(lance.dataset(uri).versions()) >= 20
    assert peaks["lance_cache_bytes"] <= 1.25 * BOUND, peaks
    assert peaks["lance_cache_limit_bytes"] == BOUND
    # and the answer is right after all that
    final = t.to_table(columns=["id", "val"]).sort_by("id")
    expect = [float(i // 10) for i in range(100)] + [float(c) for c in range(10)]
    assert final.column("val").to_pylist() == expect
    t.close()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
def test_a_bad_lance_cache_bound_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MEMWAL_LANCE_INDEX_CACHE_MB", value)
    with pytest.raises(mq.MemWalError, match="MEMWAL_LANCE_INDEX_CACHE_MB"):
        lancecache.new_session()
