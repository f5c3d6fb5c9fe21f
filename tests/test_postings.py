"""The full-text postings sidecar of flushed generations (``memwal_postings.bin``):
written at flush as the base index's tokenizer splits the text,
read by a cold full-text search instead of tokenizing, and never the source of truth
(missing, damaged or for another tokenizer: the text is tokenized, same answers)."""

from __future__ import annotations

import os
import shutil
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query import search
from memwal_query.format import baseindex, postings, rowfile
from memwal_query.read import sources, view
from memwal_query.search import textindex

from helpers import PK, parity_spec

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("text", pa.string()),
        pa.field("tags", pa.list_(pa.string())),
    ]
)
WORDS = "alpha beta gamma delta running runs jumped quick brown foxes the of".split()


def _rows(ids, rng: np.random.Generator) -> pa.Table:
    ids = np.asarray(ids, np.int64)
    text = [
        None if rng.random() < 0.05 else " ".join(rng.choice(WORDS, rng.integers(0, 9)))
        for _ in ids
    ]
    tags = [list(rng.choice(WORDS, rng.integers(0, 3))) for _ in ids]
    return pa.table({"id": ids, "text": text, "tags": tags}, schema=SCHEMA)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    """The table of :func:`_table`, built once; tests work on copies."""
    t = _table(tmp_path_factory.mktemp("postings"))
    t.close()
    return t.uri


def _copy(built: str, tmp_path) -> mq.MemWalTable:
    shutil.copytree(built, tmp_path / "t")
    _forget()
    return mq.MemWalTable.open(str(tmp_path / "t"))


def _table(tmp_path) -> mq.MemWalTable:
    """Two regions, 3 flushes of upserts and deletes: 6 generations (a block)."""
    rng = np.random.default_rng(3)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(200), rng), uri)
    ds = lance.dataset(uri)
    ds.create_scalar_index("text", "INVERTED", name="text_idx", stem=True)
    ds.create_scalar_index("tags", "INVERTED", name="tags_idx")
    t = mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    for _ in range(3):
        t.write(_rows(rng.choice(260, 80, replace=False), rng))
        t.delete(pa.table({"id": pa.array(rng.choice(260, 6, replace=False), pa.int64())}))
        t.flush()
    return t


def _forget() -> None:
    search.clear_caches()
    sources.GENERATION_CACHE.clear()
    sources.GENERATIONS_WITHOUT_SIDECAR.clear()


def _answers(t: mq.MemWalTable) -> list:
    out = []
    for col, q in [("text", "running fox"), ("text", "alpha"), ("tags", "beta gamma")]:
        got = t.fts_search(col, q, k=15, columns=["id"])
        out.append(list(zip(got["id"].to_pylist(), np.round(got["_score"], 5).tolist())))
    got = t.fts_search("text", "quick", k=15, filter="id > 100", columns=["id"])
    out.append(got["id"].to_pylist())
    return out


def test_each_generation_stores_the_postings_of_each_indexed_column(built, tmp_path):
    t = _copy(built, tmp_path)
    tokenizers = baseindex.fts_tokenizers(t.catalog.dataset())
    assert sorted(c for c, _ in tokenizers) == ["tags", "text"]
    gens = [g.uri for g in view.resolve(t.catalog).generations]
    assert len(gens) == 6
    for uri in gens:
        rows = rowfile.read(t.catalog.io, uri)
        for column, kw in tokenizers:
            stored = postings.read(t.catalog.io, uri, column, kw)
            assert stored is not None
            want = postings.Postings.of(rows.column(column), kw)
            assert stored.doc_len.tolist() == want.doc_len.tolist()
            assert (stored.num_docs, stored.total_tokens) == (want.num_docs, want.total_tokens)
            for word in [*want.words.to_pylist(), "nosuchword"]:
                a, b = stored.posting(word), want.posting(word)
                assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
        # another tokenizer (the index was made again with other settings): not used
        assert postings.read(t.catalog.io, uri, "text", {"stem": False}) is None


def test_a_cold_search_reads_postings_instead_of_tokenizing(built, tmp_path, monkeypatch):
    t = _copy(built, tmp_path)
    _forget()
    want = _answers(t)  # warm: tokenizes nothing either
    _forget()
    built = []
    real = postings.Postings.of.__func__

    def of(cls, col, kw):
        built.append(len(col))
        return real(cls, col, kw)

    monkeypatch.setattr(postings.Postings, "of", classmethod(of))
    assert _answers(t) == want
    assert built == []  # every generation's postings came from its sidecar


def test_missing_damaged_or_foreign_postings_are_tokenized_with_the_same_answers(built, tmp_path):
    t = _copy(built, tmp_path)
    _forget()
    want = _answers(t)
    gens = [g.uri for g in view.resolve(t.catalog).generations]
    os.remove(os.path.join(gens[0], postings.POSTINGS_FILE))  # as pylance writes them
    path = os.path.join(gens[1], postings.POSTINGS_FILE)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x10  # a flipped bit: the CRC catches it
    open(path, "wb").write(bytes(data))
    # well framed, but its arrays do not fit together (a writer bug, hostile storage)
    bad = postings.Postings(
        pa.array(["alpha"]), np.array([0, 5]), np.arange(3), np.ones(3), np.ones(2), 2
    )
    postings.write(
        t.catalog.io, gens[2], [("text", baseindex.fts_tokenizers(t.catalog.dataset())[0][1], bad)]
    )
    # postings of another row count than the generation: ignored too
    other = postings.Postings.of(pa.array(["alpha beta"] * 3), {})
    for column, kw in baseindex.fts_tokenizers(t.catalog.dataset()):
        postings.write(t.catalog.io, gens[3], [(column, kw, other)])
    _forget()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _answers(t) == want
    damaged = [str(w.message) for w in seen if postings.POSTINGS_FILE in str(w.message)]
    assert any("CRC" in m for m in damaged)
    assert any("inconsistent" in m for m in damaged)
    assert any("for a generation of" in m for m in damaged)


def _entry_table(p: postings.Postings, key: str, **over) -> pa.Table:
    cols = {
        "column": pa.array(["text"]),
        "tokenizer": pa.array([key]),
        "words": pa.array([p.words.to_pylist()], pa.list_(pa.string())),
        "starts": pa.array([p.starts], pa.list_(pa.int64())),
        "rows": pa.array([p.rows.astype(np.int32)], pa.list_(pa.int32())),
        "tfs": pa.array([p.tfs.astype(np.int32)], pa.list_(pa.int32())),
        "doc_len": pa.array([p.doc_len.astype(np.int32)], pa.list_(pa.int32())),
        "num_docs": pa.array([p.num_docs], pa.int64()),
    }
    return pa.table({**cols, **over})


def test_crafted_postings_that_pass_the_crc_are_checked_whole(built, tmp_path):
    """Hostile storage: well framed sidecars whose content is wrong in type, nulls,
    sizes or sums are not used (a warning naming the file), never an untyped error or
    another ranking, and nothing bad is cached: repaired, the file is used again."""
    t = _copy(built, tmp_path)
    want = _answers(t)
    gen = view.resolve(t.catalog).generations[0].uri
    kw = dict(baseindex.fts_tokenizers(t.catalog.dataset()))["text"]
    key = postings.tokenizer_key(kw)
    good = postings.read(t.catalog.io, gen, "text", kw)
    assert good is not None
    n = len(good.doc_len)
    bad = {
        "words of integers": dict(words=pa.array([[1] * len(good.words)], pa.list_(pa.int64()))),
        "words not a list": dict(words=pa.array(["x"])),
        "null starts": dict(starts=pa.array([None], pa.list_(pa.int64()))),
        "null num_docs": dict(num_docs=pa.array([None], pa.int64())),
        "negative lengths": dict(doc_len=pa.array([-np.ones(n, np.int32)], pa.list_(pa.int32()))),
        "lengths not the counts' sums": dict(
            doc_len=pa.array([good.doc_len.astype(np.int32) + 1], pa.list_(pa.int32()))
        ),
        "dictionary words": dict(
            words=pa.array([good.words.to_pylist()], pa.list_(pa.string())).cast(
                pa.list_(pa.dictionary(pa.int32(), pa.string()))
            )
        ),
    }
    path = os.path.join(gen, postings.POSTINGS_FILE)
    for name, over in bad.items():
        open(path, "wb").write(rowfile.seal(_entry_table(good, key, **over), postings._MAGIC))
        _forget()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert _answers(t) == want, name
        assert any(path in str(w.message) for w in seen), name
    # two record batches, the entry in the second: read whole, used
    other = _entry_table(good, key, column=pa.array(["other"]))
    both = pa.concat_tables([other, _entry_table(good, key)])
    open(path, "wb").write(rowfile.seal(both, postings._MAGIC))
    got = postings.read(t.catalog.io, gen, "text", kw)
    assert got is not None and got.rows.tolist() == good.rows.tolist()


def test_a_failed_postings_write_does_not_fail_the_flush(built, tmp_path, monkeypatch):
    from memwal_query.exceptions import StorageError

    t = _copy(built, tmp_path)

    def fail(*args, **kwargs):
        raise StorageError("memwal_postings.bin: simulated 503")

    monkeypatch.setattr(postings, "write", fail)
    t.write(_rows([1000, 1001], np.random.default_rng(1)))
    t.flush()
    got = t.lookup(pa.array([1000, 1001], pa.int64()), columns=["id"])
    assert sorted(got["id"].to_pylist()) == [1000, 1001]
    newest = view.resolve(t.catalog).generations[-1].uri
    assert not os.path.exists(os.path.join(newest, postings.POSTINGS_FILE))


def test_postings_only_for_bounded_text_and_bulk_tokenizers(built, tmp_path, monkeypatch):
    """The flush's extra work is bounded: a column with more text than
    POSTINGS_MAX_TEXT_BYTES gets none (the search tokenizes it, same answers)."""
    from memwal_query.write import flush

    t = _copy(built, tmp_path)
    monkeypatch.setattr(flush, "POSTINGS_MAX_TEXT_BYTES", 200)
    rng = np.random.default_rng(2)
    t.write(_rows(range(300, 302), rng))  # a little text: stored
    t.flush()
    small = view.resolve(t.catalog).generations[-1].uri
    t.write(_rows(range(400, 460), rng))  # more than 200 bytes of text: not stored
    t.flush()
    large = view.resolve(t.catalog).generations[-1].uri
    kw = dict(baseindex.fts_tokenizers(t.catalog.dataset()))["text"]
    assert postings.read(t.catalog.io, small, "text", kw) is not None
    assert postings.read(t.catalog.io, large, "text", kw) is None
    _forget()
    warm = _answers(t)
    for uri in [g.uri for g in view.resolve(t.catalog).generations]:
        if os.path.exists(os.path.join(uri, postings.POSTINGS_FILE)):
            os.remove(os.path.join(uri, postings.POSTINGS_FILE))
    _forget()
    assert _answers(t) == warm
    assert postings.separator({"base_tokenizer": "ngram", "min_ngram_length": 2}) is None


def test_object_stores_read_the_generations_postings_concurrently(monkeypatch):
    """map_generations: one after the other locally, on the reader pool when the store
    answers many requests at once (an object store)."""
    import threading

    from memwal_query.read.view import GenerationRef

    refs = [GenerationRef("r", g, f"/nowhere/g{g}") for g in range(9)]
    seen: list[str] = []

    def fn(ref):
        seen.append(threading.current_thread().name)
        return ref.generation

    assert sources.map_generations(fn, refs, None) == list(range(9))
    assert set(seen) == {threading.current_thread().name}
    seen.clear()
    monkeypatch.setattr(sources, "parallel_reads", lambda uri, so: True)
    assert sources.map_generations(fn, refs, None) == list(range(9))
    assert all(n.startswith("memwal-generations") for n in seen)


def test_a_null_list_spanning_values_tokenizes_as_null():
    """A null entry of a list column may still span values (legal Arrow): they belong to
    no document."""
    values = pa.array(["alpha", "beta", "gamma", "delta"])
    col = pa.ListArray.from_arrays(
        pa.array([0, 1, 3, 4], pa.int32()), values, mask=pa.array([False, True, False])
    )
    tokens, doc, valid = postings.tokenize_many(col, {})
    assert valid.tolist() == [True, False, True]
    assert sorted(zip(doc.tolist(), tokens.to_pylist())) == [(0, "alpha"), (2, "delta")]


@pytest.mark.parametrize("kw", [{}, {"base_tokenizer": "ngram", "min_ngram_length": 2}])
def test_encoded_postings_round_trip(tmp_path, kw):
    col = pa.array(["alpha beta", None, "", "beta beta gamma", "café naïve"])
    p = postings.Postings.of(col, kw)
    io = sources.file_io(str(tmp_path), None)
    postings.write(io, str(tmp_path), [("c", kw, p)])
    back = postings.read(io, str(tmp_path), "c", kw)
    assert back is not None
    assert back.words.to_pylist() == p.words.to_pylist()
    for name in ("starts", "rows", "tfs", "doc_len"):
        assert getattr(back, name).tolist() == getattr(p, name).tolist()
    assert back.num_docs == p.num_docs == 4
    assert textindex.Postings is postings.Postings
