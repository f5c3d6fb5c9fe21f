"""The MemTable key index of point lookups: sorted key hashes per MemTable, extended as
it grows, matched exactly."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.schema import (
    TOMBSTONE,
    as_int64,
)
from memwal_query.search.caches import MEMTABLE_KEY_INDEXES
from memwal_query.search.keys import _conform_keys, _index_hashes, _match_keys

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.memtable import MemTableSnapshot


_MEM_KEYS_GATHER = 32  # up to this many rows are sliced out of their batches, else take

EXTEND_AFTER_SCANS = 8
"""A MemTable's rows appended since its key index was last extended are scanned by each
lookup (a membership test of their key hashes: ~10 ns a row) until the lookups have
scanned this many times as many rows as are pending; then they are indexed (~100 ns a
row: hashes sorted and merged into the runs). A lookup of a few keys in a MemTable that
grows between lookups (a WAL tail under a stream) so costs what its rows cost to test,
not what they cost to index, and a MemTable looked up again and again is indexed after
a few scans: at most about twice the cheaper of the two (measured, numpy 2 on 2 cores:
33,000 rows indexed in 9-15 ms, tested against 10 keys in 0.2 ms)."""


class _MemKeyRun:
    """Sorted key hashes of the MemTable rows ``[start, end)`` and those rows' keys."""

    __slots__ = ("start", "end", "hashes", "local", "keys")

    def __init__(self, start: int, hashes: np.ndarray, local: np.ndarray, keys: pa.Table):
        self.start = start
        self.end = start + keys.num_rows
        self.hashes = hashes  # sorted
        self.local = local  # row - start of each hash
        self.keys = keys  # key columns of rows start..end, in row order (one chunk)


def _merge_runs(a: _MemKeyRun, b: _MemKeyRun) -> _MemKeyRun:
    """One run of two adjacent runs (``a.end == b.start``), by a linear merge."""
    na, nb = len(a.hashes), len(b.hashes)
    at_b = np.searchsorted(a.hashes, b.hashes, side="right") + np.arange(nb)
    from_a = np.ones(na + nb, bool)
    from_a[at_b] = False
    hashes = np.empty(na + nb, np.uint64)
    local = np.empty(na + nb, np.int64)
    hashes[at_b] = b.hashes
    hashes[from_a] = a.hashes
    local[at_b] = b.local + (b.start - a.start)
    local[from_a] = a.local
    keys = pa.concat_tables([a.keys, b.keys]).combine_chunks()
    return _MemKeyRun(a.start, hashes, local, keys)


class _MemKeyIndex:
    """Key hashes of one MemTable's rows, for point lookups in O(log n).

    Built incrementally as batches are appended (tracked by batch identity): every new
    group of batches becomes a sorted run of ``(hash, row)``, and adjacent runs are
    merged while the older one is at most twice the newer one, so there are O(log n)
    runs and each row is merged O(log n) times. A lookup binary-searches every run;
    the candidate rows (equal hash: every version of the key, and any 64-bit hash
    collision) are compared with the probe keys exactly and the newest wins.

    The index holds weak references to the batches only: once one is garbage collected
    (the MemTable is gone), ids may be reused and the index is never used again.

    A single integer key is its own hash (:func:`_value_hashes`: exact, and no hashing
    of every row appended); other keys are hashed with :func:`_index_hashes`.
    """

    def __init__(self, pk: list[str], batch_keys: pa.Schema, key_schema: pa.Schema) -> None:
        self.lock = threading.Lock()
        self.pk = pk
        self.batch_keys = batch_keys  # key fields as stored in the batches
        self.key_schema = key_schema  # key fields of the table (= lookup keys)
        self.ids: tuple[int, ...] = ()
        self._refs: list[weakref.ref[pa.RecordBatch]] = []
        self._dead = [False]
        self.offsets = np.zeros(1, np.int64)  # first row of each batch, then the total
        self.runs: list[_MemKeyRun] = []
        self.by_value = _by_value(key_schema)
        self.scanned = 0  # rows scanned by lookups since the index was last extended

    @property
    def dead(self) -> bool:
        return self._dead[0]

    def extend(self, batches: Sequence[pa.RecordBatch]) -> None:
        """Index ``batches[len(self.ids):]`` (the earlier ones are indexed already)."""
        new = batches[len(self.ids) :]
        if not new:
            return
        dead = self._dead

        def died(_ref: weakref.ref[pa.RecordBatch], dead: list[bool] = dead) -> None:
            dead[0] = True

        self.scanned = 0
        self._refs.extend(weakref.ref(b, died) for b in new)
        self.ids = self.ids + tuple(map(id, new))
        start = int(self.offsets[-1])
        sizes = np.array([b.num_rows for b in new], np.int64)
        self.offsets = np.concatenate([self.offsets, start + np.cumsum(sizes)])
        if not sizes.sum():
            return
        keys = pa.Table.from_batches([b.select(self.pk) for b in new], schema=self.batch_keys)
        keys = _conform_keys(keys, self.key_schema).combine_chunks()
        hashes = _value_hashes(keys) if self.by_value else _index_hashes(keys)
        order = np.argsort(hashes, kind="stable")
        self.runs.append(_MemKeyRun(start, hashes[order], order.astype(np.int64), keys))
        while len(self.runs) > 1 and len(self.runs[-2].hashes) <= 2 * len(self.runs[-1].hashes):
            b = self.runs.pop()
            self.runs.append(_merge_runs(self.runs.pop(), b))

    def find(
        self, probe: pa.Table, hashes: np.ndarray, limit: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(probe index, row) of the newest row below ``limit`` of each probe key found.

        ``probe`` holds distinct keys, ``hashes`` their :func:`_index_hashes`.
        """
        cand_keys: list[pa.Table] = []
        cand_rows: list[np.ndarray] = []
        for run in self.runs:
            if run.start >= limit:
                break
            lo = np.searchsorted(run.hashes, hashes, "left")
            hi = np.searchsorted(run.hashes, hashes, "right")
            cnt = hi - lo
            total = int(cnt.sum())
            if total == 0:
                continue
            if total == len(cnt) and int(cnt.max()) == 1:  # one candidate per probe key
                pos = lo
            else:
                ends = np.cumsum(cnt)
                pos = np.arange(total) + np.repeat(lo - (ends - cnt), cnt)
            local = run.local[pos]
            if run.end > limit:
                local = local[local < limit - run.start]
                if len(local) == 0:
                    continue
            cand_keys.append(run.keys.take(local))
            cand_rows.append(local + run.start)
        if not cand_rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        keys = cand_keys[0] if len(cand_keys) == 1 else pa.concat_tables(cand_keys)
        rows = cand_rows[0] if len(cand_rows) == 1 else np.concatenate(cand_rows)
        return _newest_matches(keys, rows, probe)

    def scan(
        self, pending: Sequence[pa.RecordBatch], probe: pa.Table, hashes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(probe index, row) of the newest row of each probe key found in ``pending``,
        the batches after the indexed ones (rows numbered on from the indexed rows), by
        testing every pending row's key hash; counted in :attr:`scanned`."""
        keys = pa.Table.from_batches([b.select(self.pk) for b in pending], schema=self.batch_keys)
        keys = _conform_keys(keys, self.key_schema).combine_chunks()
        self.scanned += keys.num_rows
        own = _value_hashes(keys) if self.by_value else _index_hashes(keys)
        hit = pc.is_in(pa.array(own), value_set=pa.array(hashes, pa.uint64()))
        local = np.flatnonzero(hit.to_numpy(zero_copy_only=False))
        if len(local) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        start = int(self.offsets[-1])
        return _newest_matches(keys.take(pa.array(local)), local + start, probe)


def _newest_matches(
    keys: pa.Table, rows: np.ndarray, probe: pa.Table
) -> tuple[np.ndarray, np.ndarray]:
    """(probe index, row) of the newest (highest) of ``rows`` whose key (``keys``, one
    per row) equals each probe key, compared exactly."""
    r, p = _match_keys(keys, probe)
    rows = rows[r]
    if len(p) > 1:  # the newest row of each probe key
        order = np.lexsort((rows, p))
        p, rows = p[order], rows[order]
        last = np.ones(len(p), bool)
        last[:-1] = p[1:] != p[:-1]
        p, rows = p[last], rows[last]
    return p, rows


def _by_value(key_schema: pa.Schema) -> bool:
    """Whether keys of ``key_schema`` are indexed by value (one integer column)."""
    return len(key_schema) == 1 and pa.types.is_integer(key_schema.field(0).type)


def _value_hashes(keys: pa.Table) -> np.ndarray:
    """One integer key column's values as uint64 (distinct keys, distinct values)."""
    return as_int64(keys.column(0).combine_chunks()).to_numpy(zero_copy_only=False).view(np.uint64)


def _memtable_find(
    table: Catalog, m: MemTableSnapshot, probe: pa.Table, hashes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probe index, row) of the newest row of each probe key in ``m``, and the row
    offsets of its batches.

    The MemTable's key index is cached per (table, region, generation). The batches
    appended since it was last extended are scanned, and indexed once lookups have
    scanned them :data:`EXTEND_AFTER_SCANS` times over. A snapshot older than the
    index (a prefix of its batches) uses it with a row limit; a different batch
    sequence (a WAL entry adopted before unsynced rows, or another MemTable) starts a
    new one.
    """
    pk = list(probe.column_names)
    if _by_value(probe.schema):
        hashes = _value_hashes(probe)
    key = (table.uri, m.region_id, m.generation, tuple(pk))
    batches = m.batches
    ids = tuple(map(id, batches))
    idx: _MemKeyIndex | None = MEMTABLE_KEY_INDEXES.get(key)
    if idx is not None:
        with idx.lock:
            done = len(idx.ids)
            if not idx.dead and idx.ids[: len(ids)] == ids:  # the index covers m
                p, r = idx.find(probe, hashes, int(idx.offsets[len(ids)]))
                return p, r, idx.offsets
            if not idx.dead and ids[:done] == idx.ids:  # m has batches after the index's
                return _find_pending(idx, batches, probe, hashes)
    batch_keys = pa.schema([m.schema.field(k) for k in pk])
    idx = _MemKeyIndex(pk, batch_keys, probe.schema)
    with idx.lock:
        MEMTABLE_KEY_INDEXES.put_newest(key, idx)
        return _find_pending(idx, batches, probe, hashes)


def _find_pending(
    idx: _MemKeyIndex, batches: Sequence[pa.RecordBatch], probe: pa.Table, hashes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_memtable_find` for a snapshot whose first batches are ``idx``'s (held
    locked) and that has more: those are indexed, or scanned (:data:`EXTEND_AFTER_SCANS`)."""
    pending = batches[len(idx.ids) :]
    rows = sum(b.num_rows for b in pending)
    if idx.scanned + rows >= EXTEND_AFTER_SCANS * rows:
        idx.extend(batches)
        p, r = idx.find(probe, hashes, int(idx.offsets[-1]))
        return p, r, idx.offsets
    p, r = idx.find(probe, hashes, int(idx.offsets[-1]))
    p_new, r_new = idx.scan(pending, probe, hashes)
    if len(p_new):  # a pending row is newer than every indexed one
        older = ~np.isin(p, p_new)
        p, r = np.concatenate([p[older], p_new]), np.concatenate([r[older], r_new])
    sizes = np.array([b.num_rows for b in pending], np.int64)
    offsets = np.concatenate([idx.offsets, idx.offsets[-1] + np.cumsum(sizes)])
    return p, r, offsets


def _memtable_rows_at(
    m: MemTableSnapshot, offsets: np.ndarray, rows: np.ndarray, cols: list[str]
) -> pa.Table:
    """Rows ``rows`` of a MemTable snapshot (columns ``cols``), in that order."""
    if len(rows) <= _MEM_KEYS_GATHER:
        which = (np.searchsorted(offsets, rows, "right") - 1).tolist()
        starts = offsets[which].tolist()
        parts = [m.batches[b].slice(r - s, 1) for b, s, r in zip(which, starts, rows.tolist())]
        return pa.Table.from_batches(parts, schema=m.schema).select(cols)
    return m.to_table().select(cols).take(pa.array(rows))


def _memtable_lookup(
    table: Catalog,
    m: MemTableSnapshot,
    probe: pa.Table,
    hashes: np.ndarray,
    read_cols: list[str],
) -> tuple[pa.Table, np.ndarray] | None:
    """Newest row (maybe a tombstone) of each probe key in one MemTable, and its probe
    index (``hashes``: the probe keys' :func:`_index_hashes`)."""
    p, r, offsets = _memtable_find(table, m, probe, hashes)
    if len(p) == 0:
        return None
    names = set(m.schema.names)
    cols = [c for c in read_cols if c in names and c != TOMBSTONE] + [TOMBSTONE]
    return _memtable_rows_at(m, offsets, r, cols), p
