"""In-memory full-text matching: token indexes of MemTables (extended as they grow) and
of generations without an INVERTED index."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.read import sources
from memwal_query.search.common import _GEN_TOKENS, _MEM_FTS
from memwal_query.search.generations import _GenInfo
from memwal_query.search.plan import _filter_indices

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.search.genblock import GenBlock
    from memwal_query.write.memtable import MemTableSnapshot


def _texts(col: pa.ChunkedArray | pa.Array) -> list[str | None]:
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [None if v is None else " ".join(x for x in v if x) for v in col.to_pylist()]
    return col.to_pylist()


_SEPARATORS: dict[str, tuple[str, str] | None] = {}
_CHUNK_PIECES = 1 << 15  # text pieces per lance.tokenize call of the batched path


def _separator(tok_kwargs: dict[str, Any]) -> tuple[str, str] | None:
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


def tokenize_many(
    col: pa.ChunkedArray | pa.Array, tok_kwargs: dict[str, Any]
) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Tokenize every document of a string (or list-of-strings) column at once.

    Returns ``(tokens, doc, valid)``: every token's text, the index of the document it
    came from, and which documents are not null (a list document is its non-null items
    joined by spaces). Documents are joined with a separator word in a few
    ``lance.tokenize`` calls rather than one call per document (see :func:`_separator`).
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks else pa.array([], col.type)
    valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), bool)
    sep = _separator(tok_kwargs)
    if sep is None and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        # one call per document anyway: join its items as the document's text
        joined = [" ".join(x for x in v if x) for v in col.filter(pc.is_valid(col)).to_pylist()]
        pieces, piece_doc = pa.array(joined, pa.string()), np.flatnonzero(valid)
    elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        pieces = pc.list_flatten(col)
        piece_doc = np.asarray(pc.list_parent_indices(col).to_numpy(zero_copy_only=False))
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


class _TokenIndex:
    """In-memory token postings of a growing list of documents (MemTables, fallbacks)."""

    def __init__(self, tok_kwargs: dict[str, Any]) -> None:
        self.tok_kwargs = tok_kwargs
        self.postings: dict[str, tuple[list[int], list[int]]] = {}
        self.doc_len: list[int] = []
        self.num_docs = 0  # non-null documents
        self.total_tokens = 0
        self.source: tuple = ()

    def extend(self, col: pa.ChunkedArray | pa.Array) -> None:
        """Add the documents of ``col`` (strings or lists of strings; vectorised)."""
        start = len(self.doc_len)
        tokens, doc, valid = tokenize_many(col, self.tok_kwargs)
        n = len(valid)
        self.doc_len += np.bincount(doc, minlength=n).tolist()
        self.num_docs += int(valid.sum())
        self.total_tokens += len(tokens)
        if not len(tokens):
            return
        enc = pc.dictionary_encode(tokens)
        ids = np.asarray(enc.indices.to_numpy(zero_copy_only=False), np.int64)
        pair, tf = np.unique(ids * n + doc, return_counts=True)  # n > 0: there are tokens
        tok_ids, rows = pair // n, pair % n + start
        bounds = np.flatnonzero(np.diff(tok_ids)) + 1
        words = enc.dictionary.to_pylist()
        for tid, r, c in zip(
            tok_ids[np.r_[0, bounds]].tolist(), np.split(rows, bounds), np.split(tf, bounds)
        ):
            got = self.postings.setdefault(words[tid], ([], []))
            got[0].extend(r.tolist())
            got[1].extend(c.tolist())

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows (document indexes) holding ``token`` and its count in each."""
        rows, tfs = self.postings.get(token, ((), ()))
        return np.asarray(rows, np.int64), np.asarray(tfs, np.float64)


def _memtable_token_index(
    table: Catalog, m: MemTableSnapshot, column: str, tok_kwargs: dict[str, Any]
) -> _TokenIndex:
    """Token index of one MemTable, extended incrementally as it grows (batch identity)."""
    key = (table.uri, m.region_id, m.generation, column, repr(sorted(tok_kwargs.items())))
    idx: _TokenIndex | None = _MEM_FTS.get(key)
    batches = m.batches
    if idx is not None:
        done = len(idx.source)
        if done > len(batches) or any(a is not b for a, b in zip(idx.source, batches[:done])):
            idx = None
    if idx is None:
        idx = _TokenIndex(tok_kwargs)
    for b in batches[len(idx.source) :]:
        idx.extend(b.column(column))
    idx.source = tuple(batches)
    _MEM_FTS.put_newest(key, idx)
    return idx


@dataclass
class _FtsStats:
    num_docs: int
    total_tokens: int
    df: dict[str, int]


class _FrozenTokens:
    """Several token indexes side by side as one (a block's generations). A token's
    postings over all parts are gathered the first time a query asks for it, then kept
    as arrays (up to :data:`_FROZEN_TOKENS` tokens): building them all up front cost a
    Python step per distinct token and generation."""

    def __init__(self, parts: list[tuple[int, _TokenIndex]]) -> None:
        self.parts = parts
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        lens = [np.asarray(ti.doc_len, np.float64) for _, ti in parts]
        self.doc_len = np.concatenate(lens) if lens else np.zeros(0, np.float64)
        self._empty = (np.zeros(0, np.int64), np.zeros(0, np.float64))

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows (block rows) holding ``token`` and its count in each."""
        got = self.postings.get(token)
        if got is None:
            rows, tfs = [], []
            for off, ti in self.parts:
                hit = ti.postings.get(token)
                if hit is not None:
                    rows.append(np.asarray(hit[0], np.int64) + off)
                    tfs.append(np.asarray(hit[1], np.float64))
            got = (np.concatenate(rows), np.concatenate(tfs)) if rows else self._empty
            if len(self.postings) >= _FROZEN_TOKENS:
                self.postings.clear()
            self.postings[token] = got
        return got


_FROZEN_TOKENS = 4096


class _MemFts:
    """Full-text matching over in-memory rows: a MemTable region or an unindexed gen."""

    def __init__(
        self,
        rows: pa.Table,
        parts: Sequence[tuple[int, _TokenIndex | _FrozenTokens]],
        live: np.ndarray,
    ) -> None:
        self.rows = rows
        self.parts = parts
        self.live = live
        # the rows matching a filter, when ``rows`` lacks the filter's columns (a block)
        self.filter_mask: Callable[[Any], np.ndarray] | None = None
        self.doc_len = np.zeros(rows.num_rows, np.float64)
        for off, ti in parts:
            dl = np.asarray(ti.doc_len, np.float64)
            self.doc_len[off : off + len(dl)] = dl[: rows.num_rows - off]

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        rows, tfs = [], []
        for off, ti in self.parts:
            r, t = ti.posting(token)
            rows.append(r + off)
            tfs.append(t)
        r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        t = np.concatenate(tfs) if tfs else np.zeros(0)
        keep = r < len(self.live)
        r, t = r[keep], t[keep]
        keep = self.live[r]
        return r[keep], t[keep]

    def stats(self, tokens: list[str]) -> _FtsStats:
        valid = self.live & (self.doc_len > 0)
        return _FtsStats(
            num_docs=int(valid.sum()),
            total_tokens=int(self.doc_len[self.live].sum()),
            df={t: len(self.posting(t)[0]) for t in set(tokens)},
        )

    def match(self, tokens: list[str], filter: Any) -> tuple[np.ndarray, np.ndarray]:
        """(matching live row indices, tf matrix [rows x unique tokens]) after filter."""
        uniq = list(dict.fromkeys(tokens))
        posts = [self.posting(t) for t in uniq]
        allrows = np.unique(np.concatenate([p[0] for p in posts])) if posts else np.zeros(0)
        allrows = allrows.astype(np.int64)
        if len(allrows) and filter is not None and self.filter_mask is not None:
            allrows = allrows[self.filter_mask(filter)[allrows]]
        elif len(allrows) and filter is not None:
            keep = _filter_indices(self.rows.take(pa.array(allrows)), filter)
            allrows = allrows[keep]
        tf = np.zeros((len(allrows), len(uniq)), np.float64)
        if len(allrows) == 0:
            return allrows, tf
        for j, (r, t) in enumerate(posts):
            pos = np.searchsorted(allrows, r)
            ok = (pos < len(allrows)) & (allrows[np.minimum(pos, len(allrows) - 1)] == r)
            tf[pos[ok], j] = t[ok]
        return allrows, tf


def _gen_mem_fts(gen: _GenInfo, table: Catalog, column: str, tok_kwargs: dict[str, Any]) -> _MemFts:
    """In-memory full-text matching for a generation without an INVERTED index."""
    ti = _gen_token_index(gen.ref, table, column, tok_kwargs)
    rows = sources.read_generation(gen.ref, table.schema, table.storage_options)
    return _MemFts(rows, [(0, ti)], gen.live_mask())


def _gen_token_index(
    ref: sources.GenerationRef, table: Catalog, column: str, tok_kwargs: dict[str, Any]
) -> _TokenIndex:
    """Token index of one generation's ``column`` (cached: generations are immutable)."""
    key = (ref.uri, column, repr(sorted(tok_kwargs.items())))
    ti: _TokenIndex | None = _GEN_TOKENS.get(key)
    if ti is None:
        rows = sources.read_generation(ref, table.schema, table.storage_options, [column])
        ti = _TokenIndex(tok_kwargs)
        ti.extend(rows.column(column))
        _GEN_TOKENS.put(key, ti)
    return ti


def _block_mem_fts(
    block: GenBlock, table: Catalog, column: str, tok_kwargs: dict[str, Any]
) -> _MemFts:
    """In-memory full-text matching over every generation of a block at once: the
    generations' token indexes side by side, live rows as the block deduplicated them
    (``_rowid`` of a match is its block row)."""
    key = ("fts", column, repr(sorted(tok_kwargs.items())))
    merged = block.cache.get(key)
    if merged is None:
        parts = []
        offset = 0
        for (_, ref), size in zip(block.members, block.sizes):
            parts.append((offset, _gen_token_index(ref, table, column, tok_kwargs)))
            offset += size
        merged = block.cache.setdefault(key, _FrozenTokens(parts))
    live = np.zeros(block.num_rows, bool)
    live[block.live_rows] = True
    rows = block.keys.append_column(column, block.values)
    mf = _MemFts(rows, [(0, merged)], live)
    mf.filter_mask = block.filter_mask
    return mf
