"""Full-text postings of flushed generations: tokenizing documents in bulk, and the
postings sidecar ``memwal_postings.bin``.

A first full-text search over many unmerged generations needs each generation's token
postings. Lance's tokenizer returns one Python object per token, so tokenizing them at
query time cost about a second at 192 generations of 500 rows. At flush the writer
therefore also stores, next to ``memwal_rows.bin``, the postings of every column with an
INVERTED index on the base table, as the base index's tokenizer splits them; a search
reads them instead of tokenizing.

Layout: one Arrow IPC file framed like the rows sidecar (:func:`memwal_query.format.
rowfile.seal`: a CRC-32 trailer, magic ``MWP1``), one row per indexed column: ``column``,
``tokenizer`` (the ``lance.tokenize`` keywords as sorted JSON), and the list columns
``words``, ``starts``, ``rows``, ``tfs``, ``doc_len`` of :class:`Postings` plus
``num_docs``. Rows are the generation's rows in write order (what
:func:`memwal_query.read.sources.read_generation` returns).

Like the rows sidecar it is an optimisation, never the source of truth: a generation
without one (pylance's writer, an older memwal_query, a column indexed after the flush,
a tokenizer changed since) or with a damaged one (a warning naming the file) is
tokenized from its text.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.rowfile import dir_name, read_sealed, seal
from memwal_query.storage.io import FileIO, join

POSTINGS_FILE = "memwal_postings.bin"
_MAGIC = b"MWP1"


_SEPARATORS: dict[str, tuple[str, str] | None] = {}
_CHUNK_PIECES = 1 << 15  # text pieces per lance.tokenize call of the batched path


def separator(tok_kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """``(word, token)``: a word that the tokenizer ``tok_kwargs`` keeps as one token of
    its own between two texts (so texts joined with it tokenize as each text alone), and
    that token; None when there is none (n-gram or raw tokenizers, a short
    ``max_token_length``...): texts are then tokenized one at a time. Random letters,
    chosen once per process and tokenizer."""
    key = repr(sorted(tok_kwargs.items()))
    if key not in _SEPARATORS:

        def toks(text: str) -> list[str]:
            return [t.text for t in lance.tokenize(text, **tok_kwargs)]

        word = "".join(chr(97 + b % 26) for b in os.urandom(24))
        alone = toks(word)
        ok = len(alone) == 1 and toks(f"alpha runs {word} beta") == (
            toks("alpha runs") + alone + toks("beta")
        )
        _SEPARATORS[key] = (word, alone[0]) if ok else None
    return _SEPARATORS[key]


def text_bytes(col: pa.ChunkedArray | pa.Array) -> int:
    """Bytes of text in a string or list-of-strings column (nulls count nothing)."""
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        col = pc.list_flatten(col)
    total = pc.sum(pc.binary_length(col)).as_py()
    return int(total or 0)


def tokenize_many(
    col: pa.ChunkedArray | pa.Array, tok_kwargs: dict[str, Any]
) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Tokenize every document of a string (or list-of-strings) column at once.

    Returns ``(tokens, doc, valid)``: every token's text, the index of the document it
    came from, and which documents are not null (a list document is its non-null items
    joined by spaces). Documents are joined with a separator word in a few
    ``lance.tokenize`` calls rather than one call per document (see :func:`separator`).
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks else pa.array([], col.type)
    valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), bool)
    sep = separator(tok_kwargs)
    if sep is None and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        # one call per document anyway: join its items as the document's text
        joined = [" ".join(x for x in v if x) for v in col.filter(pc.is_valid(col)).to_pylist()]
        pieces, piece_doc = pa.array(joined, pa.string()), np.flatnonzero(valid)
    elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        # a null list may still span values (legal Arrow): list_flatten skips them while
        # list_parent_indices does not, so each value's document comes from the lengths
        pieces = pc.list_flatten(col)
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
        piece_doc = np.repeat(np.arange(len(col), dtype=np.int64), lengths)
        keep = pc.and_(pc.is_valid(pieces), pc.not_equal(pc.binary_length(pieces), 0))
        keep = pc.fill_null(keep, False)
        pieces, piece_doc = pieces.filter(keep), piece_doc[keep.to_numpy(zero_copy_only=False)]
    else:
        pieces = col.filter(pc.is_valid(col))
        piece_doc = np.flatnonzero(valid)
    pieces = pieces.cast(pa.large_string())
    texts: list[pa.Array] = []
    owner: list[np.ndarray] = []
    if sep is None:
        for i, text in enumerate(pieces.to_pylist()):
            toks = pa.array([t.text for t in lance.tokenize(text, **tok_kwargs)], pa.string())
            texts.append(toks)
            owner.append(np.full(len(toks), i, np.int64))
    else:
        word, sep_token = sep
        for lo in range(0, len(pieces), _CHUNK_PIECES):
            chunk = pieces.slice(lo, _CHUNK_PIECES)
            one = pa.LargeListArray.from_arrays(pa.array([0, len(chunk)], pa.int64()), chunk)
            glue = pa.scalar(f" {word} ", pa.large_string())
            text = pc.binary_join(one, glue)[0].as_py() or ""
            toks = pa.array([t.text for t in lance.tokenize(text, **tok_kwargs)], pa.string())
            is_sep = np.asarray(pc.equal(toks, sep_token).to_numpy(zero_copy_only=False), bool)
            texts.append(toks.filter(pa.array(~is_sep)))
            owner.append((lo + np.cumsum(is_sep))[~is_sep])
    tokens = pa.concat_arrays(texts) if texts else pa.array([], pa.string())
    piece_of = np.concatenate(owner) if owner else np.zeros(0, np.int64)
    return tokens, piece_doc[piece_of].astype(np.int64), valid


class Postings:
    """Token postings of a fixed set of documents (a flushed generation) as sorted
    arrays: a token's postings are one slice, found without a Python step per token or
    posting.

    ``words``: the distinct tokens; the postings of ``words[i]`` are
    ``rows[starts[i]:starts[i + 1]]`` (document indexes, ascending) with their counts in
    ``tfs``; ``doc_len``: tokens per document (0 for a null one); ``num_docs``: non-null
    documents.
    """

    def __init__(
        self,
        words: pa.Array,
        starts: np.ndarray,
        rows: np.ndarray,
        tfs: np.ndarray,
        doc_len: np.ndarray,
        num_docs: int,
    ) -> None:
        self.words = words
        self.starts = np.asarray(starts, np.int64)
        self.rows = np.asarray(rows, np.int64)
        self.tfs = np.asarray(tfs, np.float64)
        self.doc_len = np.asarray(doc_len, np.float64)
        self.num_docs = num_docs
        self.total_tokens = int(self.doc_len.sum())
        self._word: dict[str, int] | None = None

    @classmethod
    def of(cls, col: pa.ChunkedArray | pa.Array, tok_kwargs: dict[str, Any]) -> Postings:
        """The postings of the documents of ``col`` (strings or lists of strings), as
        the tokenizer ``tok_kwargs`` (``lance.tokenize`` keywords) splits them."""
        tokens, doc, valid = tokenize_many(col, tok_kwargs)
        n = len(valid)
        doc_len = np.bincount(doc, minlength=n)
        if not len(tokens):
            empty = np.zeros(0, np.int64)
            return cls(
                pa.array([], pa.string()),
                np.zeros(1, np.int64),
                empty,
                empty,
                doc_len,
                int(valid.sum()),
            )
        enc = pc.dictionary_encode(tokens)
        ids = np.asarray(enc.indices.to_numpy(zero_copy_only=False), np.int64)
        pair, tf = np.unique(ids * n + doc, return_counts=True)  # by token, then row
        words = enc.dictionary
        starts = np.searchsorted(pair // n, np.arange(len(words) + 1))
        return cls(words, starts, pair % n, tf, doc_len, int(valid.sum()))

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows (document indexes) holding ``token`` and its count in each."""
        if self._word is None:  # on first use (a block asks its parts through ``find``)
            words = self.words.to_pylist()
            self._word = dict(zip(words, range(len(words))))
        i = self._word.get(token)
        if i is None:
            return self.rows[:0], self.tfs[:0]
        lo, hi = self.starts[i], self.starts[i + 1]
        return self.rows[lo:hi], self.tfs[lo:hi]


def tokenizer_key(tok_kwargs: dict[str, Any]) -> str:
    """The ``tokenizer`` value recorded for ``tok_kwargs`` (sorted JSON)."""
    return json.dumps(tok_kwargs, sort_keys=True)


def encode(entries: list[tuple[str, dict[str, Any], Postings]], owner: str | None = None) -> bytes:
    """The sidecar bytes of ``(column, tokenizer keywords, postings)`` entries, stamped
    with the generation directory name ``owner`` (:func:`rowfile.seal`)."""

    def lists(values: list[Any], t: pa.DataType) -> pa.Array:
        return pa.array(values, pa.list_(t))

    ps = [p for _, _, p in entries]
    t = pa.table(
        {
            "column": pa.array([c for c, _, _ in entries], pa.string()),
            "tokenizer": pa.array([tokenizer_key(k) for _, k, _ in entries], pa.string()),
            "words": pa.ListArray.from_arrays(
                _offsets([len(p.words) for p in ps]),
                pa.concat_arrays([p.words.cast(pa.string()) for p in ps])
                if ps
                else pa.array([], pa.string()),
            ),
            "starts": lists([p.starts for p in ps], pa.int64()),
            "rows": lists([p.rows.astype(np.int32) for p in ps], pa.int32()),
            "tfs": lists([p.tfs.astype(np.int32) for p in ps], pa.int32()),
            "doc_len": lists([p.doc_len.astype(np.int32) for p in ps], pa.int32()),
            "num_docs": pa.array([p.num_docs for p in ps], pa.int64()),
        }
    )
    return seal(t, _MAGIC, owner)


def _offsets(sizes: list[int]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int32))


def write(io: FileIO, gen_uri: str, entries: list[tuple[str, dict[str, Any], Postings]]) -> None:
    """Write the postings sidecar of the generation at ``gen_uri`` (before its manifest
    commit)."""
    io.write(join(gen_uri, POSTINGS_FILE), encode(entries, dir_name(gen_uri)))


def read(io: FileIO, gen_uri: str, column: str, tok_kwargs: dict[str, Any]) -> Postings | None:
    """The postings of ``column`` as the tokenizer ``tok_kwargs`` splits it, from the
    generation's sidecar; None when it has none or none for that column and tokenizer,
    and None with a warning naming the file when it is damaged or its arrays do not fit
    together (the caller tokenizes the text instead)."""
    path = join(gen_uri, POSTINGS_FILE)
    t = read_sealed(io, path, _MAGIC, "a postings sidecar", "tokenizing the text")
    if t is None:
        return None
    try:
        return _entry(t, column, tokenizer_key(tok_kwargs))
    except Exception as e:  # noqa: BLE001 - whatever is wrong in it: not used
        warnings.warn(f"{path}: malformed ({e}); tokenizing the text", RuntimeWarning, stacklevel=2)
        return None


_SCHEMA = pa.schema(
    [
        ("column", pa.string()),
        ("tokenizer", pa.string()),
        ("words", pa.list_(pa.string())),
        ("starts", pa.list_(pa.int64())),
        ("rows", pa.list_(pa.int32())),
        ("tfs", pa.list_(pa.int32())),
        ("doc_len", pa.list_(pa.int32())),
        ("num_docs", pa.int64()),
    ]
)
"""The sidecar's schema (what :func:`encode` writes; anything else is not used)."""


def _entry(t: pa.Table, column: str, key: str) -> Postings | None:
    """The entry of ``(column, key)`` of a decoded sidecar (None: none), checked whole:
    ValueError when the schema, nulls or the arrays' sizes, order and sums are wrong."""
    if not t.schema.equals(_SCHEMA):
        raise ValueError(f"schema {t.schema} is not {_SCHEMA}")
    if any(c.null_count for c in t.columns):
        raise ValueError("nulls")
    if any(c.num_chunks != 1 for c in t.columns):
        t = t.combine_chunks()
    names, keys = t.column("column").to_pylist(), t.column("tokenizer").to_pylist()
    hits = [i for i, (c, k) in enumerate(zip(names, keys)) if c == column and k == key]
    if not hits:
        return None
    i = hits[0]

    def values(name: str) -> pa.Array:
        lists = t.column(name).chunk(0)
        v = lists.flatten() if len(lists) == 1 else lists[i].values
        if v.null_count:
            raise ValueError(f"nulls in {name!r}")
        return v

    words = values("words")
    starts = values("starts").to_numpy()
    rows = values("rows").to_numpy()
    tfs = values("tfs").to_numpy()
    doc_len = values("doc_len").to_numpy()
    num_docs = int(t.column("num_docs")[i].as_py())
    n = len(doc_len)
    if (
        len(starts) != len(words) + 1
        or starts[0] != 0
        or starts[-1] != len(rows)
        or np.any(np.diff(starts) < 0)
        or len(tfs) != len(rows)
        or (len(rows) and (rows.min() < 0 or rows.max() >= n or tfs.min() < 1))
        or (n and doc_len.min() < 0)
        or not 0 <= num_docs <= n
        or not np.array_equal(np.bincount(rows, weights=tfs, minlength=n), doc_len)
    ):
        raise ValueError("inconsistent postings arrays")
    return Postings(words, starts, rows, tfs, doc_len, num_docs)
