"""The durable WAL tail of a region: acknowledged writes not flushed yet.

The default consistency (``"latest"``, :data:`memwal_query.read.view.DEFAULT_CONSISTENCY`)
reads, per region, the WAL entries after the region manifest's
``replay_after_wal_entry_position`` up to the first missing position, as MemTable
snapshots (:func:`tails`). What that costs:

- **Nothing unflushed**: one read per region, of the position after the replay position
  of the manifest read last time (the catalog keeps it), which is missing (a failed
  ``open`` on a local disk, a GET answered 404 on an object store; on an object store
  the probes of all regions run at once). The region's manifest is then *not* read
  again: that read replaces the manifest check a ``strong`` read makes (see below why
  the known manifest is then as good as the newest). A region whose probe finds an
  entry, or whose manifest was never read, has its manifest read as ``strong`` does,
  then its tail.
- **Unflushed entries**: on an object store :data:`READ_AHEAD` positions are read at
  once. An entry is immutable (written once with put-if-not-exists,
  never rewritten), so decoded and conformed entries are kept in a process-wide cache
  keyed by the table's lineage, the entry's path and the schema
  (:data:`ENTRIES`, bounded by :data:`CACHE_BYTES`), and each region's tail as read
  last (:data:`TAILS`): a query reads only the entries written since the previous
  one, plus the probe of the next position.

Why a missing position ends the tail: entries are written at consecutive positions, one
at a time, so an entry acknowledged before the query started has every position before
it written too. A position can go missing afterwards only by GC, which deletes an entry
only with the generation it was flushed into, once every retained base version merged
that generation (:mod:`memwal_query.maintain.gc`). That generation was flushed after
the manifest ``M`` the tail started from (the entry was above ``M``'s replay position),
so its number is at least ``M.current_generation``. The view reads the base version
``V`` after the tails; when ``V`` merged a generation numbered ``M.current_generation``
or more, the view is resolved again with every manifest read anew
(:func:`memwal_query.read.view._check_tails`); otherwise no entry above ``M``'s replay
position was collected, and a missing position is the end of the WAL when it was read.

The same argument lets a region whose first position ``p`` after the *known* manifest
``M`` (read by an earlier query) is missing keep ``M`` without reading it again: a later
manifest differs in its generations only by a flush, and a flush covers WAL entries
(every row of a generation is in an entry at or below its replay position; a
non-durable writer syncs before it seals), so it needs entry ``p``. Either ``p`` was
never written, and ``M`` with nothing after it is the region's state when ``p`` was
found missing; or it was flushed, merged and collected, and ``V`` shows it. A sealed
region's manifest is always read again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa

from memwal_query.exceptions import ObjectNotFoundError
from memwal_query.format.naming import wal_entry_name
from memwal_query.format.schema import storage_schema
from memwal_query.format.wal import conform_entry, decode_entry
from memwal_query.storage import paths
from memwal_query.storage.cache import LRUCache
from memwal_query.storage.io import in_chunks, join
from memwal_query.write.memtable import MemTableSnapshot

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.format.manifest import RegionManifest

CACHE_BYTES = 256 << 20
"""Most bytes of decoded WAL entries kept between queries (per process)."""

_Batches = tuple[pa.RecordBatch, ...]
_Entry = tuple[int | None, _Batches]
ENTRIES: LRUCache[tuple[str, str], tuple[pa.Schema, _Entry, int]] = LRUCache(
    1 << 16, max_bytes=CACHE_BYTES, sizeof=lambda e: e[2], name="wal_entries"
)
"""Decoded WAL entries: ``(lineage, path) -> (storage schema they were conformed to,
(generation recorded in the entry or None, its rows as record batches), bytes)``; an
entry conformed to another schema (the table's changed) is read again. The batches
are the same objects every time an entry is read: what readers build on them (a
MemTable view, a key index) is keyed by their identity and extended, not rebuilt."""


class _Tail:
    """What one region's tail held when it was last read: the entries from ``start``
    (the replay position + 1 of the manifest it was read for) up to ``end``
    (exclusive; the first position found missing), by generation. Immutable: a read
    that finds more builds a new one (:meth:`extended`)."""

    __slots__ = ("start", "current_generation", "schema", "end", "by_gen", "nbytes")

    def __init__(
        self,
        start: int,
        current_generation: int,
        schema: pa.Schema,
        end: int,
        by_gen: dict[int, _Batches],
        nbytes: int,
    ) -> None:
        self.start = start
        self.current_generation = current_generation
        self.schema = schema
        self.end = end
        self.by_gen = by_gen
        self.nbytes = nbytes

    def fits(self, manifest: RegionManifest, schema: pa.Schema) -> bool:
        """Whether this tail was read after ``manifest``'s replay position, with its
        generation numbering, conformed to ``schema``."""
        return (
            self.start == manifest.replay_after_wal_entry_position + 1
            and self.current_generation == manifest.current_generation
            and (self.schema is schema or self.schema.equals(schema))
        )

    def extended(self, found: list[_Entry], nbytes: int) -> tuple[_Tail, list[_Batches]]:
        """This tail and the entries ``found`` at ``end``, ``end + 1``, ..., and the
        rows of each entry found as slices of the new tail's batches.

        The rows of the entries found that rank in one generation become one record
        batch (copied once): a stream's writer puts many small entries, and what
        readers do per batch (a MemTable view's chunks, a key index's runs, a scan's
        batches) then scales with the reads that found them, not with the entries."""
        by_gen: dict[int, list[pa.RecordBatch]] = {}
        where: list[tuple[int, int, int]] = []  # per entry: rank, first row, rows
        # A later position is a newer write, so an entry's generation is at least that
        # of every entry before it in the tail, and at least the manifest's current
        # one. A writer that claimed the region replays the whole tail into the
        # current generation and records that number in its entries, below one a
        # previous writer had sealed and recorded (not flushed); a fenced writer's
        # late write records an older one. Neither may rank below an older write.
        top = max(self.by_gen, default=self.current_generation)
        offset: dict[int, int] = {}
        for gen, batches in found:
            top = max(top, self.current_generation if gen is None else gen)
            by_gen.setdefault(top, []).extend(batches)
            n = sum(b.num_rows for b in batches)
            where.append((top, offset.get(top, 0), n))
            offset[top] = offset.get(top, 0) + n
        merged = dict(self.by_gen)
        joined = {g: _one_batch(added) for g, added in by_gen.items() if added}
        for g in by_gen:
            merged[g] = merged.get(g, ()) + ((joined[g],) if g in joined else ())
        tail = _Tail(
            self.start,
            self.current_generation,
            self.schema,
            self.end + len(found),
            merged,
            self.nbytes + nbytes,
        )
        rows = [(joined[g].slice(first, n),) if n else () for g, first, n in where]
        return tail, rows


def _one_batch(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """The rows of ``batches`` (one schema) as one record batch."""
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


TAILS: LRUCache[tuple[str, str], _Tail] = LRUCache(
    1 << 12, max_bytes=CACHE_BYTES, sizeof=lambda t: t.nbytes, name="wal_tails", budget=False
)
"""Per region, ``(lineage, WAL directory) -> _Tail`` read last: the next read of the
same tail (same manifest) reads only the positions from its ``end`` on. Entries are
immutable, so the entries it holds are what reading them again would return (the
same argument as :data:`ENTRIES`'; a gap GC made below ``end`` is caught the same way,
by :func:`memwal_query.read.view._check_tails`). Bounded by its own bytes
(:data:`CACHE_BYTES`), not by the read caches' shared budget
(:func:`memwal_query.storage.cache.cache_size_bytes`): every read at the default
consistency needs every tail again, and the views built from the tails are stored after
them, so under that budget each read evicted the tails it had just read, and the next
one decoded every entry again and rebuilt what is tied to the tails' batches (regions'
MemTable rows, MemTable key indexes)."""


def forget() -> None:
    """Forget every cached WAL entry and tail (the next read reads them from storage,
    as another process would)."""
    ENTRIES.clear()
    TAILS.clear()


_SCHEMAS: LRUCache[int, tuple[pa.Schema, pa.Schema]] = LRUCache(64)


def _storage_schema(schema: pa.Schema) -> pa.Schema:
    """:func:`storage_schema`, one object per table schema object (identity checks
    replace comparisons in the entry cache)."""
    hit = _SCHEMAS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    return _SCHEMAS.put(id(schema), (schema, storage_schema(schema)))[1]


@functools.lru_cache(maxsize=1 << 12)
def _wal_dir(table_uri: str, region_id: str) -> str:
    return paths.wal_dir(table_uri, region_id)


@functools.lru_cache(maxsize=1 << 16)
def _entry_path(wal_dir: str, position: int) -> str:
    return join(wal_dir, wal_entry_name(position))


WAL_READERS = 16
"""WAL positions read at once on an object store."""

_PROBES = ThreadPoolExecutor(WAL_READERS, thread_name_prefix="memwal-walprobe")
_TAILS = ThreadPoolExecutor(WAL_READERS, thread_name_prefix="memwal-waltail")
# (two pools: a tail waits for its region's probe, which must not queue behind it)


class _Region:
    """The WAL of one region as a reader sees it."""

    def __init__(self, table: Catalog, region_id: str, schema: pa.Schema) -> None:
        self.io = table.io
        self.lineage = table.lineage
        self.primary_key = table.primary_key
        self.schema = schema
        self.wal_dir = _wal_dir(table.uri, region_id)

    def sized_entry(self, position: int) -> tuple[_Entry, int] | None:
        """The entry at ``position`` (from the cache when read before) and its bytes,
        None when missing; WalCorruptError when damaged."""
        path = _entry_path(self.wal_dir, position)
        key = (self.lineage, path)
        hit = ENTRIES.get(key)
        if hit is not None and (hit[0] is self.schema or hit[0].equals(self.schema)):
            return hit[1], hit[2]
        try:
            data = self.io.read(path)
        except ObjectNotFoundError:
            return None
        entry = decode_entry(path, position, data)
        rows = conform_entry(path, entry.table, self.schema, self.primary_key)
        batches = tuple(rows.to_batches())
        nbytes = rows.get_total_buffer_size()
        ENTRIES.put(key, (self.schema, (entry.generation, batches), nbytes))
        return (entry.generation, batches), nbytes


_Sized = tuple[_Entry, int] | None


def _done(fn: Callable[[int], _Sized], position: int) -> Future[_Sized]:
    """``fn(position)`` run now, as a completed future."""
    out: Future[_Sized] = Future()
    try:
        out.set_result(fn(position))
    except BaseException as e:  # noqa: BLE001 - raised by .result()
        out.set_exception(e)
    return out


def _cached_tail(table: Catalog, wal_dir: str) -> _Tail | None:
    return TAILS.get((table.lineage, wal_dir))


class Probes:
    """Reads of each region's first unflushed position after the manifest read last
    time (see the module docs), all at once on an object store.

    A region whose tail after that manifest was read before and held entries needs no
    read: the entry at that position exists (entries are immutable).

    Parameters
    ----------
    table : Catalog
    region_ids : list of str
        Regions whose state is about to be read.
    """

    def __init__(self, table: Catalog, region_ids: Sequence[str]) -> None:
        self.schema = _storage_schema(table.schema)
        self._started: dict[str, tuple[RegionManifest, int, Future[_Sized]]] = {}
        at_once = table.io.parallel_requests and len(region_ids) > 1
        for region_id in region_ids:
            known = table.known_region_manifest(region_id)
            if known is None or known.sealed:
                continue
            position = known.replay_after_wal_entry_position + 1
            region = _Region(table, region_id, self.schema)
            cached = _cached_tail(table, region.wal_dir)
            if cached is not None and cached.fits(known, self.schema) and cached.end > position:
                probe = _done(lambda _: _PRESENT, position)
            elif at_once:
                probe = _PROBES.submit(region.sized_entry, position)
            else:
                probe = _done(region.sized_entry, position)
            self._started[region_id] = (known, position, probe)

    def unchanged(self) -> dict[str, RegionManifest]:
        """The regions whose probe found nothing unflushed, with the manifest known
        for them (as good as the newest: see the module docs). Waits for the probes."""
        out = {}
        for region_id, (known, _, probe) in list(self._started.items()):
            if probe.result() is None:
                out[region_id] = known
                del self._started[region_id]
        return out

    def take(self, region_id: str, position: int) -> Future[_Sized] | None:
        """The probe of ``position`` of a region, if one was started at that position."""
        started = self._started.pop(region_id, None)
        if started is None or started[1] != position:
            return None
        return started[2]


_PRESENT: _Sized = ((None, ()), 0)
"""A probe's answer for an entry known to exist (its tail is cached): never read as
rows (:func:`tail` continues its cached tail instead)."""

READ_AHEAD = 8
"""On an object store, the WAL positions read at once after an entry was found."""


def _entries(
    region: _Region, position: int, first: _Sized, at_once: bool
) -> Iterator[tuple[_Entry, int]]:
    """``first`` (the entry at ``position`` and its bytes) and the entries after it, up
    to the first missing position; on an object store :data:`READ_AHEAD` positions are
    read at once (positions after the first missing one are ignored: written later, or
    not at all)."""
    found = first
    while found is not None:
        yield found
        position += 1
        if not at_once:
            found = region.sized_entry(position)
            continue
        batch = [
            _PROBES.submit(region.sized_entry, q) for q in range(position, position + READ_AHEAD)
        ]
        for read in batch[:-1]:
            found = read.result()
            if found is None:
                return
            yield found
            position += 1
        found = batch[-1].result()


def tail(
    table: Catalog,
    region_id: str,
    manifest: RegionManifest,
    schema: pa.Schema,
    probe: Future[_Sized] | None = None,
) -> list[MemTableSnapshot]:
    """Durable WAL entries after the manifest's replay position, as MemTable snapshots
    (one per generation recorded in the entries, oldest first). An entry ranks in the
    highest generation recorded at or before its position, and never below the
    manifest's ``current_generation``: a later position is a newer write.

    The tail read last for the same manifest (:data:`TAILS`) is continued: only the
    positions after its end are read. The snapshots' batches are the same objects in
    every read of the same entries.

    Parameters
    ----------
    probe : Future, optional
        The read of the first position, already started (:class:`Probes`).

    Raises
    ------
    WalCorruptError
        An entry cannot be decoded or does not fit the table's schema.
    StorageError
        The store failed (not a missing entry, which ends the tail).
    """
    region = _Region(table, region_id, schema)
    start = manifest.replay_after_wal_entry_position + 1
    key = (table.lineage, region.wal_dir)
    known = TAILS.get(key)
    if known is None or not known.fits(manifest, region.schema):
        if known is not None and known.start < start:
            _forget_entries(table.lineage, region.wal_dir, known.start, min(known.end, start))
        known = _Tail(start, manifest.current_generation, region.schema, start, {}, 0)
    if known.end == start and probe is not None:
        first = probe.result()
        if first is _PRESENT:  # the cached tail it stood for is gone: read it
            first = region.sized_entry(start)
    else:
        first = region.sized_entry(known.end)
    found = list(_entries(region, known.end, first, table.io.parallel_requests))
    if found:
        end = known.end
        known, rows = known.extended([e for e, _ in found], sum(n for _, n in found))
        TAILS.put(key, known)
        # the entries' cached rows become views of the tail's batches (one copy held)
        for i, (((gen, _), nbytes), shared) in enumerate(zip(found, rows)):
            path = _entry_path(region.wal_dir, end + i)
            ENTRIES.put((table.lineage, path), (region.schema, (gen, shared), nbytes))
    return [
        MemTableSnapshot(region_id, gen, batches, schema)
        for gen, batches in sorted(known.by_gen.items())
    ]


def _forget_entries(lineage: str, wal_dir: str, start: int, end: int) -> None:
    """Drop the cached entries at positions ``start .. end - 1`` of a WAL: a flush put
    them behind the region's replay position, so no tail read from now on reads them
    (a query that pinned an older manifest reads them from storage again), and each
    holds a slice of the batches of the tail that read it, which would otherwise stay
    until the budget evicted it."""
    for position in range(start, end):
        ENTRIES.pop((lineage, _entry_path(wal_dir, position)))


def tails(
    table: Catalog, manifests: dict[str, RegionManifest], probes: Probes
) -> dict[str, list[MemTableSnapshot]]:
    """:func:`tail` of each region in ``manifests`` (sealed regions excluded by the
    caller), using the probes started for them; regions are read at once on an object
    store."""
    items = list(manifests.items())

    def one(item: tuple[str, RegionManifest]) -> list[MemTableSnapshot]:
        region_id, m = item
        probe = probes.take(region_id, m.replay_after_wal_entry_position + 1)
        return tail(table, region_id, m, probes.schema, probe)

    if len(items) <= 2 or not table.io.parallel_requests:
        results = [one(i) for i in items]
    else:
        results = in_chunks(_TAILS, one, items, WAL_READERS)
    return {r: t for (r, _), t in zip(items, results)}
