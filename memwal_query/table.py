"""MemWalTable: a Lance base table plus its MemWAL regions.

Entry point of the library::

    t = MemWalTable.initialize(uri, region_spec=bucket_spec(...))   # once
    t = MemWalTable.open(uri)
    t.write(rows)                                  # routed to their regions
    t.to_table()                                   # newest row per key
    t.maintenance.merge()                          # background work, grouped
    t.consumers.register("etl")                    # change-feed consumers

``MemWalTable`` *holds* a :class:`~memwal_query.catalog.Catalog` (``t.catalog``: the
read-only handle every lower layer receives) and a
:class:`~memwal_query.write.routing.RoutedWriters` (the writers :meth:`MemWalTable.write`
opens). Its own surface is data in and out; background work is under
:attr:`MemWalTable.maintenance` and change-feed consumers under
:attr:`MemWalTable.consumers`. ``docs/api.md`` lists the surface and the spelling of
each concept in Python, the CLI and Spark.
"""

from __future__ import annotations

import datetime as dt
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.catalog import Catalog
from memwal_query.catalog import (
    region_id_for as region_id_for,  # public, re-exported (memwal_query.region_id_for)
)
from memwal_query.exceptions import RegionSpecError, SchemaChangedError, WriteIncompleteError
from memwal_query.format.schema import coerce_rows
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.regions.checks import field_names
from memwal_query.search.common import DEFAULT_NPROBES, DEFAULT_REFINE_FACTOR
from memwal_query.storage.io import normalize_uri
from memwal_query.table_init import write_index
from memwal_query.write.liveness import DEFAULT_HEARTBEAT_INTERVAL
from memwal_query.write.memtable import DictionaryCounts
from memwal_query.write.opening import WriterOpener, WriterOptions
from memwal_query.write.routing import RoutedWriters
from memwal_query.write.writer import RegionWriter
from memwal_query.write.writer_state import (
    DEFAULT_MAX_MEMTABLE_AGE,
    DEFAULT_MAX_MEMTABLE_BYTES,
    DEFAULT_MAX_MEMTABLE_ROWS,
    DEFAULT_MAX_UNFLUSHED_MEMTABLES,
    DEFAULT_MAX_WAL_BUFFER_BYTES,
    DEFAULT_MAX_WAL_ENTRIES,
    DEFAULT_WAL_FLUSH_INTERVAL,
)

if TYPE_CHECKING:
    from memwal_query.maintain.fsck import FsckReport
    from memwal_query.maintain.merger import MergeReport
    from memwal_query.maintain.policy import MaintenancePolicy, MaintenanceReport
    from memwal_query.maintain.snapshots import SnapshotRefresh
    from memwal_query.maintain.status import TableStatus
    from memwal_query.read.changes import Changes
    from memwal_query.read.provider import MemWalDataset
    from memwal_query.regions.spec import RegionSpec


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that spelling ``old`` is deprecated in favour of ``new`` (kept one release).

    Parameters
    ----------
    old, new : str
        The deprecated and the current spelling, as the warning names them.
    stacklevel : int
        Passed to :func:`warnings.warn` (the caller of the deprecated spelling).
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class MemWalTable:
    """A Lance base table with a MemWAL index: streaming upserts through regions.

    Use :meth:`initialize` once on an existing Lance dataset with a primary key, then
    :meth:`open`. :meth:`write` and :meth:`delete` may be called from several threads:
    rows of one region go through one shared writer (group commit).

    Parameters
    ----------
    uri : str
        Base table URI (local path, ``file://``, ``s3://``...).
    storage_options : dict, optional
        Passed to Lance and to the object-store layer.

    Raises
    ------
    TableNotFoundError, StorageError, PrimaryKeyError, NotInitializedError
        See :class:`~memwal_query.catalog.Catalog`.
    """

    def __init__(
        self, uri: str | os.PathLike, storage_options: dict[str, str] | None = None
    ) -> None:
        catalog = Catalog(uri, storage_options)
        self._catalog = catalog
        self._dictionary_counts = DictionaryCounts()  # shared by this object's writers
        self._opener = WriterOpener(
            catalog,
            lookup=self._partial_lookup,
            complete_spec_change=_complete_spec_change,
            dictionary_values=self._dictionary_values,
        )
        self._routed = RoutedWriters(self._opener)
        self._maintenance = Maintenance(self)
        self._consumers = Consumers(self)
        self._alter = Alter(self)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def initialize(
        cls,
        uri: str | os.PathLike,
        region_spec: RegionSpec | None = None,
        *,
        maintained_indexes: Iterable[str] | None = None,
        storage_options: dict[str, str] | None = None,
        primary_key: str | Sequence[str] | None = None,
        primary_key_index: bool = True,
        reset: bool = False,
    ) -> MemWalTable:
        """Write the MemWAL index into an existing Lance table and open it.

        Parameters
        ----------
        uri : str
            The base table.
        region_spec : RegionSpec, optional
            How rows map to regions (spec ids must be positive). None: the one-region
            spec :func:`~memwal_query.regions.spec.unsharded_spec` (every key in one
            region, one writer at a time; pylance's ``unsharded=True``). Pass a bucket
            spec (:func:`~memwal_query.regions.spec.bucket_spec`) for parallel writers.
        maintained_indexes : list of str, optional
            Names of base-table indexes to build for every flushed generation too.
        storage_options : dict, optional
            Lance-style storage options (object stores), used for every later access.
        primary_key : str or list of str, optional
            The key column(s) (a list for a composite key). Needed when the table does
            not declare its key yet (Lance field metadata
            ``lance-schema:unenforced-primary-key``): the columns are checked (they
            exist, have a key type, hold no NULL and no key twice), then marked
            (non-nullable, with that metadata). A key the table already declares may be
            repeated; another one is a :class:`PrimaryKeyError`.
        primary_key_index : bool
            Create a BTREE scalar index on the (first) primary-key column when the base
            table has none (default), so that point lookups and the base side of
            searches are index lookups rather than scans. Merged rows are covered again
            after ``maintenance.catch_up_indexes()``; until then Lance scans the new
            fragments.
        reset : bool
            Remove what an earlier MemWAL of this table left in ``_mem_wal/`` (regions,
            WAL, generations, catch-up progress) first. Without it, leftover regions
            are refused with :class:`LeftoverRegionsError`: they belong to an earlier
            lineage of the base table (e.g. it was overwritten with Lance), and their
            rows would be read on top of the new data.

        Returns
        -------
        MemWalTable

        Raises
        ------
        TableNotFoundError, PrimaryKeyError, AlreadyInitializedError, RegionSpecError,
        LeftoverRegionsError
        SchemaError
            A dictionary column has 8- or 16-bit indices (pandas categoricals do): a
            MemWAL table combines many writes' values in one file and one read, so
            rewrite the column with 32-bit indices (or plain values) first; nothing is
            written.

        Warns
        -----
        RegionSpecWarning
            When the spec reads columns outside the primary key: every key must live in
            exactly one region, so a key's value in those columns must never change.
        """
        norm = normalize_uri(uri)
        options = dict(storage_options or {})
        write_index(
            norm,
            options,
            region_spec=region_spec,
            maintained_indexes=maintained_indexes,
            primary_key_index=primary_key_index,
            reset=reset,
            primary_key=primary_key,
        )
        return cls(norm, options)

    @classmethod
    def create(
        cls,
        uri: str | os.PathLike,
        data: Any,
        *,
        primary_key: str | Sequence[str],
        region_spec: RegionSpec | None = None,
        vector_columns: dict[str, int | None] | Sequence[str] | None = None,
        storage_options: dict[str, str] | None = None,
        mode: str = "create",
        primary_key_index: bool = True,
    ) -> MemWalTable:
        """Create a table from data (or a schema) with the key given here, and open it.

        Writes the Lance base table with ``primary_key`` marked, then its MemWAL index
        (what :meth:`initialize` does); ``memwal init --primary-key`` marks the key of
        an existing table the same way.

        Parameters
        ----------
        uri : str
            Where the table goes (local path, ``s3://``, ``gs://``, ``az://``...).
        data : table-like or pyarrow.Schema
            The first rows: a pandas or Polars DataFrame, a pyarrow Table, RecordBatch
            or RecordBatchReader, a dict of columns, anything exporting
            ``__arrow_c_stream__``; or a ``pyarrow.Schema`` for an empty table. The
            column types are the table's (give pyarrow types for exact ones).
        primary_key : str or list of str
            The key column(s): one name, or a list for a composite key. The columns
            must exist and have a key type (integer, float, decimal, boolean, string,
            binary, date, time, timestamp); they become non-nullable. A NULL key or a
            key given twice in ``data`` is refused (nothing is written): the table
            would have no single newest row for it.
        region_spec : RegionSpec, optional
            How rows map to regions (see :meth:`initialize`; default one region).
        vector_columns : dict or list of str, optional
            Columns of lists of numbers (a pandas column of arrays) to store as vectors
            (``fixed_size_list``), which vector search and vector indexes need:
            ``{"vec": 128}``, or ``["vec"]`` to take the length every row has. A row of
            another length is a :class:`SchemaError`. Later writes cast lists into
            such a column the same way.
        storage_options : dict, optional
            Object-store options, used for every later access.
        mode : {"create", "overwrite"}
            ``"create"`` refuses an existing table (:class:`AlreadyExistsError`);
            ``"overwrite"`` replaces it (and removes what its MemWAL left in
            ``_mem_wal/``: stop its writers first).
        primary_key_index : bool
            Build a BTREE index on the (first) key column (see :meth:`initialize`).

        Returns
        -------
        MemWalTable

        Raises
        ------
        PrimaryKeyError
            A key column is absent or of another type, or ``data`` holds a NULL key or a
            key twice (the message names the column or the value).
        SchemaError
            ``data`` cannot be converted, or a vector column has rows of another length.
        AlreadyExistsError
            ``mode="create"`` and a table exists at ``uri``.
        RegionSpecError
            The region spec does not fit the table (the new table is removed again).

        Examples
        --------
        >>> t = MemWalTable.create(uri, df, primary_key="id")  # doctest: +SKIP
        >>> t = MemWalTable.create(uri, df, primary_key=["tenant", "id"])  # doctest: +SKIP
        """
        from memwal_query.table_init import create_table

        norm = normalize_uri(uri)
        options = dict(storage_options or {})
        create_table(
            norm,
            options,
            data,
            primary_key=primary_key,
            vector_columns=vector_columns,
            region_spec=region_spec,
            primary_key_index=primary_key_index,
            mode=mode,
        )
        return cls(norm, options)

    @classmethod
    def open(
        cls, uri: str | os.PathLike, storage_options: dict[str, str] | None = None
    ) -> MemWalTable:
        """Open an initialized table (see :class:`MemWalTable`).

        Parameters
        ----------
        uri : str or os.PathLike
            The base Lance table (local path or object-store URI).
        storage_options : dict, optional
            Object-store options, as Lance takes them.

        Returns
        -------
        MemWalTable

        Raises
        ------
        TableNotFoundError, StorageError, PrimaryKeyError, NotInitializedError
            No Lance table at ``uri``, the store cannot be read, the table has no
            primary key or no MemWAL index.
        """
        return cls(uri, storage_options)

    # -- identity ----------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        """The read-only handle of the table (base dataset, MemWAL index, region
        manifests): what the lower-level functions of the package take."""
        return self._catalog

    @property
    def uri(self) -> str:
        """The base table's normalized URI."""
        return self._catalog.uri

    @property
    def storage_options(self) -> dict[str, str]:
        """The storage options the table was opened with."""
        return self._catalog.storage_options

    @property
    def schema(self) -> pa.Schema:
        """The table's Arrow schema (fixed when opened)."""
        return self._catalog.schema

    @property
    def primary_key(self) -> list[str]:
        """The primary-key column names."""
        return self._catalog.primary_key

    @property
    def region_spec(self) -> RegionSpec | None:
        """The current region spec (highest spec id), or None when the index records
        none (rows then go to the one region of the unsharded spec)."""
        return self._catalog.region_spec

    @property
    def maintenance(self) -> Maintenance:
        """Background work: merge, GC, index catch-up, snapshots, fsck, status, maintain,
        region spec changes, drain."""
        return self._maintenance

    @property
    def consumers(self) -> Consumers:
        """Change-feed consumers: register, list, drop."""
        return self._consumers

    @property
    def alter(self) -> Alter:
        """Schema changes: add columns (see ``docs/schema.md``)."""
        return self._alter

    # -- writing -----------------------------------------------------------------------
    def writer(
        self,
        region_id: str | None = None,
        *,
        region_values: dict[str, Any] | None = None,
        spec_id: int | None = None,
        durable: bool = True,
        max_memtable_rows: int = DEFAULT_MAX_MEMTABLE_ROWS,
        max_memtable_bytes: int = DEFAULT_MAX_MEMTABLE_BYTES,
        max_wal_buffer_bytes: int = DEFAULT_MAX_WAL_BUFFER_BYTES,
        wal_flush_interval: float = DEFAULT_WAL_FLUSH_INTERVAL,
        max_unflushed_memtables: int = DEFAULT_MAX_UNFLUSHED_MEMTABLES,
        backpressure_timeout: float | None = None,
        max_wal_entries: int = DEFAULT_MAX_WAL_ENTRIES,
        max_memtable_age: float = DEFAULT_MAX_MEMTABLE_AGE,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
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
        spec_id : int, optional
            The region spec ``region_values`` were computed by;
            :class:`SpecChangedError` when the table's current spec is another one.
            The index is re-read first (and again after the claim), so a writer never
            writes with a stale spec; when the current spec replaced an older one whose
            regions are not sealed and merged yet, that is done first
            (:func:`memwal_query.maintain.specs.complete_spec_change`).
        durable, max_memtable_rows, max_memtable_bytes, max_wal_buffer_bytes, \
wal_flush_interval, max_unflushed_memtables, backpressure_timeout, max_wal_entries, \
max_memtable_age, heartbeat_interval
            The writer's options: see :class:`RegionWriter`.

        Returns
        -------
        RegionWriter

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
        options = WriterOptions(
            durable=durable,
            max_memtable_rows=max_memtable_rows,
            max_memtable_bytes=max_memtable_bytes,
            max_wal_buffer_bytes=max_wal_buffer_bytes,
            wal_flush_interval=wal_flush_interval,
            max_unflushed_memtables=max_unflushed_memtables,
            backpressure_timeout=backpressure_timeout,
            max_wal_entries=max_wal_entries,
            max_memtable_age=max_memtable_age,
            heartbeat_interval=heartbeat_interval,
        )
        return self._opener.open(
            region_id, region_values=region_values, spec_id=spec_id, options=options
        )

    def configure_writers(
        self,
        *,
        durable: bool = True,
        max_memtable_rows: int = DEFAULT_MAX_MEMTABLE_ROWS,
        max_memtable_bytes: int = DEFAULT_MAX_MEMTABLE_BYTES,
        max_wal_buffer_bytes: int = DEFAULT_MAX_WAL_BUFFER_BYTES,
        wal_flush_interval: float = DEFAULT_WAL_FLUSH_INTERVAL,
        max_unflushed_memtables: int = DEFAULT_MAX_UNFLUSHED_MEMTABLES,
        backpressure_timeout: float | None = None,
        max_wal_entries: int = DEFAULT_MAX_WAL_ENTRIES,
        max_memtable_age: float = DEFAULT_MAX_MEMTABLE_AGE,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    ) -> None:
        """Set the options of the writers :meth:`write` opens from now on.

        Writers already open keep theirs; an option not given takes its default.

        Parameters
        ----------
        durable, max_memtable_rows, max_memtable_bytes, max_wal_buffer_bytes, \
wal_flush_interval, max_unflushed_memtables, backpressure_timeout, max_wal_entries, \
max_memtable_age, heartbeat_interval
            The writer options of :meth:`writer`, with the same meanings and defaults.
        """
        self._routed.options = WriterOptions(
            durable=durable,
            max_memtable_rows=max_memtable_rows,
            max_memtable_bytes=max_memtable_bytes,
            max_wal_buffer_bytes=max_wal_buffer_bytes,
            wal_flush_interval=wal_flush_interval,
            max_unflushed_memtables=max_unflushed_memtables,
            backpressure_timeout=backpressure_timeout,
            max_wal_entries=max_wal_entries,
            max_memtable_age=max_memtable_age,
            heartbeat_interval=heartbeat_interval,
        )

    def write(
        self, data: Any, *, partial: bool = False, schema_mode: str | None = None
    ) -> dict[str, int]:
        """Route rows to their regions by the region spec and put them.

        One writer per region is opened on first use and kept for later calls (close
        them with :meth:`close`).

        Parameters
        ----------
        data : table-like
            Whole rows (every column). See :meth:`RegionWriter.put`.
        partial : bool
            Partial update: missing columns keep each key's current value.
        schema_mode : {None, "merge"}
            What to do with columns of ``data`` the table lacks: None (default) refuses
            them (:class:`SchemaError` naming them, and this option); ``"merge"`` adds
            them first, nullable, with the type they have in ``data``
            (:meth:`Alter.add_columns`; rows written before read NULL for them), as
            deltalake's ``write_deltalake(..., schema_mode="merge")``.

        Returns
        -------
        dict
            ``{region_id: rows written}``, every region in it durable.

        Raises
        ------
        SchemaError, PrimaryKeyError
            The rows do not fit the table (nothing written).
        WriteIncompleteError
            Some regions were written and others failed (both are listed).
        FencedError
            Another writer kept fencing this table's writer of a region
            (:attr:`fence_retries` claims).

        Notes
        -----
        Each region's rows are one WAL entry (all or nothing), and the regions of one
        call are written concurrently and independently; a reader may see some of them
        before the others. Upserts and deletes are idempotent, so retrying the call
        converges to the same table. A fenced put was never acknowledged, so the
        region is claimed again and the put retried (with exponential backoff): writers
        of one region take turns, and the later acknowledged write of a key wins. Rows
        routed to a region of a spec that is no longer the current one are routed again
        by the current spec.
        """
        from memwal_query.format.schema import SCHEMA_MODES, to_table

        if schema_mode not in SCHEMA_MODES:
            raise ValueError(f"schema_mode must be one of {SCHEMA_MODES}, got {schema_mode!r}")
        table = to_table(data, columns=self._catalog.schema.names)
        self._add_input_columns(table, schema_mode)
        return self._again_on_schema_change(lambda: self._write_rows(table, partial))

    def _again_on_schema_change(self, call: Callable[[], dict[str, int]]) -> dict[str, int]:
        """``call()``; when a writer found that another process changed the schema since
        this object read it, take the new one and call again (whole-row upserts and
        deletes are idempotent; rows that lack a column it added are then refused as
        any such rows are)."""
        try:
            return call()
        except (SchemaChangedError, WriteIncompleteError) as e:
            errors = e.errors.values() if isinstance(e, WriteIncompleteError) else [e]
            if not all(isinstance(x, SchemaChangedError) for x in errors):
                raise
        self._refresh_schema(close=True)
        return call()

    def _write_rows(self, data: pa.Table, partial: bool) -> dict[str, int]:
        """Coerce ``data`` to the table schema and route it (see :meth:`write`)."""
        from memwal_query.format.schema import coerce_partial_rows
        from memwal_query.regions.spec import check_partial_sources

        cat = self._catalog
        if partial:
            rows, missing = coerce_partial_rows(data, cat.schema, cat.primary_key)
            check_partial_sources(cat.routing_spec(), missing, cat.lance_schema)
        else:
            rows, missing = coerce_rows(data, cat.schema, cat.primary_key), []

        def check(spec: RegionSpec) -> None:
            check_partial_sources(spec, missing, cat.lance_schema)

        return self._routed.route(rows, lambda w, part: w._put_routed(part, missing), check)

    def _add_input_columns(self, data: pa.Table, schema_mode: str | None) -> None:
        """Make the columns of ``data`` the table lacks known: another process may have
        added them (take the new schema), or ``schema_mode="merge"`` adds them."""
        from memwal_query.format.schema import extra_columns

        if not extra_columns(data.schema, self._catalog.schema):
            return
        if self._catalog.schema_changes():
            self._refresh_schema()
        extra = extra_columns(data.schema, self._catalog.schema)
        if extra and schema_mode == "merge":
            self.alter.add_columns(extra)

    def _refresh_schema(self, close: bool = False) -> None:
        """Take the base table's current schema; when it changed (or ``close``), this
        object's writers (opened with the old one) are closed, their rows left in the
        WAL for the next writer to replay."""
        if self._catalog.refresh_schema() or close:
            self._routed.close(flush=False)

    def delete(self, keys: Any) -> dict[str, int]:
        """Route delete tombstones to their regions (the spec must read key columns only).

        Same atomicity and retries as :meth:`write`.

        Parameters
        ----------
        keys : array-like, pa.Array, pa.Table or dict
            Primary-key values: an array (or list) for a single-column key, a table or
            dict with the key columns otherwise.

        Returns
        -------
        dict
            ``{region_id: rows deleted}``, every region in it durable.

        Raises
        ------
        RegionSpecError
            The region spec reads columns outside the primary key.
        PrimaryKeyError
            The keys do not fit the table's primary key (nothing written).
        WriteIncompleteError, FencedError
            As for :meth:`write`.
        """
        from memwal_query.format.schema import coerce_keys

        cat = self._catalog
        key_table = coerce_keys(keys, cat.schema, cat.primary_key)

        def check(spec: RegionSpec) -> None:
            names = field_names(cat.lance_schema)
            sources = {names.get(i) for f in spec.fields for i in f.source_ids}
            if not sources <= set(cat.primary_key):
                raise RegionSpecError(
                    "cannot route deletes by key: the region spec reads "
                    f"{sorted(map(str, sources))}, not only the primary key "
                    f"{cat.primary_key}; delete through the region's writer"
                )

        check(cat.routing_spec())
        return self._again_on_schema_change(
            lambda: self._routed.route(key_table, lambda w, part: w.delete(part), check)
        )

    @property
    def fence_retries(self) -> int:
        """How many times :meth:`write`/:meth:`delete`/:meth:`flush` claim a region
        again after being fenced by another writer of it (default
        :data:`~memwal_query.write.routing.DEFAULT_FENCE_RETRIES`; exponential backoff
        from 50 ms, at most 2 s)."""
        return self._routed.fence_retries

    @fence_retries.setter
    def fence_retries(self, value: int) -> None:
        self._routed.fence_retries = value

    def writers(self) -> list[RegionWriter]:
        """The writers opened by :meth:`write`.

        Returns
        -------
        list of RegionWriter
            Pass them as ``writers=`` to read their unflushed rows elsewhere.
        """
        return self._routed.writers()

    def flush(self) -> dict[str, int | None]:
        """Flush this object's writers (those :meth:`write` opened), concurrently.

        Other processes' writers are not touched (``t.maintenance.drain()`` claims every
        region instead). A writer fenced by another writer of its region meanwhile is
        claimed again (as :meth:`write` does): its acknowledged rows are in the WAL,
        and the new claim replays and flushes them.

        Returns
        -------
        dict
            ``{region_id: generation flushed}`` (None: nothing to flush).
        """
        return self._routed.flush()

    def close(self, flush: bool = True) -> None:
        """Close the writers opened by :meth:`write`.

        Parameters
        ----------
        flush : bool
            Flush each writer's MemTables into generations first (default). Without a
            flush, acknowledged rows stay in the WAL for the next writer to replay.
        """
        self._routed.close(flush)

    def __enter__(self) -> MemWalTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(flush=exc[0] is None)

    # -- reading -----------------------------------------------------------------------
    def provider(
        self,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        *,
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

        Returns
        -------
        MemWalDataset
        """
        from memwal_query.read.provider import MemWalDataset

        return MemWalDataset(
            self._catalog,
            consistency,
            self._default_writers(writers),
            meta_columns,
            max_staleness=max_staleness,
            as_of=as_of,
        )

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: Any = None,
        *,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        as_of: Any = None,
    ) -> pa.Table:
        """The deduplicated table (newest row per key) as a pyarrow Table.

        Parameters
        ----------
        columns : list of str, optional
            Output columns (default: all table columns).
        filter : pyarrow.compute.Expression, optional
            Evaluated on the newest version of each key.
        consistency, writers, as_of
            As for :meth:`provider`.

        Returns
        -------
        pa.Table

        Raises
        ------
        VersionGoneError
            ``as_of`` names a moment whose base version or generations GC removed.
        """
        return self.provider(consistency, writers, as_of=as_of).to_table(
            columns=columns, filter=filter
        )

    def count_rows(
        self,
        *,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        as_of: Any = None,
    ) -> int:
        """Number of live rows in the deduplicated view.

        Parameters
        ----------
        consistency, writers, as_of
            As for :meth:`provider`.

        Returns
        -------
        int
        """
        return self.provider(consistency, writers, as_of=as_of).count_rows()

    def changes(
        self,
        since: Any = None,
        *,
        consistency: str = DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        regions: Sequence[str] | None = None,
        max_rows: int | None = None,
        until: Any = None,
    ) -> Changes:
        """Every acknowledged change after ``since``, once, in per-region order.

        Parameters
        ----------
        since : str, int, datetime or None
            A cursor from an earlier call, a base version, a moment, or None (the
            earliest change still available).
        consistency : str
            ``"latest"`` (default: flushed and durable unflushed WAL entries) or
            ``"strong"`` (flushed entries only).
        writers : list of RegionWriter, optional
            Read these writers' regions as with ``"latest"``. Unlike :meth:`provider`,
            defaults to none.
        regions : list of str, optional
            Only these region ids.
        max_rows : int, optional
            Stop after the WAL entry that reaches this many rows
            (``Changes.complete`` is then False).
        until : str, int, datetime or None
            Upper bound, in the same forms as ``since``.

        Returns
        -------
        Changes
            ``.table`` (rows + ``_change_type``, ``_region``, ``_gen``, ``_seq``) and
            ``.cursor`` (pass it as ``since`` next time).

        Raises
        ------
        CursorError
            ``since`` or ``until`` is not a cursor of this table, a base version or a
            moment.
        ChangesGoneError
            GC removed a WAL entry the cursor needs (register a consumer with
            :attr:`consumers` to keep them; see docs/changes.md).
        """
        from memwal_query.read.changes import changes

        return changes(
            self._catalog,
            since,
            consistency=consistency,
            writers=writers,
            regions=regions,
            max_rows=max_rows,
            until=until,
        )

    # -- search ------------------------------------------------------------------------
    def lookup(
        self,
        keys: Any,
        columns: Sequence[str] | None = None,
        *,
        writers: Sequence[RegionWriter] | None = None,
        consistency: str = DEFAULT_CONSISTENCY,
        as_of: Any = None,
        debug: dict | None = None,
    ) -> pa.Table:
        """Newest live rows of the given primary keys.

        Parameters
        ----------
        keys, columns, consistency, debug
            As for :func:`memwal_query.search.lookup`.
        writers : list of RegionWriter, optional
            Defaults to the writers opened by :meth:`write`.
        as_of : int, datetime or str, optional
            Look the keys up in the table as it was at that base version or moment.

        Returns
        -------
        pa.Table
            One row per key that has a live row (absent and deleted keys are left out).
        """
        from memwal_query.search import lookup

        return lookup(
            self._catalog,
            keys,
            columns,
            self._default_writers(writers),
            consistency=consistency,
            as_of=as_of,
            debug=debug,
        )

    def vector_search(
        self,
        column: str,
        query: Any,
        k: int = 10,
        *,
        filter: Any = None,
        nprobes: int = DEFAULT_NPROBES,
        refine_factor: int | None = DEFAULT_REFINE_FACTOR,
        columns: Sequence[str] | None = None,
        writers: Sequence[RegionWriter] | None = None,
        consistency: str = DEFAULT_CONSISTENCY,
        debug: dict | None = None,
    ) -> pa.Table:
        """Top-k nearest rows across all LSM levels, with ``_distance``.

        Parameters
        ----------
        column, query, k, filter, nprobes, refine_factor, columns, consistency, debug
            As for :func:`memwal_query.search.vector_search`.
        writers : list of RegionWriter, optional
            Defaults to the writers opened by :meth:`write`.

        Returns
        -------
        pa.Table
            At most ``k`` rows, nearest first, with ``_distance``.
        """
        from memwal_query.search import vector_search

        return vector_search(
            self._catalog,
            column,
            query,
            k,
            filter,
            nprobes,
            refine_factor,
            self._default_writers(writers),
            columns=columns,
            consistency=consistency,
            debug=debug,
        )

    def fts_search(
        self,
        column: str,
        query: str,
        k: int = 10,
        *,
        filter: Any = None,
        columns: Sequence[str] | None = None,
        writers: Sequence[RegionWriter] | None = None,
        consistency: str = DEFAULT_CONSISTENCY,
        debug: dict | None = None,
    ) -> pa.Table:
        """Top-k full-text matches across all LSM levels, with globally comparable
        ``_score``.

        Parameters
        ----------
        column, query, k, filter, columns, consistency, debug
            As for :func:`memwal_query.search.fts_search`.
        writers : list of RegionWriter, optional
            Defaults to the writers opened by :meth:`write`.

        Returns
        -------
        pa.Table
            At most ``k`` rows, best first, with ``_score``.
        """
        from memwal_query.search import fts_search

        return fts_search(
            self._catalog,
            column,
            query,
            k,
            filter,
            self._default_writers(writers),
            columns=columns,
            consistency=consistency,
            debug=debug,
        )

    def _default_writers(self, writers: Sequence[RegionWriter] | None) -> list[RegionWriter]:
        return self._routed.writers() if writers is None else list(writers)

    def _partial_lookup(
        self, keys: pa.Table, *, columns: Sequence[str], writers: Sequence[RegionWriter]
    ) -> pa.Table:
        """The :class:`~memwal_query.write.writer_state.PartialLookup` of this table's
        writers."""
        from memwal_query.search import lookup

        return lookup(self._catalog, keys, columns, list(writers))

    def _dictionary_values(self, columns: Sequence[str]) -> DictionaryCounts:
        """The :class:`~memwal_query.write.writer_state.DictionaryValues` of this table
        (a read of ``columns`` of every row), added to the counts this object's writers
        share (so that together they stay within the index types)."""
        import pyarrow.compute as pc

        from memwal_query.format.schema import dictionary_values

        rows = self.to_table(columns=list(columns), writers=[])
        shared = self._dictionary_counts
        for name in columns:
            col = rows.column(name)
            if pa.types.is_dictionary(col.type):
                values = dictionary_values(col)
            else:
                values = pc.unique(col)
            with shared.lock:
                known = shared.get(name)
                if known is not None:
                    values = pc.unique(pa.concat_arrays([known, values.cast(known.type)]))
                shared[name] = values
        return shared

    # -- deprecated spellings ----------------------------------------------------------
    if not TYPE_CHECKING:  # static checks see only the documented surface

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            moved = _MOVED.get(name)
            if moved is not None:
                new, get = moved
                deprecated(f"MemWalTable.{name}", new)
                return get(self)
            catalog = self.__dict__.get("_catalog")
            if catalog is not None and hasattr(catalog, name):
                # The catalog's other names, deprecated on the facade: lower-level functions
                # handed a MemWalTable keep working for one release.
                deprecated(f"MemWalTable.{name}", f"MemWalTable.catalog.{name}")
                return getattr(catalog, name)
            raise AttributeError(f"'MemWalTable' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "write_retries":
            deprecated("MemWalTable.write_retries", "MemWalTable.fence_retries")
            name = "fence_retries"
        catalog = self.__dict__.get("_catalog")
        if (
            catalog is not None
            and not name.startswith("_")
            and not hasattr(type(self), name)
            and hasattr(catalog, name)
        ):
            deprecated(f"MemWalTable.{name}", f"MemWalTable.catalog.{name}")
            setattr(catalog, name, value)
            return
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"MemWalTable({self.uri!r}, primary_key={self.primary_key})"


def _complete_spec_change(catalog: Catalog) -> None:
    """The :class:`~memwal_query.write.opening.SpecChangeCompleter` of every table."""
    from memwal_query.maintain.specs import complete_spec_change

    complete_spec_change(catalog)


class Maintenance:
    """Background work on a table: ``t.maintenance`` (see ``docs/maintenance.md``).

    Every operation is safe alongside writers, readers and other maintainers (see
    :mod:`memwal_query.maintain`).
    """

    def __init__(self, table: MemWalTable) -> None:
        self._table = table

    def merge(
        self,
        *,
        regions: Sequence[str] | None = None,
        max_generations: int | None = None,
        batch_rows: int | None = None,
    ) -> MergeReport:
        """Merge flushed generations into the base table, each region in order.

        Parameters
        ----------
        regions : list of str, optional
            Only these regions (default: every region).
        max_generations : int, optional
            At most this many generations per region.
        batch_rows : int, optional
            Consecutive generations of a region totalling up to this many rows are
            merged by one commit (default
            :data:`memwal_query.maintain.merger.DEFAULT_BATCH_ROWS`; ``0``: one commit
            per generation).

        Returns
        -------
        MergeReport

        Raises
        ------
        MergeFailedError
            Some regions failed (every region is attempted; ``.results`` holds what was
            merged).
        InvalidPathError
            A region id of ``regions`` is malformed.
        RegionNotFoundError
            A region id of ``regions`` names no region of the table (nothing merged).
        """
        from memwal_query.maintain.merger import (
            DEFAULT_BATCH_ROWS,
            DEFAULT_MAX_RETRIES,
            MergeReport,
            merge,
        )

        rows = DEFAULT_BATCH_ROWS if batch_rows is None else batch_rows
        cat = self._table.catalog
        if regions is None:
            return MergeReport(merge(cat, None, max_generations, DEFAULT_MAX_RETRIES, rows))
        done = []
        for region_id in cat.check_region_ids(regions):
            done.extend(merge(cat, region_id, max_generations, DEFAULT_MAX_RETRIES, rows))
        return MergeReport(done)

    def gc(
        self,
        *,
        dry_run: bool = False,
        cleanup_older_than: dt.timedelta | None = None,
        min_age: dt.timedelta | None = None,
        retain_versions_for: dt.timedelta | None = None,
        progress: Callable[[int, int], None] | None = None,
        sizes: dict[str, int] | None = None,
    ) -> list[str]:
        """Delete merged, caught-up, unreferenced generations and WAL entries.

        Parameters
        ----------
        dry_run : bool
            Only list what would be removed.
        cleanup_older_than : datetime.timedelta, optional
            First remove base-table versions older than this with Lance (None: keep
            every version).
        min_age : datetime.timedelta, optional
            Never remove a version that was the latest within this window (readers may
            still use it); default ``cleanup_older_than``.
        retain_versions_for : datetime.timedelta, optional
            Keep every base version that was the latest within this window, so time
            travel (``as_of``) to any moment in it works.
        progress : callable, optional
            ``progress(done, total)`` as paths are deleted.
        sizes : dict, optional
            Filled with the bytes of each path, measured before it is deleted.

        Returns
        -------
        list of str
            The paths removed (or that would be).

        Notes
        -----
        See :mod:`memwal_query.maintain.gc` for the rules. Changes a registered
        consumer has not consumed are never removed.
        """
        from memwal_query.maintain.gc import gc

        return gc(
            self._table.catalog,
            dry_run=dry_run,
            cleanup_older_than=cleanup_older_than,
            min_age=min_age,
            progress=progress,
            retain_versions_for=retain_versions_for,
            sizes=sizes,
        )

    def catch_up_indexes(self, names: Sequence[str] | None = None) -> dict[str, dict[str, int]]:
        """Extend base indexes over merged data and record their catch-up progress.

        Parameters
        ----------
        names : list of str, optional
            Index names (default: every index).

        Returns
        -------
        dict
            The recorded progress per index: ``{index name: {region_id: generation}}``.

        Raises
        ------
        NotInitializedError
            A named index does not exist on the base table.
        """
        from memwal_query.maintain.catchup import catch_up_indexes

        return catch_up_indexes(self._table.catalog, None if names is None else list(names))

    def refresh_snapshots(self) -> SnapshotRefresh:
        """Write the current region states as snapshots into the MemWAL index.

        ``consistency="eventual"`` readers use them.

        Returns
        -------
        SnapshotRefresh
            What the refresh wrote (see :mod:`memwal_query.maintain.snapshots`).
        """
        from memwal_query.maintain.snapshots import SnapshotRefresh, refresh

        return SnapshotRefresh.of(refresh(self._table.catalog))

    def fsck(self, *, progress: Callable[[str], None] | None = None) -> FsckReport:
        """Every problem of the table's storage (``memwal fsck``); changes nothing.

        Reads every manifest, WAL entry, unmerged generation, bloom filter and the
        MemWAL index.

        Parameters
        ----------
        progress : callable, optional
            Called as ``progress(region_id)`` before each region.

        Returns
        -------
        FsckReport
            No findings for a healthy table.
        """
        from memwal_query.maintain.fsck import FsckReport, check

        return FsckReport(check(self._table.catalog, progress))

    def status(self) -> TableStatus:
        """The table's state (``memwal status``); changes nothing.

        Returns
        -------
        TableStatus
            Live rows, and per region: epoch, generations flushed/merged, WAL span,
            unflushed entries and rows, their age, whether the writer is alive, sizes
            (see :class:`memwal_query.maintain.status.TableStatus`).
        """
        from memwal_query.maintain.status import status

        return status(self._table.catalog)

    def maintain(
        self,
        policy: MaintenancePolicy | None = None,
        *,
        dry_run: bool = False,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> MaintenanceReport:
        """One maintenance pass: merge regions over the policy's thresholds, catch up
        indexes, refresh snapshots, GC with a retention window (``memwal maintain``).

        Parameters
        ----------
        policy : MaintenancePolicy, optional
            What to do and when (default: ``MaintenancePolicy()``; the defaults and
            why each step is safe alongside writers, readers and other maintainers are
            in docs/maintenance.md).
        dry_run : bool
            Only plan and report; change nothing.
        progress : callable, optional
            Called as ``progress(step, done, total)`` as steps advance.

        Returns
        -------
        MaintenanceReport

        Raises
        ------
        MaintenanceFailedError
            A step still failed after its retries; the other steps ran, and the error
            carries the report.
        """
        from memwal_query.maintain.policy import maintain

        return maintain(self._table.catalog, policy, dry_run=dry_run, progress=progress)

    def set_region_spec(
        self, spec: RegionSpec, *, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Make ``spec`` the region spec of new writes (``memwal spec set``).

        The index keeps every spec (the current one has the highest id, so
        ``spec.spec_id`` must be above every recorded id). Keys then move to their
        regions of the new spec: the regions of older specs are claimed (fencing their
        writers), flushed, sealed and merged into the base table before any writer of
        the new spec writes (see :mod:`memwal_query.maintain.specs`), so a key is never
        unmerged in two regions. Writes routed meanwhile by the old spec are routed
        again by :meth:`MemWalTable.write`/:meth:`MemWalTable.delete`
        (:class:`SpecChangedError` for callers of :meth:`MemWalTable.writer`). This
        table's own writers are closed first. ``progress(done, total)`` is called as
        older-spec regions are sealed and merged.

        Parameters
        ----------
        spec : RegionSpec
            The new spec; its ``spec_id`` must be above every recorded id.
        progress : callable, optional
            Called as ``progress(done, total)`` as older-spec regions are drained.

        Raises
        ------
        RegionSpecError
            ``spec`` is not a RegionSpec, its id is not above every recorded id, or it
            cannot evaluate the table's rows; the index is unchanged.
        """
        from memwal_query.maintain.specs import check_new_spec, set_region_spec

        cat = self._table.catalog
        check_new_spec(cat, spec)
        self._table._routed.close(flush=False)  # their rows are in the WAL: drained below
        set_region_spec(cat, spec, progress)

    def drain(self, region_id: str) -> int | None:
        """Claim a region (fencing its live writer), replay its unflushed WAL, flush it
        as a generation and let the region go (``memwal drain``): for regions whose
        writer is gone.

        Parameters
        ----------
        region_id : str

        Returns
        -------
        int or None
            The generation flushed (None: nothing to flush).

        Raises
        ------
        RegionSpecError
            There is no such region.
        """
        w = self._table._opener.open(region_id)
        try:
            return w.flush()
        finally:
            w.close(flush=False)


class Alter:
    """Schema changes of a table: ``t.alter`` (see ``docs/schema.md``).

    Safe while writers, readers and maintenance run, in any process: rows written
    before a change read NULL for an added column everywhere (SQL, search, the change
    feed, Spark, the merger); a writer opened before it either writes its rows ahead of
    every row carrying the column or is refused with :class:`SchemaChangedError`
    (never dropping a value of the column).
    """

    def __init__(self, table: MemWalTable) -> None:
        self._table = table

    def add_columns(self, fields: Any) -> pa.Schema:
        """Add nullable columns to the table (every existing row reads NULL for them).

        Parameters
        ----------
        fields : pyarrow.Field, list of pyarrow.Field, pyarrow.Schema or dict
            The new columns; ``{"name": type}`` for short, with a ``pyarrow.DataType``
            or an Arrow type name (``"string"``, ``"int64"``, ``"timestamp[us]"``).
            Only the schema changes (Lance ``add_columns``: no data is rewritten).

        Returns
        -------
        pyarrow.Schema
            The table's schema afterwards (also :attr:`MemWalTable.schema`).

        Raises
        ------
        SchemaError
            A column exists already, is not nullable, has the NULL type or a reserved
            name (``_tombstone``...); the table is unchanged.
        CommitConflictError
            Other commits of the base table (merges, index updates) kept landing first;
            each lost race is checked again and retried (with backoff) first.
        """
        from memwal_query.exceptions import CommitConflictError
        from memwal_query.format.schema import new_fields
        from memwal_query.maintain.merger import DEFAULT_MAX_RETRIES, _backoff, _is_conflict

        t = self._table
        for attempt in range(1, DEFAULT_MAX_RETRIES + 1):
            t._refresh_schema()
            items = new_fields(fields, t.catalog.schema)
            try:
                t.catalog.dataset().add_columns(items)
            except Exception as e:
                if not _is_conflict(e):
                    raise
                # another commit (a merge, an index update) landed first: check again
                # on the new version, then retry
                _backoff(attempt)  # sleeps
                continue
            t._refresh_schema()
            return t.catalog.schema
        raise CommitConflictError(
            f"{t.uri}: adding columns lost {DEFAULT_MAX_RETRIES} commit races with other "
            "commits of the base table; try again"
        )


class Consumers:
    """Change-feed consumers of a table: ``t.consumers`` (see ``docs/changes.md``).

    A registered consumer's cursor keeps GC from removing the changes after it.
    """

    def __init__(self, table: MemWalTable) -> None:
        self._table = table

    def register(self, name: str, cursor: Any = None) -> str:
        """Record (or advance) consumer ``name`` at ``cursor``: GC keeps every change
        after it.

        Parameters
        ----------
        name : str
            1-128 letters, digits, ``_``, ``.`` or ``-``.
        cursor : str, int, datetime or None
            As ``since`` of :meth:`MemWalTable.changes`; None: the earliest change still
            available.

        Returns
        -------
        str
            The stored cursor.

        Raises
        ------
        CursorError
            A malformed name, or a cursor that is not one of this table.
        """
        from memwal_query.read.consumers import register_consumer

        return register_consumer(self._table.catalog, name, cursor)

    def list(self) -> dict[str, str]:
        """Registered consumers.

        Returns
        -------
        dict
            ``{name: encoded cursor}``.
        """
        from memwal_query.read.consumers import consumers

        return {name: c.encode() for name, c in consumers(self._table.catalog).items()}

    def drop(self, name: str) -> None:
        """Forget a registered consumer (GC stops keeping changes for it).

        Parameters
        ----------
        name : str
        """
        from memwal_query.read.consumers import drop_consumer

        drop_consumer(self._table.catalog, name)

    def __call__(self) -> dict[str, str]:
        deprecated("MemWalTable.consumers()", "MemWalTable.consumers.list()")
        return self.list()


def _old_merge(t: MemWalTable) -> Callable[..., list[tuple[str, int]]]:
    def merge(
        region_id: str | None = None,
        max_generations: int | None = None,
        batch_rows: int | None = None,
    ) -> list[tuple[str, int]]:
        report = t.maintenance.merge(
            regions=None if region_id is None else [region_id],
            max_generations=max_generations,
            batch_rows=batch_rows,
        )
        return [(r.region_id, r.generation) for r in report.merged]

    return merge


def _old_gc(t: MemWalTable) -> Callable[..., list[str]]:
    def gc(
        dry_run: bool = False,
        cleanup_older_than: dt.timedelta | None = None,
        min_age: dt.timedelta | None = None,
        progress: Callable[[int, int], None] | None = None,
        retain_versions_for: dt.timedelta | None = None,
        sizes: dict[str, int] | None = None,
    ) -> list[str]:
        return t.maintenance.gc(
            dry_run=dry_run,
            cleanup_older_than=cleanup_older_than,
            min_age=min_age,
            retain_versions_for=retain_versions_for,
            progress=progress,
            sizes=sizes,
        )

    return gc


def _old_maintain(t: MemWalTable) -> Callable[..., MaintenanceReport]:
    def maintain(
        policy: MaintenancePolicy | None = None,
        dry_run: bool = False,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> MaintenanceReport:
        return t.maintenance.maintain(policy, dry_run=dry_run, progress=progress)

    return maintain


def _old_set_region_spec(t: MemWalTable) -> Callable[..., None]:
    def set_region_spec(
        spec: RegionSpec, progress: Callable[[int, int], None] | None = None
    ) -> None:
        t.maintenance.set_region_spec(spec, progress=progress)

    return set_region_spec


def _old_refresh_snapshots(t: MemWalTable) -> Callable[[], Any]:
    def refresh_snapshots() -> Any:
        t.maintenance.refresh_snapshots()
        return t.catalog.refresh_index()

    return refresh_snapshots


def _old_check(t: MemWalTable) -> Callable[[], list[Any]]:
    return lambda: t.maintenance.fsck().findings


_MOVED: dict[str, tuple[str, Callable[[MemWalTable], Any]]] = {
    "merge": ("MemWalTable.maintenance.merge(regions=[...])", _old_merge),
    "gc": ("MemWalTable.maintenance.gc", _old_gc),
    "catch_up_indexes": (
        "MemWalTable.maintenance.catch_up_indexes",
        lambda t: t.maintenance.catch_up_indexes,
    ),
    "refresh_snapshots": ("MemWalTable.maintenance.refresh_snapshots", _old_refresh_snapshots),
    "check": ("MemWalTable.maintenance.fsck", _old_check),
    "status": ("MemWalTable.maintenance.status", lambda t: t.maintenance.status),
    "maintain": ("MemWalTable.maintenance.maintain", _old_maintain),
    "set_region_spec": ("MemWalTable.maintenance.set_region_spec", _old_set_region_spec),
    "register_consumer": ("MemWalTable.consumers.register", lambda t: t.consumers.register),
    "drop_consumer": ("MemWalTable.consumers.drop", lambda t: t.consumers.drop),
    "write_retries": ("MemWalTable.fence_retries", lambda t: t.fence_retries),
}
"""Deprecated spellings of :class:`MemWalTable` moved to its namespaces: ``{old name:
(new spelling, the value the old name gives)}`` (kept for one release; each use warns).
The catalog's names (``t.dataset()``, ``t.io``...) are found on ``t.catalog`` the same
way (:meth:`MemWalTable.__getattr__`)."""
