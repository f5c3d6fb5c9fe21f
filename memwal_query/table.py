"""MemWalTable: a Lance base table plus its MemWAL regions.

Entry point of the library::

    t = MemWalTable.initialize(uri, region_spec=bucket_spec(...))   # once
    t = MemWalTable.open(uri)
    with t.writer(region_values={"bucket": 3}) as w:
        w.put(rows)

Finding a region from its value
-------------------------------
With a region spec, the id of the region holding region value ``v`` is *derived* from
``(spec_id, v)``: the first 16 bytes of ``sha256("memwal-region/{spec_id}/{v}")`` with
the UUID version-4 and variant bits set (:func:`region_id_for`). Two writers for the same
value therefore always compute the same region id, and the region manifest's
put-if-not-exists + epoch fencing decides which of them owns it: two regions for one
value can never be created. The region's values are recorded in its manifest
(``region_field_entries``, as pylance does) so strong-consistency readers can prune
regions without the MemWAL index snapshot.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import os
import re
import threading
import uuid as uuid_mod
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    AlreadyInitializedError,
    FencedError,
    InvalidPathError,
    JobEndedError,
    LeftoverRegionsError,
    NotInitializedError,
    RegionSpecError,
    RegionSpecWarning,
    StorageError,
    TableNotFoundError,
    WriteIncompleteError,
    WriterClosedError,
)
from memwal_query.format import fieldvalues
from memwal_query.format import index as mwindex
from memwal_query.format.manifest import RegionManifest, RegionManifestStore, foreign_lineage
from memwal_query.format.schema import coerce_rows, require_primary_key
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, file_io_for, normalize_uri
from memwal_query.write.writer import RegionWriter

if TYPE_CHECKING:
    from memwal_query.read.provider import MemWalDataset
    from memwal_query.regions.spec import RegionSpec


LINEAGE_KEY = "memwal_query.lineage"
"""Key of the table's lineage in ``MemWalIndexDetails.writer_config_defaults`` (a random
token written by :meth:`MemWalTable.initialize`; regions record it when created)."""


def _canonical(value: Any) -> str:
    """Type-tagged canonical text of a region value (same value -> same text)."""
    if value is None:
        return "n"
    if isinstance(value, bool):
        return f"i:{int(value)}"
    if isinstance(value, int):
        return f"i:{value}"
    if isinstance(value, float):
        return f"i:{int(value)}" if value.is_integer() else f"f:{value!r}"
    if isinstance(value, decimal.Decimal):
        return f"d:{value.normalize()}"
    if isinstance(value, str):
        return "s:" + value
    if isinstance(value, bytes | bytearray | memoryview):
        return "b:" + bytes(value).hex()
    if isinstance(value, dt.datetime):
        return "t:" + value.isoformat()
    if isinstance(value, dt.date):
        return "D:" + value.isoformat()
    return "r:" + repr(value)


def region_id_for(spec_id: int, values: dict[str, Any]) -> str:
    """Deterministic region id (UUID v4 layout) of a region value under a spec."""
    text = f"memwal-region/{spec_id}/" + json.dumps(
        [[k, _canonical(values[k])] for k in sorted(values)], ensure_ascii=False
    )
    digest = hashlib.sha256(text.encode()).digest()[:16]
    return str(uuid_mod.UUID(bytes=digest, version=4))


class MemWalTable:
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
        self.uri = normalize_uri(uri)
        self.storage_options = dict(storage_options or {})
        self.io: FileIO = file_io_for(self.uri, self.storage_options)
        self._dataset = _open_dataset(self.uri, self.storage_options)
        self._dataset_lock = threading.Lock()
        index = mwindex.read_index(self.io, self._dataset)
        if index is None:
            raise NotInitializedError(
                f"{self.uri}: the table has no MemWAL index; call MemWalTable.initialize"
            )
        self._index = index
        self.schema: pa.Schema = self._dataset.schema
        self.primary_key: list[str] = require_primary_key(self.schema, self.uri)
        self.lance_schema = self._dataset.lance_schema
        self._writers: dict[str, RegionWriter] = {}
        # Guards opening the writers of write()/delete(): two threads routing rows to
        # one region must share one writer (a second claim would fence the first).
        self._writers_lock = threading.Lock()
        self._writer_options: dict[str, Any] = {}
        self._manifests: dict[str, RegionManifest] = {}  # last read per region
        # parsed region spec and region values, valid while the protos they were parsed
        # from are the ones held (a query reads them for every region: issue 20)
        self._spec_cache: tuple[Any, RegionSpec] | None = None
        self._values_cache: dict[str, tuple[RegionManifest, RegionSpec, Any]] = {}

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
        io = file_io_for(norm, options)
        ds = _open_dataset(norm, options)
        pk = require_primary_key(ds.schema, norm)
        if mwindex.read_index(io, ds) is not None:
            raise AlreadyInitializedError(f"{norm}: the table already has a MemWAL index")
        from memwal_query.regions.spec import unsharded_spec

        if region_spec is None:
            region_spec = unsharded_spec()
        if region_spec.spec_id <= 0:
            raise RegionSpecError(f"region spec id must be positive, got {region_spec.spec_id}")
        _check_spec_sources(region_spec, ds.lance_schema, norm, ds.schema)
        _warn_non_key_sources(region_spec, ds.lance_schema, pk, norm)
        specs = [region_spec.to_proto()]
        names = list(maintained_indexes or [])
        existing = {i.name for i in ds.describe_indices()}
        missing = [n for n in names if n not in existing]
        if missing:
            raise NotInitializedError(
                f"{norm}: maintained index(es) {missing} do not exist on the base table "
                f"(existing: {sorted(existing)})"
            )
        check_no_leftover_regions(io, norm, reset)
        if reset:
            io.delete_tree(paths.mem_wal_root(norm))
        key_field = ds.lance_schema.field(pk[0]).id()
        if primary_key_index and not any(
            list(i.fields) == [key_field] for i in ds.describe_indices()
        ):
            ds.create_scalar_index(pk[0], "BTREE")
            ds = _open_dataset(norm, options)
        details = mwindex.new_details(specs, names)
        details.writer_config_defaults[LINEAGE_KEY] = uuid_mod.uuid4().hex
        mwindex.commit_details(ds, details, None, storage_options=options)
        return cls(norm, options)

    @classmethod
    def open(
        cls, uri: str | os.PathLike, storage_options: dict[str, str] | None = None
    ) -> MemWalTable:
        """Open an initialized table."""
        return cls(uri, storage_options)

    # -- base table and index ----------------------------------------------------------
    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        """The base Lance dataset (latest version unless ``version`` is given)."""
        if version is not None:
            return lance.dataset(self.uri, version=version, storage_options=self.storage_options)
        # A LanceDataset object must not be used from two threads at once (PyO3 borrow
        # panics), so every caller gets its own object, checked out under a lock.
        with self._dataset_lock:
            return self._dataset.checkout_version(self._dataset.latest_version)

    def index(self, dataset: lance.LanceDataset | None = None) -> mwindex.MemWalIndex:
        """The MemWAL index of ``dataset``'s version (default: the latest version).

        Pass the dataset you read so that data and merge progress come from the same
        version (reading "latest" twice could pair old data with newer progress).
        """
        ds = dataset if dataset is not None else self.dataset()
        idx = mwindex.read_index(self.io, ds)
        if idx is None:
            raise NotInitializedError(f"{self.uri}: the MemWAL index disappeared")
        from memwal_query.maintain.catchup import read_progress

        progress = read_progress(self.io, self.uri)
        if progress.index_catchup:
            mwindex._max_progress(idx.details, progress)
        if dataset is None:
            self._index = idx
        return idx

    @property
    def region_spec(self) -> RegionSpec | None:
        """The current region spec (highest spec id), or None."""
        specs = self._index.details.region_specs
        if not specs:
            return None
        cached = self._spec_cache
        if cached is not None and cached[0] is specs:
            return cached[1]
        from memwal_query.regions.spec import RegionSpec

        spec = RegionSpec.from_proto(max(specs, key=lambda s: s.spec_id))
        self._spec_cache = (specs, spec)
        return spec

    @property
    def maintained_indexes(self) -> list[str]:
        """Base-table index names also built for flushed generations."""
        return list(self._index.details.maintained_indexes)

    # -- regions -----------------------------------------------------------------------
    @property
    def lineage(self) -> str:
        """The token :meth:`initialize` recorded for this life of the table ("" when the
        index was written by pylance or an older memwal_query)."""
        return self._index.details.writer_config_defaults.get(LINEAGE_KEY, "")

    def region_ids(self) -> list[str]:
        """Ids of every region that has a directory under ``_mem_wal/``."""
        return _region_dirs(self.io, self.uri)

    def region_manifest(self, region_id: str) -> RegionManifest | None:
        """Newest manifest of a region (None when it has none).

        The last manifest read per region is kept; finding that nothing changed since
        costs one HEAD of the next version (see :meth:`RegionManifestStore.load_latest`).
        A region of another lineage (left over from before the base table was
        initialized again) counts as absent, with a warning: its rows are not this
        table's.
        """
        known = self._manifests.get(region_id)
        manifest = RegionManifestStore(self.io, self.uri, region_id).load_latest(known)
        if manifest is not None and foreign_lineage(manifest, self.lineage):
            warnings.warn(
                f"{self.uri}: region {region_id} belongs to another lineage of the table "
                f"({manifest.lineage}, the table's is {self.lineage}) and is not read; "
                "remove it with MemWalTable.initialize(..., reset=True)",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        if manifest is not None and manifest is not known:
            self._manifests[region_id] = manifest
        return manifest

    def region_values(
        self, region_id: str, manifest: RegionManifest | None = None
    ) -> tuple[int, dict[str, Any]] | None:
        """``(spec_id, {field_id: value})`` recorded in a region's manifest, or None.

        Values are read from the manifest's ``region_field_entries`` (as pylance's
        native writer records them); None for manual regions or another spec.
        ``manifest``: the region's manifest when the caller has just read it.
        """
        if manifest is None:
            manifest = self.region_manifest(region_id)
        spec = self.routing_spec()
        if manifest is None or manifest.region_spec_id != spec.spec_id:
            return None
        cached = self._values_cache.get(region_id)
        if cached is not None and cached[0] is manifest and cached[1] is spec:
            return cached[2]
        raw = dict(manifest.region_field_entries)
        values = {}
        for f in spec.fields:
            entry = raw.get(f.field_id)
            values[f.field_id] = (
                None if entry is None else fieldvalues.decode(entry, self._field_type(f))
            )
        self._values_cache[region_id] = (manifest, spec, (spec.spec_id, values))
        return spec.spec_id, values

    def known_region_values(self, region_id: str) -> tuple[int, dict[str, Any]] | None:
        """The values :meth:`region_values` last read for a region under the current
        spec, without reading anything (a region's values are fixed when it is
        created), or None when not read yet."""
        cached = self._values_cache.get(region_id)
        if cached is None or cached[1] is not self.routing_spec():
            return None
        return cached[2]

    def _field_type(self, f: Any) -> pa.DataType:
        """Arrow type of a region field's values (declared, or its source's type)."""
        declared = f.declared_type
        if declared is not None:
            return declared
        by_id = {}
        stack = list(self.lance_schema.fields())
        while stack:
            x = stack.pop()
            by_id[x.id()] = x.name()
            stack.extend(x.children())
        name = by_id.get(f.source_ids[0]) if f.source_ids else None
        if name is None or self.schema.get_field_index(name) < 0:
            raise RegionSpecError(f"region field {f.field_id!r}: no result type and no source")
        return self.schema.field(name).type

    def _field_entries(self, values: dict[str, Any]) -> tuple[tuple[str, bytes], ...]:
        spec = self.routing_spec()
        out = []
        for f in spec.fields:
            raw = fieldvalues.encode(values.get(f.field_id), self._field_type(f))
            if raw is not None:
                out.append((f.field_id, raw))
        return tuple(out)

    def region_id_for(self, values: dict[str, Any]) -> str:
        """Region id of a region value under the current spec (see module docs)."""
        spec = self.routing_spec()
        wanted = {f.field_id for f in spec.fields}
        if set(values) != wanted:
            raise RegionSpecError(
                f"region values must name exactly the spec's fields {sorted(wanted)}, "
                f"got {sorted(values)}"
            )
        return region_id_for(spec.spec_id, values)

    def routing_spec(self) -> RegionSpec:
        """The spec rows are routed by: the current spec, or for a table whose index
        records none (initialized by pylance or an older memwal_query) the one-region
        :func:`~memwal_query.regions.spec.unsharded_spec`."""
        spec = self.region_spec
        if spec is not None:
            return spec
        from memwal_query.regions.spec import unsharded_spec

        return unsharded_spec()

    def writer(
        self,
        region_id: str | None = None,
        *,
        region_values: dict[str, Any] | None = None,
        durable: bool = True,
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
        """
        from memwal_query.regions.spec import is_unsharded

        spec = self.routing_spec()
        if region_values is None and region_id is None:
            if not is_unsharded(spec):
                raise RegionSpecError(
                    f"{self.uri}: region spec {spec.spec_id} has several regions; pass "
                    "region_values (or use MemWalTable.write to route rows)"
                )
            region_values = _one_region(spec)
        if region_values is None:
            assert region_id is not None
            region_id = paths.validate_region_id(region_id)
            known = self.region_values(region_id)
            if known is not None:
                spec_id, region_values = known
                entries = self._field_entries(region_values)
            elif self.region_manifest(region_id) is not None:
                spec_id, entries = 0, ()  # not the spec's: recovery only (rows refused)
            elif is_unsharded(spec) and region_id == self.region_id_for(_one_region(spec)):
                spec_id, region_values = spec.spec_id, _one_region(spec)
                entries = self._field_entries(region_values)
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
            entries = self._field_entries(region_values)
        return RegionWriter(
            self,
            region_id,
            durable=durable,
            region_values=region_values,
            region_spec_id=spec_id,
            region_field_entries=entries,
            **options,
        )

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
        self, dry_run: bool = False, cleanup_older_than=None, min_age=None, progress=None
    ) -> list[str]:
        """Delete merged, caught-up, unreferenced generations and WAL entries.

        See :mod:`memwal_query.maintain.gc` for the rules. ``cleanup_older_than`` (a
        ``datetime.timedelta``) first removes older base-table versions with Lance,
        except those that were the latest within ``min_age`` (default:
        ``cleanup_older_than``), which readers may still use. ``progress(done, total)``
        is called as paths are deleted.
        """
        from memwal_query.maintain.gc import gc

        return gc(
            self,
            dry_run=dry_run,
            cleanup_older_than=cleanup_older_than,
            min_age=min_age,
            progress=progress,
        )

    def status(self) -> dict[str, Any]:
        """Per region: epoch, generations flushed/merged, WAL span, sizes."""
        from memwal_query.maintain.gc import status

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
        consistency: str = "strong",
        writers: Sequence[RegionWriter] | None = None,
        meta_columns: bool = False,
        max_staleness: float | None = None,
    ) -> MemWalDataset:
        """A deduplicated view to register in DataFusion (``ctx.register_table``).

        Parameters
        ----------
        consistency : str
            ``"strong"``: region manifests (+ ``writers``' MemTables);
            ``"eventual"``: region snapshots of the MemWAL index; ``"latest"``: region
            manifests + every region's durable, not yet flushed WAL entries (see
            :mod:`memwal_query.read.view`).
        writers : list of RegionWriter, optional
            Writers whose unflushed rows are read too (read-your-writes). Defaults to
            the writers opened by :meth:`write` on this object.
        meta_columns : bool
            Expose ``_gen`` and ``_rowaddr``.
        max_staleness : float, optional
            ``eventual``: seconds after which a snapshot is too old (manifests instead).
        """
        from memwal_query.read.provider import MemWalDataset

        if writers is None:
            writers = list(self._writers.values())
        return MemWalDataset(self, consistency, writers, meta_columns, max_staleness=max_staleness)

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: Any = None,
        consistency: str = "strong",
        writers: Sequence[RegionWriter] | None = None,
    ) -> pa.Table:
        """The deduplicated table (newest row per key) as a pyarrow Table.

        ``filter`` is a ``pyarrow.compute.Expression`` evaluated on the newest version.
        """
        return self.provider(consistency, writers).to_table(columns=columns, filter=filter)

    def count_rows(self, consistency: str = "strong", writers=None) -> int:
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
        """Newest live rows of the given primary keys (see :mod:`memwal_query.search`)."""
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
        return list(self._writers.values()) if writers is None else list(writers)

    # -- routing writes ----------------------------------------------------------------
    def configure_writers(self, **options: Any) -> None:
        """Options (``durable``, ``max_memtable_rows``...) for writers opened by write()."""
        self._writer_options = dict(options)

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
        retries run out, :class:`FencedError` is raised.
        """
        from memwal_query.format.schema import coerce_partial_rows
        from memwal_query.regions.spec import check_partial_sources

        spec = self.routing_spec()
        if partial:
            rows, missing = coerce_partial_rows(data, self.schema, self.primary_key)
            check_partial_sources(spec, missing, self.lance_schema)
        else:
            rows, missing = coerce_rows(data, self.schema, self.primary_key), []
        parts = split_by_region(spec, rows, self.lance_schema)
        return self._write_parts(parts, lambda w, part: w._put_routed(part, missing))

    def delete(self, keys: Any) -> dict[str, int]:
        """Route delete tombstones to their regions (the spec must read key columns only).

        Same return value, atomicity and retries as :meth:`write`.
        """
        from memwal_query.format.schema import coerce_keys

        key_table = coerce_keys(keys, self.schema, self.primary_key)
        spec = self.routing_spec()
        names = _field_names(self.lance_schema)
        sources = {names.get(i) for f in spec.fields for i in f.source_ids}
        if not sources <= set(self.primary_key):
            raise RegionSpecError(
                f"cannot route deletes by key: the region spec reads {sorted(map(str, sources))}, "
                f"not only the primary key {self.primary_key}; delete through the region's writer"
            )
        parts = split_by_region(spec, key_table, self.lance_schema)
        return self._write_parts(parts, lambda w, part: w.delete(part))

    write_retries: int = 5
    """How many times :meth:`write`/:meth:`delete` claim a region again after being
    fenced by another writer of it (exponential backoff from 50 ms, at most 2 s)."""

    def _write_parts(
        self,
        parts: list[tuple[dict[str, Any], pa.Table]],
        put: Callable[[RegionWriter, pa.Table], None],
    ) -> dict[str, int]:
        """Write each region's part (concurrently) with fencing retries; see :meth:`write`."""
        jobs = [(self.region_id_for(values), values, part) for values, part in parts]

        def one(job: tuple[str, dict[str, Any], pa.Table]) -> BaseException | None:
            try:
                self._put_region(*job, put)
            except BaseException as e:  # noqa: BLE001 - collected per region
                return e
            return None

        outcomes = [one(jobs[0])] if len(jobs) == 1 else concurrently(one, jobs)
        written: dict[str, int] = {}
        errors: dict[str, BaseException] = {}
        for (region_id, _, part), error in zip(jobs, outcomes):
            if error is None:
                written[region_id] = written.get(region_id, 0) + part.num_rows
            else:
                errors[region_id] = error
        if errors:
            if not written:
                raise next(iter(errors.values()))
            raise WriteIncompleteError(self.uri, written, errors)
        return written

    def _put_region(
        self,
        region_id: str,
        values: dict[str, Any],
        part: pa.Table,
        put: Callable[[RegionWriter, pa.Table], None],
    ) -> None:
        """``put`` ``part`` through the region's writer, claiming it again when fenced."""
        self._retry_fenced(region_id, values, lambda w: put(w, part))

    def _retry_fenced(
        self, region_id: str, values: dict[str, Any], call: Callable[[RegionWriter], Any]
    ) -> Any:
        """``call`` the region's routed writer; when another writer fenced it, drop it,
        claim the region again (after a backoff) and call again, ``write_retries``
        times. A fenced call was never acknowledged, so calling again is safe."""
        import random
        import time

        for attempt in range(self.write_retries + 1):
            w = self._routed_writer(region_id, values)
            try:
                return call(w)
            except FencedError as e:
                self._drop_writer(region_id, w)
                if isinstance(e, JobEndedError) or attempt == self.write_retries:
                    raise
            except WriterClosedError:
                # closed by another thread's drop after its fence: claim again
                self._drop_writer(region_id, w)
                if attempt == self.write_retries:
                    raise
            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _drop_writer(self, region_id: str, w: RegionWriter) -> None:
        """Forget a fenced writer (its acknowledged rows are in the WAL; the next
        writer of the region replays them)."""
        with self._writers_lock:
            if self._writers.get(region_id) is w:
                del self._writers[region_id]
        try:
            w.close(flush=False)
        except Exception:  # noqa: BLE001 - fenced: nothing of ours left to save
            pass

    def _routed_writer(self, region_id: str, values: dict[str, Any]) -> RegionWriter:
        """The writer :meth:`write`/:meth:`delete` use for a region, opened on first
        use, once per region even when several threads ask at the same time."""
        w = self._writers.get(region_id)
        if w is not None:
            return w
        with self._writers_lock:
            w = self._writers.get(region_id)
            if w is None:
                w = self.writer(region_values=values, **self._writer_options)
                self._writers[region_id] = w
            return w

    def writers(self) -> list[RegionWriter]:
        """Writers opened by :meth:`write`."""
        return list(self._writers.values())

    def flush(self) -> dict[str, int | None]:
        """Flush every writer opened by :meth:`write` (concurrently); ``{region_id: gen}``.

        A writer fenced by another writer of its region meanwhile is claimed again (as
        :meth:`write` does): its acknowledged rows are in the WAL, and the new claim
        replays and flushes them.
        """
        items = list(self._writers.items())
        gens = concurrently(lambda item: self._flush_routed(*item), items)
        return {rid: g for (rid, _), g in zip(items, gens)}

    def _flush_routed(self, region_id: str, w: RegionWriter) -> int | None:
        values = w.region_values or {}
        return self._retry_fenced(region_id, values, lambda writer: writer.flush())

    def close(self, flush: bool = True) -> None:
        """Close the writers opened by :meth:`write` (flushing them first by default)."""
        try:
            if flush:
                self.flush()
        finally:
            writers, self._writers = self._writers, {}
            for w in writers.values():
                try:
                    w.close(flush=False)
                except FencedError:
                    pass  # its acknowledged rows are in the WAL: the region's next writer has them

    def __enter__(self) -> MemWalTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    def __repr__(self) -> str:
        return f"MemWalTable({self.uri!r}, primary_key={self.primary_key})"


def concurrently(fn: Callable[[Any], Any], items: Iterable[Any], max_workers: int = 8) -> list:
    """``[fn(x) for x in items]`` run in threads (flushes overlap their I/O and the
    GIL-free parts of Lance and numpy); every call finishes, then the first error is
    raised."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


def split_by_region(
    spec: RegionSpec, rows: pa.Table, lance_schema: Any
) -> list[tuple[dict[str, Any], pa.Table]]:
    """Split ``rows`` by region value: ``[(values, rows_of_that_region), ...]``."""
    from memwal_query.regions.spec import is_unsharded

    if rows.num_rows == 0:
        return []
    if is_unsharded(spec):
        return [(_one_region(spec), rows)]
    values = pa.Table.from_batches([spec.evaluate(rows, lance_schema)])
    field_ids = values.column_names
    import numpy as np

    keyed = values.append_column("__row", pa.array(np.arange(rows.num_rows, dtype=np.int64)))
    # NULL region values form their own group, as they form their own region.
    groups = keyed.group_by(field_ids, use_threads=False).aggregate([("__row", "list")])
    out = []
    for i in range(groups.num_rows):
        region = {f: groups.column(f)[i].as_py() for f in field_ids}
        idx = groups.column("__row_list")[i].values
        out.append((region, rows.take(pc.cast(idx, pa.int64()))))
    return out


def _one_region(spec: RegionSpec) -> dict[str, Any]:
    """The region values of the only region of an ``unsharded`` spec."""
    return {f.field_id: 0 for f in spec.fields}


def _field_names(lance_schema: Any) -> dict[int, str]:
    out: dict[int, str] = {}
    stack = list(lance_schema.fields())
    while stack:
        f = stack.pop()
        out[f.id()] = f.name()
        stack.extend(f.children())
    return out


def _field_ids(lance_schema: Any) -> set[int]:
    ids: set[int] = set()
    stack = list(lance_schema.fields())
    while stack:
        f = stack.pop()
        ids.add(f.id())
        stack.extend(f.children())
    return ids


def _check_spec_sources(
    spec: RegionSpec, lance_schema: Any, uri: str, schema: pa.Schema | None = None
) -> None:
    """RegionSpecError unless every source field exists and (with ``schema``) the spec
    can evaluate rows of the table (e.g. truncate of a decimal column cannot)."""
    known = _field_ids(lance_schema)
    for f in spec.fields:
        missing = [i for i in f.source_ids if i not in known]
        if missing:
            raise RegionSpecError(
                f"{uri}: region field {f.field_id!r} refers to unknown field id(s) {missing}"
            )
    if schema is not None:
        try:
            spec.evaluate(pa.RecordBatch.from_pylist([], schema=schema), schema)
        except RegionSpecError as e:
            raise RegionSpecError(f"{uri}: {e}") from e


def _warn_non_key_sources(spec: RegionSpec, lance_schema: Any, pk: list[str], uri: str) -> None:
    """RegionSpecWarning when the spec reads columns outside the primary key.

    Every key must live in exactly one region (dedup and region pruning rely on it).
    A spec over primary-key columns guarantees it; one over other columns (e.g. a time
    range on ``ts`` with key ``id``) only if a key's value in them never changes.
    """
    names = _field_names(lance_schema)
    outside = sorted({names[i] for f in spec.fields for i in f.source_ids if i in names} - set(pk))
    if outside:
        warnings.warn(
            f"{uri}: region spec {spec.spec_id} reads column(s) {outside} outside the "
            f"primary key {pk}. Each key must live in exactly one region, so a key's value "
            f"in {outside} must never change once written: an upsert that changes it puts "
            "the key in a second region, and reads may then return an older version or a "
            "row that no longer matches the filter. Include these column(s) in the primary "
            "key (e.g. key (id, ts) for time-range regions) or region on key columns.",
            RegionSpecWarning,
            stacklevel=3,
        )


def check_no_leftover_regions(io: FileIO, uri: str, reset: bool) -> None:
    """LeftoverRegionsError when ``uri``'s ``_mem_wal/`` holds regions (before a new
    MemWAL index is written) and ``reset`` does not allow removing them."""
    leftovers = _region_dirs(io, uri)
    if leftovers and not reset:
        more = ", ..." if len(leftovers) > 5 else ""
        raise LeftoverRegionsError(
            f"{uri}: _mem_wal/ holds {len(leftovers)} region(s) of an earlier MemWAL of "
            f"this table ({', '.join(leftovers[:5])}{more}); their rows would be read on "
            "top of the current base table. Pass reset=True (memwal init --reset) to "
            "remove them first.",
            leftovers,
        )


def _region_dirs(io: FileIO, uri: str) -> list[str]:
    """Ids of the region directories under ``uri``'s ``_mem_wal/``."""
    paths.check_mem_wal_root(io, uri)
    out = []
    for name in io.list(paths.mem_wal_root(uri)):
        try:
            out.append(paths.validate_region_id(name))
        except InvalidPathError:
            continue
    return out


def _open_dataset(uri: str, storage_options: dict[str, str]) -> lance.LanceDataset:
    """The Lance dataset at ``uri``.

    Raises
    ------
    TableNotFoundError
        Lance found no table there (no ``_versions/``).
    StorageError
        The store could not be read: a missing bucket, denied credentials, an
        unreachable endpoint, an unreadable manifest. Not a TableNotFoundError: the
        table may well exist.
    """
    try:
        return lance.dataset(uri, storage_options=storage_options or None)
    except (ValueError, OSError, RuntimeError) as e:
        text = str(e)
        if "was not found" in text or "LanceError(IO)" not in text:
            raise TableNotFoundError(f"{uri}: no Lance table here ({e})") from e
        raise StorageError(f"{uri}: cannot open the Lance table: {_store_error(text)}") from e


def _store_error(text: str) -> str:
    """One line saying why a Lance I/O error happened (S3 error code first)."""
    code = re.search(r"<Code>([^<]+)</Code>", text)
    status = re.search(r"status code: (\d{3})", text)
    first = (text.split("<?xml", 1)[0].splitlines() or [""])[0]
    first = first.removeprefix("LanceError(IO): ").rstrip(" :")
    if code is not None:
        first = f"{first} ({code.group(1)})"
    if code is not None and code.group(1) == "NoSuchBucket":
        return f"no such bucket: {first}"
    if status is not None and status.group(1) in ("401", "403"):
        return f"access denied (check the credentials): {first}"
    if "error sending request" in text:
        return f"cannot reach the store (check the endpoint): {first}"
    return first
