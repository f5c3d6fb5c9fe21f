"""The newest version of every key among a read's flushed generations and MemTables.

:func:`newer_view` builds a :class:`NewerView` of a :class:`~memwal_query.read.view.ReadPlan`
with the one dedup rule (:func:`memwal_query.read.dedup.newest_indices`). The flushed
part is cached per set of generations (:data:`FLUSHED_VIEWS`, :data:`NEWEST_COLUMNS`);
MemTable rows are combined per query.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.format.schema import (
    GEN_COLUMN,
    ROWADDR_COLUMN,
    TOMBSTONE,
    as_int64,
    cache_key,
)
from memwal_query.read.dedup import (
    _DENSE_LIMIT,
    KeySet,
    KeySetUnion,
    in_sorted,
    int_runs,
    newest_indices,
)
from memwal_query.read.sources import (
    GENERATION_CACHE,
    conform,
    generation_columns,
    memtable_rows,
    read_generations,
    read_schema,
    region_key_columns,
)
from memwal_query.read.view import GenerationRef, ReadPlan
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
        winners: np.ndarray | None,
        keys: KeySet | KeySetUnion,
        newest: Callable[[Sequence[str]], pa.Table] | None = None,
        tombstones: np.ndarray | None = None,
        newest_live: Callable[[Sequence[str]], pa.Table] | None = None,
        flushed: _FlushedView | None = None,
    ) -> None:
        self._rows = rows
        self._names = list(names)
        self._winners = winners
        self.keys = keys
        self._newest = newest
        self._tombstones = tombstones
        self._newest_live = newest_live
        self._flushed = flushed  # winners and tombstones from there when not given

    @property
    def winners(self) -> np.ndarray:
        if self._winners is None and self._flushed is not None:
            return self._flushed.winners
        assert self._winners is not None
        return self._winners

    @property
    def tombstones(self) -> np.ndarray | None:
        if self._tombstones is None and self._flushed is not None:
            return self._flushed.tombstones
        return self._tombstones

    def _live_known(self) -> int | None:
        """How many newest rows are live when known without reading or concatenating."""
        if self._winners is None and self._flushed is not None:
            return self._flushed.live
        if self.tombstones is not None:
            return len(self.winners) - int(self.tombstones.sum())
        return None

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
        if filter is None and (self._flushed is not None or self._tombstones is not None):
            if not cols:
                n = self._live_known()
                assert n is not None
                return pa.table({_POS: pa.nulls(n)}).select([])
            if self._newest_live is not None:
                return self._newest_live(cols)
        if (
            self._newest is None
            and self._tombstones is not None
            and (filter is None or filter_columns)
        ):
            return self._live_by_flags(cols, filter, filter_columns)
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

    def _live_by_flags(
        self, cols: list[str], filter: pc.Expression | None, filter_columns: Sequence[str]
    ) -> pa.Table:
        """:meth:`live` with the tombstone flags known: only the live newest rows are
        taken (for the filter's columns first), no ``_tombstone`` column read."""
        assert self._tombstones is not None
        at = self.winners[~self._tombstones]
        if filter is not None and len(at):
            probe = self.columns(list(dict.fromkeys(filter_columns))).take(pa.array(at))
            probe = probe.append_column(_POS, pa.array(np.arange(len(at), dtype=np.int64)))
            at = at[probe.filter(filter).column(_POS).to_numpy()]
        if not cols:  # e.g. count(*): no columns, but the right number of rows
            return pa.table({_POS: pa.nulls(len(at))}).select([])
        return self.columns(cols).take(pa.array(at))

    def live_count(self) -> int:
        """How many newest rows are live (not tombstones): reads ``_tombstone`` only."""
        known = self._live_known()
        if known is not None:
            return known
        if len(self.winners) == 0:
            return 0
        tomb = pc.fill_null(self.newest([TOMBSTONE]).column(TOMBSTONE), False)
        return len(self.winners) - int(pc.sum(tomb.cast(pa.int64())).as_py() or 0)

    def newest(self, names: Sequence[str]) -> pa.Table:
        """The newest rows (:attr:`winners`, in that order, tombstones included), only
        ``names`` (for flushed generations alone, cached per column)."""
        if self._newest is not None:
            return self._newest(list(names))
        return self.columns(names).take(pa.array(self.winners))


class _FlushedView:
    """The newest row of each key among a set of flushed generations: their row count
    (``num_rows``), the key set (``keys``), how many newest rows are live (``live``),
    and the newest rows' indices (``winners``, sorted), region rank (``regions``),
    ``_gen`` (``gens``) and tombstone flag (``tombstones``).

    Built from the regions' :class:`_RegionFlushed` (``parts``, oldest region rank
    first, which the region cache holds too), the arrays are concatenated when first
    used: a ``count(*)`` uses none of them, an unfiltered read only ``winners`` and
    ``tombstones`` (``regions`` and ``gens`` order them against MemTable rows)."""

    __slots__ = ("num_rows", "keys", "live", "_parts", "_arrays", "_whole", "_lock", "_keys")

    def __init__(
        self,
        num_rows: int,
        keys: KeySet,
        parts: list[tuple[int, _RegionFlushed]] | None = None,
        arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.num_rows = num_rows
        self.keys = keys
        self._parts = parts or []
        # winners, regions, gens, tombstones (None until first used)
        self._arrays: list[np.ndarray | None] = list(arrays or (None,) * 4)
        self._whole = arrays is not None
        self._lock = threading.Lock()
        self._keys: np.ndarray | None = None  # winner_keys, once joined
        if arrays is not None:
            self.live = len(arrays[0]) - int(np.count_nonzero(arrays[3]))
        else:
            self.live = sum(
                len(p.winners) - int(np.count_nonzero(p.tombstones)) for _, p in self._parts
            )

    def _array(self, i: int) -> np.ndarray:
        with self._lock:
            got = self._arrays[i]
            if got is not None:
                return got
            parts = self._parts
            if i in (0, 3):
                offsets = np.cumsum([0] + [p.num_rows for _, p in parts])
                self._arrays[0] = _joined(
                    [p.winners + off for (_, p), off in zip(parts, offsets)], np.int64
                )
                self._arrays[3] = _joined([p.tombstones for _, p in parts], bool)
            else:
                self._arrays[1] = np.repeat(
                    np.array([rank for rank, _ in parts], np.int64),
                    [len(p.winners) for _, p in parts],
                )
                self._arrays[2] = _joined([p.gens for _, p in parts], np.int64)
            got = self._arrays[i]
            assert got is not None
            return got

    @property
    def winners(self) -> np.ndarray:
        return self._array(0)

    def winner_keys(self) -> np.ndarray | None:
        """The int64 key of each winner (built region by region: a single integer
        key), or None (then read from the generations)."""
        if self._whole:
            return None
        with self._lock:
            if self._keys is None:
                self._keys = _joined([p.keys for _, p in self._parts], np.int64)
            return self._keys

    def region_keys(self) -> list[tuple[int, np.ndarray]] | None:
        """(region rank, int64 keys of its winners) of each region, in the order of
        :attr:`winners`; None when built from every row at once."""
        if self._whole:
            return None
        return [(rank, p.keys) for rank, p in self._parts]

    @property
    def regions(self) -> np.ndarray:
        return self._array(1)

    @property
    def gens(self) -> np.ndarray:
        return self._array(2)

    @property
    def tombstones(self) -> np.ndarray:
        return self._array(3)

    @property
    def nbytes(self) -> int:
        """Bytes held (the region parts counted here too, though the region cache
        shares them)."""
        held = self.keys.nbytes + sum(p.nbytes for _, p in self._parts)
        held += self._keys.nbytes if self._keys is not None else 0
        return held + sum(a.nbytes for a in self._arrays if a is not None)


def _joined(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def _flushed_view_nbytes(view: _FlushedView) -> int:
    return view.nbytes


FLUSHED_VIEWS: LRUCache[tuple[Any, ...], _FlushedView] = LRUCache(
    8, max_bytes=256 << 20, sizeof=_flushed_view_nbytes, name="flushed_views"
)
"""Row count, newest indices, key set, and region ranks, ``_gen`` and tombstone flags of
the newest rows of a set of flushed generations, per (table, generation directories,
schema); bounded by bytes (default 256 MiB) and by :data:`FLUSHED_VIEWS_PER_TABLE` per
table: under a stream every flush and merge makes a new set, and a reader needs the
newest one (the one before it for queries that pinned it)."""

FLUSHED_VIEWS_PER_TABLE = 2
"""Most sets of flushed generations of one table (and schema) whose views are kept: a
superseded set is read again only by a query that pinned it, and each view holds every
key of its set (at 10M rows and 32 regions of a stream, ~30 MB each)."""


def _memtable_view_nbytes(entry: tuple[Any, ...]) -> int:
    rows, winners, keys, regions, gens = entry[1:6]
    return int(rows.nbytes + winners.nbytes + keys.nbytes + regions.nbytes + gens.nbytes)


_ByRegion = list[tuple[int, np.ndarray]]

_MEMTABLE_VIEWS: LRUCache[tuple[Any, ...], tuple[Any, ...]] = LRUCache(
    8, max_bytes=256 << 20, sizeof=_memtable_view_nbytes, name="memtable_views"
)
"""The same of a set of MemTable snapshots, per (table URI, (region, generation, batch
count) of each snapshot, schema), with the snapshots' last batches to tell a snapshot
from another of the same size; bounded by bytes (default 256 MiB: the rows are held)."""


def _ranks(plan: ReadPlan) -> dict[str, int]:
    """Region rank of every region of the plan: ordered as the region ids, and the same
    in every plan (cached flushed views are combined with later plans' MemTables): the
    first 60 bits of the (canonical, lowercase) UUID."""
    return {v.region_id: int(v.region_id.replace("-", "")[:15], 16) for v in plan.regions}


def _table_key(plan: ReadPlan) -> str:
    """The plan's table in the per-region caches (every unsharded table has the same
    region id): the base table's URI, or for a plan without a base (a Spark partition
    of generations and WAL tails) the table its generations are in; "" when it has
    neither (its kept rows are then told apart by their batch objects only)."""
    if plan.base is not None:
        return str(plan.base.uri)
    for g in plan.generations:
        return g.uri.rpartition("/_mem_wal/")[0]
    return ""


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
    256, max_bytes=256 << 20, sizeof=_column_nbytes, name="newest_columns"
)
"""Columns of the newest rows of a set of flushed generations (what an unfiltered scan
returns of them), per (generations, schema, column); bounded
by bytes (default 256 MiB). An entry is used only while every one of its generations is
in :data:`GENERATION_CACHE` (so forgetting a generation there forgets it here too);
:func:`memwal_query.search.forget.forget_merged` drops the entries holding a merged
generation."""

TAKE_GENERATIONS = 64
"""An unfiltered read takes the newest live rows of this many generations at a time
from their rows (read and released, not cached: :func:`_taken`)."""


def _flushed_newest(
    plan: ReadPlan,
    schema: pa.Schema,
    names: Sequence[str],
    winners: np.ndarray,
    storage_options: dict[str, str] | None,
    live: np.ndarray | None = None,
    expect: tuple[str, Callable[[], np.ndarray | None]] | None = None,
) -> pa.Table:
    """Columns ``names`` of the plan's generations at rows ``winners`` (the newest row
    per key), or with ``live`` (a mask over ``winners``) at the live ones only (cached,
    see :data:`NEWEST_COLUMNS`).

    ``expect``: (key column, a function giving the int64 key of each winner as the keys
    files gave it, called only when that column is read); its values must be those
    keys, else CorruptFileError (a keys file that does not match its generation's rows:
    never a wrong answer)."""
    uris = tuple(g.uri for g in plan.generations)
    cached = all(u in GENERATION_CACHE for u in uris)
    got: dict[str, pa.ChunkedArray] = {}
    which = "newest" if live is None else "live"
    token = cache_key(schema)
    for name in names:
        hit = NEWEST_COLUMNS.get((uris, token, name, which)) if cached else None
        if hit is not None and hit[0] is winners:
            got[name] = hit[1]
    missing = [n for n in names if n not in got]
    if missing:
        rows = winners if live is None else winners[live]
        taken = _taken(plan, schema, missing, rows, storage_options, keep=live is None)
        for name in missing:
            col = taken[name]
            expected = expect[1]() if expect is not None and expect[0] == name else None
            if expected is not None:
                _check_keys(plan, col, expected if live is None else expected[live])
            got[name] = col
            NEWEST_COLUMNS.put((uris, token, name, which), (winners, got[name]))
    target = read_schema(schema)
    fields = [target.field(n) for n in names]
    return pa.Table.from_arrays([got[n] for n in names], schema=pa.schema(fields))


def _taken(
    plan: ReadPlan,
    schema: pa.Schema,
    names: Sequence[str],
    rows: np.ndarray,
    storage_options: dict[str, str] | None,
    keep: bool,
) -> dict[str, pa.ChunkedArray]:
    """Columns ``names`` of the plan's generations (concatenated, oldest first) at the
    sorted row indices ``rows``.

    ``keep``: the generations' columns are read whole and cached
    (:data:`GENERATION_CACHE`: a filter reads them again). Otherwise the generations
    not cached are read :data:`TAKE_GENERATIONS` at a time, their rows at ``rows``
    taken and the rest released (a chunk per group): an unfiltered read holds the rows
    it returns, not every row of every generation, nor its rows twice (what it keeps
    of them is cached in :data:`NEWEST_COLUMNS`; the generations are recorded in
    :data:`GENERATION_CACHE` as read, with no column, which keeps that valid)."""
    if keep:
        flushed = _flushed_rows(plan, schema, names, storage_options)
        at = pa.array(rows)
        # one column at a time, its chunks (one per generation) joined first: a take
        # across thousands of chunks costs several times more
        return {n: pa.chunked_array([flushed.column(n).combine_chunks().take(at)]) for n in names}
    target = read_schema(schema)
    pieces: dict[str, list[pa.Array]] = {n: [] for n in names}
    refs = plan.generations
    start = 0  # row index of the group's first row
    for i in range(0, len(refs), TAKE_GENERATIONS):
        group_refs = refs[i : i + TAKE_GENERATIONS]
        group = read_generations(group_refs, schema, storage_options, names, keep=False)
        for ref in group_refs:
            GENERATION_CACHE.add(ref.uri, {})
        size = sum(t.num_rows for t in group)
        lo, hi = np.searchsorted(rows, [start, start + size])
        if hi > lo:
            at = pa.array(rows[lo:hi] - start)
            for n in names:
                chunks = [c for t in group for c in t.column(n).chunks]
                col = pa.chunked_array(chunks, target.field(n).type)
                pieces[n].append(col.combine_chunks().take(at))
        start += size
        del group
    return {n: pa.chunked_array(pieces[n], target.field(n).type) for n in names}


def _check_keys(plan: ReadPlan, col: pa.ChunkedArray, expected: np.ndarray) -> None:
    """CorruptFileError when the keys read from the generations' rows (``col``) are not
    the ones their keys files (region keys files, keys sidecars) listed."""
    from memwal_query.exceptions import CorruptFileError
    from memwal_query.format.keyfile import REGION_KEYS_FILE

    got = as_int64(col).to_numpy(zero_copy_only=False)
    if len(got) == len(expected) and np.array_equal(got, expected):
        return
    newest: dict[str, GenerationRef] = {}
    for g in plan.generations:
        newest[g.region_id] = g
    files = sorted(f"{g.uri.rstrip('/')}/{REGION_KEYS_FILE}" for g in newest.values())
    raise CorruptFileError(
        files[0] if len(files) == 1 else ", ".join(files),
        "the keys listed for these generations are not the keys of their rows (a region "
        "keys file or keys sidecar does not match its generation); remove the region keys "
        "files named (optional files) to read each generation's own keys",
    )


def _flushed_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None,
    rows_next: bool = False,
) -> _FlushedView:
    """The :class:`_FlushedView` of the plan's generations (cached). Reads the
    generations' key columns, ``_gen`` and ``_tombstone`` only (their region keys files
    or keys sidecars; with ``rows_next``, no keys sidecar: see :func:`newer_view`).

    With a single integer key, built region by region (:func:`_region_flushed`: a
    region's generations read before, less those merged since, plus those flushed
    since), the regions combined as they are unless a key is in two regions; otherwise
    every row at once (:func:`_flushed_view_whole`)."""
    table = _table_key(plan)
    token = cache_key(schema)
    key = (table, tuple(g.uri for g in plan.generations), token)
    hit = FLUSHED_VIEWS.get(key)
    if hit is not None:
        return hit
    view = _flushed_view_built(plan, table, schema, pk, storage_options, rows_next)
    FLUSHED_VIEWS.put(key, view)
    FLUSHED_VIEWS.keep_recent(
        lambda k: k[0] == table and type(k[2]) is type(token) and bool(k[2] == token),
        FLUSHED_VIEWS_PER_TABLE,
    )
    return view


def _flushed_view_built(
    plan: ReadPlan,
    table: str,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None,
    rows_next: bool,
) -> _FlushedView:
    """:func:`_flushed_view` without the cache (``table``: the plan's
    :func:`_table_key`)."""
    ranks = _ranks(plan)
    parts: list[_RegionFlushed] = []
    if len(pk) == 1:
        for region in plan.regions:
            if not region.generations:
                continue
            got = _region_flushed(
                table, region.generations, schema, pk[0], storage_options, rows_next
            )
            if got is None:
                parts = []
                break
            parts.append(got)
    if len(pk) != 1 or (plan.generations and not parts):
        return _flushed_view_whole(plan, schema, pk, storage_options, rows_next)
    keys = KeySet.of_ints(pk[0], [p.keys for p in parts])
    if len(parts) > 1 and keys.distinct() != len(keys):
        return _flushed_view_whole(plan, schema, pk, storage_options, rows_next)
    rows = sum(p.num_rows for p in parts)
    return _FlushedView(rows, keys, [(ranks[p.region_id], p) for p in parts])


def _flushed_view_whole(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None,
    rows_next: bool = False,
) -> _FlushedView:
    """:func:`_flushed_view` with every row deduplicated at once."""
    ranks = _ranks(plan)
    refs = plan.generations
    keys, sizes = generation_columns(
        refs, schema, [*pk, TOMBSTONE], storage_options, not rows_next, not rows_next
    )
    regions = np.repeat(np.array([ranks[g.region_id] for g in refs], np.int64), sizes)
    gens = np.repeat(np.array([g.generation for g in refs], np.int64), sizes)
    winners = newest_indices(keys, pk, regions, gens)
    tomb = pc.fill_null(keys.column(TOMBSTONE).take(pa.array(winners)), False)
    tombstones = tomb.to_numpy(zero_copy_only=False).astype(bool, copy=False)
    arrays = (winners, regions[winners], gens[winners], tombstones)
    return _FlushedView(keys.num_rows, KeySet(keys.select(pk)), arrays=arrays)


class _RegionFlushed:
    """The newest row of each key among one region's flushed generations (oldest
    first): ``winners`` (sorted indices into their rows), and the key and tombstone
    flag of each (their ``_gen``, :attr:`gens`, follows from the generations' sizes)."""

    __slots__ = ("region_id", "uris", "generations", "sizes", "winners", "keys", "tombstones")

    def __init__(
        self,
        region_id: str,
        uris: tuple[str, ...],
        generations: tuple[int, ...],
        sizes: tuple[int, ...],
        winners: np.ndarray,
        keys: np.ndarray,
        tombstones: np.ndarray,
    ) -> None:
        self.region_id = region_id
        self.uris = uris
        self.generations = generations
        self.sizes = sizes
        self.winners = winners
        self.keys = keys
        self.tombstones = tombstones

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    @property
    def gens(self) -> np.ndarray:
        """``_gen`` of each winner (the generation its row index falls in)."""
        ends = np.cumsum(np.array(self.sizes, np.int64))
        at = np.searchsorted(ends, self.winners, side="right")
        return np.array(self.generations, np.int64)[at]

    @property
    def nbytes(self) -> int:
        return self.winners.nbytes + self.keys.nbytes + self.tombstones.nbytes


_REGION_FLUSHED: LRUCache[tuple[str, str, pa.Schema | bytes], _RegionFlushed] = LRUCache(
    1 << 12, max_bytes=512 << 20, sizeof=lambda r: r.nbytes, name="region_flushed"
)
"""Per (table URI, region id, schema), the :class:`_RegionFlushed` of the generations
read last (an immutable generation is identified by its directory). Keyed by the
table too: every unsharded table has the same region id, and two of them read in turn
must not replace each other's entry."""


def _region_flushed(
    table_uri: str,
    refs: list[GenerationRef],
    schema: pa.Schema,
    key: str,
    storage_options: dict[str, str] | None,
    rows_next: bool = False,
) -> _RegionFlushed | None:
    """:class:`_RegionFlushed` of one region's generations ``refs`` (oldest first), from
    the one read last when ``refs`` are its generations less some oldest ones (merged
    since: their newest rows go, no other row was newer) plus newer ones (flushed since:
    read, and the older newest rows of their keys go); None when the key column is not
    an integer column."""
    region_id = refs[0].region_id
    uris = tuple(r.uri for r in refs)
    entry = (table_uri, region_id, cache_key(schema))
    known = _REGION_FLUSHED.get(entry)
    keep = 0
    if known is not None:
        if known.uris == uris:
            return known
        # the longest suffix of the known generations that begins ``uris``
        for drop in range(len(known.uris)):
            tail = known.uris[drop:]
            if uris[: len(tail)] == tail:
                keep = len(tail)
                break
        if keep == 0:
            known = None
    if known is not None:
        dropped = len(known.uris) - keep
        shift = sum(known.sizes[:dropped])
        stay = known.winners >= shift
        winners = known.winners[stay] - shift
        keys, tombstones = known.keys[stay], known.tombstones[stay]
        sizes = known.sizes[dropped:]
    else:
        winners, keys = np.zeros(0, np.int64), np.zeros(0, np.int64)
        tombstones = np.zeros(0, bool)
        sizes = ()
    added = refs[keep:]
    if added:
        # not cached: what this region keeps of them is its newest rows' keys and flags
        whole = None
        if keep == 0 and len(added) > 1:  # the region keys file as one table
            whole = region_key_columns(added, schema, [key, TOMBSTONE], storage_options)
        newest = None
        if whole is not None:
            rows, counts, newest = whole
        else:
            rows, counts = generation_columns(
                added, schema, [key, TOMBSTONE], storage_options, False, not rows_next
            )
        ints = _int_keys(rows.column(key))
        if ints is None:
            return None
        if newest is not None:  # the file's own newest rows (and no earlier ones here)
            lasts = np.flatnonzero(newest)
            stale = np.zeros(0, bool)
        else:
            lasts, _ = int_runs(ints)  # ordered by key: ints[lasts] is sorted and distinct
            stale = in_sorted(keys, ints[lasts]) if len(keys) else np.zeros(0, bool)
            lasts = np.sort(lasts)
        n = sum(sizes)
        tomb = pc.fill_null(rows.column(TOMBSTONE).take(pa.array(lasts)), False)
        winners = np.concatenate([winners[~stale], lasts + n])
        keys = np.concatenate([keys[~stale], ints[lasts]])
        tombstones = np.concatenate(
            [tombstones[~stale], tomb.to_numpy(zero_copy_only=False).astype(bool)]
        )
        sizes = tuple(sizes) + tuple(int(c) for c in counts)
    generations = tuple(r.generation for r in refs)
    out = _RegionFlushed(region_id, uris, generations, tuple(sizes), winners, keys, tombstones)
    return _REGION_FLUSHED.put(entry, out)


class _RegionRows:
    """The MemTable rows of one region (its snapshots, oldest generation first) with
    the newest row of each of their keys; extended as the snapshots grow.

    Attributes
    ----------
    parts : tuple
        ``(generation, batch count, last batch)`` of each snapshot: identifies the rows.
    schema : pa.Schema
        The table schema the rows were conformed to (only a read with that schema
        extends them).
    rows : pa.Table
        The rows (:func:`conform`-ed, with ``_gen`` and ``_rowaddr``).
    keys : np.ndarray
        Their integer keys.
    winners : np.ndarray
        Sorted indices of the last row of each key.
    """

    __slots__ = ("parts", "batches", "schema", "rows", "keys", "winners", "gens", "rows_nbytes")

    def __init__(
        self,
        parts: tuple[tuple[int, int, pa.RecordBatch], ...],
        batches: tuple[tuple[pa.RecordBatch, ...], ...],
        schema: pa.Schema,
        rows: pa.Table,
        keys: np.ndarray,
        winners: np.ndarray,
        gens: np.ndarray,
        rows_nbytes: int,
    ) -> None:
        self.parts = parts
        self.batches = batches
        self.schema = schema
        self.rows = rows
        self.keys = keys
        self.winners = winners
        self.gens = gens  # _gen of each winner
        self.rows_nbytes = rows_nbytes  # bytes of ``rows`` (counted as they are added)

    @property
    def nbytes(self) -> int:
        """Bytes held: the rows (and the snapshots' batches they keep), the keys and
        the winners."""
        return self.rows_nbytes + self.keys.nbytes + self.winners.nbytes + self.gens.nbytes


def _parts(mems: list[MemTableSnapshot]) -> tuple[tuple[int, int, pa.RecordBatch], ...]:
    return tuple((m.generation, len(m.batches), m.batches[-1]) for m in mems if m.batches)


def _region_delta(
    mems: list[MemTableSnapshot], known: _RegionRows
) -> list[tuple[int, int, tuple[pa.RecordBatch, ...]]] | None:
    """The batches ``mems`` hold beyond ``known``, as ``(generation, first row index in
    that snapshot, batches)``, or None when ``mems`` do not extend ``known`` (rows
    anywhere but at the end: rebuild)."""
    live = [m for m in mems if m.batches]
    old = known.parts
    if len(live) < len(old):
        return None
    for i, (gen, count, last) in enumerate(old):
        m = live[i]
        if m.generation != gen or len(m.batches) < count or m.batches[count - 1] is not last:
            return None
        if m.batches[:count] != known.batches[i]:  # identical objects: no comparison
            return None
        if len(m.batches) > count and i != len(old) - 1:
            return None  # an older snapshot grew: its rows do not come last
    out = []
    for i, m in enumerate(live):
        if i < len(old):
            gen, count, _ = old[i]
            if len(m.batches) > count:
                before = sum(b.num_rows for b in known.batches[i])
                out.append((m.generation, before, m.batches[count:]))
        else:
            out.append((m.generation, 0, m.batches))
    return out


def _conformed(
    gen: int, first_row: int, batches: Sequence[pa.RecordBatch], schema: pa.Schema
) -> pa.Table:
    """MemTable batches as read rows: ``_gen`` and ``_rowaddr`` (row index in their
    snapshot, from ``first_row``), conformed to ``schema``."""
    t = pa.Table.from_batches(list(batches))
    n = t.num_rows
    addr = pa.array(np.arange(first_row, first_row + n, dtype=np.uint64))
    t = t.append_column(GEN_COLUMN, pa.repeat(pa.scalar(gen, pa.uint64()), n))
    return conform(t.append_column(ROWADDR_COLUMN, addr), schema)


def _region_rows(
    mems: list[MemTableSnapshot], schema: pa.Schema, pk: list[str], known: _RegionRows | None
) -> _RegionRows | None:
    """:class:`_RegionRows` of one region's snapshots, extending ``known`` when they
    extend it; None when the key is not a single integer column."""
    if known is not None and not (known.schema is schema or known.schema.equals(schema)):
        known = None  # conformed to another schema (another table object's)
    delta = _region_delta(mems, known) if known is not None else None
    base = known if delta is not None else None
    if delta is None:
        delta = [(m.generation, 0, m.batches) for m in mems if m.batches]
    if not delta and base is not None:
        return base
    if len(pk) != 1:
        return None
    tables = [_conformed(g, first, b, schema) for g, first, b in delta]
    added = pa.concat_tables(tables) if tables else conform(schema.empty_table(), schema)
    ints = _int_keys(added.column(pk[0]))
    if ints is None:
        return None
    lasts, _ = int_runs(ints)  # ordered by key: ints[lasts] is sorted and distinct
    new_keys = ints[lasts]
    lasts = np.sort(lasts)
    gen_added = np.repeat(
        np.array([g for g, _, _ in delta], np.int64), [t.num_rows for t in tables]
    )
    if base is None:
        rows, keys, winners, gens = added, ints, lasts, gen_added[lasts]
        rows_nbytes = added.nbytes
    else:
        n = base.rows.num_rows
        stale = in_sorted(base.keys[base.winners], new_keys)
        winners = np.concatenate([base.winners[~stale], lasts + n])
        gens = np.concatenate([base.gens[~stale], gen_added[lasts]])
        rows = pa.concat_tables([base.rows, added])
        rows_nbytes = base.rows_nbytes + added.nbytes
        keys = np.concatenate([base.keys, ints])
    batches = tuple(m.batches for m in mems if m.batches)
    return _RegionRows(_parts(mems), batches, schema, rows, keys, winners, gens, rows_nbytes)


def _int_keys(col: pa.ChunkedArray) -> np.ndarray | None:
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_temporal(t):
        return as_int64(col.combine_chunks()).to_numpy(zero_copy_only=False)
    return None


_REGION_ROWS: LRUCache[tuple[str, str], _RegionRows] = LRUCache(
    1 << 12, max_bytes=512 << 20, sizeof=lambda r: r.nbytes, name="region_rows"
)
"""Per (table URI, region id), the :class:`_RegionRows` of its MemTable snapshots read
last (a later read whose snapshots extend them adds only the new rows; told apart by
the snapshots' batch objects, which the WAL tail cache and the writers keep the same).
Keyed by the table too: every unsharded table has the same region id."""


def _newer_nbytes(entry: tuple[Any, ...]) -> int:
    return int(entry[2].nbytes + entry[3].nbytes)


_MemView = tuple[
    pa.Table, np.ndarray, KeySet, np.ndarray, np.ndarray, "_ByRegion | None", tuple[Any, ...]
]


_NEWER_COMBINED: LRUCache[tuple[str, pa.Schema | bytes], tuple[Any, ...]] = LRUCache(
    16, max_bytes=256 << 20, sizeof=_newer_nbytes, name="newer_combined"
)
"""Per (table URI, schema), the newest rows (indices, tombstone flags) of the flushed
view and MemTable rows read last: a read of the same flushed view and the same
regions' rows (:data:`_REGION_ROWS` objects, nothing written since) reuses them."""


def _memtable_view(
    table_uri: str,
    mems: list[MemTableSnapshot],
    schema: pa.Schema,
    pk: list[str],
    ranks: dict[str, int],
) -> _MemView:
    """Rows, newest indices, keys, region rank and ``_gen`` of the newest rows of
    MemTable snapshots, (region rank, int64 key of each newest row) per region (None
    when every row was deduplicated at once), and what identifies the rows (their
    :class:`_RegionRows` and ranks, or the cached rows of every snapshot).

    With a single integer key, built region by region from each region's rows read
    before plus the rows added since (:data:`_REGION_ROWS`); the regions' newest rows
    are combined as they are unless a key has rows in two regions (then, and for other
    keys, every row is deduplicated at once: :func:`_memtable_view_whole`)."""
    by_region: dict[str, list[MemTableSnapshot]] = {}
    for m in mems:
        by_region.setdefault(m.region_id, []).append(m)
    parts: list[_RegionRows] = []
    for region_id, ms in sorted(by_region.items(), key=lambda kv: ranks[kv[0]]):
        ms = sorted(ms, key=lambda m: m.generation)
        got = _region_rows(ms, schema, pk, _REGION_ROWS.get((table_uri, region_id)))
        if got is None:
            return _memtable_view_whole(table_uri, mems, schema, pk, ranks)
        parts.append(_REGION_ROWS.put((table_uri, region_id), got))
    regions_sorted = sorted(by_region, key=lambda r: ranks[r])
    offsets = np.cumsum([0] + [p.rows.num_rows for p in parts])
    winners = np.concatenate([p.winners + off for p, off in zip(parts, offsets)])
    win_keys = np.concatenate([p.keys[p.winners] for p in parts])
    keys = KeySet(pa.table({pk[0]: win_keys}))
    if len(parts) > 1 and keys.distinct() != len(win_keys):
        return _memtable_view_whole(table_uri, mems, schema, pk, ranks)
    rows_m = pa.concat_tables([p.rows for p in parts])
    reg = np.repeat(
        np.array([ranks[r] for r in regions_sorted], np.int64), [len(p.winners) for p in parts]
    )
    gens = np.concatenate([p.gens for p in parts])
    region_keys = [(ranks[r], p.keys[p.winners]) for r, p in zip(regions_sorted, parts)]
    sources = (*parts, *(ranks[r] for r in regions_sorted))
    return rows_m, winners, keys, reg, gens, region_keys, sources


def _memtable_view_whole(
    table_uri: str,
    mems: list[MemTableSnapshot],
    schema: pa.Schema,
    pk: list[str],
    ranks: dict[str, int],
) -> _MemView:
    """:func:`_memtable_view` with every row deduplicated at once (cached: they only
    grow)."""
    key = (
        table_uri,
        tuple((m.region_id, m.generation, len(m.batches)) for m in mems),
        cache_key(schema),
    )
    lasts = tuple(m.batches[-1] for m in mems)
    hit = _MEMTABLE_VIEWS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], lasts)) and hit[6] == ranks:
        return (*hit[1:6], None, (hit[1], *ranks.values()))
    rows_m = pa.concat_tables([conform(memtable_rows(m), schema) for m in mems])
    sizes = [m.num_rows for m in mems]
    regions = np.repeat(np.array([ranks[m.region_id] for m in mems], np.int64), sizes)
    gens = np.repeat(np.array([m.generation for m in mems], np.int64), sizes)
    win_m = newest_indices(rows_m, pk, regions, gens)
    keys = KeySet(rows_m.select(pk))
    out = (rows_m, win_m, keys, regions[win_m], gens[win_m])
    _MEMTABLE_VIEWS.put(key, (lasts, *out, dict(ranks)))
    return (*out, None, (rows_m, *ranks.values()))


def _one_rank(*ranks: np.ndarray) -> bool:
    """Whether the region ranks in ``ranks`` are all one."""
    ends = [int(r) for a in ranks if len(a) for r in (a.min(), a.max())]
    return min(ends) == max(ends)


def _own_region_hits(flushed: _ByRegion | None, mems: _ByRegion | None) -> np.ndarray | None:
    """Which flushed winners (the keys of each region's, ``flushed``, in the winners'
    order) have a MemTable row in their own region (``mems``, keys of its newest rows
    per region rank); None when either side is not known per region or the MemTable
    keys span more than a dense flag table's range. One flag table over the MemTable
    keys' range, set and cleared region by region: no sort."""
    if flushed is None or mems is None:
        return None
    mem = {rank: keys for rank, keys in mems if len(keys)}
    if not mem:
        return None
    lo = min(int(k.min()) for k in mem.values())
    hi = max(int(k.max()) for k in mem.values())
    if hi - lo >= _DENSE_LIMIT:
        return None
    flags = np.zeros(hi - lo + 1, bool)
    out = []
    for rank, keys in flushed:
        theirs = mem.get(rank)
        if theirs is None or not len(keys):
            out.append(np.zeros(len(keys), bool))
            continue
        flags[theirs - lo] = True
        off = keys.view(np.uint64) - np.uint64(lo & 0xFFFFFFFFFFFFFFFF)
        got = flags.take(off, mode="clip")
        got &= off <= np.uint64(hi - lo)
        out.append(got)
        flags[theirs - lo] = False
    return _joined(out, bool)


def _combined(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None,
    fv: _FlushedView,
    memtables: _MemView,
) -> tuple[np.ndarray, np.ndarray]:
    """The newest rows of a flushed view and a MemTable view together: their sorted
    indices into the flushed rows followed by the MemTable rows, and tombstone flags."""
    n_f, win_f, reg_f, gen_f = fv.num_rows, fv.winners, fv.regions, fv.gens
    rows_m, win_m, keys_m, reg_m, gen_m, mem_regions, _ = memtables
    winners = win_m + n_f
    tomb_f = fv.tombstones
    tomb_m = pc.fill_null(rows_m.column(TOMBSTONE).take(pa.array(win_m)), False)
    tombstones = tomb_m.to_numpy(zero_copy_only=False).astype(bool, copy=False)
    if len(win_f):
        ints = fv.winner_keys()
        mem_key_cols = rows_m.select(pk)
        if ints is not None:  # as int64: the MemTables' keys are compared as int64 too
            winners_f = pa.table({pk[0]: pa.array(ints, pa.int64())})
            mem_key_cols = pa.table({pk[0]: as_int64(mem_key_cols.column(0))})
        else:
            winners_f = _flushed_rows(plan, schema, pk, storage_options).take(pa.array(win_f))
        hit = keys_m.contains(winners_f)  # flushed winners whose key has a MemTable row
        own = _own_region_hits(fv.region_keys(), mem_regions) if hit.any() else None
        if own is not None and own.any():
            # a MemTable row is newer than every generation of its region: those flushed
            # winners lose (in a bucket layout, every hit); the others decide below
            stay = ~own
            win_f, tomb_f = win_f[stay], tomb_f[stay]
            if np.count_nonzero(own) == np.count_nonzero(hit):
                hit = np.zeros(len(win_f), bool)
            else:
                hit, reg_f, gen_f = hit[stay], reg_f[stay], gen_f[stay]
                winners_f = winners_f.filter(pa.array(stay))
        if not hit.any() or _one_rank(reg_f, reg_m):
            # One region: a MemTable row is newer than every generation of its region.
            winners = np.concatenate([win_f[~hit], winners])
            tombstones = np.concatenate([tomb_f[~hit], tombstones])
        else:
            # Keys in MemTables and in another region's generations: the one rule
            # (dedup.newest_indices: _gen, then region rank) decides those keys only.
            keys_hit = winners_f.filter(pa.array(hit))
            mem_keys = mem_key_cols.take(pa.array(win_m))
            mem_hit = KeySet(keys_hit).contains(mem_keys)
            both = pa.concat_tables([keys_hit, mem_keys.filter(pa.array(mem_hit))])
            keep = newest_indices(
                both,
                pk,
                np.concatenate([reg_f[hit], reg_m[mem_hit]]),
                np.concatenate([gen_f[hit], gen_m[mem_hit]]),
            )
            decided = np.concatenate([win_f[hit], winners[mem_hit]])[keep]
            decided_tomb = np.concatenate([tomb_f[hit], tombstones[mem_hit]])[keep]
            # the undecided winners are in order (flushed rows first): the few decided
            # ones are inserted where they belong, no sort of every winner
            kept = np.concatenate([win_f[~hit], winners[~mem_hit]])
            kept_tomb = np.concatenate([tomb_f[~hit], tombstones[~mem_hit]])
            order = np.argsort(decided)
            at = np.searchsorted(kept, decided[order])
            winners = np.insert(kept, at, decided[order])
            tombstones = np.insert(kept_tomb, at, decided_tomb[order])
    return winners, tombstones


def newer_view(
    plan: ReadPlan,
    schema: pa.Schema,
    pk: list[str],
    storage_options: dict[str, str] | None = None,
    rows_next: bool = False,
) -> NewerView:
    """Build the :class:`NewerView` of a plan (vectorised; see class docs).

    ``rows_next``: the caller reads the generations' other columns next (a full read):
    their keys come from the region keys files or from those rows, never from a keys
    sidecar alone (:func:`memwal_query.read.sources.generation_columns`)."""
    fv = _flushed_view(plan, schema, pk, storage_options, rows_next)
    names = read_schema(schema).names
    mems = [m for r in plan.regions for m in r.memtables]
    if not mems:
        return NewerView(
            lambda cols: _flushed_rows(plan, schema, cols, storage_options),
            names,
            None,
            fv.keys,
            lambda cols: _flushed_newest(
                plan, schema, cols, fv.winners, storage_options, None, (pk[0], fv.winner_keys)
            ),
            None,
            lambda cols: _flushed_newest(
                plan,
                schema,
                cols,
                fv.winners,
                storage_options,
                ~fv.tombstones,
                (pk[0], fv.winner_keys),
            ),
            flushed=fv,
        )
    keys_f = fv.keys
    memtables = _memtable_view(_table_key(plan), mems, schema, pk, _ranks(plan))
    rows_m, keys_m = memtables[0], memtables[2]
    sources = memtables[6]
    key = (_table_key(plan), cache_key(schema))
    known = _NEWER_COMBINED.get(key)
    if (
        known is not None
        and known[0] is fv
        and len(known[1]) == len(sources)
        and all(a is b or (isinstance(a, int) and a == b) for a, b in zip(known[1], sources))
    ):
        winners, tombstones = known[2], known[3]
    else:
        winners, tombstones = _combined(plan, schema, pk, storage_options, fv, memtables)
        _NEWER_COMBINED.put(key, (fv, sources, winners, tombstones))

    def rows(cols: Sequence[str]) -> pa.Table:
        flushed = _flushed_rows(plan, schema, cols, storage_options)
        return pa.concat_tables([flushed, rows_m.select(list(cols))])

    return NewerView(rows, names, winners, KeySetUnion([keys_f, keys_m]), tombstones=tombstones)
