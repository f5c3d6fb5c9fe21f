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

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import CorruptFileError
from memwal_query.format import keyfile
from memwal_query.format.schema import TOMBSTONE, as_int64
from memwal_query.read import pruning
from memwal_query.read.dedup import KeySet, newest_indices
from memwal_query.read.newer import NewerView, _ranks
from memwal_query.read.sources import (
    conform,
    file_io,
    generation_columns,
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


def _pinnable(t: pa.DataType) -> type | None:
    """The Python type of the literals a key column of type ``t`` is pinned by (None:
    not pinned)."""
    if pa.types.is_integer(t):
        return int
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str
    return None


def pinned_keys(
    predicates: Sequence[tuple[str, str, Any]], schema: pa.Schema, pk: Sequence[str]
) -> pa.Table | None:
    """The keys a filter pins its primary key to, or None.

    Parameters
    ----------
    predicates : sequence of (column, op, value)
        The filter's conjunction (:func:`memwal_query.read.pruning.predicates_from_expression`).
    schema : pa.Schema
        The table schema.
    pk : sequence of str
        The primary-key columns (each an integer or a utf8/large_utf8 column).

    Returns
    -------
    pa.Table or None
        The distinct keys (the key columns, in the table's types) every row the filter
        keeps has one of: per key column, the intersection of its ``= v`` and
        ``IN (...)`` predicates (NULL literals left out: they match no row); for a
        composite key, every combination of those values. None when a key column is
        neither an integer nor a string column, a key column has no such predicate, a
        literal is not of the column's kind (an integer for integer columns, a string
        for string columns: floats, booleans, casts are the filter's own semantics, on
        the full view) or does not fit the column type, or more than
        :data:`POINT_KEYS_MAX` keys remain.
    """
    if not pk or POINT_KEYS_MAX <= 0:
        return None
    kinds = {c: _pinnable(schema.field(c).type) for c in pk}
    if any(k is None for k in kinds.values()):
        return None
    pinned: dict[str, set[Any]] = {}
    for column, op, value in predicates:
        if column not in kinds or op not in ("=", "in"):
            continue
        values = value if op == "in" else [value]
        got = set()
        for v in values:  # the filter's literals, not data rows
            if v is None:
                continue
            if type(v) is not kinds[column]:
                return None
            got.add(v)
        pinned[column] = got if column not in pinned else pinned[column] & got
    if len(pinned) != len(kinds) or math.prod(len(v) for v in pinned.values()) > POINT_KEYS_MAX:
        return None
    combos = list(itertools.product(*(sorted(pinned[c]) for c in pk)))
    try:
        return pa.table(
            {c: pa.array([k[i] for k in combos], schema.field(c).type) for i, c in enumerate(pk)}
        )
    except (pa.ArrowInvalid, OverflowError):
        return None


def pinned_keys_of(expr: Any, schema: pa.Schema, pk: Sequence[str]) -> pa.Table | None:
    """The keys a filter expression pins its primary key to, or None.

    :func:`pinned_keys` of its conjunction; else, when one of its conjuncts is an
    ``OR`` each of whose disjuncts pins the key (``(a = 1 AND b = 'x') OR (a = 2 AND
    b = 'y')``), the union of the disjuncts' keys (at most :data:`POINT_KEYS_MAX`).

    Parameters
    ----------
    expr : pc.Expression or None
        The filter.
    schema : pa.Schema
        The table schema.
    pk : sequence of str
        The primary-key columns.

    Returns
    -------
    pa.Table or None
        As :func:`pinned_keys`.
    """
    keys = pinned_keys(pruning.predicates_from_expression(expr), schema, pk)
    if keys is not None:
        return keys
    for disjuncts in pruning.disjunctions_from_expression(expr):
        each = [pinned_keys(conjunction, schema, pk) for conjunction in disjuncts]
        if not each or any(k is None for k in each):
            continue
        union = pa.concat_tables([k for k in each if k is not None])
        union = union.group_by(list(pk)).aggregate([]).select(list(pk))
        if union.num_rows <= POINT_KEYS_MAX:
            return union
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


def _is_int_key(schema: pa.Schema, pk: Sequence[str]) -> bool:
    return len(pk) == 1 and pa.types.is_integer(schema.field(pk[0]).type)


def _member(t: pa.Table, values: dict[str, pa.Array]) -> np.ndarray:
    """Which rows of ``t`` hold one of the keys whose per-column values are ``values``
    (the pinned keys are every combination of them: a row is pinned iff each of its key
    columns holds one of its column's values)."""
    mask: Any = None
    for name, vals in values.items():
        col = t.column(name)
        hit = pc.is_in(col, value_set=vals.cast(col.type))
        mask = hit if mask is None else pc.and_(mask, hit)
    return pc.fill_null(mask, False).to_numpy(zero_copy_only=False)


def _hashed_hits(
    refs: Sequence[GenerationRef],
    schema: pa.Schema,
    pk: list[str],
    values: dict[str, pa.Array],
    storage_options: dict[str, str] | None,
) -> list[tuple[np.ndarray, pa.Table]]:
    """Per generation of ``refs``, (row positions in write order, their key columns) of
    its rows of the pinned keys: a membership test on the generations' keys (their
    region keys files or keys sidecars, cached as the full view reads them, see
    :func:`memwal_query.read.sources.generation_columns`)."""
    if not refs:
        return []
    keys, sizes = generation_columns(refs, schema, pk, storage_options)
    at = np.flatnonzero(_member(keys, values)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    which = np.searchsorted(starts, at, side="right") - 1
    found = keys.take(pa.array(at))
    out = []
    for i in range(len(refs)):
        lo, hi = np.searchsorted(which, [i, i + 1])
        out.append((at[lo:hi] - starts[i], found.slice(lo, hi - lo)))
    return out


def point_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    keys: pa.Table | pa.Array,
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
        The primary key (integer and string columns).
    keys : pa.Table or pa.Array
        The keys (:func:`pinned_keys`; an array: the one key column's values).
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
        A key index file, region keys file or keys sidecar lists rows that do not hold
        its keys (named).
    """
    if isinstance(keys, (pa.Array, pa.ChunkedArray)):
        keys = pa.table({pk[0]: keys})
    int_key = _is_int_key(schema, pk)
    ranks = _ranks(plan)
    parts: list[tuple[GenerationRef, np.ndarray]] = []
    found: list[pa.Table] = []
    regions: list[np.ndarray] = []
    gens: list[np.ndarray] = []
    refs = plan.generations  # region by region, oldest first
    if int_key:
        key = pk[0]
        probe = np.unique(
            as_int64(keys.column(key).combine_chunks()).to_numpy(zero_copy_only=False)
        )
        values = {key: pa.array(probe, pa.int64())}

        def hits(ref: GenerationRef) -> tuple[np.ndarray, np.ndarray]:
            return _generation_hits(ref, schema, key, probe, storage_options)

        gen_hits: list[tuple[np.ndarray, pa.Table]] = [
            (at, pa.table({key: ints})) for at, ints in map_generations(hits, refs, storage_options)
        ]
    else:
        values = {c: pc.unique(keys.column(c).combine_chunks()) for c in pk}
        gen_hits = _hashed_hits(refs, schema, pk, values, storage_options)
    for ref, (at, got_keys) in zip(refs, gen_hits):
        if len(at):
            parts.append((ref, at))
            found.append(got_keys)
            regions.append(np.full(len(at), ranks[ref.region_id], np.int64))
            gens.append(np.full(len(at), ref.generation, np.int64))
    mem_parts: list[pa.Table] = []
    for region in plan.regions:
        for m in sorted(region.memtables, key=lambda m: m.generation):
            if not m.batches:
                continue
            mem = m.to_table()
            if int_key:
                mem = pa.table({key: as_int64(mem.column(key))})
            at = np.flatnonzero(_member(mem, values))
            if not len(at):
                continue
            hit = conform(memtable_rows(m, at), schema)
            mem_parts.append(hit)
            found.append(_key_table(hit, pk, int_key))
            regions.append(np.full(hit.num_rows, ranks[m.region_id], np.int64))
            gens.append(np.full(hit.num_rows, m.generation, np.int64))
    target = read_schema(schema)
    key_types = pa.schema(
        [pa.field(c, pa.int64() if int_key else target.field(c).type) for c in pk]
    )
    cand = (
        pa.concat_tables([t.cast(key_types) for t in found]) if found else key_types.empty_table()
    )
    reg = np.concatenate(regions) if regions else np.zeros(0, np.int64)
    gen = np.concatenate(gens) if gens else np.zeros(0, np.int64)
    winners = newest_indices(cand, pk, reg, gen)

    def rows(cols: Sequence[str]) -> pa.Table:
        names = list(cols)
        out = [
            read_generation(r, schema, storage_options, names).take(pa.array(at)) for r, at in parts
        ]
        out += [t.select(names) for t in mem_parts]
        if not out:
            return pa.Table.from_batches([], pa.schema([target.field(n) for n in names]))
        return pa.concat_tables(out)

    taken = rows([*pk, TOMBSTONE])
    got = _key_table(taken, pk, int_key).cast(key_types)
    if not got.equals(cand):
        bad = _lying_files(parts, cand, got, int_key, refs)
        raise CorruptFileError(
            ", ".join(bad),
            "its entries point keys at rows of other keys",
        )
    tomb = pc.fill_null(taken.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
    key_set = KeySet(cand.take(pa.array(winners)))
    return NewerView(rows, target.names, winners, key_set, tombstones=tomb[winners].astype(bool))


def _key_table(t: pa.Table, pk: list[str], int_key: bool) -> pa.Table:
    """The key columns of rows ``t`` (a single integer key as int64)."""
    if int_key:
        return pa.table({pk[0]: as_int64(t.column(pk[0]).combine_chunks())})
    return t.select(pk)


def _lying_files(
    parts: list[tuple[GenerationRef, np.ndarray]],
    want: pa.Table,
    got: pa.Table,
    int_key: bool,
    refs: Sequence[GenerationRef],
) -> list[str]:
    """The key files that gave keys ``want`` for rows that hold ``got`` (parts in order,
    then MemTable rows): the key index files of those generations for an integer key;
    else their keys sidecars and the region keys files of the newest generation of each
    region of ``refs`` (a region keys file lists the keys of its region's generations)."""
    bad, start = [], 0
    for ref, at in parts:
        end = start + len(at)
        if not want.slice(start, len(at)).equals(got.slice(start, len(at))):
            bad.append(ref)
        start = end
    bad = bad or [ref for ref, _ in parts]
    if int_key:
        return [f"{r.uri.rstrip('/')}/{keyfile.KEY_INDEX_FILE}" for r in bad]
    newest = {r.region_id: r for r in refs}
    regions = sorted({newest[r.region_id].uri for r in bad})
    return [
        *(f"{u.rstrip('/')}/{keyfile.REGION_KEYS_FILE}" for u in regions),
        *(f"{r.uri.rstrip('/')}/{keyfile.KEYS_FILE}" for r in bad),
    ]
