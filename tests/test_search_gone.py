"""Searches with a read plan made before merge + GC (real Lance tables).

Reading a garbage-collected generation never surfaces as a builtin OSError from Lance:
the search retries once with a fresh plan (the rows are in the base by then), and a
plan that still names the gone generation raises GenerationGoneError.
"""

import datetime as dt

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query import search
from memwal_query.exceptions import GenerationGoneError
from memwal_query.read import view

from helpers import PK

DIM = 4
Q = np.zeros(DIM, np.float32)


def _rows(ids, dist, text):
    vecs = np.zeros((len(ids), DIM), np.float32)
    vecs[:, 0] = dist
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    flat = pa.array(vecs.reshape(-1))
    return pa.table(
        {"id": ids, "text": text, "vec": pa.FixedSizeListArray.from_arrays(flat, DIM)},
        schema=schema,
    )


@pytest.fixture
def collected(tmp_path):
    """A table whose generation 1 was read (caches warm), then merged and collected.

    Returns the table and a read plan made before the merge (it names generation 1).
    """
    uri = str(tmp_path / "base")
    n = 200
    ds = lance.write_dataset(
        _rows(list(range(n)), np.arange(n, dtype=np.float32) + 10, ["filler"] * n), uri
    )
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(_rows([11, 700], [1.0, 0.5], ["zebra one", "zebra two"]))
    w.flush()
    w.close()
    # Warm every cache on generation 1.
    assert t.lookup([11, 700]).column("id").to_pylist() == [11, 700]
    assert t.vector_search("vec", Q, k=2).column("id").to_pylist() == [700, 11]
    assert sorted(t.fts_search("text", "zebra", k=5).column("id").to_pylist()) == [11, 700]
    stale = view.resolve(t.catalog)
    assert [g.generation for r in stale.regions for g in r.generations] == [1]
    t.maintenance.merge()
    assert t.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    return t, stale


def _stale_once(monkeypatch, plan):
    real = view.resolve
    calls = []

    def resolve(*a, **k):
        calls.append(1)
        return plan if len(calls) == 1 else real(*a, **k)

    monkeypatch.setattr(view, "resolve", resolve)
    return calls


@pytest.mark.parametrize("cold", [False, True])
def test_lookup_with_stale_plan_retries(collected, monkeypatch, cold):
    t, stale = collected
    if cold:
        search.clear_caches()
    calls = _stale_once(monkeypatch, stale)
    got = t.lookup([11, 700, 5])
    assert got.column("id").to_pylist() == [11, 700, 5]
    assert got.column("text").to_pylist() == ["zebra one", "zebra two", "filler"]
    # cold: the gone generation's files are read, GenerationGoneError, a re-plan; warm:
    # its rows are answered from the cache (the rows it held: the same answer)
    assert len(calls) == (2 if cold else 1)


def test_vector_search_with_stale_plan_retries(collected, monkeypatch):
    t, stale = collected
    calls = _stale_once(monkeypatch, stale)
    got = t.vector_search("vec", Q, k=3)
    assert got.column("id").to_pylist() == [700, 11, 0]
    assert len(calls) == 2


def test_fts_search_with_stale_plan_retries(collected, monkeypatch):
    t, stale = collected
    calls = _stale_once(monkeypatch, stale)
    got = t.fts_search("text", "zebra", k=5)
    assert sorted(got.column("id").to_pylist()) == [11, 700]
    assert len(calls) == 2


def test_plan_that_keeps_naming_a_gone_generation_raises_typed_error(collected, monkeypatch):
    t, stale = collected
    monkeypatch.setattr(view, "resolve", lambda *a, **k: stale)
    search.clear_caches()  # (warm, a lookup answers from the rows cached: the same rows)
    with pytest.raises(GenerationGoneError, match="generation 1"):
        t.lookup([11, 700])
    with pytest.raises(GenerationGoneError):
        t.vector_search("vec", Q, k=3)
