"""Vector search over many unmerged generations as one block.

The block path (every generation read once, deduplicated, searched exactly) must give
the answer of exact search over the deduplicated table: updates in later generations,
deletes, keys of two regions, MemTables newer than every generation.
"""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query import search
from memwal_query.search import genblock

PK = {"lance-schema:unenforced-primary-key": "true"}
DIM = 4
SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), False, PK), pa.field("vec", pa.list_(pa.float32(), DIM))]
)


def _rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    vecs = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    flat = pa.array(vecs.ravel(), pa.float32())
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "vec": pa.FixedSizeListArray.from_arrays(flat, DIM)},
        schema=SCHEMA,
    )


def _exact(t: mq.MemWalTable, q: np.ndarray, k: int, writers: list) -> list[int]:
    live = t.to_table(columns=["id", "vec"], writers=writers)
    mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
    d = ((mat - q) ** 2).sum(1)
    ids = live.column("id").to_numpy()
    return ids[np.lexsort((ids, d))][:k].tolist()


def test_block_equals_exact_search_over_the_deduplicated_table(tmp_path):
    rng = np.random.default_rng(3)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(300), rng), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    for _ in range(4):  # 4 generations per region: updates, new keys, deletes
        t.write(_rows(rng.choice(400, 60, replace=False), rng))
        t.flush()
        t.delete(pa.table({"id": pa.array(rng.choice(400, 10, replace=False), pa.int64())}))
        t.flush()
    t.write(_rows(rng.choice(400, 30, replace=False), rng))  # MemTables, newest
    writers = t.writers()
    try:
        for q in rng.standard_normal((8, DIM)).astype(np.float32):
            dbg: dict = {}
            got = t.vector_search("vec", q, k=25, debug=dbg)
            assert got["id"].to_pylist() == _exact(t, q, 25, writers)
            kinds = {s["kind"] for s in dbg["sources"]}
            assert "block" in kinds and "generation" not in kinds
            d = got["_distance"].to_numpy()
            assert (np.diff(d) >= 0).all()
        # a filter is evaluated on the block too: same answer
        q = rng.standard_normal(DIM).astype(np.float32)
        dbg = {}
        flt = t.vector_search("vec", q, k=25, filter="id >= 0", debug=dbg)
        assert "block" in {s["kind"] for s in dbg["sources"]}
        assert flt["id"].to_pylist() == t.vector_search("vec", q, k=25)["id"].to_pylist()
    finally:
        t.close()


def test_block_is_not_used_below_its_thresholds(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(50), rng), uri)
    t = mq.MemWalTable.initialize(uri)
    for _ in range(4):
        t.write(_rows(rng.choice(60, 20, replace=False), rng))
        t.flush()
    t.close()
    q = np.zeros(DIM, np.float32)
    dbg: dict = {}
    blocked = t.vector_search("vec", q, k=10, debug=dbg)
    assert [s["kind"] for s in dbg["sources"]] == ["base", "block"]
    monkeypatch.setattr(genblock, "BLOCK_MAX_ROWS", 10)  # too many rows: one by one
    search.clear_caches()  # the block of these generations is cached
    dbg = {}
    single = t.vector_search("vec", q, k=10, debug=dbg)
    assert [s["kind"] for s in dbg["sources"]].count("generation") == 4
    assert blocked["id"].to_pylist() == single["id"].to_pylist()
    assert blocked["_distance"].to_pylist() == single["_distance"].to_pylist()


def test_full_text_block_equals_the_per_generation_path(tmp_path):
    rng = np.random.default_rng(5)
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("text", pa.string())])
    words = np.array(["apple", "pear", "plum", "fig", "kiwi", "lime"])

    def rows(ids: np.ndarray) -> pa.Table:
        text = [" ".join(w) for w in words[rng.integers(0, len(words), (len(ids), 3))].tolist()]
        return pa.table({"id": pa.array(ids, pa.int64()), "text": text}, schema=schema)

    t = _two_regions_with_text(tmp_path, rows, rng, keys=260, upserts=40)
    try:
        live = t.to_table(writers=t.writers())
        for word in ["apple", "kiwi lime", "fig"]:
            dbg: dict = {}
            got = t.fts_search("text", word, k=500, debug=dbg)
            assert "block" in {s["kind"] for s in dbg["sources"]}
            # every live row containing a query word, once, with its newest text
            want = {
                i
                for i, x in zip(live["id"].to_pylist(), live["text"].to_pylist())
                if set(x.split()) & set(word.split())
            }
            assert sorted(got["id"].to_pylist()) == sorted(want)
            newest = dict(zip(live["id"].to_pylist(), live["text"].to_pylist()))
            assert all(
                newest[i] == x for i, x in zip(got["id"].to_pylist(), got["text"].to_pylist())
            )
            dbg = {}
            one = t.fts_search("text", word, k=500, filter="id >= 0", debug=dbg)
            assert "block" in {s["kind"] for s in dbg["sources"]}
            assert sorted(one["id"].to_pylist()) == sorted(want)
    finally:
        t.close()


def _cat_table(tmp_path, rng: np.random.Generator):
    """A table whose ``cat`` changes between versions of a key: base, 2 regions x 3
    generations (updates, deletes) and MemTables (newest)."""
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("cat", pa.int64()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
            pa.field("text", pa.string()),
        ]
    )
    words = np.array(["apple", "pear", "plum", "fig"])

    def rows(ids: np.ndarray) -> pa.Table:
        vecs = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        text = [" ".join(w) for w in words[rng.integers(0, len(words), (len(ids), 2))].tolist()]
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "cat": pa.array(rng.integers(0, 4, len(ids)), pa.int64()),
                "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM),
                "text": text,
            },
            schema=schema,
        )

    return _two_regions_with_text(tmp_path, rows, rng, keys=240, upserts=80)


def _two_regions_with_text(tmp_path, rows, rng: np.random.Generator, keys: int, upserts: int):
    """Base of 200 keys with an INVERTED index on ``text``, two regions, 3 rounds of
    ``upserts`` upserts and 8 deletes among ``keys`` keys (each flushed: 6 generations
    per region at most), then 20 rows left in the MemTables (newest)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(rows(np.arange(200)), uri)
    lance.dataset(uri).create_scalar_index("text", "INVERTED", name="text_idx")
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    for _ in range(3):
        t.write(rows(rng.choice(keys, upserts, replace=False)))
        t.flush()
        t.delete(pa.table({"id": pa.array(rng.choice(keys, 8, replace=False), pa.int64())}))
        t.flush()
    t.write(rows(rng.choice(keys, 20, replace=False)))  # MemTables
    return t


def test_filtered_search_over_the_block_applies_to_the_newest_rows(tmp_path, monkeypatch):
    """Vector and full-text search with a filter (SQL text and Expression)
    use the block; the filter applies to the newest version of each key only: a key
    whose older version matches and newest does not is not returned, and the answer
    equals the per-generation path's and exact search over the deduplicated rows."""
    import pyarrow.compute as pc

    from memwal_query.search import fulltext, vector

    rng = np.random.default_rng(11)
    t = _cat_table(tmp_path, rng)
    try:
        live = t.to_table(writers=t.writers())
        newest_cat = dict(zip(live["id"].to_pylist(), live["cat"].to_pylist()))
        mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
        ids = live.column("id").to_numpy()
        cats = live.column("cat").to_numpy()
        for flt in ["cat = 3", pc.field("cat") == 3, "cat = 1 AND id > 50"]:
            want_rows = (
                cats == 3
                if not isinstance(flt, str) or flt == "cat = 3"
                else ((cats == 1) & (ids > 50))
            )
            for q in rng.standard_normal((3, DIM)).astype(np.float32):
                dbg: dict = {}
                got = t.vector_search("vec", q, k=15, filter=flt, columns=["id", "cat"], debug=dbg)
                assert "block" in {s["kind"] for s in dbg["sources"]}
                d = ((mat[want_rows] - q) ** 2).sum(1)
                exact = ids[want_rows][np.lexsort((ids[want_rows], d))][:15].tolist()
                assert got["id"].to_pylist() == exact
                assert all(
                    newest_cat[i] == c
                    for i, c in zip(got["id"].to_pylist(), got["cat"].to_pylist())
                )
            dbg = {}
            fts = t.fts_search("text", "apple fig", k=500, filter=flt, columns=["id"], debug=dbg)
            assert "block" in {s["kind"] for s in dbg["sources"]}
            texts = dict(zip(live["id"].to_pylist(), live["text"].to_pylist()))
            want = {
                int(i)
                for i in ids[want_rows].tolist()
                if {"apple", "fig"} & set(texts[int(i)].split())
            }
            assert sorted(fts["id"].to_pylist()) == sorted(want)
        # the per-generation path gives the same answers
        q = rng.standard_normal(DIM).astype(np.float32)
        blocked = t.vector_search("vec", q, k=15, filter="cat = 3")
        bfts = t.fts_search("text", "pear", k=50, filter="cat = 3")
        monkeypatch.setattr(vector, "BLOCK_MIN_GENERATIONS", 1000)
        monkeypatch.setattr(fulltext, "BLOCK_MIN_GENERATIONS", 1000)
        dbg = {}
        single = t.vector_search("vec", q, k=15, filter="cat = 3", debug=dbg)
        assert "block" not in {s["kind"] for s in dbg["sources"]}
        assert blocked["id"].to_pylist() == single["id"].to_pylist()
        sfts = t.fts_search("text", "pear", k=50, filter="cat = 3")
        assert sorted(bfts["id"].to_pylist()) == sorted(sfts["id"].to_pylist())
    finally:
        t.close()


def test_null_vectors_in_the_block_hide_older_versions_and_never_match(tmp_path):
    """A key whose newest version has a NULL vector is not returned, nor any older
    version of it; null and non-null vectors mix within and across generations."""
    rng = np.random.default_rng(8)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(100), rng), uri)
    t = mq.MemWalTable.initialize(uri)
    nulled: set[int] = set()
    for _ in range(5):
        rows = _rows(rng.choice(120, 30, replace=False), rng)
        mask = rng.random(rows.num_rows) < 0.3
        vec = pa.array(rows["vec"].to_pylist(), rows.schema.field("vec").type, mask=mask)
        t.write(rows.set_column(1, rows.schema.field("vec"), vec))
        t.flush()
        ids = rows["id"].to_pylist()
        nulled = (nulled - set(ids)) | {i for i, m in zip(ids, mask) if m}
    search.clear_caches()
    live = t.to_table(columns=["id", "vec"])
    keep = live["vec"].is_valid().to_numpy(zero_copy_only=False)
    mat = np.stack(live["vec"].filter(pa.array(keep)).to_numpy(zero_copy_only=False))
    ids = live["id"].to_numpy()[keep]
    assert nulled and not nulled & set(ids.tolist())
    for q in rng.standard_normal((4, DIM)).astype(np.float32):
        dbg: dict = {}
        got = t.vector_search("vec", q, k=40, debug=dbg)["id"].to_pylist()
        d = ((mat - q) ** 2).sum(1)
        assert got == ids[np.lexsort((ids, d))][:40].tolist()
        assert "block" in {s["kind"] for s in dbg["sources"]}


def test_block_of_many_rows_ranks_l2_exactly(tmp_path, monkeypatch):
    """A block large enough for the ranked shortcut (norms and one matrix product, the
    best candidates scored exactly) gives exact search's distances and rows, also with
    duplicate vectors."""
    rng = np.random.default_rng(8)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(100), rng), uri)
    t = mq.MemWalTable.initialize(uri)
    for g in range(2):
        rows = _rows(np.arange(1000 * g, 1000 * g + 1000), rng)
        if g == 1:  # 40 rows repeat one vector: equal distances
            same = pa.array([np.full(DIM, 0.25, np.float32)] * 40, SCHEMA.field("vec").type)
            rest = rows["vec"].combine_chunks()[40:]
            rows = rows.set_column(1, "vec", pa.concat_arrays([same, rest]))
        t.write(rows)
        t.flush()
    t.close()
    answered = []
    real = genblock.GenBlock._nearest_l2

    def spy(self, *a):
        got = real(self, *a)
        answered.append(got[0] is not None)
        return got

    monkeypatch.setattr(genblock.GenBlock, "_nearest_l2", spy)
    live = t.to_table(columns=["id", "vec"])
    mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
    ids = live.column("id").to_numpy()
    queries = [*rng.standard_normal((6, DIM)).astype(np.float32), np.full(DIM, 0.25, np.float32)]
    for q in queries:
        got = t.vector_search("vec", q, k=30)
        d = ((mat - q) ** 2).sum(1)
        want = np.sort(d)[:30]
        assert got["_distance"].to_numpy() == pytest.approx(want, rel=1e-5, abs=1e-5)
        # the same rows, up to ties at the k-th distance
        assert set(ids[d < want[-1] - 1e-5].tolist()) <= set(got["id"].to_pylist())
    assert answered and all(answered)
