"""All flushed generations of a search as one in-memory source.

A Lance query costs a few milliseconds however small the table, so asking every
unmerged generation separately makes a vector search pay per generation (192
generations: 192 queries). Generations are small (a flushed MemTable each) and
immutable, so a search instead reads the searched column of every generation of its
view once (cached per set of generations), deduplicates them with the readers' one rule
(:func:`memwal_query.read.dedup.newest_indices`: highest ``_gen``, then write order,
then region rank) and answers each query with one exact, vectorised numpy pass over
the live rows. The base table and the MemTables stay sources of their own; staleness
between them and the block is decided per row with the same rule.

Exact search over the generations makes their part of the result exact (recall 1);
the block is used when the generations hold at most :data:`BLOCK_MAX_ROWS` rows in all.
A filter is evaluated on the block's live rows only (the newest version of each key
among the generations, :meth:`GenBlock.filter_mask`), with the same DataFusion SQL as
the MemTables': a stale version never matches in place of the newest one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.schema import TOMBSTONE, cache_key
from memwal_query.read import sources, view
from memwal_query.read.dedup import newest_indices
from memwal_query.search.caches import GENERATION_BLOCKS
from memwal_query.search.common import DISTANCE, ROWID
from memwal_query.search.keys import _ints, _KeyIndex
from memwal_query.search.plan import _filter_indices
from memwal_query.search.vecmath import _distances, _vectors

BLOCK_MAX_ROWS = 2_000_000
"""Generations holding more rows than this in all are searched one by one (their indexes)."""
BLOCK_MIN_GENERATIONS = 4
"""Fewer generations than this are searched one by one (a few concurrent Lance queries
cost about as much as the block, and keep their per-generation counters in ``debug``)."""

FILTER_MASKS = 16
"""Filter results kept per block (the same filter asked again costs nothing)."""


class _TooLarge(Exception):
    """Internal: the generations hold more than BLOCK_MAX_ROWS rows."""


class GenBlock:
    """The searched column of a set of generations, deduplicated, as one matrix.

    Rows are ordered by region rank, then generation, then write order. ``gens`` and
    ``ranks`` give each row's ``_gen`` and region rank; ``live_rows`` (and, one bool per
    row, ``live_mask``) the rows that are the newest version of a live key among these
    generations.
    """

    def __init__(
        self,
        members: Sequence[tuple[int, view.GenerationRef]],
        schema: pa.Schema,
        pk: list[str],
        column: str,
        storage_options: dict[str, str] | None,
    ) -> None:
        self.members = list(members)
        self.schema = schema
        self.pk = pk
        self.column = column
        self.storage_options = storage_options
        cols = [*pk, column, TOMBSTONE]
        total = [0]
        lock = threading.Lock()

        def count(t: pa.Table) -> None:
            with lock:
                total[0] += t.num_rows
                if total[0] > BLOCK_MAX_ROWS:
                    raise _TooLarge

        # GenerationGoneError when a generation's files are gone: the search re-plans
        refs = [ref for _, ref in self.members]
        parts = sources.read_generations(refs, schema, storage_options, cols, check=count)
        self.sizes = [t.num_rows for t in parts]
        sizes = np.array(self.sizes, np.int64)
        starts = np.cumsum(sizes) - sizes
        self.member = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
        self.gens = np.array([ref.generation for ref in refs], np.int64)[self.member]
        self.ranks = np.array([rank for rank, _ in self.members], np.int64)[self.member]
        self.pos = np.arange(int(sizes.sum()), dtype=np.int64) - starts[self.member]
        rows = pa.concat_tables(parts) if parts else pa.table({})
        self.keys = rows.select(pk).combine_chunks()
        self.values = rows.column(column)
        last = newest_indices(self.keys, pk, self.ranks, self.gens)
        tomb = pc.fill_null(rows.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
        self.live_rows = last[~tomb[last]]
        self.live_mask = np.zeros(len(self.gens), bool)  # the same, one bool per row
        self.live_mask[self.live_rows] = True
        # newest version of every key here (tombstones too: they hide older rows): for
        # one integer key column sorted values (binary search), else a hashed key index
        ints = _ints(self.keys.column(0)) if len(pk) == 1 and len(last) else None
        self._newest_ints: tuple[np.ndarray, np.ndarray] | None = None
        self._newest: _KeyIndex | None = None
        if ints is not None:
            order = np.argsort(ints[last])  # unique keys: no need for a stable sort
            self._newest_ints = (ints[last][order], last[order])
        else:
            self._newest = _KeyIndex(self.keys.take(pa.array(last)), tomb[last], last)
        self._lock = threading.Lock()
        self.cache: dict[Any, Any] = {}  # derived structures (e.g. merged token indexes)
        self._matrix: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._masks: dict[str, np.ndarray] = {}

    @property
    def num_rows(self) -> int:
        return len(self.gens)

    def newest(self, keys: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(``_gen``, region rank) of the newest version of each key here (-1: absent)."""
        n = keys.num_rows
        g = np.full(n, -1, np.int64)
        r = np.full(n, -1, np.int64)
        if n == 0 or len(self.live_rows) + len(self.gens) == 0:
            return g, r
        if self._newest_ints is not None:
            probe = _ints(keys.column(0))
            if probe is not None:
                values, at = self._newest_ints
                pos = np.minimum(np.searchsorted(values, probe), len(values) - 1)
                hit = values[pos] == probe
                rows = at[pos[hit]]
                g[hit] = self.gens[rows]
                r[hit] = self.ranks[rows]
                return g, r
            # keys of another type than the table's (not expected): exact key index
            last = self._newest_ints[1]
            self._newest = _KeyIndex(
                self.keys.take(pa.array(last)), np.zeros(len(last), bool), last
            )
            self._newest_ints = None
        assert self._newest is not None
        if self._newest.num_keys == 0:
            return g, r
        pos = self._newest.probe(keys)
        hit = pos >= 0
        rows = self._newest.rows[pos[hit]]
        g[hit] = self.gens[rows]
        r[hit] = self.ranks[rows]
        return g, r

    def matrix(self, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(float32 matrix of every row's non-null vector, their block rows, which of
        them are live). Not narrowed to the live rows: distances to all of them cost
        about what gathering the live rows' vectors would."""
        with self._lock:
            if self._matrix is None:
                # every row's vector at once (a take across the generations' chunks cost
                # a cold search ~20 ms at 192 generations)
                every, valid = _vectors(self.values, dim)
                self._matrix = (np.ascontiguousarray(every), valid, self.live_mask[valid])
            return self._matrix

    def filter_mask(self, filter: Any) -> np.ndarray:
        """Which block rows are live and match ``filter`` (SQL text or a pyarrow
        Expression), one bool per block row.

        The filter is evaluated on the live rows only (the newest version of each key
        here), reading the columns it names from the generations (cached per
        generation); a stale version of a key never stands in for its newest one.
        """
        key = filter if isinstance(filter, str) else f"expr:{filter}"
        with self._lock:
            mask = self._masks.get(key)
        if mask is not None:
            return mask
        names = _named_columns(filter, self.schema.names, [*self.pk, self.column])
        try:
            idx = self._filter_live(filter, names)
        except Exception:  # noqa: BLE001 - a column the text scan missed: all columns
            idx = self._filter_live(filter, list(self.schema.names))
        mask = np.zeros(self.num_rows, bool)
        mask[self.live_rows[idx]] = True
        with self._lock:
            if len(self._masks) >= FILTER_MASKS:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = mask
        return mask

    def _filter_live(self, filter: Any, names: list[str]) -> np.ndarray:
        """Positions in ``live_rows`` of the rows matching ``filter``."""
        key = ("live columns", tuple(names))
        rows = self.cache.get(key)
        if rows is None:
            refs = [ref for _, ref in self.members]
            parts = sources.read_generations(refs, self.schema, self.storage_options, names)
            rows = pa.concat_tables(parts).take(pa.array(self.live_rows))
            rows = self.cache.setdefault(key, rows)
        return _filter_indices(rows, filter)

    def knn(self, q: np.ndarray, k: int, metric: str, filter: Any = None) -> pa.Table:
        """Exact ``k`` nearest live rows (matching ``filter`` when given): key, vector,
        ``_distance``, ``_rowid`` (block row)."""
        mat, rows, live = self.matrix(q.size)
        ok = live if filter is None else live & self.filter_mask(filter)[rows]
        cand = np.flatnonzero(ok)
        d: np.ndarray | None = None
        if metric in ("l2", "euclidean"):
            d, cand = self._nearest_l2(mat, q, cand, k)
        if d is None:
            d = _distances(mat, q, metric)
            if k < len(cand):
                cand = cand[np.argpartition(d[cand], k - 1)[:k]]
        top = cand[np.lexsort((rows[cand], d[cand]))]
        chosen = rows[top]
        take = pa.array(chosen)
        out = self.keys.take(take).append_column(self.column, self.values.take(take))
        out = out.append_column(DISTANCE, pa.array(d[top].astype(np.float32)))
        return out.append_column(ROWID, pa.array(chosen.astype(np.uint64)))

    def _nearest_l2(
        self, mat: np.ndarray, q: np.ndarray, cand: np.ndarray, k: int
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """(exact squared L2 distances, indexed like ``mat``, valid at the returned
        candidates; the ``k`` nearest of ``cand``), or (None, ``cand``) when the shortcut
        cannot prove its answer.

        Ranks ``cand`` by ``|x|^2 - 2 x.q`` (one matrix-vector product, with the norms
        cached) and scores the best ``4k + 64`` exactly; the answer is exact when their
        ``k``-th exact distance is below what any other candidate can have (its ranked
        value plus ``|q|^2`` minus a float32 rounding bound). Else the caller scores
        every row.
        """
        m = 4 * k + 64
        if len(cand) <= 2 * m:
            return None, cand
        with self._lock:
            norms = self.cache.get("l2 norms")
            if norms is None:
                norms = np.einsum("ij,ij->i", mat, mat)
                self.cache["l2 norms"] = norms
        qq = float(np.dot(q, q))
        ranked = (norms - 2.0 * (mat @ q))[cand]
        part = np.argpartition(ranked, m - 1)
        pick, rest = cand[part[:m]], part[m:]
        exact = _distances(mat[pick], q, "l2")
        kth = float(np.partition(exact, k - 1)[k - 1])
        # float32 rounding of |x|^2, 2 x.q and |q|^2: relative to their magnitudes
        tol = 1e-4 * (float(norms[cand].max()) + qq + 1.0)
        if kth >= float(ranked[rest].min()) + qq - tol:
            return None, cand
        d = np.full(len(mat), np.inf, np.float32)
        d[pick] = exact
        best = np.argpartition(exact, k - 1)[:k]
        return d, pick[best]

    def take(self, rows: np.ndarray, columns: list[str]) -> pa.Table:
        """Columns ``columns`` of block rows ``rows``, in that order."""
        members = self.member[rows]
        out: list[tuple[np.ndarray, pa.Table]] = []
        for i in np.unique(members).tolist():
            at = np.flatnonzero(members == i)
            _, ref = self.members[i]
            t = sources.read_generation(ref, self.schema, self.storage_options, columns)
            out.append((at, t.take(pa.array(self.pos[rows[at]]))))
        order = np.concatenate([at for at, _ in out])
        got = pa.concat_tables([t for _, t in out])
        return got.take(pa.array(np.argsort(order, kind="stable")))


def _named_columns(filter: Any, names: Sequence[str], have: Sequence[str]) -> list[str]:
    """Columns of ``names`` a filter may refer to (every name that occurs in its text,
    case-insensitively: reading one column too many is harmless), with ``have`` first."""
    text = str(filter).lower()
    named = [n for n in names if n.lower() in text]
    return list(dict.fromkeys([*have, *named]))


def _block_key(
    members: Sequence[tuple[int, view.GenerationRef]], schema: pa.Schema, pk: list[str], column: str
) -> tuple[Any, ...]:
    return (tuple((r, g.uri) for r, g in members), column, tuple(pk), cache_key(schema))


def cached_block(
    members: Sequence[tuple[int, view.GenerationRef]], schema: pa.Schema, pk: list[str], column: str
) -> GenBlock | None:
    """The block of ``members`` when it is cached (see :func:`gen_block`), else None."""
    block: GenBlock | None = GENERATION_BLOCKS.get(_block_key(members, schema, pk, column))
    return block


def gen_block(
    members: Sequence[tuple[int, view.GenerationRef]],
    schema: pa.Schema,
    pk: list[str],
    column: str,
    storage_options: dict[str, str] | None,
) -> GenBlock | None:
    """The (cached) block of ``members`` (``(region rank, generation)``, ordered by rank,
    then generation); None when they hold more than :data:`BLOCK_MAX_ROWS` rows."""
    key = _block_key(members, schema, pk, column)
    block: GenBlock | None = GENERATION_BLOCKS.get(key)
    if block is None:
        try:
            block = GenBlock(members, schema, pk, column, storage_options)
        except _TooLarge:
            return None
        GENERATION_BLOCKS.put(key, block)
    return block
