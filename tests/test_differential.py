"""Differential test: every reader equals a dict model after every step.

Random puts, deletes (also of the same keys again and again), flushes, merges, base
index rebuilds and GC (old base versions too) over two regions with small MemTables
(automatic flushes). After *every* step:

- SQL (DataFusion over the provider, read-your-writes) equals the model;
- ``lookup`` of every key ever used (and unknown ones) equals the model;
- exact vector search (IVF_FLAT probed in full) returns brute force's nearest ids;
- full-text search with a large k returns exactly the live matching documents;
- a *second* table object with no writers (another process) reading with
  ``consistency="latest"`` (durable WAL entries not yet flushed) equals the model too,
  by SQL and by lookup.

The Spark reader is compared with the same kind of model in ``test_spark.py``
(``test_reader_differential``), where the SparkSession lives.
"""

from __future__ import annotations

import datetime as dt

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest
from test_search import DIM, rows
from test_search_model import indexed_table

import memwal_query as mq
from memwal_query import search

WORDS = ["apple", "pear", "plum", "kiwi", "fig"]
N = 60


def _tokens(text: str) -> set[str]:
    return {x.text for x in lance.tokenize(text)}


def _check(t, other, writers, model, rng) -> None:
    keys = sorted(model)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong", writers=writers)
    got = ctx.sql("SELECT id, x, text FROM t ORDER BY id").to_arrow_table().to_pylist()
    assert [(r["id"], r["x"], r["text"]) for r in got] == [(k, *model[k][:2]) for k in keys]
    probe = list(range(-2, N + 25))
    found = search.lookup(
        t.catalog, probe, columns=["id", "x", "text"], writers=writers
    ).to_pylist()
    assert [(r["id"], r["x"], r["text"]) for r in found] == [(k, *model[k][:2]) for k in keys]
    # another process: no MemTables, but every acknowledged (durable) write
    latest = other.to_table(columns=["id", "x"], consistency="latest").sort_by("id")
    assert latest["id"].to_pylist() == keys
    assert latest["x"].to_pylist() == [model[k][0] for k in keys]
    far = other.lookup(probe, columns=["id", "x"], consistency="latest")
    assert far["id"].to_pylist() == keys
    if not keys:
        return
    mat = np.stack([model[k][2] for k in keys])
    q = rng.standard_normal(DIM).astype(np.float32)
    dist = ((mat - q) ** 2).sum(1)
    res = search.vector_search(t.catalog, "vec", q, k=5, writers=writers, nprobes=4)
    truth = np.array(keys)[np.argsort(dist, kind="stable")[:5]]
    assert res["id"].to_pylist() == truth.tolist()
    word = str(rng.choice(WORDS))
    match = sorted(k for k in keys if _tokens(word) & _tokens(model[k][1]))
    full = search.fts_search(t.catalog, "text", word, k=1000, writers=writers)
    assert sorted(full["id"].to_pylist()) == match


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 7])
def test_every_reader_equals_the_model(tmp_path, seed):
    rng = np.random.default_rng(seed)

    def texts(m: int) -> list[str]:
        return [" ".join(rng.choice(WORDS, rng.integers(1, 4))) for _ in range(m)]

    t, model = indexed_table(tmp_path, rng, N, "IVF_FLAT", texts, regions=2)
    writers = [t.writer(region_values={"r": r}, max_memtable_rows=12) for r in range(2)]
    other = mq.MemWalTable.open(t.uri)
    hot = rng.choice(N + 20, 12, replace=False)  # keys updated and deleted again and again
    ops = ["put", "put", "put", "del", "del", "flush", "merge", "reindex", "gc"]
    for _step in range(36):
        op = str(rng.choice(ops))
        wi = int(rng.integers(0, 2))
        w = writers[wi]

        def mine(keys, wi=wi) -> list[int]:  # a key lives in one region
            return sorted({int(k) for k in keys if k % 2 == wi})

        pool = np.concatenate([hot, rng.choice(N + 20, 6)])
        if op == "put":
            ks = mine(rng.choice(pool, int(rng.integers(1, 10))))
            if ks:
                vs = rng.standard_normal((len(ks), DIM)).astype(np.float32)
                ts, xs = texts(len(ks)), rng.integers(0, 10, len(ks)).tolist()
                w.put(rows(ks, vs, x=xs, text=ts))
                model.update({k: (xx, tt, v) for k, xx, tt, v in zip(ks, xs, ts, vs)})
        elif op == "del":
            ks = mine(rng.choice(pool, int(rng.integers(1, 6))))
            if ks:
                w.delete(pa.table({"id": pa.array(ks, pa.int64())}))
                for k in ks:
                    model.pop(k, None)
        elif op == "flush":
            w.flush()
        elif op == "merge":
            t.maintenance.merge()
        elif op == "reindex":
            t.catalog.dataset().optimize.optimize_indices()
        else:
            t.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
        _check(t, other, writers, model, rng)
    for w in writers:
        w.close()
