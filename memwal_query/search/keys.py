"""Key matching on Arrow tables: first/last occurrences, exact key pairs, the
per-generation key index."""

from __future__ import annotations

import functools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.bloom import hash_keys
from memwal_query.format.keyfile import KeyIndex
from memwal_query.format.schema import (
    as_int64,
    normalize_keys,
)
from memwal_query.read.dedup import newest_indices
from memwal_query.search.common import _IDX, _PROBE, _SMALL_MATCH


def _last_occurrence(keys: pa.Table) -> np.ndarray:
    """Sorted row indices of the last occurrence of each key (rows in write order):
    the readers' one deduplication, :func:`memwal_query.read.dedup.newest_indices`."""
    return newest_indices(keys, keys.column_names)


def _mask_to_indices(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask).astype(np.int64)


def _normalized_keys(keys: pa.Table) -> pa.Table:
    """Key columns as values that are equal exactly when the keys are (see
    :func:`_hashable_column`; ``hash_keys`` of the result is :func:`_index_hashes`)."""
    cols = [_hashable_column(c) for c in keys.columns]
    return pa.Table.from_arrays(cols, names=keys.column_names)


class _KeyIndex:
    """Newest row of each key of an immutable source, probed by sorted key hashes.

    Parameters
    ----------
    keys : pa.Table
        Primary-key columns of every row, in write order.
    tombstone : np.ndarray
        Tombstone flag of every row.
    row_index : np.ndarray
        Dataset row index of every row (what ``take`` accepts).
    """

    def __init__(self, keys: pa.Table, tombstone: np.ndarray, row_index: np.ndarray) -> None:
        # Normalized keys (-0.0 == 0.0, NaN == NaN) hashed by value: the bloom hash of
        # most key types (floats, timestamps, decimals...) is their null flag only, which
        # put every key in one run and made each probe a Python scan of the generation.
        norm = _normalized_keys(keys)
        last = _last_occurrence(norm)
        newest = norm.take(pa.array(last))
        hashes = hash_keys(newest)  # == _index_hashes of the original keys
        order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[order]
        self.keys = newest.take(pa.array(order)).combine_chunks()
        self.rows = row_index[last][order]
        self.tombstone = tombstone[last][order]
        self.num_keys = len(order)

    def probe(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Position in this index of each probe key, -1 when absent.

        ``hashes`` are the probe keys' :func:`_index_hashes` (not their bloom hashes).
        Every index entry of equal hash is compared exactly (vectorised), with floats
        compared as keys (``-0.0 == 0.0``, ``NaN == NaN``).
        """
        n = keys.num_rows
        out = np.full(n, -1, np.int64)
        if n == 0 or self.num_keys == 0:
            return out
        norm = _normalized_keys(keys)
        h = hash_keys(norm) if hashes is None else hashes
        lo = np.searchsorted(self.hashes, h, "left")
        counts = np.searchsorted(self.hashes, h, "right") - lo
        total = int(counts.sum())
        if total == 0:
            return out
        probe_idx = np.repeat(np.arange(n, dtype=np.int64), counts)
        pos = np.repeat(lo, counts) + (
            np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        ok = np.ones(total, bool)
        for i in range(norm.num_columns):
            mine = self.keys.column(i).take(pa.array(pos))
            theirs = norm.column(i).take(pa.array(probe_idx))
            ok &= pc.fill_null(pc.equal(mine, theirs), False).to_numpy(zero_copy_only=False)
        out[probe_idx[ok]] = pos[ok]
        return out

    def contains(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask: which probe keys exist (as a row or a tombstone)."""
        return self.probe(keys, hashes) >= 0


class _SortedKeyIndex:
    """Newest row of each key of a flushed generation with a single integer key, as its
    flush wrote it (:func:`memwal_query.format.keyfile.read_index`): keys sorted by
    value, probed by binary search (the same interface as :class:`_KeyIndex`).

    Parameters
    ----------
    index : KeyIndex
        The generation's key index file, read.
    field : pa.Field
        The key column.
    """

    def __init__(self, index: KeyIndex, field: pa.Field) -> None:
        self.values = index.keys
        self.rows = index.rows
        self.tombstone = index.tombstone
        self.num_keys = len(index.keys)
        self.field = field

    @functools.cached_property
    def keys(self) -> pa.Table:
        """The keys, in index order, as a table of the key column."""
        arr = pa.array(self.values, pa.int64())
        t = self.field.type
        arr = arr.view(t) if t == pa.uint64() else arr.cast(t)
        return pa.Table.from_arrays([arr], schema=pa.schema([pa.field(self.field.name, t)]))

    def probe(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Position in this index of each probe key (one integer column), -1 when
        absent (``hashes`` is not used: keys are compared by value)."""
        n = keys.num_rows
        out = np.full(n, -1, np.int64)
        if n == 0 or self.num_keys == 0:
            return out
        col = keys.column(0)
        valid = pc.is_valid(col).to_numpy(zero_copy_only=False)
        ints = as_int64(pc.fill_null(col, 0)).to_numpy(zero_copy_only=False).astype(np.int64)
        pos = np.minimum(np.searchsorted(self.values, ints), self.num_keys - 1)
        hit = valid & (self.values[pos] == ints)
        out[hit] = pos[hit]
        return out

    def contains(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask: which probe keys exist (as a row or a tombstone)."""
        return self.probe(keys, hashes) >= 0


def _first_occurrence(keys: pa.Table) -> np.ndarray:
    n = keys.num_rows
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    if keys.num_columns == 1:
        ints = _ints(keys.column(0))
        if ints is not None:
            return np.sort(np.unique(ints, return_index=True)[1]).astype(np.int64)
    idx = pa.array(np.arange(n, dtype=np.int64))
    first = keys.append_column(_IDX, idx).group_by(keys.column_names).aggregate([(_IDX, "min")])
    return np.sort(first.column(f"{_IDX}_min").to_numpy())


def _ints(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """The values as int64, or None (not integers, NULLs, or uint64 beyond int64)."""
    if not pa.types.is_integer(col.type) or col.null_count:
        return None
    if col.type == pa.uint64() and len(col) and pc.max(col).as_py() > np.iinfo(np.int64).max:
        return None
    return pc.cast(col, pa.int64()).to_numpy()


def _py_comparable(t: pa.DataType) -> bool:
    """Types whose Python values are equal exactly when Arrow's are."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    )


def _match_keys(rows_keys: pa.Table, probe: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (row index, probe index) with equal keys (probe keys are distinct).

    Float keys compare as keys: a base row written with ``-0.0`` is the row of ``0.0``
    (Arrow's ``index_in`` and joins tell them apart).
    """
    rows_keys = normalize_keys(rows_keys, rows_keys.column_names)
    probe = normalize_keys(probe, probe.column_names)
    if (
        rows_keys.num_rows * probe.num_rows <= _SMALL_MATCH
        and rows_keys.schema.types == probe.schema.types
        and all(_py_comparable(t) for t in probe.schema.types)
        and not any(c.null_count for c in rows_keys.columns)
        and not any(c.null_count for c in probe.columns)
    ):  # a few keys (a point lookup): Python values, no kernel overhead
        where = {k: i for i, k in enumerate(zip(*(c.to_pylist() for c in probe.columns)))}
        pairs = [
            (i, where[k])
            for i, k in enumerate(zip(*(c.to_pylist() for c in rows_keys.columns)))
            if k in where
        ]
        return np.array([i for i, _ in pairs], np.int64), np.array([j for _, j in pairs], np.int64)
    if rows_keys.num_columns == 1:
        pos = pc.index_in(rows_keys.column(0), value_set=probe.column(0).combine_chunks())
        found = pc.is_valid(pos).to_numpy(zero_copy_only=False)
        r = _mask_to_indices(found)
        return r, pos.to_numpy(zero_copy_only=False)[found].astype(np.int64)
    left = rows_keys.append_column(_IDX, pa.array(np.arange(rows_keys.num_rows, dtype=np.int64)))
    right = probe.append_column(_PROBE, pa.array(np.arange(probe.num_rows, dtype=np.int64)))
    joined = left.join(right, keys=rows_keys.column_names, join_type="inner")
    return joined.column(_IDX).to_numpy(), joined.column(_PROBE).to_numpy()


_NATIVE_HASH_TYPES = (pa.int32(), pa.int64(), pa.string(), pa.binary())


def _hashable_column(col: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """``col`` as a type :func:`hash_keys` hashes by value (it hashes other types by their
    null flag only, which would put every key in one bucket).

    Equal keys get equal values (floats: ``-0.0`` and every NaN are made one value), so
    the hashes only pre-select candidates, which are then compared exactly. Types with
    no such conversion are returned unchanged (one bucket: still exact, just a scan).
    """
    t = col.type
    if t in _NATIVE_HASH_TYPES:
        return col
    try:
        if pa.types.is_boolean(t) or pa.types.is_integer(t):
            return pc.cast(col, pa.int64(), safe=False)  # bit-preserving, so injective
        if pa.types.is_floating(t):
            x = pc.add(pc.cast(col, pa.float64()), pa.scalar(0.0, pa.float64()))
            x = pc.if_else(pc.is_nan(x), pa.scalar(math.nan, pa.float64()), x)
            x = x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x
            return x.view(pa.int64())
        if pa.types.is_fixed_size_binary(t) or pa.types.is_large_binary(t):
            return pc.cast(col, pa.binary())
        if pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return pc.cast(col, pa.string())
        if pa.types.is_binary_view(t):
            return pc.cast(col, pa.binary())
        width = t.bit_width  # ValueError: not fixed width
        if width % 8 == 0:  # temporal, decimal...: the value's bytes
            arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            return pc.cast(arr.view(pa.binary(width // 8)), pa.binary())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError):
        pass
    return col


def _native_hash(schema: pa.Schema) -> bool:
    """Whether :func:`_index_hashes` of such keys equals :func:`hash_keys`."""
    return all(f.type in _NATIVE_HASH_TYPES for f in schema)


def _index_hashes(keys: pa.Table) -> np.ndarray:
    """Key hashes for the MemTable key index (bloom hashes of :func:`_hashable_column`)."""
    if _native_hash(keys.schema):
        return hash_keys(keys)
    cols = [_hashable_column(c) for c in keys.columns]
    return hash_keys(pa.Table.from_arrays(cols, names=keys.column_names))


def _conform_keys(keys: pa.Table, key_schema: pa.Schema) -> pa.Table:
    """Key columns cast to the table's key types (what lookup keys are coerced to)."""
    if all(a.type == b.type for a, b in zip(keys.schema, key_schema)):
        return keys
    cols = [c if c.type == f.type else c.cast(f.type) for c, f in zip(keys.columns, key_schema)]
    return pa.Table.from_arrays(cols, schema=key_schema)
