"""The batched tokenizer of in-memory full-text matching (MemTables, generations without
an INVERTED index) gives exactly the postings of tokenizing one document at a time."""

from __future__ import annotations

import collections
import random

import lance
import pyarrow as pa
import pytest

from memwal_query.format.postings import Postings, separator
from memwal_query.search.textindex import _TokenIndex

WORDS = (
    "Alpha beta gamma running jumps quick brown fox lazy dogs the a of and vector "
    "search café naïve x1y2 foo_bar CamelCase don't"
).split()


def _one_at_a_time(texts: list[str | None], kw: dict) -> tuple:
    post: dict[str, tuple[list[int], list[int]]] = {}
    lens, docs, total = [], 0, 0
    for i, text in enumerate(texts):
        if text is None:
            lens.append(0)
            continue
        toks = [t.text for t in lance.tokenize(text, **kw)]
        lens.append(len(toks))
        docs += 1
        total += len(toks)
        for tok, c in collections.Counter(toks).items():
            rows, tfs = post.setdefault(tok, ([], []))
            rows.append(i)
            tfs.append(c)
    return post, lens, docs, total


def _docs(rnd: random.Random, n: int) -> list[str | None]:
    out: list[str | None] = []
    for _ in range(n):
        r = rnd.random()
        if r < 0.05:
            out.append(None)
        elif r < 0.1:
            out.append("")
        else:
            out.append(" ".join(rnd.choices(WORDS, k=rnd.randint(0, 12))) + rnd.choice(["", "."]))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"stem": True, "remove_stop_words": True},
        {"lower_case": False, "ascii_folding": True},
        {"base_tokenizer": "whitespace"},
        {"base_tokenizer": "raw"},
        {"base_tokenizer": "ngram", "min_ngram_length": 2, "max_ngram_length": 3},
        {"max_token_length": 5},
    ],
)
def test_batched_postings_equal_one_document_at_a_time(kw: dict) -> None:
    rnd = random.Random(7)
    docs = _docs(rnd, 600)
    lists = [
        None
        if rnd.random() < 0.1
        else [rnd.choice([None, "", *WORDS]) for _ in range(rnd.randint(0, 4))]
        for _ in range(400)
    ]
    joined = [None if v is None else " ".join(x for x in v if x) for v in lists]
    cases = [
        (pa.array(docs), docs),
        (pa.chunked_array([pa.array(docs[:50]), pa.array(docs[50:])]), docs),
        (pa.array(docs, pa.large_string()), docs),
        (pa.array(lists, pa.list_(pa.string())), joined),
    ]
    for col, texts in cases:
        ti = _TokenIndex(kw)
        half = len(col) // 2
        ti.extend(col[:half])  # two calls: row numbers continue
        ti.extend(col[half:])
        post, lens, docs_n, total = _one_at_a_time(texts, kw)
        assert ti.doc_len == lens
        assert (ti.num_docs, ti.total_tokens) == (docs_n, total)
        assert {k: (list(r), list(t)) for k, (r, t) in ti.postings.items()} == post
        frozen = Postings.of(col, kw)  # a generation's: all documents at once, as arrays
        assert frozen.doc_len.tolist() == lens
        assert (frozen.num_docs, frozen.total_tokens) == (docs_n, total)
        got = {k: tuple(a.tolist() for a in frozen.posting(k)) for k in post}
        assert got == {k: (r, [float(x) for x in t]) for k, (r, t) in post.items()}
        assert [len(a) for a in frozen.posting("nosuchtokenanywhere")] == [0, 0]


def test_separator_only_where_texts_tokenize_apart() -> None:
    assert separator({}) is not None
    assert separator({"stem": True}) is not None
    # a raw tokenizer keeps a whole text as one token, n-grams cut the separator:
    # both are tokenized one document at a time
    assert separator({"base_tokenizer": "raw"}) is None
    assert separator({"base_tokenizer": "ngram", "min_ngram_length": 2}) is None
    assert separator({"max_token_length": 5}) is None
