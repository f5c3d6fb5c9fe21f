"""Key-pinned reads: the newer rows of a filter that pins the primary key to literals.

A filter that is a conjunction containing ``pk = literal`` or ``pk IN (literals)``
(a single integer primary-key column) can only keep rows of those keys. For such a
filter the read core builds its :class:`~memwal_query.read.newer.NewerView` from those
keys' rows only (:func:`point_view`): in each flushed generation the rows its key
index file lists for them (:func:`memwal_query.format.keyfile.read_index`), or, for a
generation without a usable index file, the rows of its key column holding them; in
each MemTable the rows holding them. Those candidate rows are deduplicated by the one
rule (:func:`memwal_query.read.dedup.newest_indices`) and the whole filter is then
evaluated on the newest version of each key, as for every read: the answer is the one
of the full view, whose newest version of a pinned key is the same row.

Why and what falls back: docs/architecture.md, "Key-pinned reads".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import CorruptFileError
from memwal_query.format import keyfile
from memwal_query.format.schema import TOMBSTONE, as_int64
from memwal_query.read.dedup import KeySet, newest_indices
from memwal_query.read.newer import NewerView, _ranks
from memwal_query.read.sources import (
    conform,
    file_io,
    map_generations,
    memtable_rows,
    read_generation,
    read_schema,
)
from memwal_query.read.view import GenerationRef, ReadPlan
from memwal_query.storage.cache import LRUCache

POINT_KEYS_MAX = 1024
"""A filter pinning the key to at most this many literals is read key-pinned
(:func:`point_view`); more, or 0, reads the full view."""


def pinned_keys(
    predicates: Sequence[tuple[str, str, Any]], schema: pa.Schema, pk: Sequence[str]
) -> pa.Array | None:
    """The keys a filter pins its single integer primary key to, or None.

    Parameters
    ----------
    predicates : sequence of (column, op, value)
        The filter's conjunction (:func:`memwal_query.read.pruning.predicates_from_expression`).
    schema : pa.Schema
        The table schema.
    pk : sequence of str
        The primary-key columns.

    Returns
    -------
    pa.Array or None
        The distinct keys (the key column's type) every row the filter keeps has one
        of: the intersection of its ``pk = v`` and ``pk IN (...)`` predicates, NULL
        literals left out (they match no row). None when the key is not one integer
        column, no such predicate exists, a literal is not a Python integer (floats,
        strings: the filter's own semantics decide, on the full view), one does not
        fit the key type, or more than :data:`POINT_KEYS_MAX` keys remain.
    """
    if len(pk) != 1 or POINT_KEYS_MAX <= 0:
        return None
    key_type = schema.field(pk[0]).type
    if not pa.types.is_integer(key_type):
        return None
    pinned: set[int] | None = None
    for column, op, value in predicates:
        if column != pk[0] or op not in ("=", "in"):
            continue
        values = value if op == "in" else [value]
        got = set()
        for v in values:  # the filter's literals, not data rows
            if v is None:
                continue
            if type(v) is not int:
                return None
            got.add(v)
        pinned = got if pinned is None else pinned & got
    if pinned is None or len(pinned) > POINT_KEYS_MAX:
        return None
    try:
        return pa.array(sorted(pinned), key_type)
    except (pa.ArrowInvalid, OverflowError):
        return None


def _index_nbytes(entry: tuple[keyfile.KeyIndex | None]) -> int:
    index = entry[0]
    if index is None:
        return 64
    return int(index.keys.nbytes + index.rows.nbytes + index.tombstone.nbytes)


KEY_INDEXES: LRUCache[str, tuple[keyfile.KeyIndex | None]] = LRUCache(
    1 << 14, max_bytes=256 << 20, sizeof=_index_nbytes, name="key_indexes"
)
"""Per generation directory, its key index file read (None inside: none or not
usable); bounded by bytes (default 256 MiB) and in the read path's cache budget.
Generations are immutable."""


def generation_index(
    ref: GenerationRef, storage_options: dict[str, str] | None
) -> keyfile.KeyIndex | None:
    """The key index file of a generation (cached), or None when it has none or it is
    damaged or does not match the generation (a warning then, once)."""
    hit = KEY_INDEXES.get(ref.uri)
    if hit is not None:
        return hit[0]
    index = keyfile.read_index(file_io(ref.uri, storage_options), ref.uri, ref.rows)
    KEY_INDEXES.put(ref.uri, (index,))
    return index


def _generation_hits(
    ref: GenerationRef,
    schema: pa.Schema,
    key: str,
    probe: np.ndarray,
    storage_options: dict[str, str] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(row positions in write order, their int64 keys) of the generation's rows of the
    sorted keys ``probe``: from its key index (the newest row of each), else from its
    key column (every row of them). Reads run concurrently on an object store
    (:func:`memwal_query.read.sources.map_generations`)."""
    index = generation_index(ref, storage_options)
    if index is not None:
        if len(index.keys) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        at = np.minimum(np.searchsorted(index.keys, probe), len(index.keys) - 1)
        hit = index.keys[at] == probe
        rows = index.rows[at[hit]]
        order = np.argsort(rows)
        return rows[order].astype(np.int64), probe[hit][order]
    col = read_generation(ref, schema, storage_options, [key]).column(key)
    ints = as_int64(col.combine_chunks()).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(np.isin(ints, probe)).astype(np.int64)
    return rows, ints[rows]


def point_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    keys: pa.Array,
    storage_options: dict[str, str] | None = None,
) -> NewerView:
    """The :class:`~memwal_query.read.newer.NewerView` of a plan restricted to ``keys``.

    Parameters
    ----------
    plan : ReadPlan
        The pinned sources.
    schema : pa.Schema
        The table schema.
    pk : list of str
        The primary key (one integer column).
    keys : pa.Array
        The keys (:func:`pinned_keys`).
    storage_options : dict, optional

    Returns
    -------
    NewerView
        Its rows are the candidate rows of ``keys`` (generations in plan order, oldest
        first per region, then MemTable rows), its winners their newest row per key by
        the one rule, its key set the keys found in any newer source. For every key
        of ``keys`` the newest row is the full view's.

    Raises
    ------
    GenerationGoneError
        A generation that must be read is gone.
    CorruptFileError
        A key index file lists rows that do not hold its keys (named).
    """
    key = pk[0]
    probe = np.unique(as_int64(keys).to_numpy(zero_copy_only=False))
    ranks = _ranks(plan)
    parts: list[tuple[GenerationRef, np.ndarray]] = []
    found: list[np.ndarray] = []
    regions: list[np.ndarray] = []
    gens: list[np.ndarray] = []
    refs = plan.generations  # region by region, oldest first

    def hits(ref: GenerationRef) -> tuple[np.ndarray, np.ndarray]:
        return _generation_hits(ref, schema, key, probe, storage_options)

    for ref, (at, ints) in zip(refs, map_generations(hits, refs, storage_options)):
        if len(at):
            parts.append((ref, at))
            found.append(ints)
            regions.append(np.full(len(at), ranks[ref.region_id], np.int64))
            gens.append(np.full(len(at), ref.generation, np.int64))
    mem_parts: list[pa.Table] = []
    value_set = pa.array(probe, pa.int64())
    for region in plan.regions:
        for m in sorted(region.memtables, key=lambda m: m.generation):
            if not m.batches:
                continue
            mask = pc.is_in(as_int64(m.to_table().column(key)), value_set=value_set)
            at = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
            if not len(at):
                continue
            hit = conform(memtable_rows(m, at), schema)
            mem_parts.append(hit)
            found.append(as_int64(hit.column(key).combine_chunks()).to_numpy(zero_copy_only=False))
            regions.append(np.full(hit.num_rows, ranks[m.region_id], np.int64))
            gens.append(np.full(hit.num_rows, m.generation, np.int64))
    cand = np.concatenate(found) if found else np.zeros(0, np.int64)
    reg = np.concatenate(regions) if regions else np.zeros(0, np.int64)
    gen = np.concatenate(gens) if gens else np.zeros(0, np.int64)
    winners = newest_indices(pa.table({key: cand}), pk, reg, gen)
    target = read_schema(schema)

    def rows(cols: Sequence[str]) -> pa.Table:
        names = list(cols)
        out = [
            read_generation(r, schema, storage_options, names).take(pa.array(at)) for r, at in parts
        ]
        out += [t.select(names) for t in mem_parts]
        if not out:
            return pa.Table.from_batches([], pa.schema([target.field(n) for n in names]))
        return pa.concat_tables(out)

    taken = rows([key, TOMBSTONE])
    got = as_int64(taken.column(key).combine_chunks()).to_numpy(zero_copy_only=False)
    if not np.array_equal(got, cand):
        bad = _lying_indexes(parts, cand, got)
        raise CorruptFileError(
            ", ".join(f"{u.rstrip('/')}/{keyfile.KEY_INDEX_FILE}" for u in bad),
            "its entries point keys at rows of other keys",
        )
    tomb = pc.fill_null(taken.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
    key_set = KeySet(pa.table({key: pa.array(cand[winners], pa.int64())}))
    return NewerView(rows, target.names, winners, key_set, tombstones=tomb[winners].astype(bool))


def _lying_indexes(
    parts: list[tuple[GenerationRef, np.ndarray]], want: np.ndarray, got: np.ndarray
) -> list[str]:
    """The generations (directories) whose rows at ``parts`` hold keys ``got`` other
    than ``want`` (the keys their index gave; parts in order, then MemTable rows)."""
    bad, start = [], 0
    for ref, at in parts:
        end = start + len(at)
        if not np.array_equal(want[start:end], got[start:end]):
            bad.append(ref.uri)
        start = end
    return bad or [ref.uri for ref, _ in parts]
