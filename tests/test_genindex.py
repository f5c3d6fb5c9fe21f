"""Maintained indexes of flushed generations (memwal_query.write.genindex)."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import baseindex
from memwal_query.storage import paths
from memwal_query.write import genindex

from helpers import PK

DIM = 8


def _schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("x", pa.int64()),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )


def _rows(ids, vecs, x=None, text=None) -> pa.Table:
    ids = list(ids)
    flat = pa.array(np.asarray(vecs, np.float32).reshape(-1))
    return pa.table(
        {
            "id": ids,
            "x": [i % 10 for i in ids] if x is None else x,
            "text": [f"doc {i}" for i in ids] if text is None else text,
            "vec": pa.FixedSizeListArray.from_arrays(flat, DIM),
        },
        schema=_schema(),
    )


@pytest.fixture
def vtable(tmp_path):
    rng = np.random.default_rng(7)
    uri = str(tmp_path / "base")
    ds = lance.write_dataset(_rows(range(600), rng.standard_normal((600, DIM))), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=8, num_sub_vectors=2, name="vec_idx")
    ds.create_scalar_index("text", "INVERTED", name="text_idx", stem=False)
    ds.create_scalar_index("x", "BITMAP", name="x_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx", "x_idx"])
    yield t, rng
    t.close(flush=False)


def _generations(t: mq.MemWalTable) -> list[str]:
    out = []
    for rid in t.catalog.region_ids():
        m = t.catalog.region_manifest(rid)
        for g in sorted(m.flushed_generations, key=lambda g: g.generation):
            out.append(paths.generation_path(t.uri, rid, g.path))
    return out


def test_generation_indexes_share_base_quantization(vtable):
    t, rng = vtable
    with t.writer() as w:
        w.put(_rows([1000, 1001, 1002], rng.standard_normal((3, DIM))))
    (gen_uri,) = _generations(t)
    report = genindex.read_report(t.catalog, gen_uri)
    assert report["vec_idx"]["status"] == "built"
    assert report["vec_idx"]["built_type"] == "IVF_PQ"
    assert report["text_idx"] == {
        "built_type": "INVERTED",
        "column": "text",
        "kind": "fts",
        "status": "built",
        "type": "Inverted",
    }
    assert report["x_idx"]["built_type"] == "BITMAP"
    base = t.catalog.dataset()
    gen = lance.dataset(gen_uri)
    assert {d.name for d in gen.describe_indices()} >= {"vec_idx", "text_idx", "x_idx"}
    # same IVF centroids and the same PQ codebook bytes as the base index
    base_c = base.get_ivf_model("vec_idx").centroids
    gen_c = gen.get_ivf_model("vec_idx").centroids
    assert base_c.equals(gen_c)

    def seg(ds):
        return [s.uuid for d in ds.describe_indices() if d.name == "vec_idx" for s in d.segments][0]

    base_cb = baseindex.read_pq_codebook(base.uri, str(seg(base)))
    gen_cb = baseindex.read_pq_codebook(gen.uri, str(seg(gen)))
    assert len(base_cb) == 256 and base_cb.type.list_size == DIM
    assert base_cb.equals(gen_cb)
    # the same tokenizer settings (stem=False is not Lance's default)
    assert baseindex.fts_params(gen, "text_idx")["stem"] is False


def test_same_vector_gets_the_same_pq_distance_in_base_and_generation(vtable):
    t, rng = vtable
    base = t.catalog.dataset()
    vec = base.take([5], columns=["vec"]).column("vec")[0].values.to_numpy()
    with t.writer() as w:
        w.put(_rows([2000], [vec]))
    (gen_uri,) = _generations(t)
    gen = lance.dataset(gen_uri)
    q = rng.standard_normal(DIM).astype(np.float32)
    nearest = {"column": "vec", "q": q, "k": 1000, "nprobes": 8}
    in_base = base.to_table(nearest=nearest, columns=["id"])
    in_gen = gen.to_table(nearest=nearest, columns=["id"])
    d_base = in_base.filter(pa.compute.equal(in_base["id"], 5))["_distance"][0].as_py()
    d_gen = in_gen.filter(pa.compute.equal(in_gen["id"], 2000))["_distance"][0].as_py()
    # PQ distances (not exact): equal only because the codebook is shared
    exact = float(((vec - q) ** 2).sum())
    assert d_base == pytest.approx(d_gen, rel=1e-6)
    assert d_base != pytest.approx(exact, rel=1e-6)


def test_tiny_and_delete_only_generations(vtable):
    t, rng = vtable
    w = t.writer()
    w.put(_rows([3000], rng.standard_normal((1, DIM))))  # 1 row < 8 partitions
    w.flush()
    w.delete(pa.table({"id": [1, 2]}))  # only tombstones: no vectors, no text
    w.flush()
    w.close()
    one, tombs = _generations(t)
    r1 = genindex.read_report(t.catalog, one)
    assert r1["vec_idx"]["status"] == "built"
    gen = lance.dataset(one)
    q = rng.standard_normal(DIM).astype(np.float32)
    got = gen.to_table(nearest={"column": "vec", "q": q, "k": 5, "nprobes": 8}, columns=["id"])
    assert got["id"].to_pylist() == [3000]
    r2 = genindex.read_report(t.catalog, tombs)
    assert r2["vec_idx"] == {
        "column": "vec",
        "kind": "vector",
        "reason": "only tombstones",
        "status": "skipped",
        "type": "IVF_PQ",
    }
    assert r2["text_idx"]["status"] == "built"  # an empty inverted index is fine


def test_missing_base_index_is_reported_not_fatal(vtable):
    t, rng = vtable
    t.catalog.dataset().drop_index("x_idx")
    t.catalog.index()  # refresh the cached details: x_idx is still listed as maintained
    assert "x_idx" in t.catalog.maintained_indexes
    with t.writer() as w:
        w.put(_rows([4000], rng.standard_normal((1, DIM))))
    (gen_uri,) = _generations(t)
    report = genindex.read_report(t.catalog, gen_uri)
    assert report["x_idx"] == {"status": "skipped", "reason": "no such index on the base table"}
    assert report["vec_idx"]["status"] == "built"


def test_unreadable_codebook_falls_back_to_ivf_flat(vtable, monkeypatch):
    t, rng = vtable
    baseindex.VECTOR_MODELS.clear()

    def broken(*a, **k):
        raise ValueError("no codebook")

    monkeypatch.setattr(baseindex, "read_pq_codebook", broken)
    with t.writer() as w:
        w.put(_rows([5000, 5001], rng.standard_normal((2, DIM))))
    baseindex.VECTOR_MODELS.clear()
    (gen_uri,) = _generations(t)
    report = genindex.read_report(t.catalog, gen_uri)
    assert report["vec_idx"]["status"] == "fallback"
    assert report["vec_idx"]["built_type"] == "IVF_FLAT"
    gen = lance.dataset(gen_uri)
    assert [d.index_type for d in gen.describe_indices() if d.name == "vec_idx"] == ["IVF_FLAT"]


def test_tensor_parser_round_trip():
    values = np.arange(12, dtype=np.float32)
    # field 1 varint 2 (FLOAT32), field 2 packed [3, 4], field 3 bytes
    body = bytes([0x08, 0x02, 0x12, 0x02, 0x03, 0x04, 0x1A, 48]) + values.tobytes()
    dtype, shape, data = baseindex._parse_tensor(body)
    assert (dtype, shape) == (2, [3, 4])
    assert np.frombuffer(data, np.float32).tolist() == values.tolist()


def test_tokenize_kwargs_reproduce_the_index_tokenizer(vtable):
    t, _ = vtable
    params = baseindex.fts_params(t.catalog.dataset(), "text_idx")
    kw = baseindex.tokenize_kwargs(params)
    assert kw["stem"] is False and kw["analyzer"] == "text"
    assert [x.text for x in lance.tokenize("Running Dogs", **kw)] == ["running", "dogs"]


def test_vector_search_with_a_base_index_lance_left_without_files(tmp_path):
    """Lance records an IVF_PQ index with no files when PQ has too few rows to train
    (200 < 256): generations then get no index, and searches still answer exactly."""
    from memwal_query import search

    rng = np.random.default_rng(0)
    uri = str(tmp_path / "small")
    vecs = rng.standard_normal((200, DIM)).astype(np.float32)
    ds = lance.write_dataset(_rows(range(200), vecs), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=4, name="vec_idx")
    with pytest.raises(Exception):  # noqa: B017 - whatever Lance raises for the files
        lance.dataset(uri).get_ivf_model("vec_idx")
    baseindex.VECTOR_MODELS.clear()
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx"])
    with t.writer() as w:
        w.put(_rows([7], np.zeros((1, DIM))))
    (gen_uri,) = _generations(t)
    assert genindex.read_report(t.catalog, gen_uri)["vec_idx"]["status"] == "skipped"
    assert (
        baseindex.vector_metric(
            t.catalog.dataset(), baseindex.find_index(t.catalog.dataset(), "vec", "vector")
        )
        == "l2"
    )
    q = np.zeros(DIM, np.float32)
    dist = ((vecs - q) ** 2).sum(1)
    dist[7] = 0.0
    got = search.vector_search(t.catalog, "vec", q, k=5)
    assert got["id"].to_pylist() == np.argsort(dist)[:5].tolist()
    t.close(flush=False)
