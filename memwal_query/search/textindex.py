"""In-memory full-text matching: token indexes of MemTables (extended as they grow) and
of generations without an INVERTED index."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format import postings
from memwal_query.format.postings import Postings
from memwal_query.read import sources, view
from memwal_query.search.caches import GENERATION_TOKEN_INDEXES, MEMTABLE_TOKEN_INDEXES
from memwal_query.search.generations import _GenInfo
from memwal_query.search.plan import _filter_indices
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.search.genblock import GenBlock
    from memwal_query.write.memtable import MemTableSnapshot


def _texts(col: pa.ChunkedArray | pa.Array) -> list[str | None]:
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [None if v is None else " ".join(x for x in v if x) for v in col.to_pylist()]
    return col.to_pylist()


class _TokenIndex:
    """In-memory token postings of a growing list of documents (MemTables, fallbacks)."""

    def __init__(self, tok_kwargs: dict[str, Any]) -> None:
        self.tok_kwargs = tok_kwargs
        self.postings: dict[str, tuple[list[int], list[int]]] = {}
        self.doc_len: list[int] = []
        self.num_docs = 0  # non-null documents
        self.total_tokens = 0
        self.source: tuple[pa.RecordBatch, ...] = ()

    def extend(self, col: pa.ChunkedArray | pa.Array) -> None:
        """Add the documents of ``col`` (strings or lists of strings; vectorised by
        :meth:`Postings.of`, appended to the growing lists word by word)."""
        start = len(self.doc_len)
        p = Postings.of(col, self.tok_kwargs)
        self.doc_len += p.doc_len.astype(np.int64).tolist()
        self.num_docs += p.num_docs
        self.total_tokens += p.total_tokens
        bounds = p.starts.tolist()
        rows, tfs = (p.rows + start).tolist(), p.tfs.astype(np.int64).tolist()
        for word, lo, hi in zip(p.words.to_pylist(), bounds, bounds[1:]):
            got = self.postings.setdefault(word, ([], []))
            got[0].extend(rows[lo:hi])
            got[1].extend(tfs[lo:hi])

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows (document indexes) holding ``token`` and its count in each."""
        rows, tfs = self.postings.get(token, ((), ()))
        return np.asarray(rows, np.int64), np.asarray(tfs, np.float64)


def _memtable_token_index(
    table: Catalog, m: MemTableSnapshot, column: str, tok_kwargs: dict[str, Any]
) -> _TokenIndex:
    """Token index of one MemTable, extended incrementally as it grows (batch identity)."""
    key = (table.uri, m.region_id, m.generation, column, repr(sorted(tok_kwargs.items())))
    idx: _TokenIndex | None = MEMTABLE_TOKEN_INDEXES.get(key)
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
    MEMTABLE_TOKEN_INDEXES.put_newest(key, idx)
    return idx


@dataclass
class _FtsStats:
    num_docs: int
    total_tokens: int
    df: dict[str, int]


class _FrozenTokens:
    """Several generations' postings side by side as one (a block): every part's words,
    ranges and rows concatenated, so finding a token is one vectorised comparison over
    all words rather than one lookup per generation. A token's gathered postings are
    kept (up to :data:`_FROZEN_TOKENS` tokens)."""

    def __init__(self, parts: list[tuple[int, Postings]]) -> None:
        self.parts = parts
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        lens = [ti.doc_len for _, ti in parts]
        self.doc_len = np.concatenate(lens) if lens else np.zeros(0, np.float64)
        self._empty = (np.zeros(0, np.int64), np.zeros(0, np.float64))
        words = [ti.words.cast(pa.large_string()) for _, ti in parts]
        self._words = pa.concat_arrays(words) if words else pa.array([], pa.large_string())
        # postings of every part one after another: word j's are rows[lo[j]:hi[j]]
        none = [np.zeros(0, np.int64)]
        base = np.cumsum([0] + [len(ti.rows) for _, ti in parts])
        self._lo = np.concatenate([ti.starts[:-1] + b for (_, ti), b in zip(parts, base)] + none)
        self._hi = np.concatenate([ti.starts[1:] + b for (_, ti), b in zip(parts, base)] + none)
        self._rows = np.concatenate([ti.rows + off for off, ti in parts] + none)
        self._tfs = np.concatenate([ti.tfs for _, ti in parts] + none).astype(np.float64)

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows (block rows) holding ``token`` and its count in each."""
        got = self.postings.get(token)
        if got is None:
            hits = np.flatnonzero(
                np.asarray(pc.equal(self._words, token).to_numpy(zero_copy_only=False), bool)
            )
            if len(hits):
                lo, hi = self._lo[hits], self._hi[hits]
                n = hi - lo
                take = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
                got = (self._rows[take], self._tfs[take])
            else:
                got = self._empty
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
        parts: Sequence[tuple[int, _TokenIndex | Postings | _FrozenTokens]],
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

    def _held(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``rows`` holding ``token`` (live or not) and its count in each."""
        rows, tfs = [], []
        for off, ti in self.parts:
            r, t = ti.posting(token)
            rows.append(r + off)
            tfs.append(t)
        r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        t = np.concatenate(tfs) if tfs else np.zeros(0)
        keep = r < len(self.live)
        return r[keep], t[keep]

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """Live rows holding ``token`` and its count in each."""
        r, t = self._held(token)
        keep = self.live[r]
        return r[keep], t[keep]

    def stats(self, tokens: list[str]) -> _FtsStats:
        """BM25 statistics of every row held here, superseded and deleted versions too.

        A Lance INVERTED index counts every row it indexed, so a flushed generation (or
        the base) counts its superseded rows; counting the same here makes the global
        statistics of a view independent of where its rows sit: a flush moving a
        MemTable's rows into a generation, or generations read as one block rather
        than through their own indexes, leaves every score unchanged.
        """
        return _FtsStats(
            num_docs=int(np.count_nonzero(self.doc_len > 0)),
            total_tokens=int(self.doc_len.sum()),
            df={t: len(self._held(t)[0]) for t in set(tokens)},
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
    ref: view.GenerationRef, table: Catalog, column: str, tok_kwargs: dict[str, Any]
) -> Postings:
    """Token index of one generation's ``column`` (cached: generations are immutable):
    from its postings sidecar (:mod:`memwal_query.format.postings`), else by tokenizing
    its text."""
    key = (ref.uri, column, repr(sorted(tok_kwargs.items())))
    ti: Postings | None = GENERATION_TOKEN_INDEXES.get(key)
    if ti is None:
        ti = postings.read(
            sources.file_io(ref.uri, table.storage_options), ref.uri, column, tok_kwargs
        )
        rows = sources.read_generation(ref, table.schema, table.storage_options, [column])
        if ti is not None and len(ti.doc_len) != rows.num_rows:
            warnings.warn(
                f"{join(ref.uri, postings.POSTINGS_FILE)}: postings of {len(ti.doc_len)} "
                f"documents for a generation of {rows.num_rows} rows; tokenizing the text",
                RuntimeWarning,
                stacklevel=2,
            )
            ti = None
        if ti is None:
            ti = Postings.of(rows.column(column), tok_kwargs)
        GENERATION_TOKEN_INDEXES.put(key, ti)
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
        indexes = sources.map_generations(
            lambda ref: _gen_token_index(ref, table, column, tok_kwargs),
            [ref for _, ref in block.members],
            table.storage_options or None,
        )
        offsets = np.cumsum([0, *block.sizes])[:-1].tolist()
        merged = block.cache.setdefault(key, _FrozenTokens(list(zip(offsets, indexes))))
    rows = block.keys.append_column(column, block.values)
    mf = _MemFts(rows, [(0, merged)], block.live_mask)
    mf.filter_mask = block.filter_mask
    return mf
