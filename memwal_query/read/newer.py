"""The newest version of every key among a read's flushed generations and MemTables.

:func:`newer_view` builds a :class:`NewerView` of a :class:`~memwal_query.read.view.ReadPlan`
with the one dedup rule (:func:`memwal_query.read.dedup.newest_indices`). The flushed
part is cached per set of generations (:data:`FLUSHED_VIEWS`, :data:`NEWEST_COLUMNS`);
MemTable rows are combined per query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.schema import TOMBSTONE
from memwal_query.read.dedup import KeySet, KeySetUnion, newest_indices
from memwal_query.read.sources import (
    GENERATION_CACHE,
    conform,
    generation_columns,
    memtable_rows,
    read_generations,
    read_schema,
)
from memwal_query.read.view import ReadPlan
from memwal_query.storage.cache import LRUCache
from memwal_query.write.memtable import MemTableSnapshot

_POS = "__memwal_pos"


class NewerView:
    """Newest version of every key among a plan's generations and MemTables.

    Held as row indices (``winners``) into the zero-copy concatenation of the sources'
    rows, so that a query materializes only the columns it needs, and reads only those
    from the generations' Lance tables (:func:`read_generation`). The flushed part
    (winners and key set) is cached per set of generations (they are immutable);
    MemTable rows, always newer than every flushed generation of their region, are
    combined per query.

    Attributes
    ----------
    winners : np.ndarray
        Sorted indices of the newest row per key (tombstones included).
    keys : KeySet or KeySetUnion
        Every key present in a newer source (to drop their base-table rows).
    tombstones : np.ndarray or None
        Whether each newest row is a tombstone, when known without reading (flushed
        generations alone: found with the keys).
    """

    def __init__(
        self,
        rows: Callable[[Sequence[str]], pa.Table],
        names: Sequence[str],
        winners: np.ndarray,
        keys: KeySet | KeySetUnion,
        newest: Callable[[Sequence[str]], pa.Table] | None = None,
        tombstones: np.ndarray | None = None,
        newest_live: Callable[[Sequence[str]], pa.Table] | None = None,
    ) -> None:
        self._rows = rows
        self._names = list(names)
        self.winners = winners
        self.keys = keys
        self._newest = newest
        self.tombstones = tombstones
        self._newest_live = newest_live

    def columns(self, names: Sequence[str] | None = None) -> pa.Table:
        """All newer rows (schema + ``_tombstone``, ``_gen``, ``_rowaddr``), only ``names``."""
        return self._rows(self._names if names is None else list(names))

    @property
    def rows(self) -> pa.Table:
        """All newer rows with every column (reads them all: prefer :meth:`columns`)."""
        return self.columns()

    def live(
        self,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        filter_columns: Sequence[str] = (),
    ) -> pa.Table:
        """Newest live rows (tombstones removed) matching ``filter``; only ``columns``.

        The filter is evaluated on the newest version of each key, reading only
        ``filter_columns`` first; the output columns are then taken for matches only.
        """
        cols = list(self._names if columns is None else columns)
        if filter is None and self.tombstones is not None:
            if not cols:
                n = len(self.winners) - int(self.tombstones.sum())
                return pa.table({_POS: pa.nulls(n)}).select([])
            if self._newest_live is not None:
                return self._newest_live(cols)
        check = list(dict.fromkeys([TOMBSTONE, *filter_columns]))
        probe = self.newest(check)
        probe = probe.append_column(_POS, pa.array(np.arange(len(self.winners), dtype=np.int64)))
        probe = probe.filter(pc.invert(pc.fill_null(probe.column(TOMBSTONE), False)))
        if filter is not None and probe.num_rows:
            probe = probe.filter(filter)
        selected = probe.column(_POS).to_numpy()
        if not cols:  # e.g. count(*): no columns, but the right number of rows
            return pa.table({_POS: pa.nulls(len(selected))}).select([])
        out = self.newest(cols)
        # positions are ascending: as many as rows means every row
        return out if len(selected) == out.num_rows else out.take(pa.array(selected))

    def live_count(self) -> int:
        """How many newest rows are live (not tombstones): reads ``_tombstone`` only."""
        if len(self.winners) == 0:
            return 0
        if self.tombstones is not None:
            return len(self.winners) - int(self.tombstones.sum())
        tomb = pc.fill_null(self.newest([TOMBSTONE]).column(TOMBSTONE), False)
        return len(self.winners) - int(pc.sum(tomb.cast(pa.int64())).as_py() or 0)

    def newest(self, names: Sequence[str]) -> pa.Table:
        """The newest rows (:attr:`winners`, in that order, tombstones included), only
        ``names`` (for flushed generations alone, cached per column)."""
        if self._newest is not None:
            return self._newest(list(names))
        return self.columns(names).take(pa.array(self.winners))


_FlushedView = tuple[int, np.ndarray, KeySet, np.ndarray, np.ndarray, np.ndarray]
FLUSHED_VIEWS: LRUCache[tuple[Any, ...], _FlushedView] = LRUCache(8)
"""Row count, newest indices, key set, and region ranks, ``_gen`` and tombstone flags of
the newest rows of a set of flushed generations, per (generation directories, schema)."""
_MEMTABLE_VIEWS: LRUCache[tuple[Any, ...], tuple[Any, ...]] = LRUCache(8)
"""The same of a set of MemTable snapshots, per (region, generation, batch count), with
the snapshots' last batches to tell a snapshot from another of the same size."""


def _ranks(plan: ReadPlan) -> dict[str, int]:
    """Region rank of every region of the plan: ordered as the region ids, and the same
    in every plan (cached flushed views are combined with later plans' MemTables): the
    first 60 bits of the (canonical, lowercase) UUID."""
    return {v.region_id: int(v.region_id.replace("-", "")[:15], 16) for v in plan.regions}


def _flushed_rows(
    plan: ReadPlan,
    schema: pa.Schema,
    columns: Sequence[str],
    storage_options: dict[str, str] | None,
) -> pa.Table:
    """The plan's generations, oldest first, only ``columns`` (zero-copy concatenation)."""
    return generation_columns(plan.generations, schema, columns, storage_options)[0]


def _column_nbytes(entry: tuple[np.ndarray, pa.ChunkedArray]) -> int:
    return entry[1].nbytes


NEWEST_COLUMNS: LRUCache[tuple[Any, ...], tuple[np.ndarray, pa.ChunkedArray]] = LRUCache(
    256, max_bytes=256 << 20, sizeof=_column_nbytes
)
"""Columns of the newest rows of a set of flushed generations (what an unfiltered scan
returns of them), one contiguous array each, per (generations, schema, column); bounded
by bytes (default 256 MiB). An entry is used only while every one of its generations is
in :data:`GENERATION_CACHE` (so forgetting a generation there forgets it here too)."""


def _flushed_newest(
    plan: ReadPlan,
    schema: pa.Schema,
    names: Sequence[str],
    winners: np.ndarray,
    storage_options: dict[str, str] | None,
    live: np.ndarray | None = None,
) -> pa.Table:
    """Columns ``names`` of the plan's generations at rows ``winners`` (the newest row
    per key), or with ``live`` (a mask over ``winners``) at the live ones only (cached,
    see :data:`NEWEST_COLUMNS`)."""
    uris = tuple(g.uri for g in plan.generations)
    cached = all(u in GENERATION_CACHE for u in uris)
    got: dict[str, pa.ChunkedArray] = {}
    which = "newest" if live is None else "live"
    for name in names:
        hit = NEWEST_COLUMNS.get((uris, schema, name, which)) if cached else None
        if hit is not None and hit[0] is winners:
            got[name] = hit[1]
    missing = [n for n in names if n not in got]
    if missing:
        rows = winners if live is None else winners[live]
        flushed = _flushed_rows(plan, schema, missing, storage_options)
        at = pa.array(rows)
        for name in missing:
            # one column at a time, its chunks (one per generation) joined first: a
            # take across thousands of chunks costs several times more
            col = flushed.column(name).combine_chunks().take(at)
            got[name] = pa.chunked_array([col], col.type)
            NEWEST_COLUMNS.put((uris, schema, name, which), (winners, got[name]))
    target = read_schema(schema)
    fields = [target.field(n) for n in names]
    return pa.Table.from_arrays([got[n] for n in names], schema=pa.schema(fields))


def _flushed_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None,
    whole_rows: bool = False,
) -> _FlushedView:
    """(row count, newest indices, key set, region rank, ``_gen`` and tombstone flag of
    the newest rows) of the plan's generations (cached). Reads the generations' key
    columns, ``_gen`` and ``_tombstone`` only (their keys sidecars)."""
    key = (tuple(g.uri for g in plan.generations), schema)
    hit = FLUSHED_VIEWS.get(key)
    if hit is not None:
        return hit
    ranks = _ranks(plan)
    refs = plan.generations
    if whole_rows:  # read whole (rows sidecars): the full read needs the other columns next
        read_generations(refs, schema, storage_options)
    keys, sizes = generation_columns(refs, schema, [*pk, TOMBSTONE], storage_options)
    regions = np.repeat(np.array([ranks[g.region_id] for g in refs], np.int64), sizes)
    gens = np.repeat(np.array([g.generation for g in refs], np.int64), sizes)
    winners = newest_indices(keys, pk, regions, gens)
    tomb = pc.fill_null(keys.column(TOMBSTONE).take(pa.array(winners)), False)
    tombstones = tomb.to_numpy(zero_copy_only=False).astype(bool, copy=False)
    view = (
        keys.num_rows,
        winners,
        KeySet(keys.select(pk)),
        regions[winners],
        gens[winners],
        tombstones,
    )
    return FLUSHED_VIEWS.put(key, view)


def _memtable_view(
    mems: list[MemTableSnapshot], schema: pa.Schema, pk: list[str], ranks: dict[str, int]
) -> tuple[pa.Table, np.ndarray, KeySet, np.ndarray, np.ndarray]:
    """Rows, newest indices, keys, and region rank and ``_gen`` of the newest rows of
    MemTable snapshots (cached: they only grow)."""
    key = (tuple((m.region_id, m.generation, len(m.batches)) for m in mems), schema)
    lasts = tuple(m.batches[-1] for m in mems)
    hit = _MEMTABLE_VIEWS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], lasts)) and hit[6] == ranks:
        return hit[1:6]
    rows_m = pa.concat_tables([conform(memtable_rows(m), schema) for m in mems])
    sizes = [m.num_rows for m in mems]
    regions = np.repeat(np.array([ranks[m.region_id] for m in mems], np.int64), sizes)
    gens = np.repeat(np.array([m.generation for m in mems], np.int64), sizes)
    win_m = newest_indices(rows_m, pk, regions, gens)
    keys = KeySet(rows_m.select(pk))
    out = (rows_m, win_m, keys, regions[win_m], gens[win_m])
    _MEMTABLE_VIEWS.put(key, (lasts, *out, dict(ranks)))
    return out


def newer_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None = None,
    whole_rows: bool = False,
) -> NewerView:
    """Build the :class:`NewerView` of a plan (vectorised; see class docs).

    ``whole_rows``: the caller reads other columns than the keys next (a full read),
    so generations not cached yet are read whole at once (their rows sidecars) rather
    than their keys first and their rows afterwards."""
    n_f, win_f, keys_f, reg_f, gen_f, tomb_f = _flushed_view(
        plan, schema, pk, storage_options, whole_rows
    )
    names = read_schema(schema).names
    mems = [m for r in plan.regions for m in r.memtables]
    if not mems:
        return NewerView(
            lambda cols: _flushed_rows(plan, schema, cols, storage_options),
            names,
            win_f,
            keys_f,
            lambda cols: _flushed_newest(plan, schema, cols, win_f, storage_options),
            tomb_f,
            lambda cols: _flushed_newest(plan, schema, cols, win_f, storage_options, ~tomb_f),
        )
    rows_m, win_m, keys_m, reg_m, gen_m = _memtable_view(mems, schema, pk, _ranks(plan))
    winners = win_m + n_f
    if len(win_f):
        winners_f = _flushed_rows(plan, schema, pk, storage_options).take(pa.array(win_f))
        hit = keys_m.contains(winners_f)  # flushed winners whose key has a MemTable row
        ranks = np.concatenate([reg_f, reg_m])
        if not hit.any() or ranks.min() == ranks.max():
            # One region: a MemTable row is newer than every generation of its region.
            winners = np.concatenate([win_f[~hit], winners])
        else:
            # Keys in MemTables and in another region's generations: the one rule
            # (dedup.newest_indices: _gen, then region rank) decides those keys only.
            keys_hit = winners_f.filter(pa.array(hit))
            mem_keys = rows_m.select(pk).take(pa.array(win_m))
            mem_hit = KeySet(keys_hit).contains(mem_keys)
            both = pa.concat_tables([keys_hit, mem_keys.filter(pa.array(mem_hit))])
            keep = newest_indices(
                both,
                pk,
                np.concatenate([reg_f[hit], reg_m[mem_hit]]),
                np.concatenate([gen_f[hit], gen_m[mem_hit]]),
            )
            decided = np.concatenate([win_f[hit], winners[mem_hit]])[keep]
            winners = np.sort(np.concatenate([win_f[~hit], winners[~mem_hit], decided]))

    def rows(cols: Sequence[str]) -> pa.Table:
        flushed = _flushed_rows(plan, schema, cols, storage_options)
        return pa.concat_tables([flushed, rows_m.select(list(cols))])

    return NewerView(rows, names, winners, KeySetUnion([keys_f, keys_m]))
