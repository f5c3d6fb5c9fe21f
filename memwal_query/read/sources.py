"""Collecting the sources of an LSM read: base table, flushed generations, MemTables.

:func:`resolve` returns a :class:`ReadPlan` for one point in time:

- the base table (generation 0) at its latest version, and the MemWAL index of that
  version, whose ``merged_generations`` say which flushed generations are already in
  it: those are not read again (a merged generation still listed produces no
  duplicates, and a garbage-collected one is never needed);
- per region, the flushed generations above the merged one, newest last, from the
  region manifests (``strong``) or the region snapshots of the MemWAL index
  (``eventual``; see :mod:`memwal_query.maintain.snapshots`);
- the MemTables of the writers handed in (read-your-writes). With ``eventual``, a region
  whose writer is handed in is read from its region manifest (strong for that region),
  so that its MemTables continue the generations read; the other regions come from the
  snapshots. Each region then shows a state it had (regions are independent: a key
  lives in one region).

Regions whose region value cannot satisfy the query's predicates are pruned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    BaseVersionGoneError,
    GenerationGoneError,
    MemWalError,
    ObjectNotFoundError,
)
from memwal_query.format.index import manifest_path
from memwal_query.format.schema import GEN_COLUMN, ROWADDR_COLUMN, TOMBSTONE
from memwal_query.read import view
from memwal_query.read.dedup import KeySet, KeySetUnion, newest_indices
from memwal_query.read.view import GenerationRef, ReadPlan
from memwal_query.storage.cache import LRUCache
from memwal_query.storage.io import in_chunks
from memwal_query.write.memtable import MemTableSnapshot

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter


def resolve(
    table: Catalog,
    consistency: str = view.DEFAULT_CONSISTENCY,
    writers: Sequence[RegionWriter] | None = None,
    predicates: list[tuple[str, str, Any]] | None = None,
    max_staleness: float | None = None,
    as_of: Any = None,
) -> ReadPlan:
    """Resolve the pinned view to read now (or, with ``as_of``, of a past moment):
    :func:`memwal_query.read.view.resolve`."""
    staleness = view.DEFAULT_MAX_STALENESS if max_staleness is None else max_staleness
    return view.resolve(table, consistency, writers, predicates, staleness, as_of)


def base_version_gone(table: Catalog, version: int) -> bool:
    """Whether version ``version`` of the base table was cleaned up (its manifest is gone)."""
    try:
        manifest_path(table.io, table.uri, version)
    except ObjectNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - cannot tell: report the original error
        return False
    return False


@contextlib.contextmanager
def reading_base(table: Catalog, base: lance.LanceDataset) -> Iterator[None]:
    """Turn an error reading ``base`` into :class:`BaseVersionGoneError` when that version
    was cleaned up meanwhile (Lance reports the deleted data file as a plain OSError or
    ArrowInvalid "Not found"); any other error propagates unchanged."""
    try:
        yield
    except MemWalError:
        raise
    except Exception as e:
        if not base_version_gone(table, base.version):
            raise
        raise BaseVersionGoneError(
            f"{table.uri}: base version {base.version} was cleaned up while it was read "
            f"(run the read again): {e}"
        ) from e


# -- reading flushed generations ---------------------------------------------------------
def _columns_nbytes(columns: dict[str, pa.ChunkedArray]) -> int:
    # the buffers' whole sizes (10x cheaper than ``nbytes``, which walks offsets; never
    # less than what is held)
    return sum(c.get_total_buffer_size() for c in columns.values())


class _GenerationCache(LRUCache[str, dict[str, pa.ChunkedArray]]):
    """Process-wide LRU of decoded generation columns (generations are immutable),
    bounded by bytes (default 1 GiB).

    Per generation directory: its ``_rowaddr`` and the columns read so far, each read
    from Lance at most once and only when a query needs it (projection pushdown: a query
    of ``id, val`` never reads a generation's other columns).
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        super().__init__(1 << 20, max_bytes=max_bytes, sizeof=_columns_nbytes)

    def columns(self, uri: str) -> dict[str, pa.ChunkedArray]:
        """The columns cached for ``uri`` (a copy; empty when none)."""
        return dict(self.get(uri) or {})

    def add(self, uri: str, columns: dict[str, pa.ChunkedArray]) -> dict[str, pa.ChunkedArray]:
        """Cache ``columns`` of ``uri`` too; return every column now cached for it."""
        merged = {**columns, **(self.get(uri) or {})}
        self.put(uri, merged)
        return dict(merged)


GENERATION_CACHE = _GenerationCache()


def read_generation(
    ref: GenerationRef,
    schema: pa.Schema,
    storage_options=None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """Rows of a flushed generation with ``_gen`` and ``_rowaddr``, in write order.

    Conformed to ``schema`` + ``_tombstone`` (columns added to the base table after the
    generation was written read as NULL; a missing ``_tombstone`` as false). With
    ``columns``, only those (names of that conformed schema) are returned, and only
    those are read from Lance. Raises GenerationGoneError when missing.
    """
    out = _read_generation(ref, schema, storage_options, columns, lance_ok=True)
    assert out is not None
    return out


def parallel_reads(uri: str, storage_options: dict[str, str] | None) -> bool:
    """Whether reading many generations at ``uri`` finishes sooner on several threads
    (:attr:`memwal_query.storage.io.FileIO.parallel_requests`: object stores yes, local
    file systems no; Lance reads, which release the GIL, always do)."""
    return bool(file_io(uri, storage_options).parallel_requests)


def _read_generation(
    ref: GenerationRef,
    schema: pa.Schema,
    storage_options,
    columns: Sequence[str] | None,
    lance_ok: bool,
) -> pa.Table | None:
    target = _storage_read_schema(schema)
    names = target.names if columns is None else [c for c in columns if c in target.names]
    cached = GENERATION_CACHE.columns(ref.uri)
    missing = [c for c in names if c not in cached and c not in (GEN_COLUMN, ROWADDR_COLUMN)]
    if (missing or ROWADDR_COLUMN not in cached) and not cached:
        side = _sidecar(ref.uri, storage_options, target)
        if side is not None:
            cached = GENERATION_CACHE.add(ref.uri, side)
            missing = [c for c in missing if c not in cached]
    if missing or ROWADDR_COLUMN not in cached:
        if not lance_ok:
            return None
        try:
            ds = lance.dataset(ref.uri, storage_options=storage_options or None)
            present = set(ds.schema.names)
            raw = ds.to_table(
                columns=[c for c in missing if c in present],
                with_row_address=ROWADDR_COLUMN not in cached,
            )
        except (ValueError, OSError, FileNotFoundError) as e:
            raise GenerationGoneError(
                f"generation {ref.generation} of region {ref.region_id} at {ref.uri} is "
                f"gone or unreadable: {e}"
            ) from e
        fresh = {c: raw.column(c) for c in raw.column_names}
        n = raw.num_rows if ROWADDR_COLUMN not in cached else len(cached[ROWADDR_COLUMN])
        for c in missing:
            if c not in present:  # written before the column existed
                t = target.field(c).type
                value = pa.scalar(False) if c == TOMBSTONE else pa.scalar(None, t)
                fresh[c] = pa.chunked_array([pa.repeat(value, n)], t)
        cached = GENERATION_CACHE.add(ref.uri, fresh)
    n = len(cached[ROWADDR_COLUMN])
    arrays = []
    for name in names:
        f = target.field(name)
        if name == GEN_COLUMN:
            col = pa.chunked_array([pa.repeat(pa.scalar(ref.generation, pa.uint64()), n)])
        else:
            col = cached[name]
        arrays.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema([target.field(c) for c in names]))


READ_TASKS = 4
"""How many tasks read the generations of a query that are not cached yet."""
_READERS = ThreadPoolExecutor(READ_TASKS, thread_name_prefix="memwal-generations")
T = TypeVar("T")


def map_generations(
    fn: Callable[[GenerationRef], T],
    refs: Sequence[GenerationRef],
    storage_options: dict[str, str] | None = None,
) -> list[T]:
    """``fn(ref)`` of each generation, in order: in this thread on a local file system,
    in a few concurrent tasks on an object store, where each read is mostly a round
    trip (:func:`parallel_reads`)."""
    if len(refs) < 2 or not parallel_reads(refs[0].uri, storage_options):
        return [fn(ref) for ref in refs]
    return in_chunks(_READERS, fn, refs, READ_TASKS)


def read_generations(
    refs: Sequence[GenerationRef],
    schema: pa.Schema,
    storage_options=None,
    columns: Sequence[str] | None = None,
    check: Callable[[pa.Table], object] | None = None,
) -> list[pa.Table]:
    """:func:`read_generation` of every generation of ``refs``, in that order.

    Generations not cached yet (a cold start: one rows sidecar each, or a Lance table
    when they have none) are read concurrently in a few tasks on an object store; on a
    local file system the cached columns and sidecars are read in this thread (threads
    would only contend for the GIL, and cost their own start on a cold start) and only
    the Lance tables, which release the GIL, in tasks. ``check`` sees each table as it
    is read (it may raise to stop the reading). An error of any generation
    (:class:`GenerationGoneError`) is raised.
    """

    def read(g: GenerationRef, lance_ok: bool = True) -> pa.Table | None:
        t = _read_generation(g, schema, storage_options, columns, lance_ok)
        if t is not None and check is not None:
            check(t)
        return t

    local = bool(refs) and not parallel_reads(refs[0].uri, storage_options)
    got = [read(g, lance_ok=False) if local or g.uri in GENERATION_CACHE else None for g in refs]
    todo = [i for i, t in enumerate(got) if t is None]
    for i, t in zip(todo, in_chunks(_READERS, read, [refs[i] for i in todo], READ_TASKS)):
        got[i] = t
    out = [t for t in got if t is not None]
    if len(out) != len(refs):  # never: each read returns a table or raises
        raise AssertionError(f"{len(refs) - len(out)} generation(s) not read")
    return out


_NO_SIDECAR: LRUCache[str, bool] = LRUCache(1 << 16)
_IOS: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}


def file_io(uri: str, storage_options: dict[str, str] | None) -> Any:
    """The FileIO of ``uri``'s store (one per scheme and storage options, kept)."""
    from memwal_query.storage.factory import file_io_for

    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    key = (scheme, tuple(sorted((storage_options or {}).items())))
    io = _IOS.get(key)
    if io is None:
        io = _IOS.setdefault(key, file_io_for(uri, storage_options))
    return io


def _sidecar(
    uri: str, storage_options: dict[str, str] | None, target: pa.Schema
) -> dict[str, pa.ChunkedArray] | None:
    """Every column of a generation from its rows sidecar (:mod:`memwal_query.format.
    rowfile`; columns added to the table after the generation was written as NULL), or
    None when it has none or a damaged one (then the Lance table is read)."""
    if _NO_SIDECAR.get(uri):
        return None
    from memwal_query.format import rowfile

    t = rowfile.read(file_io(uri, storage_options), uri)
    if t is None:
        _NO_SIDECAR.put(uri, True)
        return None
    wanted = set(target.names)
    out = {c: t.column(c) for c in t.column_names if c in wanted}
    for f in target:
        if f.name not in out and f.name != GEN_COLUMN:  # written before the column existed
            value = pa.scalar(False) if f.name == TOMBSTONE else pa.scalar(None, f.type)
            out[f.name] = pa.chunked_array([pa.repeat(value, t.num_rows)], f.type)
    return out


def memtable_rows(m: MemTableSnapshot) -> pa.Table:
    """Rows of a MemTable snapshot with ``_gen`` and ``_rowaddr`` (= row index)."""
    t = m.to_table()
    gen = pa.repeat(pa.scalar(m.generation, pa.uint64()), t.num_rows)
    addr = pa.array(np.arange(t.num_rows, dtype=np.uint64))
    return t.append_column(GEN_COLUMN, gen).append_column(ROWADDR_COLUMN, addr)


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select/cast ``t`` to ``schema`` + ``_tombstone``/``_gen``/``_rowaddr``; missing = NULL."""
    target = _storage_read_schema(schema)
    if t.schema.equals(target, check_metadata=False):
        return t
    cols = []
    for f in target:
        if f.name in t.column_names:
            c = t.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=target)


_READ_SCHEMAS: dict[pa.Schema, pa.Schema] = {}
_READ_SCHEMAS_BY_ID: dict[int, tuple[pa.Schema, pa.Schema]] = {}


def _storage_read_schema(schema: pa.Schema) -> pa.Schema:
    # by identity first: hashing a schema costs more than reading a small generation
    known = _READ_SCHEMAS_BY_ID.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    out = _READ_SCHEMAS.get(schema)
    if out is None:
        fields = [pa.field(f.name, f.type, nullable=True) for f in schema]
        fields += [
            pa.field(TOMBSTONE, pa.bool_()),
            pa.field(GEN_COLUMN, pa.uint64()),
            pa.field(ROWADDR_COLUMN, pa.uint64()),
        ]
        out = _READ_SCHEMAS[schema] = pa.schema(fields)
    if len(_READ_SCHEMAS_BY_ID) > 64:
        _READ_SCHEMAS_BY_ID.clear()
    _READ_SCHEMAS_BY_ID[id(schema)] = (schema, out)
    return out


def _empty(schema: pa.Schema) -> pa.Table:
    return conform(schema.empty_table(), schema)


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
    """

    def __init__(
        self,
        rows: Callable[[Sequence[str]], pa.Table],
        names: Sequence[str],
        winners: np.ndarray,
        keys: KeySet | KeySetUnion,
        newest: Callable[[Sequence[str]], pa.Table] | None = None,
    ) -> None:
        self._rows = rows
        self._names = list(names)
        self.winners = winners
        self.keys = keys
        self._newest = newest

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

    def newest(self, names: Sequence[str]) -> pa.Table:
        """The newest rows (:attr:`winners`, in that order, tombstones included), only
        ``names`` (for flushed generations alone, cached per column)."""
        if self._newest is not None:
            return self._newest(list(names))
        return self.columns(names).take(pa.array(self.winners))


_FLUSHED_VIEWS: LRUCache[tuple, tuple[int, np.ndarray, KeySet, np.ndarray, np.ndarray]] = LRUCache(
    8
)
_MEM_VIEWS: LRUCache[tuple, tuple] = LRUCache(8)


def _ranks(plan: ReadPlan) -> dict[str, int]:
    """Region rank of every region of the plan: ordered as the region ids, and the same
    in every plan (cached flushed views are combined with later plans' MemTables): the
    first 60 bits of the (canonical, lowercase) UUID."""
    return {v.region_id: int(v.region_id.replace("-", "")[:15], 16) for v in plan.regions}


def _flushed_rows(
    plan: ReadPlan, schema: pa.Schema, columns: Sequence[str], storage_options
) -> pa.Table:
    """The plan's generations, oldest first, only ``columns`` (zero-copy concatenation)."""
    parts = read_generations(plan.generations, schema, storage_options, columns)
    if parts:
        return pa.concat_tables(parts)
    return _empty(schema).select(list(columns))


def _column_nbytes(entry: tuple[np.ndarray, pa.ChunkedArray]) -> int:
    return entry[1].nbytes


NEWEST_COLUMNS: LRUCache[tuple, tuple[np.ndarray, pa.ChunkedArray]] = LRUCache(
    256, max_bytes=256 << 20, sizeof=_column_nbytes
)
"""Columns of the newest rows of a set of flushed generations (what an unfiltered scan
returns of them), one contiguous array each, per (generations, schema, column); bounded
by bytes (default 256 MiB). An entry is used only while every one of its generations is
in :data:`GENERATION_CACHE` (so forgetting a generation there forgets it here too)."""


def _flushed_newest(
    plan: ReadPlan, schema: pa.Schema, names: Sequence[str], winners: np.ndarray, storage_options
) -> pa.Table:
    """Columns ``names`` of the plan's generations at rows ``winners`` (the newest row
    per key; cached, see :data:`NEWEST_COLUMNS`)."""
    uris = tuple(g.uri for g in plan.generations)
    cached = all(u in GENERATION_CACHE for u in uris)
    got: dict[str, pa.ChunkedArray] = {}
    for name in names:
        hit = NEWEST_COLUMNS.get((uris, schema, name)) if cached else None
        if hit is not None and hit[0] is winners:
            got[name] = hit[1]
    missing = [n for n in names if n not in got]
    if missing:
        taken = _flushed_rows(plan, schema, missing, storage_options).take(pa.array(winners))
        for name in missing:
            col = taken.column(name).combine_chunks()
            got[name] = pa.chunked_array([col], col.type)
            NEWEST_COLUMNS.put((uris, schema, name), (winners, got[name]))
    target = _storage_read_schema(schema)
    fields = [target.field(n) for n in names]
    return pa.Table.from_arrays([got[n] for n in names], schema=pa.schema(fields))


def _flushed_view(
    plan: ReadPlan, schema: pa.Schema, pk: list[str], storage_options
) -> tuple[int, np.ndarray, KeySet, np.ndarray, np.ndarray]:
    """(row count, newest indices, key set, region rank and ``_gen`` of the newest rows)
    of the plan's generations (cached)."""
    key = (tuple(g.uri for g in plan.generations), schema)
    hit = _FLUSHED_VIEWS.get(key)
    if hit is not None:
        return hit
    ranks = _ranks(plan)
    parts = read_generations(plan.generations, schema, storage_options, [*pk, GEN_COLUMN])
    keys = pa.concat_tables(parts) if parts else _empty(schema).select([*pk, GEN_COLUMN])
    regions = np.repeat(
        np.array([ranks[g.region_id] for g in plan.generations], dtype=np.int64),
        [p.num_rows for p in parts],
    )
    gens = keys.column(GEN_COLUMN).to_numpy().astype(np.int64) if parts else np.zeros(0, np.int64)
    winners = newest_indices(keys, pk, regions, gens)
    view = (keys.num_rows, winners, KeySet(keys.select(pk)), regions[winners], gens[winners])
    return _FLUSHED_VIEWS.put(key, view)


def _memtable_view(
    mems: list[MemTableSnapshot], schema: pa.Schema, pk: list[str], ranks: dict[str, int]
) -> tuple[pa.Table, np.ndarray, KeySet, np.ndarray, np.ndarray]:
    """Rows, newest indices, keys, and region rank and ``_gen`` of the newest rows of
    MemTable snapshots (cached: they only grow)."""
    key = (tuple((m.region_id, m.generation, len(m.batches)) for m in mems), schema)
    lasts = tuple(m.batches[-1] for m in mems)
    hit = _MEM_VIEWS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], lasts)) and hit[6] == ranks:
        return hit[1:6]
    rows_m = pa.concat_tables([conform(memtable_rows(m), schema) for m in mems])
    sizes = [m.num_rows for m in mems]
    regions = np.repeat(np.array([ranks[m.region_id] for m in mems], np.int64), sizes)
    gens = np.repeat(np.array([m.generation for m in mems], np.int64), sizes)
    win_m = newest_indices(rows_m, pk, regions, gens)
    keys = KeySet(rows_m.select(pk))
    out = (rows_m, win_m, keys, regions[win_m], gens[win_m])
    _MEM_VIEWS.put(key, (lasts, *out, dict(ranks)))
    return out


def newer_view(plan: ReadPlan, schema: pa.Schema, pk: list[str], storage_options=None) -> NewerView:
    """Build the :class:`NewerView` of a plan (vectorised; see class docs)."""
    n_f, win_f, keys_f, reg_f, gen_f = _flushed_view(plan, schema, pk, storage_options)
    names = _storage_read_schema(schema).names
    mems = [m for r in plan.regions for m in r.memtables]
    if not mems:
        return NewerView(
            lambda cols: _flushed_rows(plan, schema, cols, storage_options),
            names,
            win_f,
            keys_f,
            lambda cols: _flushed_newest(plan, schema, cols, win_f, storage_options),
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
