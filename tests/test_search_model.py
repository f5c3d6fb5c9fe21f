"""Randomized searches checked against brute force over a plain Python model.

Random puts, deletes, flushes (also of tombstone-only generations), merges and base
index rebuilds (``optimize_indices``, which records the index catch-up) over one or two
regions, on a real Lance base table with IVF and INVERTED indexes maintained in the
generations. Then every search is compared with the model (newest row per key):

- ``lookup`` of every key (deleted and unknown keys absent, newest values);
- ``vector_search`` with an ``IVF_FLAT`` base index probed in full (exact, so the ids
  must equal brute force), for k = 1, 5, 30 and more than the live rows, without and
  with filters on the newest version (SQL text and pyarrow expression); with
  ``IVF_PQ`` (approximate), that no deleted key, old version or duplicate comes back;
- ``fts_search``: with k above the match count exactly the live documents matching
  the query and filter (by their newest text), and for small k the best of those by the
  search's own global scores;
- the SQL table functions give the API's answers.
"""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_search import DIM, rows

import memwal_query as mq
from memwal_query import search
from memwal_query.regions.spec import expression_spec

WORDS = ["apple", "pear", "plum", "kiwi", "fig", "lime", "date", "peach"]
N = 300


def indexed_table(
    tmp_path, rng, n: int, index_type: str, texts, regions: int = 1
) -> tuple[mq.MemWalTable, dict]:
    """``n`` random rows (``texts(m)`` makes texts) with a vector index (``index_type``)
    and an INVERTED index, both maintained; and the model ``{id: (x, text, vec)}``. The
    table has ``regions`` regions: region ``{"r": id % regions}``."""
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    text = texts(n)
    x = rng.integers(0, 10, n).tolist()
    model = {i: (x[i], text[i], vecs[i]) for i in range(n)}
    uri = str(tmp_path / "base")
    ds = lance.write_dataset(rows(range(n), vecs, x=x, text=text), uri)
    if index_type == "IVF_FLAT":
        ds.create_index("vec", "IVF_FLAT", num_partitions=4, name="vec_idx")
    else:
        ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=4, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    spec = expression_spec(ds, ["id"], f"col0 % {regions}", "int64", field_id="r")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx"], region_spec=spec)
    return t, model


def _build(tmp_path, seed: int, index_type: str, regions: int, steps: int):
    """A table after ``steps`` random operations, its writers and the model."""
    rng = np.random.default_rng(seed)

    def texts(m: int) -> list[str]:
        return [" ".join(rng.choice(WORDS, rng.integers(1, 6))) for _ in range(m)]

    t, model = indexed_table(tmp_path, rng, N, index_type, texts, regions=regions)
    writers = [t.writer(region_values={"r": r}, max_memtable_rows=15) for r in range(regions)]
    ops = ["put", "put", "del", "flush", "merge", "reindex", "emptyflush"]
    for _ in range(steps):
        op = rng.choice(ops)
        wi = int(rng.integers(0, regions))
        w = writers[wi]

        def mine(keys: np.ndarray, wi: int = wi) -> list[int]:  # a key lives in one region
            return [k for k in keys.tolist() if k % regions == wi]

        if op == "put":
            ks = mine(rng.choice(N + 60, int(rng.integers(1, 30)), replace=False))
            vs = rng.standard_normal((len(ks), DIM)).astype(np.float32)
            ts, xs = texts(len(ks)), rng.integers(0, 10, len(ks)).tolist()
            if ks:
                w.put(rows(ks, vs, x=xs, text=ts))
            model.update({k: (xx, tt, v) for k, xx, tt, v in zip(ks, xs, ts, vs)})
        elif op == "del":
            ks = mine(rng.choice(N + 60, int(rng.integers(1, 15)), replace=False))
            if ks:
                w.delete(pa.table({"id": pa.array(ks, pa.int64())}))
            for k in ks:
                model.pop(k, None)
        elif op == "flush":
            w.flush()
        elif op == "emptyflush":  # a generation holding one tombstone of an unknown key
            w.delete(pa.table({"id": pa.array([10**6 + wi], pa.int64())}))
            w.flush()
        elif op == "merge":
            t.maintenance.merge()
        else:
            t.catalog.dataset().optimize.optimize_indices()
    return t, writers, model


def _tokens(text: str) -> set[str]:
    return {x.text for x in lance.tokenize(text)}


def _check(t: mq.MemWalTable, writers: list, model: dict, exact: bool) -> None:
    keys = sorted(model)
    got = search.lookup(t.catalog, list(range(-3, N + 80)), writers=writers)
    assert got["id"].to_pylist() == keys
    for r in got.to_pylist():
        assert (r["x"], r["text"]) == model[r["id"]][:2]
        assert np.allclose(r["vec"], model[r["id"]][2])

    mat = np.stack([model[k][2] for k in keys])
    xs = np.array([model[k][0] for k in keys])
    key_arr = np.array(keys)
    rng = np.random.default_rng(0)
    for _ in range(3):
        q = rng.standard_normal(DIM).astype(np.float32)
        dist = ((mat - q) ** 2).sum(1)
        for flt, mask in ((None, xs >= 0), ("x > 4", xs > 4), (pc.field("x") < 3, xs < 3)):
            for k in (1, 5, 30, 1000):
                res = search.vector_search(t.catalog, "vec", q, k=k, filter=flt, writers=writers)
                got_ids = res["id"].to_pylist()
                assert len(got_ids) == min(k, int(mask.sum()))
                assert len(set(got_ids)) == len(got_ids)
                for r in res.to_pylist():
                    x, text, vec = model[r["id"]]  # KeyError: a deleted key came back
                    assert (r["x"], r["text"]) == (x, text) and np.allclose(r["vec"], vec)
                    assert r["_distance"] == pytest.approx(float(((vec - q) ** 2).sum()), 1e-4)
                if exact:
                    truth = key_arr[mask][np.argsort(dist[mask], kind="stable")[:k]]
                    assert got_ids == truth.tolist()

    for query in ["apple", "pear plum", "kiwi fig fig", "date"]:
        qt = _tokens(query)
        for flt, keep in ((None, lambda x: True), ("x > 4", lambda x: x > 4)):
            match = sorted(k for k in keys if keep(model[k][0]) and qt & _tokens(model[k][1]))
            full = search.fts_search(
                t.catalog, "text", query, k=10_000, filter=flt, writers=writers
            )
            assert sorted(full["id"].to_pylist()) == match
            for r in full.to_pylist():
                assert (r["x"], r["text"]) == model[r["id"]][:2]
            best = full["_score"].to_numpy()
            for k in (1, 3, 10):
                part = search.fts_search(t.catalog, "text", query, k=k, filter=flt, writers=writers)
                assert part["_score"].to_numpy() == pytest.approx(best[:k], rel=1e-5)

    ctx = datafusion.SessionContext()
    mq.register(ctx, "ev", t, consistency="strong", writers=writers)
    search.register_search_functions(ctx, writers={"ev": writers})
    q = rng.standard_normal(DIM).astype(np.float32)
    qs = ", ".join(repr(float(v)) for v in q)
    sql = ctx.sql(f"SELECT id FROM vector_search('ev', 'vec', [{qs}], 7)").to_arrow_table()
    api = search.vector_search(t.catalog, "vec", q, k=7, writers=writers)
    assert sql["id"].to_pylist() == api["id"].to_pylist()
    sql = ctx.sql("SELECT id, _score FROM fts_search('ev', 'text', 'kiwi', 5)").to_arrow_table()
    api = search.fts_search(t.catalog, "text", "kiwi", k=5, writers=writers)
    assert sql["_score"].to_pylist() == api["_score"].to_pylist()
    probe = [1, 2, 3, N + 1, N + 2, 10**6]
    sql = ctx.sql(f"SELECT id FROM lookup('ev', {probe}) ORDER BY id").to_arrow_table()
    assert sql["id"].to_pylist() == [k for k in sorted(probe) if k in model]


@pytest.mark.parametrize(
    "seed,index_type,regions",
    # one case in the fast lane (pytest -m "not slow"), the others in the full run
    [(2, "IVF_FLAT", 1)]
    + [
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [(0, "IVF_FLAT", 1), (11, "IVF_FLAT", 1), (100, "IVF_PQ", 1)]
        + [(2, "IVF_FLAT", 2), (15, "IVF_FLAT", 2)]
    ],
)
def test_searches_match_the_model(tmp_path, seed, index_type, regions):
    t, writers, model = _build(tmp_path, seed, index_type, regions, steps=16)
    try:
        _check(t, writers, model, exact=index_type == "IVF_FLAT")
    finally:
        for w in writers:
            w.close(flush=False)
