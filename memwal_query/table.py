"""MemWalTable: a Lance base table plus its MemWAL regions.

Entry point of the library::

    t = MemWalTable.initialize(uri, region_spec=bucket_spec(...))   # once
    t = MemWalTable.open(uri)
    with t.writer(region_values={"bucket": 3}) as w:
        w.put(rows)

Layers
------
``MemWalTable`` is the facade over the layers (see ``docs/architecture.md``): it *is* a
:class:`~memwal_query.catalog.Catalog` (the read-only handle every lower layer receives)
and adds writing (region writers, routing), reading (providers, lookup, search) and
maintenance (merge, GC, index catch-up, snapshots) on top, by calling down.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.catalog import (
    Catalog,
    one_region,
    write_index,
)
from memwal_query.catalog import (
    region_id_for as region_id_for,  # public, re-exported (memwal_query.region_id_for)
)
from memwal_query.exceptions import (
    RegionSpecError,
    SpecChangedError,
)
from memwal_query.format import index as mwindex
from memwal_query.format.schema import coerce_rows
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.regions.checks import field_names
from memwal_query.storage import paths
from memwal_query.storage.io import normalize_uri
from memwal_query.write.routing import RoutedWriters, split_by_region
from memwal_query.write.writer import RegionWriter

if TYPE_CHECKING:
    from memwal_query.maintain.policy import MaintenancePolicy, MaintenanceReport
    from memwal_query.maintain.status import TableStatus
    from memwal_query.read.changes import Changes
    from memwal_query.read.provider import MemWalDataset
    from memwal_query.regions.spec import RegionSpec


class MemWalTable(Catalog):
    """A Lance base table with a MemWAL index: streaming upserts through regions.

    Use :meth:`initialize` once on an existing Lance dataset with a primary key, then
    :meth:`open`. :meth:`write` and :meth:`delete` may be called from several threads:
    rows of one region go through one shared writer (group commit).

    Parameters
    ----------
    uri : str
        Base table URI (local path or ``file://``).
    storage_options : dict, optional
        Passed to Lance and to the object-store layer.
    """

    def __init__(self, uri: str | os.PathLike, storage_options: dict[str, str] | None = None):
        super().__init__(uri, storage_options)
        self._routed = RoutedWriters(self, self._open_routed)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def initialize(
        cls,
        uri: str | os.PathLike,
        region_spec: RegionSpec | None = None,
        maintained_indexes: Iterable[str] | None = None,
        storage_options: dict[str, str] | None = None,
        primary_key_index: bool = True,
        reset: bool = False,
    ) -> MemWalTable:
        """Write the MemWAL index into an existing Lance table and open it.

        Parameters
        ----------
        uri : str
            The base table; it must have a primary key.
        region_spec : RegionSpec, optional
            How rows map to regions (spec ids must be positive). None: the one-region
            spec :func:`~memwal_query.regions.spec.unsharded_spec` (every key in one
            region, one writer at a time; pylance's ``unsharded=True``). Pass a bucket
            spec (:func:`~memwal_query.regions.spec.bucket_spec`) for parallel writers.
        maintained_indexes : list of str, optional
            Names of base-table indexes to build for every flushed generation too.
        storage_options : dict, optional
            Lance-style storage options (object stores), used for every later access.
        primary_key_index : bool
            Create a BTREE scalar index on the (first) primary-key column when the base
            table has none (default), so that point lookups and the base side of
            searches are index lookups rather than scans. Merged rows are covered again
            after :meth:`catch_up_indexes`; until then Lance scans the new fragments.
        reset : bool
            Remove what an earlier MemWAL of this table left in ``_mem_wal/`` (regions,
            WAL, generations, catch-up progress) first. Without it, leftover regions
            are refused with :class:`LeftoverRegionsError`: they belong to an earlier
            lineage of the base table (e.g. it was overwritten with Lance), and their
            rows would be read on top of the new data.

        Raises
        ------
        TableNotFoundError, PrimaryKeyError, AlreadyInitializedError, RegionSpecError,
        LeftoverRegionsError

        Warns
        -----
        RegionSpecWarning
            When the spec reads columns outside the primary key: every key must live in
            exactly one region, so a key's value in those columns must never change.
        """
        norm = normalize_uri(uri)
        options = dict(storage_options or {})
        write_index(norm, options, region_spec, maintained_indexes, primary_key_index, reset)
        return cls(norm, options)

    @classmethod
    def open(
        cls, uri: str | os.PathLike, storage_options: dict[str, str] | None = None
    ) -> MemWalTable:
        """Open an initialized table."""
        return cls(uri, storage_options)

    def writer(
        self,
        region_id: str | None = None,
        *,
        region_values: dict[str, Any] | None = None,
        durable: bool = True,
        spec_id: int | None = None,
        **options: Any,
    ) -> RegionWriter:
        """Claim a region and return its writer (fencing any previous writer).

        Every key lives in exactly one region, the one the region spec gives it, so a
        writer is always the writer of a region of the spec (or the recovery writer of
        an existing region, below); a second writer of the same region fences the
        first (its next call raises :class:`FencedError`).

        Parameters
        ----------
        region_id : str, optional
            Region to write. None: the region of ``region_values``; without those, the
            table's only region when the spec has one (the default spec). An existing
            region may be named by id; one that the current spec does not own (a manual
            region of an older table, or one of another spec) can be claimed to replay,
            flush and close it, but refuses new rows (:class:`WrongRegionError`).
        region_values : dict, optional
            ``{field_id: value}`` of the region; rows of other regions are rejected.
        durable : bool
            See :class:`RegionWriter`.
        spec_id : int, optional
            The region spec ``region_values`` were computed by;
            :class:`SpecChangedError` when the table's current spec is another one.
            The index is re-read first (and again after the claim), so a writer never
            writes with a stale spec; when the current spec replaced an older one whose
            regions are not sealed and merged yet, that is done first
            (:func:`memwal_query.maintain.specs.complete_spec_change`).
        **options
            ``max_memtable_rows``, ``max_memtable_bytes``, ``max_wal_buffer_bytes``,
            ``wal_flush_interval``, ``max_unflushed_memtables``,
            ``backpressure_timeout``, ``max_wal_entries``, ``max_memtable_age``.

        Raises
        ------
        RegionSpecError
            No region can be chosen: the spec has several regions and neither
            ``region_values`` nor an existing ``region_id`` was given (use
            :meth:`write` to route rows), or ``region_id`` names no existing region and
            is not the region of ``region_values``.
        LeftoverRegionsError
            The region belongs to an earlier lineage of the table.
        SpecChangedError
            ``spec_id`` is not the current spec (also when it changed while claiming).
        """
        from memwal_query.regions.spec import is_unsharded

        self.index()
        spec = self.routing_spec()
        if spec_id is not None and spec_id != spec.spec_id:
            raise SpecChangedError(self.uri, spec_id, spec.spec_id)
        if region_values is None and region_id is None:
            if not is_unsharded(spec):
                raise RegionSpecError(
                    f"{self.uri}: region spec {spec.spec_id} has several regions; pass "
                    "region_values (or use MemWalTable.write to route rows)"
                )
            region_values = one_region(spec)
        if region_values is None:
            assert region_id is not None
            region_id = paths.validate_region_id(region_id)
            known = self.region_values(region_id)
            if known is not None and known[0] == spec.spec_id:
                spec_id, region_values = known
                entries = self.field_entries(region_values)
            elif self.region_manifest(region_id) is not None:
                spec_id, entries = 0, ()  # not the spec's: recovery only (rows refused)
            elif is_unsharded(spec) and region_id == self.region_id_for(one_region(spec)):
                spec_id, region_values = spec.spec_id, one_region(spec)
                entries = self.field_entries(region_values)
            else:
                raise RegionSpecError(
                    f"{self.uri}: there is no region {region_id}; regions are created "
                    "from the region spec (pass region_values, or use MemWalTable.write)"
                )
        else:
            derived = self.region_id_for(region_values)
            if region_id is not None and paths.validate_region_id(region_id) != derived:
                raise RegionSpecError(
                    f"region {region_id} is not the region of values {region_values} ({derived})"
                )
            region_id = derived
            spec_id = spec.spec_id
            entries = self.field_entries(region_values)
        if spec_id == spec.spec_id and self.spec_change_pending:
            from memwal_query.maintain.specs import complete_spec_change

            complete_spec_change(self)
        return RegionWriter(
            self,
            region_id,
            durable=durable,
            region_values=region_values,
            region_spec_id=spec_id,
            region_field_entries=entries,
            lookup=self.lookup,
            **options,
        )

    def set_region_spec(
        self, spec: RegionSpec, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Make ``spec`` the region spec of new writes (``memwal spec set``).

        The index keeps every spec (``region_specs``; the current one has the highest
        id, so ``spec.spec_id`` must be above every recorded id). Keys then move to
        their regions of the new spec: the regions of older specs are claimed (fencing
        their writers), flushed, sealed and merged into the base table before any
        writer of the new spec writes (see :mod:`memwal_query.maintain.specs`), so a
        key is never unmerged in two regions. Writes routed meanwhile by the old spec
        are routed again by :meth:`write`/:meth:`delete` (:class:`SpecChangedError`
        for callers of :meth:`writer`). This table's own writers are closed first.
        ``progress(done, total)`` is called as older-spec regions are sealed and merged.

        Raises
        ------
        RegionSpecError
            ``spec`` is not a RegionSpec, its id is not above every recorded id, or it
            cannot evaluate the table's rows; the index is unchanged.
        """
        from memwal_query.maintain.specs import check_new_spec, set_region_spec

        check_new_spec(self, spec)
        self._routed.close(flush=False)  # their rows are in the WAL: drained below
        set_region_spec(self, spec, progress)

    # -- background work ---------------------------------------------------------------
    def merge(
        self,
        region_id: str | None = None,
        max_generations: int | None = None,
        batch_rows: int | None = None,
    ) -> list[tuple[str, int]]:
        """Merge flushed generations into the base table; ``[(region_id, generation)]``.

        Consecutive generations of a region totalling up to ``batch_rows`` rows (default
        :data:`memwal_query.maintain.merger.DEFAULT_BATCH_ROWS`) are merged by one commit; ``0``
        commits each generation on its own. See :mod:`memwal_query.maintain.merger` for the
        ordering and atomicity guarantees.
        """
        from memwal_query.maintain.merger import DEFAULT_BATCH_ROWS, DEFAULT_MAX_RETRIES, merge

        rows = DEFAULT_BATCH_ROWS if batch_rows is None else batch_rows
        done = merge(self, region_id, max_generations, DEFAULT_MAX_RETRIES, rows)
        return [(r.region_id, r.generation) for r in done]

    def refresh_snapshots(self) -> mwindex.MemWalIndex:
        """Write the current region states as snapshots into the MemWAL index.

        ``eventual`` readers use them (see :mod:`memwal_query.maintain.snapshots`).
        """
        from memwal_query.maintain.snapshots import refresh

        refresh(self)
        return self.index()

    def catch_up_indexes(self, names: list[str] | None = None) -> dict[str, dict[str, int]]:
        """Extend base indexes over merged data and record ``index_catchup``."""
        from memwal_query.maintain.catchup import catch_up_indexes

        return catch_up_indexes(self, names)

    def gc(
        self,
        dry_run: bool = False,
        cleanup_older_than=None,
        min_age=None,
        progress=None,
        retain_versions_for=None,
        sizes: dict[str, int] | None = None,
    ) -> list[str]:
        """Delete merged, caught-up, unreferenced generations and WAL entries.

        See :mod:`memwal_query.maintain.gc` for the rules. ``cleanup_older_than`` (a
        ``datetime.timedelta``) first removes older base-table versions with Lance,
        except those that were the latest within ``min_age`` (default:
        ``cleanup_older_than``), which readers may still use. ``progress(done, total)``
        is called as paths are deleted. ``retain_versions_for`` (a timedelta) keeps
        every base version that was the latest within that window, so time travel
        (``as_of``) to any moment in it works. Changes a registered consumer
        (:meth:`register_consumer`) has not consumed are never removed. ``sizes`` (a
        dict), when given, is filled with the bytes of each path, measured before it is
        deleted. Returns the paths removed (or, with ``dry_run``, that would be).
        """
        from memwal_query.maintain.gc import gc

        return gc(
            self,
            dry_run=dry_run,
            cleanup_older_than=cleanup_older_than,
            min_age=min_age,
            progress=progress,
            retain_versions_for=retain_versions_for,
            sizes=sizes,
        )

    # -- change feed -------------------------------------------------------------------
    def changes(
        self,
        since: Any = None,
        writers: Sequence[RegionWriter] | None = None,
        consistency: str = DEFAULT_CONSISTENCY,
        max_rows: int | None = None,
        regions: Sequence[str] | None = None,
    ) -> Changes:
        """Every change after ``since``: ``.table`` (rows + ``_change_type``, ``_region``,
        ``_gen``, ``_seq``) and ``.cursor`` (pass it as ``since`` next time).

        ``since``: a cursor, a base version, a timestamp, or None (the earliest change
        still available). See :mod:`memwal_query.read.changes` for the guarantees, and
        :meth:`register_consumer` to keep GC from removing what a consumer needs.
        Unlike :meth:`provider`, ``writers`` defaults to none.
        """
        from memwal_query.read.changes import changes

        return changes(
            self,
            since,
            consistency=consistency,
            writers=writers,
            regions=regions,
            max_rows=max_rows,
        )

    def register_consumer(self, name: str, cursor: Any = None) -> str:
        """Record (or advance) consumer ``name`` at ``cursor``: GC keeps every change
        after it. Returns the stored cursor (None: the earliest change available)."""
        from memwal_query.read.consumers import register_consumer

        return register_consumer(self, name, cursor)

    def consumers(self) -> dict[str, str]:
        """Registered consumers and their cursors."""
        from memwal_query.read.consumers import consumers

        return {name: c.encode() for name, c in consumers(self).items()}

    def drop_consumer(self, name: str) -> None:
        """Forget a registered consumer (GC stops keeping changes for it)."""
        from memwal_query.read.consumers import drop_consumer

        drop_consumer(self, name)

    def maintain(
        self,
        policy: MaintenancePolicy | None = None,
        dry_run: bool = False,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> MaintenanceReport:
        """One maintenance pass: merge regions over the policy's thresholds, catch up
        indexes, refresh snapshots, GC with a retention window (``memwal maintain``).

        See :mod:`memwal_query.maintain.policy` for the policy defaults and why each
        step is safe alongside writers, readers and other maintainers. ``dry_run`` only
        reports; ``progress(step, done, total)`` is called as steps advance.
        """
        from memwal_query.maintain.policy import maintain

        return maintain(self, policy, dry_run=dry_run, progress=progress)

    def status(self) -> TableStatus:
        """Live rows, and per region: epoch, generations flushed/merged, WAL span,
        unflushed entries and rows, their age, whether the writer is alive, sizes (see
        :class:`memwal_query.maintain.status.TableStatus`)."""
        from memwal_query.maintain.status import status

        return status(self)

    # -- reading -----------------------------------------------------------------------
    def check(self) -> list:
        """Every problem of the table's storage, as :class:`memwal_query.maintain.fsck.Finding`s.

        Reads every manifest, WAL entry, unmerged generation, bloom filter and the
        MemWAL index; changes nothing. Empty for a healthy table (``memwal fsck``).
        """
        from memwal_query.maintain.fsck import check

        return check(self)

    def provider(
        self,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        meta_columns: bool = False,
        max_staleness: float | None = None,
        as_of: Any = None,
    ) -> MemWalDataset:
        """A deduplicated view to register in DataFusion (``ctx.register_table``).

        Parameters
        ----------
        consistency : str
            ``"latest"`` (default): region manifests (+ ``writers``' MemTables) +
            every region's durable, not yet flushed WAL entries: every acknowledged
            write; ``"strong"``: flushed rows only (region manifests + ``writers``'
            MemTables); ``"eventual"``: region snapshots of the MemWAL index (see
            :mod:`memwal_query.read.view`).
        writers : list of RegionWriter, optional
            Writers whose unflushed rows are read too (read-your-writes). Defaults to
            the writers opened by :meth:`write` on this object.
        meta_columns : bool
            Expose ``_gen`` and ``_rowaddr``.
        max_staleness : float, optional
            ``eventual``: seconds after which a snapshot is too old (manifests instead).
        as_of : int, datetime or str, optional
            Time travel: the table as it was at that base version (or at the newest
            base version not after that moment), with the generations live then
            (:func:`memwal_query.read.view.resolve_as_of`); ``VersionGoneError`` when
            GC removed what that moment needs.
        """
        from memwal_query.read.provider import MemWalDataset

        if writers is None:
            writers = self._routed.writers()
        return MemWalDataset(
            self, consistency, writers, meta_columns, max_staleness=max_staleness, as_of=as_of
        )

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: Any = None,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
    ) -> pa.Table:
        """The deduplicated table (newest row per key) as a pyarrow Table.

        ``filter`` is a ``pyarrow.compute.Expression`` evaluated on the newest version.
        """
        return self.provider(consistency, writers).to_table(columns=columns, filter=filter)

    def count_rows(self, consistency: str = DEFAULT_CONSISTENCY, writers=None) -> int:
        """Number of live rows in the deduplicated view."""
        return self.provider(consistency, writers).count_rows()

    # -- search ------------------------------------------------------------------------
    def lookup(
        self,
        keys: Any,
        columns: Sequence[str] | None = None,
        writers: Sequence[RegionWriter] | None = None,
        **kw: Any,
    ) -> pa.Table:
        """Newest live rows of the given primary keys (see :mod:`memwal_query.search`);
        ``as_of=`` (a base version or moment) looks them up in the past."""
        from memwal_query.search import lookup

        return lookup(self, keys, columns, self._default_writers(writers), **kw)

    def vector_search(
        self,
        column: str,
        query: Any,
        k: int = 10,
        filter: Any = None,
        nprobes: int = 20,
        refine_factor: int | None = 20,
        writers: Sequence[RegionWriter] | None = None,
        **kw: Any,
    ) -> pa.Table:
        """Top-k nearest rows across all LSM levels, with ``_distance`` (see
        :func:`memwal_query.search.vector_search`; ``refine_factor`` 20 by default)."""
        from memwal_query.search import vector_search

        return vector_search(
            self,
            column,
            query,
            k,
            filter,
            nprobes,
            refine_factor,
            self._default_writers(writers),
            **kw,
        )

    def fts_search(
        self,
        column: str,
        query: str,
        k: int = 10,
        filter: Any = None,
        writers: Sequence[RegionWriter] | None = None,
        **kw: Any,
    ) -> pa.Table:
        """Top-k full-text matches across all LSM levels, with globally comparable ``_score``."""
        from memwal_query.search import fts_search

        return fts_search(self, column, query, k, filter, self._default_writers(writers), **kw)

    def _default_writers(self, writers: Sequence[RegionWriter] | None) -> list[RegionWriter]:
        return self._routed.writers() if writers is None else list(writers)

    # -- routing writes ----------------------------------------------------------------
    def configure_writers(self, **options: Any) -> None:
        """Options (``durable``, ``max_memtable_rows``...) for writers opened by write()."""
        self._routed.options = dict(options)

    def write(self, data: Any, *, partial: bool = False) -> dict[str, int]:
        """Route rows to their regions by the region spec and put them.

        One writer per region is opened on first use and kept for later calls (close
        them with :meth:`close`). Returns ``{region_id: rows written}``, every region
        in it durable.

        Parameters
        ----------
        data : table-like
            Whole rows (every column). See :meth:`RegionWriter.put`.
        partial : bool
            Partial update: missing columns keep each key's current value.

        Atomicity: each region's rows are one WAL entry (all or nothing), and the
        regions of one call are written concurrently and independently; a reader may
        see some of them before the others. When a region fails, the others are still
        durable: :class:`WriteIncompleteError` lists both (when none was written, the
        region's own error is raised). Upserts and deletes are idempotent, so retrying
        the call converges to the same table.

        Another process writing the same region fences this table's writer; a fenced
        put was never acknowledged, so the region is claimed again and the put retried
        (``write_retries`` times, default 5, with exponential backoff): writers of one
        region take turns, and the later acknowledged write of a key wins. When the
        retries run out, :class:`FencedError` is raised. Rows routed to a region of a
        spec that is no longer the current one (:meth:`set_region_spec`, here or in
        another process) are routed again by the current spec.
        """
        from memwal_query.format.schema import coerce_partial_rows
        from memwal_query.regions.spec import check_partial_sources

        if partial:
            rows, missing = coerce_partial_rows(data, self.schema, self.primary_key)
            check_partial_sources(self.routing_spec(), missing, self.lance_schema)
        else:
            rows, missing = coerce_rows(data, self.schema, self.primary_key), []

        def check(spec: RegionSpec) -> None:
            check_partial_sources(spec, missing, self.lance_schema)

        return self._route(rows, lambda w, part: w._put_routed(part, missing), check)

    def delete(self, keys: Any) -> dict[str, int]:
        """Route delete tombstones to their regions (the spec must read key columns only).

        Same return value, atomicity and retries as :meth:`write`.
        """
        from memwal_query.format.schema import coerce_keys

        key_table = coerce_keys(keys, self.schema, self.primary_key)

        def check(spec: RegionSpec) -> None:
            names = field_names(self.lance_schema)
            sources = {names.get(i) for f in spec.fields for i in f.source_ids}
            if not sources <= set(self.primary_key):
                raise RegionSpecError(
                    "cannot route deletes by key: the region spec reads "
                    f"{sorted(map(str, sources))}, not only the primary key "
                    f"{self.primary_key}; delete through the region's writer"
                )

        check(self.routing_spec())
        return self._route(key_table, lambda w, part: w.delete(part), check)

    def _route(
        self,
        rows: pa.Table,
        put: Callable[[RegionWriter, pa.Table], None],
        check: Callable[[RegionSpec], None],
    ) -> dict[str, int]:
        """Split ``rows`` by the current spec and ``put`` each region's part; rows whose
        region turned out to belong to an older spec (the spec changed meanwhile,
        :class:`SpecChangedError`) are routed again by the new one (``check`` is run on
        it first)."""
        written: dict[str, int] = {}
        for attempt in range(self._routed.write_retries + 1):
            spec = self.routing_spec()
            if attempt:
                check(spec)
            parts = split_by_region(spec, rows, self.lance_schema)
            try:
                done = self._routed.write_parts(parts, put, spec.spec_id)
            except SpecChangedError as e:
                unwritten = getattr(e, "unwritten", None)
                if unwritten is None or attempt == self._routed.write_retries:
                    raise
                for region_id, n in getattr(e, "written", {}).items():
                    written[region_id] = written.get(region_id, 0) + n
                rows = pa.concat_tables(unwritten)
                self.index()
                continue
            for region_id, n in done.items():
                written[region_id] = written.get(region_id, 0) + n
            return written
        raise AssertionError("unreachable")

    @property
    def write_retries(self) -> int:
        """How many times :meth:`write`/:meth:`delete`/:meth:`flush` claim a region
        again after being fenced by another writer of it (default 5; exponential
        backoff from 50 ms, at most 2 s)."""
        return self._routed.write_retries

    @write_retries.setter
    def write_retries(self, value: int) -> None:
        self._routed.write_retries = value

    def _open_routed(self, values: dict[str, Any], spec_id: int, **options: Any) -> RegionWriter:
        return self.writer(region_values=values, spec_id=spec_id, **options)

    def writers(self) -> list[RegionWriter]:
        """Writers opened by :meth:`write`."""
        return self._routed.writers()

    def flush(self) -> dict[str, int | None]:
        """Flush every writer opened by :meth:`write` (concurrently); ``{region_id: gen}``.

        A writer fenced by another writer of its region meanwhile is claimed again (as
        :meth:`write` does): its acknowledged rows are in the WAL, and the new claim
        replays and flushes them.
        """
        return self._routed.flush()

    def close(self, flush: bool = True) -> None:
        """Close the writers opened by :meth:`write` (flushing them first by default)."""
        self._routed.close(flush)

    def __enter__(self) -> MemWalTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    def __repr__(self) -> str:
        return f"MemWalTable({self.uri!r}, primary_key={self.primary_key})"
