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
  (:data:`ENTRIES`, bounded by :data:`CACHE_BYTES`); a query reads only the entries
  written since the previous one, plus the probe of the next position.

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

_Entry = tuple[int | None, pa.Table]
ENTRIES: LRUCache[tuple[str, str], tuple[pa.Schema, _Entry]] = LRUCache(
    1 << 16, max_bytes=CACHE_BYTES, sizeof=lambda e: e[1][1].nbytes
)
"""Decoded WAL entries: ``(lineage, path) -> (storage schema they were conformed to,
(generation recorded in the entry or None, rows))``; an entry conformed to another
schema (the table's changed) is read again."""

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

    def entry(self, position: int) -> _Entry | None:
        """The entry at ``position`` (from the cache when read before), None when
        missing; WalCorruptError when damaged."""
        path = _entry_path(self.wal_dir, position)
        key = (self.lineage, path)
        hit = ENTRIES.get(key)
        if hit is not None and (hit[0] is self.schema or hit[0].equals(self.schema)):
            return hit[1]
        try:
            data = self.io.read(path)
        except ObjectNotFoundError:
            return None
        entry = decode_entry(path, position, data)
        rows = conform_entry(path, entry.table, self.schema, self.primary_key)
        return ENTRIES.put(key, (self.schema, (entry.generation, rows)))[1]


def _done(fn: Callable[[int], _Entry | None], position: int) -> Future[_Entry | None]:
    """``fn(position)`` run now, as a completed future."""
    out: Future[_Entry | None] = Future()
    try:
        out.set_result(fn(position))
    except BaseException as e:  # noqa: BLE001 - raised by .result()
        out.set_exception(e)
    return out


class Probes:
    """Reads of each region's first unflushed position after the manifest read last
    time (see the module docs), all at once on an object store.

    Parameters
    ----------
    table : Catalog
    region_ids : list of str
        Regions whose state is about to be read.
    """

    def __init__(self, table: Catalog, region_ids: Sequence[str]) -> None:
        self.schema = _storage_schema(table.schema)
        self._started: dict[str, tuple[RegionManifest, int, Future[_Entry | None]]] = {}
        at_once = table.io.parallel_requests and len(region_ids) > 1
        for region_id in region_ids:
            known = table.known_region_manifest(region_id)
            if known is None or known.sealed:
                continue
            position = known.replay_after_wal_entry_position + 1
            region = _Region(table, region_id, self.schema)
            probe = (
                _PROBES.submit(region.entry, position) if at_once else _done(region.entry, position)
            )
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

    def take(self, region_id: str, position: int) -> Future[_Entry | None] | None:
        """The probe of ``position`` of a region, if one was started at that position."""
        started = self._started.pop(region_id, None)
        if started is None or started[1] != position:
            return None
        return started[2]


READ_AHEAD = 8
"""On an object store, the WAL positions read at once after an entry was found."""


def _entries(
    region: _Region, position: int, first: _Entry | None, at_once: bool
) -> Iterator[_Entry]:
    """``first`` (the entry at ``position``) and the entries after it, up to the first
    missing position; on an object store :data:`READ_AHEAD` positions are read at once
    (positions after the first missing one are ignored: written later, or not at all)."""
    found = first
    while found is not None:
        yield found
        position += 1
        if not at_once:
            found = region.entry(position)
            continue
        batch = [_PROBES.submit(region.entry, q) for q in range(position, position + READ_AHEAD)]
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
    probe: Future[_Entry | None] | None = None,
) -> list[MemTableSnapshot]:
    """Durable WAL entries after the manifest's replay position, as MemTable snapshots
    (one per generation recorded in the entries, none below the manifest's
    ``current_generation``), oldest first.

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
    position = manifest.replay_after_wal_entry_position + 1
    first = probe.result() if probe is not None else region.entry(position)
    by_gen: dict[int, list[pa.Table]] = {}
    for gen, rows in _entries(region, position, first, table.io.parallel_requests):
        # Above the replay position every entry belongs to the current generation or a
        # later one, as a replaying writer puts it: an entry recording an older one (a
        # fenced writer's late write) must not rank below the flushed generations.
        gen = manifest.current_generation if gen is None else max(gen, manifest.current_generation)
        by_gen.setdefault(gen, []).append(rows)
    out = []
    for gen, tables in sorted(by_gen.items()):
        batches = tuple(b for t in tables for b in t.to_batches())
        out.append(MemTableSnapshot(region_id, gen, batches, schema))
    return out


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
