"""Vectorised last-write-wins: newest row per primary key, and key-set membership.

Rows handed to :func:`newest_per_key` are in ascending (``_gen``, ``_rowaddr``) order per
region (generations oldest first, then MemTables, rows in write order), so within a
region the newest version of a key is simply its *last* occurrence. Integer keys (any
range: negative, beyond 32 bits, near the int64 limits) find it with a dense table when
their range is compact and with a sort otherwise (the key and the row index packed into
one int64 when they fit, else an argsort of the keys); other keys with a hash
aggregation ``max(row index) GROUP BY key``.

The one rule every reader applies (SQL, lookup, vector and full-text search, Spark):
the newest version of a key is the one with the highest ``_gen``; within a region,
the highest ``_rowaddr`` (write order); a key written to two regions (regions created
by hand, or a region spec changed) with the same ``_gen`` in both: the region later in
region-id order. :func:`newest_indices` with ``regions`` applies it to rows of several
regions at O(rows) cost, sorting only the rows of keys found in more than one region.

:class:`KeySet` answers "is this base row's key overwritten by a newer source?" for
whole batches: a dense lookup table for integer keys in a compact range, binary search
for other integers, a hash-set join for everything else.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.rowaddrs import run_starts
from memwal_query.format.schema import as_int64, normalize_keys
from memwal_query.read import deletions

if TYPE_CHECKING:
    import lance

_IDX = "__memwal_idx"
_DENSE_LIMIT = 1 << 26
_RANGE_LOOP_MAX = 4096  # ranges counted one slice each (more: a binary search of all)


def newest_per_key(rows: pa.Table, pk: list[str]) -> pa.Table:
    """The last row of each key (rows must be oldest-first per key), in input order."""
    order = newest_indices(rows, pk)
    if len(order) == rows.num_rows:
        return rows
    return rows.take(pa.array(order))


def _int_values(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_temporal(t):
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        return as_int64(col).to_numpy(zero_copy_only=False)
    return None


def in_sorted(values: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    """Boolean mask: which ``values`` are in ``sorted_values`` (ascending; binary search)."""
    if not len(sorted_values):
        return np.zeros(len(values), dtype=bool)
    pos = np.searchsorted(sorted_values, values)
    pos[pos == len(sorted_values)] = 0
    return sorted_values[pos] == values


class KeySet:
    """A set of primary keys with vectorised membership tests.

    Parameters
    ----------
    keys : pa.Table
        Primary-key column(s).
    """

    def __init__(self, keys: pa.Table) -> None:
        self.pk = keys.column_names
        self.size = keys.num_rows
        self._dense: np.ndarray | None = None
        self._sorted: np.ndarray | None = None
        self._table: pa.Table | None = None
        self._addresses: dict[tuple[str, int, bool], np.ndarray] = {}  # base_addresses
        self._addresses_lock = threading.Lock()
        ints = _int_values(keys.column(0)) if len(self.pk) == 1 and self.size else None
        if self.size == 0:
            return
        if ints is not None:
            self._set_ints([ints])
        else:
            self._table = normalize_keys(keys, self.pk).combine_chunks()

    @classmethod
    def of_ints(cls, name: str, parts: list[np.ndarray]) -> KeySet:
        """The set of the keys of ``parts`` (one int64 key column ``name``), built part
        by part: the parts are not concatenated when their range is compact.

        Parameters
        ----------
        name : str
            The primary-key column.
        parts : list of np.ndarray
            int64 keys.

        Returns
        -------
        KeySet
        """
        out = cls(pa.table({name: pa.array([], pa.int64())}))
        parts = [p for p in parts if len(p)]
        out.size = sum(len(p) for p in parts)
        if parts:
            out._set_ints(parts)
        return out

    def _set_ints(self, parts: list[np.ndarray]) -> None:
        lo = min(int(p.min()) for p in parts)
        hi = max(int(p.max()) for p in parts)
        if hi - lo < _DENSE_LIMIT:
            dense = np.zeros(hi - lo + 1, dtype=bool)
            for p in parts:
                dense[p - lo] = True
            self._dense, self._lo, self._hi = dense, lo, hi
        else:
            ordered = np.sort(np.concatenate(parts))
            self._sorted = ordered[run_starts(ordered)]

    @property
    def hashed(self) -> bool:
        """Whether membership goes through a hash set (non-integer or composite keys),
        whose build costs O(set size) on every :meth:`contains` call."""
        return self._table is not None

    def has_addresses(self, base: lance.LanceDataset, row_ids: bool = False) -> bool:
        """Whether :meth:`base_addresses` of ``base``'s version is cached."""
        return (base.uri, base.version, row_ids) in self._addresses

    def base_addresses(self, base: lance.LanceDataset, row_ids: bool = False) -> np.ndarray:
        """Sorted row addresses (``_rowaddr``), or with ``row_ids`` row ids (``_rowid``),
        of the rows of ``base`` whose key is in the set.

        Reads the base table's key columns once per base version (cached on this set:
        sets of flushed generations live as long as the generations are unmerged), so
        that a scan can drop overwritten base rows by row address: a binary search per
        batch instead of building the hash set again for every batch. Row ids are what
        Lance's ``row_addr_blocklist`` is matched against: they equal the addresses
        unless the dataset has stable row ids (then they differ after a compaction).
        """
        key = (base.uri, base.version, row_ids)
        column = "_rowid" if row_ids else "_rowaddr"
        with self._addresses_lock:
            hit = self._addresses.get(key)
            if hit is not None:
                return hit
            parts = [np.zeros(0, dtype=np.uint64)]
            scan = deletions.scan(
                base,
                self.pk,
                with_row_address=not row_ids,
                with_row_id=row_ids,
                batch_size=1 << 20,
            )
            for batch, gone in scan:  # bounded memory: one batch of keys at a time
                addr = deletions.live_values(batch, column)
                found = self.contains(batch.select(self.pk))
                if gone is not None:
                    found &= ~gone
                parts.append(addr[found])
            found = np.sort(np.concatenate(parts))
            if len(self._addresses) >= 4:
                self._addresses.pop(next(iter(self._addresses)))
            self._addresses[key] = found
            return found

    def __len__(self) -> int:
        return self.size

    def sorted_ints(self) -> np.ndarray | None:
        """The distinct keys of an integer key set as int64, ascending (None for a
        hashed set)."""
        if self._dense is not None:
            out = np.flatnonzero(self._dense).astype(np.int64, copy=False)
            out += np.int64(self._lo)  # in place: one array of the keys' size
            return out
        if self._sorted is not None:
            return self._sorted
        if self._table is not None:
            return None
        return np.zeros(0, np.int64)

    def mark(self, into: np.ndarray, lo: int) -> None:
        """Set ``into[k - lo]`` for every key ``k`` of an integer key set that lies in
        ``lo .. lo + len(into) - 1`` (``into``: a boolean array, one flag per key).

        Raises
        ------
        TypeError
            The set is hashed (not one integer key column).
        """
        hi = lo + len(into) - 1
        if self._dense is not None:
            a, b = max(lo, self._lo), min(hi, self._hi)
            if a <= b:
                into[a - lo : b - lo + 1] |= self._dense[a - self._lo : b - self._lo + 1]
            return
        keys = self.sorted_ints()
        if keys is None:
            raise TypeError("a hashed key set has no integer keys to mark")
        i = int(np.searchsorted(keys, np.int64(lo), side="left"))
        j = int(np.searchsorted(keys, np.int64(hi), side="right"))
        into[keys[i:j] - np.int64(lo)] = True

    def count_in_ranges(self, first: np.ndarray, last: np.ndarray) -> int | None:
        """How many distinct keys of an integer key set lie in each range ``first[i] ..
        last[i]`` (int64, inclusive), summed over the ranges; None for a hashed set."""
        if self._dense is not None and len(first) <= _RANGE_LOOP_MAX:
            # slices of the dense table: no array of the keys
            lo, hi = self._lo, self._hi
            total = 0
            for a, b in zip(first.tolist(), last.tolist()):
                a, b = max(a, lo), min(b, hi)
                if a <= b:
                    total += int(np.count_nonzero(self._dense[a - lo : b - lo + 1]))
            return total
        keys = self.sorted_ints()
        if keys is None:
            return None
        inside = np.searchsorted(keys, last, side="right") - np.searchsorted(keys, first)
        return int(inside.sum())

    @property
    def nbytes(self) -> int:
        """Bytes the set holds (its table, and the base addresses cached on it)."""
        held = sum(a.nbytes for a in self._addresses.values())
        for part in (self._dense, self._sorted):
            if part is not None:
                held += part.nbytes
        if self._table is not None:
            held += self._table.nbytes
        return held

    def distinct(self) -> int:
        """How many distinct keys the set holds (counted: O(set size))."""
        if self._dense is not None:
            return int(np.count_nonzero(self._dense))
        if self._sorted is not None:
            return len(self._sorted)
        if self._table is None:
            return 0
        return self._table.group_by(self.pk).aggregate([]).num_rows

    def contains(self, keys: pa.Table | pa.RecordBatch) -> np.ndarray:
        """Boolean mask: which rows of ``keys`` (same columns) are in the set."""
        n = keys.num_rows
        if self.size == 0 or n == 0:
            return np.zeros(n, dtype=bool)
        if self._dense is not None or self._sorted is not None:
            v = _int_values(keys.column(0))
            assert v is not None  # an integer key set is only probed with integer keys
            if self._dense is not None:
                # offsets from the low end as uint64: below it wraps to huge, so one
                # comparison bounds both ends (no boolean indexing: a gather, clipped)
                off = v.view(np.uint64) - np.uint64(self._lo & 0xFFFFFFFFFFFFFFFF)
                got = self._dense.take(off, mode="clip")
                got &= off <= np.uint64(self._hi - self._lo)
                return got
            assert self._sorted is not None
            return in_sorted(v, self._sorted)
        if isinstance(keys, pa.RecordBatch):
            keys = pa.Table.from_batches([keys])
        keys = normalize_keys(keys, self.pk)
        assert self._table is not None
        if len(self.pk) == 1:
            return pc.is_in(keys.column(0), value_set=self._table.column(0)).to_numpy(
                zero_copy_only=False
            )
        probe = pa.table({**{k: keys.column(k) for k in self.pk}, _IDX: np.arange(n)})
        hit = probe.join(self._table, keys=self.pk, join_type="left semi").column(_IDX)
        out = np.zeros(n, dtype=bool)
        out[hit.to_numpy()] = True
        return out


class KeySetUnion:
    """The union of several :class:`KeySet` (each one cached on its own).

    Parameters
    ----------
    sets : list of KeySet
        Sets over the same primary-key columns.
    """

    def __init__(self, sets: list[KeySet]) -> None:
        self.sets = [s for s in sets if len(s)]

    def __len__(self) -> int:
        """Total size of the sets (a key in two sets counts twice; 0 means empty)."""
        return sum(len(s) for s in self.sets)

    def contains(self, keys: pa.Table | pa.RecordBatch) -> np.ndarray:
        """Boolean mask: which rows of ``keys`` are in any of the sets."""
        out = np.zeros(keys.num_rows, dtype=bool)
        for s in self.sets:
            out |= s.contains(keys)
        return out


def newest_indices(
    rows: pa.Table,
    pk: list[str],
    regions: np.ndarray | None = None,
    generations: np.ndarray | None = None,
    key_order: bool = False,
) -> np.ndarray:
    """Sorted row indices of the newest row per key.

    Without ``regions``: the last row of each key (rows oldest-first per key). With
    ``regions`` (region rank of every row, e.g. its position in region-id order) and
    ``generations`` (``_gen`` of every row; rows oldest-first per key *within* a
    region): the module's rule, highest ``_gen``, then the later row of a region, then
    the higher region rank. Keys found in one region only cost nothing extra.

    ``key_order`` (without ``regions`` only): when the key is one integer or temporal
    column, the indices in the order of their keys' int64 values instead (the order
    the deduplication finds them in: no sort; a source in key order costs Lance's
    ``merge_insert`` less); other keys come sorted as without it.
    """
    if rows.num_rows == 0:
        return np.zeros(0, dtype=np.int64)
    multi = regions is not None and bool(len(regions)) and regions.min() != regions.max()
    if len(pk) == 1:
        ints = _int_values(rows.column(pk[0]))
        if ints is not None:
            lasts, firsts = int_runs(ints)
            if not multi:
                return lasts if key_order else np.sort(lasts)
            assert regions is not None
            return _across_regions(rows, pk, lasts, firsts, regions, generations)
    idx = pa.array(np.arange(rows.num_rows, dtype=np.int64))
    keyed = normalize_keys(rows.select(pk), pk).append_column(_IDX, idx)
    if not multi:
        last = keyed.group_by(pk).aggregate([(_IDX, "max")]).column(f"{_IDX}_max")
        return np.sort(last.to_numpy())
    agg = keyed.group_by(pk).aggregate([(_IDX, "max"), (_IDX, "min")])
    lasts = agg.column(f"{_IDX}_max").to_numpy()
    firsts = agg.column(f"{_IDX}_min").to_numpy()
    assert regions is not None
    return _across_regions(rows, pk, lasts, firsts, regions, generations)


def _dense_span(n: int) -> int:
    """Largest key range (max - min) deduplicated with a dense table for ``n`` keys:
    within a few times the row count (a table of int64 per value in the range), so the
    memory stays O(rows); wider ranges are sorted."""
    return max(1 << 16, 2 * n)


def int_runs(ints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(last, first) row index of each distinct value of ``ints`` (int64, rows in write
    order), ordered by value.

    A dense table over the range when it is compact (:func:`_dense_span`); otherwise a
    sort: the value offset and the row index packed into one int64 and sorted (numpy's
    vectorised sort) when the range times the row count fits in 63 bits, else an
    argsort of the values with the first and last index of each run of equal values.
    Never a hash table, whatever the range (negative, beyond 32 bits, int64 limits).
    """
    n = len(ints)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = int(ints.min()), int(ints.max())
    span = hi - lo  # a Python int: no overflow near the int64 limits
    pos = np.arange(n, dtype=np.int64)
    if span <= _dense_span(n):
        last = np.full(span + 1, -1, dtype=np.int64)
        np.maximum.at(last, ints - lo, pos)
        first = np.full(span + 1, n, dtype=np.int64)
        np.minimum.at(first, ints - lo, pos)
        seen = last >= 0
        return last[seen], first[seen]
    bits = n.bit_length()
    if span < (1 << (63 - bits)):
        packed = ints - lo  # offsets are >= 0 and below 2**(63-bits)
        packed <<= bits  # in place: one array of the keys' size, not three
        packed |= pos
        del pos
        packed.sort()
        values = packed >> bits
        starts = run_starts(values)
        ends = np.append(starts[1:], n) - 1
        low = np.int64((1 << bits) - 1)
        return packed[ends] & low, packed[starts] & low
    order = np.argsort(ints)
    starts = run_starts(ints[order])
    return np.maximum.reduceat(order, starts), np.minimum.reduceat(order, starts)


def _across_regions(
    rows: pa.Table,
    pk: list[str],
    lasts: np.ndarray,
    firsts: np.ndarray,
    regions: np.ndarray,
    generations: np.ndarray | None,
) -> np.ndarray:
    """Newest row of each key given its first and last row; keys whose rows lie in more
    than one region (their first and last row, or any rows between, differ in region)
    are decided by (``_gen``, region rank, row order)."""
    if generations is None:
        raise ValueError("newest_indices: regions given without generations")
    # Rows grouped by region (each region's rows contiguous, in any region order): a
    # key spans regions iff its first and last rows differ in region. Otherwise compare
    # every row with its key's last.
    if (regions[firsts] == regions[lasts]).all() and _grouped(regions):
        return np.sort(lasts)
    key_last = _key_last_index(rows, pk, lasts)
    odd_rows = regions[key_last] != regions
    if not odd_rows.any():
        return np.sort(lasts)
    mark = np.zeros(rows.num_rows, bool)
    mark[key_last[odd_rows]] = True  # a key is identified by the index of its last row
    idx = np.flatnonzero(mark[key_last])
    order = np.lexsort((idx, regions[idx], generations[idx]))
    ordered = idx[order]
    winners = ordered[newest_indices(rows.select(pk).take(pa.array(ordered)), pk)]
    return np.sort(np.concatenate([lasts[~mark[lasts]], winners]))


def _grouped(regions: np.ndarray) -> bool:
    """Whether each value of ``regions`` occupies one contiguous run."""
    changes = np.flatnonzero(regions[1:] != regions[:-1])
    run_values = regions[np.concatenate([[0], changes + 1])]
    return len(np.unique(run_values)) == len(run_values)


def _key_last_index(rows: pa.Table, pk: list[str], lasts: np.ndarray) -> np.ndarray:
    """For every row, the index of the last row of its key (``lasts``: one per key)."""
    n = rows.num_rows
    if len(pk) == 1:
        ints = _int_values(rows.column(pk[0]))
        if ints is not None:
            lo = int(ints.min())
            span = int(ints.max()) - lo
            if span <= _dense_span(n):
                table = np.zeros(span + 1, dtype=np.int64)
                table[ints[lasts] - lo] = lasts
                return table[ints - lo]
            # by value: each key's last row, then every row's key located by binary search
            owners = ints[lasts]
            order = np.argsort(owners)
            return lasts[order][np.searchsorted(owners[order], ints)]
    keys = normalize_keys(rows.select(pk), pk)
    probe = keys.append_column(_IDX, pa.array(np.arange(n, dtype=np.int64)))
    owners = keys.take(pa.array(lasts)).append_column("__memwal_last", pa.array(lasts))
    joined = probe.join(owners, keys=pk, join_type="inner")
    out = np.empty(n, dtype=np.int64)
    out[joined.column(_IDX).to_numpy()] = joined.column("__memwal_last").to_numpy()
    return out
