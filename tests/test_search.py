"""Point lookup, vector search and full-text search across every LSM source."""

from __future__ import annotations

import math
import shutil

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query import search
from memwal_query.format import index as mwindex
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.storage import paths

from helpers import PK

DIM = 8
Q = np.full(DIM, 4.0, np.float32)
N_BASE = 400


def near(d: float) -> np.ndarray:
    """A vector at squared L2 distance d**2 from Q."""
    v = Q.copy()
    v[0] += d
    return v


def schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("x", pa.int64()),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )


def rows(ids, vecs=None, x=None, text=None, rng=None) -> pa.Table:
    ids = list(ids)
    if vecs is None:
        rng = rng or np.random.default_rng(abs(hash(tuple(ids))) % (1 << 32))
        vecs = rng.standard_normal((len(ids), DIM))
    flat = pa.array(np.asarray(vecs, np.float32).reshape(-1))
    return pa.table(
        {
            "id": ids,
            "x": [i % 10 for i in ids] if x is None else x,
            "text": [f"common t{i % 20}" for i in ids] if text is None else text,
            "vec": pa.FixedSizeListArray.from_arrays(flat, DIM),
        },
        schema=schema(),
    )


SPECIAL_TEXT = {
    20: "apple banana",
    21: "apple pie",
    22: "apple tart",
    23: "apple crumble",
    24: "banana split",
}
SPECIAL_VEC = {10: near(1), 11: near(2), 12: near(3), 13: near(4), 14: near(5)}


def base_rows() -> pa.Table:
    rng = np.random.default_rng(42)
    vecs = rng.standard_normal((N_BASE, DIM))
    for i, v in SPECIAL_VEC.items():
        vecs[i] = v
    text = [SPECIAL_TEXT.get(i, f"common t{i % 20}") for i in range(N_BASE)]
    return rows(range(N_BASE), vecs, text=text)


def make_table(
    tmp_path, maintained=("vec_idx", "text_idx"), index=True, region_sql=None
) -> mq.MemWalTable:
    """The base table, initialized (one region; ``region_sql``: region ``r`` = that
    expression over ``id``)."""
    from memwal_query.regions.spec import expression_spec

    uri = str(tmp_path / "base")
    ds = lance.write_dataset(base_rows(), uri)
    if index:
        ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=2, name="vec_idx")
        ds.create_scalar_index("text", "INVERTED", name="text_idx")
        ds.create_scalar_index("id", "BTREE", name="id_idx")
    spec = None
    if region_sql is not None:
        spec = expression_spec(ds, ["id"], region_sql, "int64", field_id="r")
    return mq.MemWalTable.initialize(
        uri, maintained_indexes=list(maintained) if index else [], region_spec=spec
    )


@pytest.fixture
def layered(tmp_path):
    """Base + generation 1 + generation 2 + an unflushed MemTable, with updates/deletes.

    Live rows near Q (squared distance): 600 (0.01), 502 (6.25), 11 (12.25),
    13 (16), 501 (36); everything else is random (~130 away).
    """
    t = make_table(tmp_path)
    w = t.writer()
    rng = np.random.default_rng(3)
    # generation 1
    w.put(rows([10], rng=rng, text=["cherry"]))  # base 10 moves away, new text
    w.put(rows([11], [near(0.5)]))
    w.delete(pa.table({"id": [12, 22]}))
    w.put(rows([500], [near(1.5)], text=["apple cider"]))
    w.put(rows([501], [near(6)], text=["apple juice"]))
    w.put(rows([503], [near(0.2)], text=["kiwi"]))
    w.put(rows([503], rng=rng, text=["mango"]))  # same generation: supersedes
    w.put(rows([20], [near(100)], text=["cherry"]))
    w.put(rows([501], [near(6)], text=["orange juice"]))  # supersedes within gen 1
    assert w.flush() == 1
    # generation 2
    w.put(rows([500], rng=rng, text=["apple cider"]))
    w.put(rows([502], [near(2.5)], text=["plum"]))
    assert w.flush() == 2
    # MemTable (generation 3)
    w.delete(pa.table({"id": [14, 500]}))
    w.put(rows([11], [near(3.5)], text=["grape"]))
    w.put(rows([21], rng=rng, text=["grape"]))
    w.put(rows([600], [near(0.1)], text=["apple apple"]))
    w.put(rows([601], [near(0.05)], text=["apple"]))
    w.delete(pa.table({"id": [601]}))
    yield t, w
    w.close(flush=False)


def ids(t: pa.Table) -> list[int]:
    return t.column("id").to_pylist()


# ----------------------------------------------------------------------------------------
# point lookup
# ----------------------------------------------------------------------------------------
def test_lookup_every_source(layered):
    t, w = layered
    got = search.lookup(t.catalog, [601, 11, 500, 12, 13, 502, 10, 999999, 11, 600], writers=[w])
    # order of first occurrence; deleted (601, 500, 12) and unknown keys are absent
    assert ids(got) == [11, 13, 502, 10, 600]
    by_id = {r["id"]: r for r in got.to_pylist()}
    assert by_id[11]["text"] == "grape"  # MemTable beats generation 1 and base
    assert by_id[13]["text"] == "common t13"  # base
    assert by_id[502]["text"] == "plum"  # generation 2
    assert by_id[10]["text"] == "cherry"  # generation 1
    assert got.schema.names == ["id", "x", "text", "vec"]
    assert np.allclose(by_id[11]["vec"], near(3.5))
    # flushed rows only (strong, no writer): 500 lives in gen 2, 11 in gen 1
    got = search.lookup(
        t.catalog, [500, 11, 601], columns=["text", "id"], writers=[], consistency="strong"
    )
    assert got.column_names == ["text", "id"]
    assert got.to_pydict() == {"text": ["apple cider", "common t11"], "id": [500, 11]}
    got = search.lookup(t.catalog, [11], writers=[], consistency="strong")
    assert np.allclose(got["vec"][0].as_py(), near(0.5))
    # by default another reader sees the MemTable's acknowledged rows (its WAL entries)
    got = search.lookup(t.catalog, [601, 11, 500], columns=["text", "id"], writers=[])
    assert got.to_pydict() == {"text": ["grape"], "id": [11]}


def test_lookup_within_generation_last_write_wins(layered):
    t, w = layered
    got = search.lookup(t.catalog, pa.array([503, 501]), columns=["id", "text"], writers=[w])
    assert got.to_pydict() == {"id": [503, 501], "text": ["mango", "orange juice"]}


def test_lookup_bloom_filters_skip_generations(layered):
    t, w = layered
    dbg: dict = {}
    got = search.lookup(t.catalog, [13], writers=[w], debug=dbg)
    assert ids(got) == [13]
    gens = [s for s in dbg["sources"] if s["source"].startswith("generation")]
    assert [s["bloom_hits"] for s in gens] == [0, 0]  # newest first, both skipped
    assert dbg["sources"][-1] == {"source": "base", "probed": 1, "hits": 1}
    dbg = {}
    search.lookup(t.catalog, [502], writers=[w], debug=dbg)
    gens = [s for s in dbg["sources"] if s["source"].startswith("generation")]
    assert len(gens) == 1 and gens[0]["hits"] == 1  # stops at generation 2
    assert not any(s["source"] == "base" for s in dbg["sources"])


def test_lookup_batch_matches_scan(layered):
    t, w = layered
    expected = {r["id"]: r for r in t.to_table(writers=[w]).to_pylist()}
    keys = np.arange(-5, 700)
    got = search.lookup(t.catalog, keys, writers=[w])
    assert ids(got) == sorted(expected)
    for r in got.to_pylist():
        e = expected[r["id"]]
        assert (r["x"], r["text"]) == (e["x"], e["text"])
    assert search.lookup(t.catalog, [], writers=[w]).num_rows == 0


def test_lookup_composite_and_string_keys(tmp_path):
    sch = pa.schema(
        [
            pa.field("a", pa.int32(), False, PK),
            pa.field("b", pa.string(), False, PK),
            pa.field("v", pa.int64()),
        ]
    )
    uri = str(tmp_path / "c")
    lance.write_dataset(
        pa.table({"a": [1, 1, 2], "b": ["x", "y", "x"], "v": [10, 11, 20]}, schema=sch), uri
    )
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        w.put(pa.table({"a": [1], "b": ["y"], "v": [111]}))
        w.delete(pa.table({"a": [2], "b": ["x"]}))
    w2 = t.writer()
    w2.put(pa.table({"a": [3], "b": ["z"], "v": [30]}))
    keys = pa.table({"a": [2, 1, 3, 1, 9], "b": ["x", "y", "z", "x", "x"]})
    got = search.lookup(t.catalog, keys, writers=[w2])
    assert got.to_pydict() == {"a": [1, 3, 1], "b": ["y", "z", "x"], "v": [111, 30, 10]}
    with pytest.raises(mq.SchemaError):
        search.lookup(t.catalog, [1, 2])
    w2.close(flush=False)


# ----------------------------------------------------------------------------------------
# vector search
# ----------------------------------------------------------------------------------------
def test_vector_search_updates_and_deletes_in_every_source(layered):
    t, w = layered
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[w], debug=dbg)
    assert ids(got) == [600, 502, 11, 13, 501]
    assert got["_distance"].to_pylist() == pytest.approx([0.01, 6.25, 12.25, 16.0, 36.0], rel=1e-4)
    assert got.schema.names == ["id", "x", "text", "vec", "_distance"]
    assert got["text"].to_pylist() == ["apple apple", "plum", "grape", "common t13", "orange juice"]
    stats = {s["source"].split(" of ")[0]: s for s in dbg["sources"]}
    assert stats["base"]["stale"] >= 4  # 10, 11, 12 (deleted), 14 (deleted in MemTable)
    assert stats["generation 1"]["index"] == "vec_idx"
    # flushed rows only: 11 is at 0.25 (gen 1), 14 and 500 live, 600 unknown
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[], consistency="strong")
    assert ids(got) == [11, 502, 13, 14, 501]
    # by default another reader sees the MemTable's acknowledged rows (its WAL entries)
    assert ids(search.vector_search(t.catalog, "vec", Q, k=5, writers=[])) == [
        600,
        502,
        11,
        13,
        501,
    ]


def test_vector_search_matches_brute_force_with_k_beyond_live_rows(layered):
    t, w = layered
    live = t.to_table(writers=[w])
    mat = np.stack(live["vec"].to_numpy(zero_copy_only=False)).astype(np.float32)
    dist = ((mat - Q) ** 2).sum(1)
    got = search.vector_search(t.catalog, "vec", Q, k=5000, writers=[w])
    assert got.num_rows == live.num_rows
    assert sorted(ids(got)) == sorted(live["id"].to_pylist())
    assert got["_distance"].to_numpy() == pytest.approx(np.sort(dist), rel=1e-4)
    assert len(set(ids(got))) == got.num_rows


def test_stale_candidates_are_found_through_the_bloom_filters(layered):
    """A source's candidates are checked against each newer generation's bloom filter,
    and only its hits against the generation's keys: the base's candidates that no
    newer generation holds never reach the exact check."""
    t, w = layered
    runs = {
        "vector": lambda dbg: search.vector_search(
            t.catalog, "vec", Q, k=10, writers=[w], debug=dbg
        ),
        "fts": lambda dbg: search.fts_search(
            t.catalog, "text", "apple", k=10, writers=[w], debug=dbg
        ),
    }
    for name, run in runs.items():
        dbg: dict = {}
        run(dbg)
        (base,) = [s for s in dbg["sources"] if s["source"] == "base"]
        assert base["bloom_checks"] > base["bloom_hits"], (name, base)
        # every bloom hit is a stale key (the filters of a few keys give no false hits)
        assert 0 < base["bloom_hits"] <= base["stale"], (name, base)


def test_vector_filter_applies_to_newest_version(tmp_path):
    """Base id=1 x=10, generation 2 id=1 x=0: filter x > 5 must not return id 1."""
    t = make_table(tmp_path)
    w = t.writer()
    w.put(rows([1], [near(0.1)], x=[10]))
    w.flush()
    t.maintenance.merge()  # the base now says id=1 x=10
    assert search.lookup(t.catalog, [1], columns=["x"]).to_pydict() == {"x": [10]}
    w.put(rows([1], [near(0.1)], x=[0]))
    w.flush()  # generation 2 says x=0
    for flt in ("x > 5", pc.field("x") > 5):
        got = search.vector_search(t.catalog, "vec", near(0.1), k=3, filter=flt, writers=[])
        assert got.num_rows == 3 and 1 not in ids(got)
        assert all(x > 5 for x in got["x"].to_pylist())
    got = search.vector_search(t.catalog, "vec", Q, k=3, filter="x < 5", writers=[])
    assert ids(got) == [1, 10, 11]
    # a MemTable version that matches again wins over generation 2
    w.put(rows([1], [near(0.1)], x=[50]))
    got = search.vector_search(t.catalog, "vec", Q, k=2, filter="x > 5", writers=[w])
    assert ids(got)[0] == 1 and got["x"][0].as_py() == 50
    assert 1 not in ids(search.vector_search(t.catalog, "vec", Q, k=3, filter="x < 5", writers=[w]))
    # the same through full-text search
    w.put(rows([2], text=["apple strudel"], x=[9]))
    w.flush()
    w.put(rows([2], text=["apple strudel"], x=[1]))
    assert 2 not in ids(
        search.fts_search(t.catalog, "text", "strudel", filter="x > 5", writers=[w])
    )
    assert ids(search.fts_search(t.catalog, "text", "strudel", filter="x < 5", writers=[w])) == [2]
    w.close(flush=False)


def test_vector_filter_on_memtable_and_generation(layered):
    t, w = layered
    got = search.vector_search(t.catalog, "vec", Q, k=4, filter="text LIKE 'apple%'", writers=[w])
    assert ids(got) == [600, 23]  # MemTable filtered with SQL; 21, 500, 501, 601 are not
    got = search.vector_search(t.catalog, "vec", Q, k=3, filter=pc.field("id") >= 500, writers=[w])
    assert ids(got) == [600, 502, 501]


def test_vector_search_empty_generations_and_sources(tmp_path):
    t = make_table(tmp_path)
    w = t.writer()
    w.delete(pa.table({"id": [10, 11]}))  # a generation of tombstones only
    assert w.flush() == 1
    w.put(rows([700], [near(0.3)]))
    w.delete(pa.table({"id": [700]}))  # a MemTable whose only row is deleted
    got = search.vector_search(t.catalog, "vec", Q, k=3, writers=[w])
    assert ids(got) == [12, 13, 14]
    got = search.vector_search(t.catalog, "vec", Q, k=3, filter="x > 100", writers=[w])
    assert got.num_rows == 0 and got.schema.names[-1] == "_distance"
    w.close(flush=False)


def test_vector_search_refetches_when_candidates_are_stale(tmp_path):
    # base row i lies at distance ((i + 1) / 10) ** 2 from Q, on a line
    uri = str(tmp_path / "line")
    steps = (np.arange(N_BASE, dtype=np.float32) + 1) / 10
    vecs = np.tile(Q, (N_BASE, 1))
    vecs[:, 0] += steps
    ds = lance.write_dataset(rows(range(N_BASE), vecs), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=4, name="vec_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx"])
    with t.writer() as w:  # the 40 nearest rows move far away in generation 1
        w.put(rows(range(40), np.full((40, DIM), 50.0)))
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, debug=dbg)
    assert ids(got) == [40, 41, 42, 43, 44]
    assert got["_distance"].to_numpy() == pytest.approx(steps[40:45] ** 2, rel=1e-4)
    base_stats = next(s for s in dbg["sources"] if s["kind"] == "base")
    assert base_stats["rounds"] == 2  # 18 candidates, all stale; then 72
    assert base_stats["fetched"] == 72 and base_stats["stale"] == 40


def test_vector_search_without_maintained_indexes(tmp_path):
    t = make_table(tmp_path, maintained=())
    with t.writer() as w:
        w.put(rows([11], [near(0.5)]))
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=2, debug=dbg)
    assert ids(got) == [11, 10]
    gen = next(s for s in dbg["sources"] if s["kind"] == "generation")
    assert gen["index"] == "flat"


def test_search_with_string_keys_and_column_subsets(tmp_path):
    sch = pa.schema(
        [
            pa.field("k", pa.string(), False, PK),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    rng = np.random.default_rng(4)
    keys = [f"key-{i}" for i in range(300)]
    vecs = rng.standard_normal((300, DIM)).astype(np.float32)
    vecs[:3] = [near(1), near(2), near(3)]
    texts = ["pear"] * 3 + ["other"] * 297

    def table_of(ks, vs, ts):
        flat = pa.array(np.asarray(vs, np.float32).reshape(-1))
        vec = pa.FixedSizeListArray.from_arrays(flat, DIM)
        return pa.table({"k": ks, "text": ts, "vec": vec}, schema=sch)

    uri = str(tmp_path / "s")
    ds = lance.write_dataset(table_of(keys, vecs, texts), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=2, num_sub_vectors=2, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx"])
    w = t.writer()
    w.put(table_of(["key-0"], [rng.standard_normal(DIM)], ["apple"]))  # moves away
    w.flush()
    w.delete(pa.table({"k": ["key-1"]}))
    w.put(table_of(["new"], [near(2.5)], ["pear pear"]))
    got = search.vector_search(t.catalog, "vec", Q, k=2, writers=[w], columns=["k"])
    assert got.column_names == ["k", "_distance"]
    assert got.to_pydict() == {"k": ["new", "key-2"], "_distance": [6.25, 9.0]}
    got = search.vector_search(t.catalog, "vec", Q, k=2, writers=[w], columns=["text"])
    assert got.to_pydict() == {
        "text": ["pear pear", "pear"],
        "_distance": got["_distance"].to_pylist(),
    }
    got = search.fts_search(t.catalog, "text", "pear", writers=[w], columns=["k"])
    assert got["k"].to_pylist() == ["new", "key-2"]
    got = search.lookup(
        t.catalog, ["key-2", "key-1", "new", "key-0", "zzz"], columns=["k", "text"], writers=[w]
    )
    assert got.to_pydict() == {
        "k": ["key-2", "new", "key-0"],
        "text": ["pear", "pear pear", "apple"],
    }
    w.close(flush=False)


# ----------------------------------------------------------------------------------------
# full-text search
# ----------------------------------------------------------------------------------------
def test_fts_updated_documents_stop_matching_old_words(layered):
    t, w = layered
    got = search.fts_search(t.catalog, "text", "apple", k=10, writers=[w])
    # 20, 21: updated; 22: deleted (gen 1); 500: deleted (MemTable); 501: superseded in
    # gen 1; 601: deleted in the MemTable
    assert ids(got) == [600, 23]
    assert got["_score"][0].as_py() > got["_score"][1].as_py()
    assert ids(search.fts_search(t.catalog, "text", "cherry", writers=[w])) in ([10, 20], [20, 10])
    assert ids(search.fts_search(t.catalog, "text", "banana", writers=[w])) == [24]
    assert sorted(ids(search.fts_search(t.catalog, "text", "grape", writers=[w]))) == [11, 21]
    assert ids(search.fts_search(t.catalog, "text", "juice", writers=[w])) == [501]
    assert ids(search.fts_search(t.catalog, "text", "kiwi", writers=[w])) == []
    assert ids(search.fts_search(t.catalog, "text", "mango", writers=[w])) == [503]
    # flushed rows only: 21 still says "apple pie", 500 is alive in gen 2
    got = search.fts_search(t.catalog, "text", "apple", k=10, writers=[], consistency="strong")
    assert sorted(ids(got)) == [21, 23, 500]
    # by default another reader sees the MemTable's acknowledged rows (its WAL entries)
    got = search.fts_search(t.catalog, "text", "apple", k=10, writers=[])
    assert sorted(ids(got)) == sorted(
        ids(search.fts_search(t.catalog, "text", "apple", k=10, writers=[w]))
    )


def test_fts_scores_equal_lance_on_the_base_table(tmp_path):
    t = make_table(tmp_path)
    base = t.catalog.dataset()
    for q in ["apple", "apple banana", "common t3 t3", "banana split pie"]:
        ours = search.fts_search(t.catalog, "text", q, k=30)
        native = base.to_table(full_text_query=q, limit=30, columns=["id"])
        a = dict(zip(ids(ours), ours["_score"].to_pylist()))
        b = dict(zip(ids(native), native["_score"].to_pylist()))
        assert sorted(a.values(), reverse=True) == pytest.approx(
            sorted(b.values(), reverse=True), rel=1e-5
        )
        for i in set(a) & set(b):
            assert a[i] == pytest.approx(b[i], rel=1e-5)


def bm25_reference(live: pa.Table, query: str) -> dict[int, float]:
    """Brute-force BM25 over the deduplicated rows (Lance's formula and tokenizer)."""
    docs = {}
    for r in live.to_pylist():
        if r["text"] is not None:
            docs[r["id"]] = [x.text for x in lance.tokenize(r["text"])]
    n = len(docs)
    avgdl = sum(len(d) for d in docs.values()) / n
    qt = [x.text for x in lance.tokenize(query)]
    df = {t: sum(1 for d in docs.values() if t in d) for t in set(qt)}
    out = {}
    for i, d in docs.items():
        s = 0.0
        for t in qt:
            tf = d.count(t)
            if tf and df[t]:
                idf = math.log((n - df[t] + 0.5) / (df[t] + 0.5) + 1)
                s += idf * 2.2 * tf / (tf + 1.2 * (0.25 + 0.75 * len(d) / avgdl))
        if s > 0:
            out[i] = s
    return out


def test_fts_scores_use_global_statistics(tmp_path):
    """Inserts only (no stale rows): scores equal BM25 over the whole corpus."""
    t = make_table(tmp_path)
    w = t.writer()
    w.put(rows(range(1000, 1030), text=[f"zeta {'apple ' * (i % 3)}tail" for i in range(30)]))
    w.flush()
    w.put(rows(range(2000, 2010), text=["apple zeta zeta"] * 5 + ["plain words"] * 5))
    dbg: dict = {}
    got = search.fts_search(t.catalog, "text", "apple zeta", k=25, writers=[w], debug=dbg)
    ref = bm25_reference(t.to_table(writers=[w]), "apple zeta")
    best = sorted(ref.items(), key=lambda kv: -kv[1])[:25]
    assert got["_score"].to_numpy() == pytest.approx([s for _, s in best], rel=1e-4)
    for i, s in zip(ids(got), got["_score"].to_pylist()):
        assert ref[i] == pytest.approx(s, rel=1e-4)
    assert dbg["stats"]["num_docs"] == N_BASE + 30 + 10
    assert dbg["stats"]["df"] == {"appl": 5 + 20 + 4, "zeta": 30 + 5}
    w.close(flush=False)


def test_fts_scores_do_not_change_when_a_flush_moves_rows(tmp_path):
    """The same rows give the same global statistics and scores wherever they sit: in a
    MemTable, in a generation searched through its own index, or in the block of every
    generation. Each step below changes only where rows sit (a flush; a flush of one
    tombstone of an unknown key, which makes the generations one block), with
    superseded and deleted versions among the moved rows, as a background flush
    between two searches does."""
    t = make_table(tmp_path)
    w = t.writer(max_memtable_rows=10_000)
    text = [f"apple {'zeta ' * (i % 3)}w{i % 4}" for i in range(20)]
    w.put(rows(range(1000, 1020), text=text))
    w.flush()
    w.put(rows(range(1000, 1006), text=["zeta zeta apple"] * 6))  # over generation 1
    w.delete(pa.table({"id": pa.array([1006, 7], pa.int64())}))
    w.flush()

    def memtable_changes() -> None:  # superseded versions within the MemTable too
        w.put(rows([1010, 1011, 3], text=["apple", "zeta tail", "apple apple zeta"]))
        w.put(rows([1010, 1001], text=["apple zeta apple", "plain"]))
        w.delete(pa.table({"id": pa.array([1012, 1011], pa.int64())}))

    def flush_unknown_tombstone() -> None:
        w.delete(pa.table({"id": pa.array([10**6], pa.int64())}))
        w.flush()

    def searched() -> tuple[list[str], dict, dict[int, float]]:
        dbg: dict = {}
        got = search.fts_search(t.catalog, "text", "apple zeta", k=1000, writers=[w], debug=dbg)
        kinds = sorted({s["kind"] for s in dbg["sources"]})
        return kinds, dbg["stats"], dict(zip(ids(got), got["_score"].to_pylist()))

    memtable_changes()
    steps = [searched()]
    for move in (w.flush, flush_unknown_tombstone, memtable_changes, w.flush):
        move()
        steps.append(searched())
    kinds = [k for k, *_ in steps]
    assert kinds[:3] == [
        ["base", "generation", "memtable"],
        ["base", "generation"],
        ["base", "block"],
    ]
    assert kinds[3:] == [["base", "block", "memtable"], ["base", "block"]]
    for before, after in [(steps[0], steps[1]), (steps[1], steps[2]), (steps[3], steps[4])]:
        assert after[1] == before[1]
        assert after[2] == pytest.approx(before[2], rel=1e-6)  # every match, same score
    w.close(flush=False)


def test_fts_top_k_when_a_source_ranks_differently_from_the_global_score(tmp_path):
    """A small generation's own BM25 (short avgdl) prefers a 1-token document; with the
    global statistics a 6-token document with tf=3 scores higher. Both the generation's
    local top-1 and top-k must give way to the global ranking (brute force)."""
    uri = str(tmp_path / "b")
    texts = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(12)) for i in range(300)]
    ds = lance.write_dataset(rows(range(300), text=texts), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=2, num_sub_vectors=2, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx"])
    gen_text = ["zebra", "zebra zebra zebra qa qb qc"] + ["qq"] * 40
    with t.writer() as w:
        w.put(rows(range(1000, 1000 + len(gen_text)), text=gen_text))
    gen = t.catalog.region_manifest(w.region_id).flushed_generations[0]
    gen_ds = lance.dataset(paths.generation_path(t.uri, w.region_id, gen.path))
    local = gen_ds.to_table(full_text_query="zebra", limit=1, columns=["id"])
    assert ids(local) == [1000]  # the generation's own index ranks 1000 first
    ref = bm25_reference(t.to_table(), "zebra")
    assert max(ref, key=ref.get) == 1001
    for k in (1, 2, 5):
        dbg: dict = {}
        got = search.fts_search(t.catalog, "text", "zebra", k=k, debug=dbg)
        assert ids(got) == [1001, 1000][:k]
        assert got["_score"].to_pylist() == pytest.approx([ref[1001], ref[1000]][:k], rel=1e-4)
    gen_stats = next(s for s in dbg["sources"] if s["kind"] == "generation")
    assert gen_stats["index"] == "text_idx"


def test_search_refills_when_every_first_candidate_is_deleted(tmp_path):
    """The nearest/best 40 base rows are deleted in a generation: the first round's
    candidates are all stale, and the search must ask the base again (not return [])."""
    uri = str(tmp_path / "line")
    steps = (np.arange(N_BASE, dtype=np.float32) + 1) / 10
    vecs = np.tile(Q, (N_BASE, 1))
    vecs[:, 0] += steps
    text = ["apple" + " filler" * i for i in range(N_BASE)]  # shorter scores higher
    ds = lance.write_dataset(rows(range(N_BASE), vecs, text=text), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=4, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx"])
    with t.writer() as w:
        w.delete(pa.table({"id": list(range(40))}))
    dbg: dict = {}
    assert ids(search.vector_search(t.catalog, "vec", Q, k=5, debug=dbg)) == [40, 41, 42, 43, 44]
    assert next(s for s in dbg["sources"] if s["kind"] == "base")["rounds"] == 2
    assert ids(search.fts_search(t.catalog, "text", "apple", k=5)) == [40, 41, 42, 43, 44]
    # the same with the deletes still in a MemTable, and through a filter
    w2 = t.writer()
    w2.delete(pa.table({"id": list(range(40, 80))}))
    got = search.vector_search(t.catalog, "vec", Q, k=3, filter="x > 0", writers=[w2])
    assert ids(got) == [81, 82, 83]
    assert ids(search.fts_search(t.catalog, "text", "apple", k=3, writers=[w2])) == [80, 81, 82]
    w2.close(flush=False)


def test_fts_filter_applies_to_newest_version(layered):
    t, w = layered
    # base 23 "apple crumble" x=3; MemTable 600 "apple apple" x=0
    assert ids(search.fts_search(t.catalog, "text", "apple", filter="x > 2", writers=[w])) == [23]
    w.put(rows([23], text=["apple crumble"], x=[0]))
    assert ids(search.fts_search(t.catalog, "text", "apple", filter="x > 2", writers=[w])) == []
    got = search.fts_search(t.catalog, "text", "apple", filter=pc.field("x") == 0, writers=[w])
    assert ids(got) == [600, 23]


def test_fts_k_beyond_matches_and_no_tokens(layered):
    t, w = layered
    got = search.fts_search(t.catalog, "text", "common", k=10_000, writers=[w])
    live = t.to_table(writers=[w])
    expected = [r["id"] for r in live.to_pylist() if "common" in (r["text"] or "")]
    assert sorted(ids(got)) == sorted(expected)
    assert (
        search.fts_search(t.catalog, "text", "the of and", writers=[w]).num_rows == 0
    )  # stop words


# ----------------------------------------------------------------------------------------
# indexed read plan
# ----------------------------------------------------------------------------------------
def set_catchup(t: mq.MemWalTable, caught: dict[str, dict[str, int]]) -> None:
    idx = t.catalog.index()
    details = pb.MemWalIndexDetails()
    details.CopyFrom(idx.details)
    del details.index_catchup[:]
    for name, regions in caught.items():
        p = details.index_catchup.add()
        p.index_name = name
        for rid, gen in regions.items():
            m = p.caught_up_generations.add()
            m.region_id.uuid = paths.region_id_to_bytes(rid)
            m.generation = gen
    mwindex.commit_details(t.catalog.dataset(), details, idx)
    t.catalog.refresh_index()


@pytest.fixture
def merged_not_reindexed(tmp_path):
    """Generation 1 merged and re-indexed, generation 2 merged but not re-indexed,
    generation 3 flushed, generation 4 in the MemTable. Keys >= 800 are another region."""
    t = make_table(tmp_path, region_sql="CASE WHEN col0 >= 800 THEN 1 ELSE 0 END")
    w = t.writer(region_values={"r": 0})
    w.put(rows([12], rng=np.random.default_rng(5), text=["alpha"]))
    assert w.flush() == 1
    assert t.maintenance.merge().by_region() == {w.region_id: [1]}
    t.catalog.dataset().optimize.optimize_indices()  # the base indexes now cover generation 1
    w.put(rows([13], [near(0.3)], text=["zucchini soup"]))
    w.put(rows([700], [near(0.7)], text=["zucchini bread"]))
    w.delete(pa.table({"id": [10, 23]}))
    assert w.flush() == 2
    assert t.maintenance.merge().by_region() == {w.region_id: [2]}  # ... but not generation 2
    w.put(rows([701], [near(0.8)], text=["zucchini cake"]))
    assert w.flush() == 3  # not merged
    w.put(rows([702], [near(0.9)], text=["zucchini pie"]))  # MemTable
    yield t, w
    w.close(flush=False)


def test_indexed_read_plan_uses_generation_indexes_for_the_gap(merged_not_reindexed):
    t, w = merged_not_reindexed
    rid = w.region_id
    frags = [f.fragment_id for f in t.catalog.dataset().get_fragments()]
    (vec_idx,) = [d for d in t.catalog.dataset().describe_indices() if d.name == "vec_idx"]
    indexed = sorted(f for s in vec_idx.segments for f in s.fragment_ids)
    assert len(frags) > len(indexed)  # generation 2's rows sit in unindexed fragments
    # Lance's optimize_indices recorded the catch-up; merging generation 2 left it behind
    catchup = t.catalog.index().index_catchup()
    assert catchup["vec_idx"] == {rid: 1} and catchup["text_idx"] == {rid: 1}
    assert t.catalog.index().merged_generations() == {rid: 2}

    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[w], debug=dbg)
    assert ids(got) == [13, 700, 701, 702, 11]
    plan = dbg["plan"]
    assert plan.indexed_only
    assert plan.skipped_fragments == sorted(set(frags) - set(indexed)) != []
    assert [g.generation for g in plan.regions[rid].gap] == [2]
    assert [g.generation for g in plan.regions[rid].generations] == [3]
    assert "gap_generations=[2]" in dbg["explain"]
    base_plan = dbg["base_lance_plan"]
    assert "ANNSubIndex" in base_plan
    assert "LanceScan" not in base_plan and "KNNVectorDistance" not in base_plan
    gap = next(s for s in dbg["sources"] if s["gap"])
    assert gap["index"] == "vec_idx" and gap["fetched"] > 0

    dbg = {}
    got = search.fts_search(t.catalog, "text", "zucchini", k=10, writers=[w], debug=dbg)
    assert sorted(ids(got)) == [13, 700, 701, 702]
    assert "FlatMatchQuery" not in dbg["base_lance_plan"]
    assert "MatchQuery" in dbg["base_lance_plan"]
    assert dbg["plan"].indexed_only
    assert ids(search.fts_search(t.catalog, "text", "crumble", writers=[w])) == []  # 23 deleted
    assert ids(search.fts_search(t.catalog, "text", "alpha", writers=[w])) == [12]  # indexed base


def test_without_catchup_record_the_base_is_searched_in_full(merged_not_reindexed):
    t, w = merged_not_reindexed
    set_catchup(t, {})  # no record: the index counts as caught up (spec)
    assert t.catalog.index().index_catchup() == {}
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[w], debug=dbg)
    assert ids(got) == [13, 700, 701, 702, 11]  # same answer ...
    assert not dbg["plan"].indexed_only
    assert "LanceScan" in dbg["base_lance_plan"]  # ... through a flat scan of new data
    dbg = {}
    search.fts_search(t.catalog, "text", "zucchini", writers=[w], debug=dbg)
    assert "FlatMatchQuery" in dbg["base_lance_plan"]


def test_gap_generation_gone_falls_back_to_full_scan(merged_not_reindexed):
    t, w = merged_not_reindexed
    rid = w.region_id
    set_catchup(t, {"vec_idx": {rid: 1}})
    gen2 = next(g for g in t.catalog.region_manifest(rid).flushed_generations if g.generation == 2)
    shutil.rmtree(paths.generation_path(t.uri, rid, gen2.path))
    search.clear_caches()
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[w], debug=dbg)
    assert ids(got) == [13, 700, 701, 702, 11]
    assert not dbg["plan"].indexed_only
    assert "full base scan" in dbg["explain"]


def test_unindexed_rows_not_from_the_gap_force_a_full_scan(merged_not_reindexed):
    t, w = merged_not_reindexed
    # a row appended to the base behind the MemWAL's back sits in an unindexed fragment
    lance.write_dataset(rows([900], [near(0.05)], text=["zucchini raw"]), t.uri, mode="append")
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=3, writers=[w], debug=dbg)
    assert ids(got) == [900, 13, 700]
    assert not dbg["plan"].indexed_only
    assert "full base scan" in dbg["explain"]
    assert 900 in ids(search.fts_search(t.catalog, "text", "zucchini", writers=[w]))


def test_second_region_gap(merged_not_reindexed):
    t, w = merged_not_reindexed
    w2 = t.writer(region_values={"r": 1})  # a second region, merged after the last rebuild
    w2.put(rows([800], [near(0.01)], text=["zucchini fresh"]))
    assert w2.flush() == 1
    t.maintenance.merge(regions=[w2.region_id])
    assert t.catalog.index().index_catchup()["vec_idx"] == {w.region_id: 1, w2.region_id: 0}
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=3, writers=[w, w2], debug=dbg)
    assert ids(got) == [800, 13, 700]
    assert dbg["plan"].indexed_only
    assert [g.generation for g in dbg["plan"].regions[w2.region_id].gap] == [1]
    assert [g.generation for g in dbg["plan"].regions[w.region_id].gap] == [2]
    assert "LanceScan" not in dbg["base_lance_plan"]
    w2.close(flush=False)


def test_concurrent_searches_share_cached_generations(layered):
    from concurrent.futures import ThreadPoolExecutor

    t, w = layered
    search.clear_caches()

    def one(i: int) -> tuple:
        v = ids(search.vector_search(t.catalog, "vec", Q, k=5, writers=[w]))
        f = ids(search.fts_search(t.catalog, "text", "apple", writers=[w]))
        lk = ids(search.lookup(t.catalog, [11, 12, 502], writers=[w]))
        return v, f, lk

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(24)))
    assert all(r == ([600, 502, 11, 13, 501], [600, 23], [11, 502]) for r in results)


# ----------------------------------------------------------------------------------------
# SQL
# ----------------------------------------------------------------------------------------
def test_sql_table_functions(layered):
    t, w = layered
    ctx = datafusion.SessionContext()
    mq.register(ctx, "events", t, consistency="strong", writers=[w])  # + search functions
    qs = ", ".join(str(float(v)) for v in Q)
    got = ctx.sql(f"SELECT id, _distance FROM vector_search('events', 'vec', [{qs}], 3)")
    assert got.to_arrow_table()["id"].to_pylist() == [600, 502, 11]
    got = ctx.sql(
        f"SELECT id FROM vector_search('events', 'vec', [{qs}], 2, 'id < 600') ORDER BY id"
    )
    assert got.to_arrow_table()["id"].to_pylist() == [11, 502]
    got = ctx.sql("SELECT id, _score FROM fts_search('events', 'text', 'apple', 5)")
    assert got.to_arrow_table()["id"].to_pylist() == [600, 23]
    got = ctx.sql("SELECT id, text FROM lookup('events', [11, 12, 13]) ORDER BY id")
    assert got.to_arrow_table().to_pydict() == {"id": [11, 13], "text": ["grape", "common t13"]}
    got = ctx.sql(
        "SELECT s.id, e.x FROM fts_search('events', 'text', 'grape', 5) s "
        "JOIN events e ON s.id = e.id ORDER BY s.id"
    )
    assert got.to_arrow_table().to_pydict() == {"id": [11, 21], "x": [1, 1]}


def test_search_rejects_bad_arguments(layered):
    t, w = layered
    with pytest.raises(mq.MemWalError):
        search.vector_search(t.catalog, "vec", Q, k=0)
    with pytest.raises(mq.MemWalError):
        search.vector_search(t.catalog, "vec", np.zeros(3), k=1)
    with pytest.raises(mq.SchemaError):
        search.vector_search(t.catalog, "nope", Q)
    with pytest.raises(mq.MemWalError):
        search.fts_search(t.catalog, "x", "apple")  # no inverted index on x


def test_recall_at_10_on_random_updates(tmp_path):
    rng = np.random.default_rng(11)
    t = make_table(tmp_path)
    w = t.writer()
    for _ in range(3):
        upd = rng.choice(N_BASE + 300, 120, replace=False)
        w.put(rows(upd.tolist(), rng.standard_normal((120, DIM))))
        w.delete(pa.table({"id": rng.choice(N_BASE, 10, replace=False)}))
        w.flush()
    w.put(rows(rng.choice(800, 50, replace=False).tolist(), rng.standard_normal((50, DIM))))
    live = t.to_table(writers=[w])
    mat = np.stack(live["vec"].to_numpy(zero_copy_only=False)).astype(np.float32)
    live_ids = np.asarray(live["id"].to_pylist())
    hits = 0
    for _ in range(20):
        q = rng.standard_normal(DIM).astype(np.float32)
        truth = set(live_ids[np.argsort(((mat - q) ** 2).sum(1))[:10]].tolist())
        got = search.vector_search(t.catalog, "vec", q, k=10, writers=[w])
        assert len(set(ids(got))) == 10
        hits += len(truth & set(ids(got)))
    assert hits / 200 >= 0.9
    w.close(flush=False)


def test_indexed_read_plan_after_generations_merged_in_one_commit(tmp_path):
    """Generations 2 and 3 (key 13 in both) merged by one commit: the unindexed base
    rows are fewer than the generations' upserts, yet all theirs, so searches stay on
    the indexes (and agree with a full scan)."""
    t = make_table(tmp_path)
    w = t.writer()
    rid = w.region_id
    w.put(rows([12], rng=np.random.default_rng(5), text=["alpha"]))
    w.flush()
    t.maintenance.merge()
    t.catalog.dataset().optimize.optimize_indices()  # the base indexes cover generation 1
    w.put(rows([13], [near(0.3)], text=["zucchini soup"]))
    w.put(rows([700], [near(0.7)], text=["zucchini bread"]))
    w.flush()
    w.put(rows([13], [near(0.31)], text=["zucchini stew"]))
    w.flush()
    before = t.catalog.dataset().version
    assert t.maintenance.merge().by_region() == {rid: [2, 3]}
    assert t.catalog.dataset().version == before + 1  # one commit
    dbg: dict = {}
    got = search.vector_search(t.catalog, "vec", Q, k=5, writers=[w], debug=dbg)
    assert dbg["plan"].indexed_only and dbg["plan"].skipped_fragments
    assert [g.generation for g in dbg["plan"].regions[rid].gap] == [2, 3]
    dbg = {}
    assert ids(search.fts_search(t.catalog, "text", "stew", writers=[w], debug=dbg)) == [13]
    assert dbg["plan"].indexed_only
    assert ids(search.fts_search(t.catalog, "text", "soup", writers=[w])) == []
    set_catchup(t, {})  # no record: the base is searched in full
    search.clear_caches()
    assert ids(search.vector_search(t.catalog, "vec", Q, k=5, writers=[w])) == ids(got)
    w.close(flush=False)
