"""Caches of merged generations are dropped (memwal_query.search.forget), real Lance tables.

Under a stream the per-generation caches (opened generations, token indexes, decoded
columns) would otherwise keep every generation ever read until their count bounds
evicted it; a lookup or search that resolves a base version forgets the generations
that version has merged, and answers (also of a view pinned before the merge) stay right.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

import memwal_query as mq
from memwal_query.maintain.policy import MaintenancePolicy
from memwal_query.read.pointview import KEY_INDEXES
from memwal_query.read.sources import GENERATION_CACHE
from memwal_query.search.caches import GENERATION_TOKEN_INDEXES, OPEN_GENERATIONS
from memwal_query.search.forget import forget_merged

from helpers import basic_rows


def _cached(uri: str) -> set[str]:
    keys = set(OPEN_GENERATIONS._items) | {k[0] for k in GENERATION_TOKEN_INDEXES._items}
    keys |= set(GENERATION_CACHE._items) | set(KEY_INDEXES._items)
    return {k for k in keys if k.startswith(uri)}


def test_merged_generations_leave_the_caches(tmp_path: Any) -> None:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(10)), uri)
    ds = lance.dataset(uri)
    ds.create_scalar_index("name", "INVERTED", name="name_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"])
    w = t.writer()
    for ids in ([1, 2], [2, 3], [4]):
        w.put(basic_rows(ids, val=[-float(i) for i in ids]))
        w.flush()
    keys = pa.array([1, 2, 3, 4, 5], pa.int64())
    before = t.lookup(keys, columns=["id", "val"]).sort_by("id")
    t.fts_search("name", "n2", k=3)
    assert t.to_table(filter=pc.field("id").isin([1, 2, 3, 4])).num_rows == 4  # key-pinned
    assert len([k for k in KEY_INDEXES._items if k.startswith(t.uri)]) == 3
    cached = _cached(t.uri)
    assert len({k.rsplit("/", 1)[1] for k in cached}) == 3, cached  # all three generations
    time.sleep(0.01)
    moment = dt.datetime.now(dt.timezone.utc)
    time.sleep(0.01)
    assert t.maintenance.merge(max_generations=2).merged  # generations 1 and 2
    after = t.lookup(keys, columns=["id", "val"]).sort_by("id")
    assert after.equals(before)
    left = {k.rsplit("/", 1)[1] for k in _cached(t.uri)}
    assert left == {k.rsplit("/", 1)[1] for k in cached if k.endswith("_gen_3")}, left
    # a lookup of the moment before the merge reads generations 1-2 again
    old = t.lookup(keys, columns=["id", "val"], as_of=moment).sort_by("id")
    assert old.equals(before)
    # the same merge progress again: nothing to do; another table's uri: untouched
    assert forget_merged(t.uri, t.catalog.index().merged_generations()) == 0
    assert forget_merged(str(tmp_path / "other"), {"x": 99}) == 0
    # a maintenance pass that merges forgets what its merger read
    t.maintenance.maintain(
        MaintenancePolicy(merge_over_generations=0, gc=False, compact_fragments=None)
    )
    assert _cached(t.uri) == set()
    w.close()
