"""The catalog handle: what every layer below the table facade knows of a table.

A :class:`Catalog` is the read-only part of a MemWAL table: its URI, storage, schema and
primary key (fixed when it is opened), its base Lance dataset and MemWAL index, its region
spec and the region manifests. Writers, readers, search and maintenance receive a
``Catalog`` (never the :class:`~memwal_query.table.MemWalTable` facade, which adds
writing, SQL and search on top), so the layers below the facade never call back up into
it. See ``docs/architecture.md``.

Finding a region from its value
-------------------------------
With a region spec, the id of the region holding region value ``v`` is *derived* from
``(spec_id, v)``: the first 16 bytes of ``sha256("memwal-region/{spec_id}/{v}")`` with
the UUID version-4 and variant bits set (:func:`region_id_for`). Two writers for the same
value therefore always compute the same region id, and the region manifest's
put-if-not-exists + epoch fencing decides which of them owns it: two regions for one
value can never be created.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import os
import threading
import uuid as uuid_mod
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import lance
import pyarrow as pa

from memwal_query.exceptions import (
    InvalidPathError,
    NotInitializedError,
    RegionNotFoundError,
    RegionSpecError,
    StorageError,
    TableNotFoundError,
    without_source_locations,
)
from memwal_query.format import fieldvalues, lancecache
from memwal_query.format import index as mwindex
from memwal_query.format.manifest import RegionManifest, RegionManifestStore, foreign_lineage
from memwal_query.format.progress import read_progress
from memwal_query.format.schema import require_primary_key
from memwal_query.storage import paths
from memwal_query.storage.errors import store_error
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import FileIO, normalize_uri

if TYPE_CHECKING:
    from memwal_query.regions.spec import RegionSpec

LINEAGE_KEY = "memwal_query.lineage"
"""Key of the table's lineage in ``MemWalIndexDetails.writer_config_defaults`` (a random
token written by :meth:`MemWalTable.initialize`; regions record it when created)."""

SPEC_READY_KEY = "memwal_query.spec_ready"
"""Key in ``MemWalIndexDetails.writer_config_defaults`` of the id of the newest region
spec whose change is complete: every region of an older spec is sealed and fully merged
(:mod:`memwal_query.maintain.specs`). Absent on a table that only ever had one spec."""


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
    """Deterministic region id (UUID v4 layout) of a region value under a spec.

    Parameters
    ----------
    spec_id : int
    values : dict
        ``{region field id: value}``.

    Returns
    -------
    str
        The same id for the same spec id and values, in every process.
    """
    text = f"memwal-region/{spec_id}/" + json.dumps(
        [[k, _canonical(values[k])] for k in sorted(values)], ensure_ascii=False
    )
    digest = hashlib.sha256(text.encode()).digest()[:16]
    return str(uuid_mod.UUID(bytes=digest, version=4))


class Catalog:
    """Read-only handle of an initialized MemWAL table (see module docs).

    Its identity (``uri``, ``storage_options``, ``io``, ``schema``, ``primary_key``,
    ``lance_schema``) is fixed when it is opened; :meth:`dataset`, :meth:`index` and
    :meth:`region_manifest` read the current state of storage (the last manifest read per
    region and the last index are cached).

    Raises
    ------
    TableNotFoundError, StorageError, PrimaryKeyError, NotInitializedError
        No Lance table at ``uri``, the store cannot be read, the table has no primary key
        or no MemWAL index.
    """

    def __init__(self, uri: str | os.PathLike, storage_options: dict[str, str] | None = None):
        self.uri = normalize_uri(uri)
        self.storage_options = dict(storage_options or {})
        self.io: FileIO = file_io_for(self.uri, self.storage_options)
        self._dataset = open_dataset(self.uri, self.storage_options)
        self._dataset_lock = threading.Lock()
        self._renewal = lancecache.SessionRenewal()
        index = mwindex.read_index(self.io, self._dataset)
        if index is None:
            raise NotInitializedError(
                f"{self.uri}: the table has no MemWAL index; initialize it first with "
                "`memwal init URI --primary-key COLUMNS` (Python: MemWalTable.initialize)"
            )
        self._index = index
        self.schema: pa.Schema = self._dataset.schema
        self.primary_key: list[str] = require_primary_key(self.schema, self.uri)
        self.lance_schema = self._dataset.lance_schema
        self._manifests: dict[str, RegionManifest] = {}  # last read per region
        # parsed region spec and region values, valid while the protos they were parsed
        # from are the ones held (a query reads them for every region)
        self._spec_cache: tuple[Any, RegionSpec] | None = None
        self._specs_cache: tuple[Any, dict[int, RegionSpec]] | None = None
        self._values_cache: dict[str, tuple[RegionManifest, RegionSpec, Any]] = {}

    # -- base table and index ----------------------------------------------------------
    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        """The base Lance dataset (latest version unless ``version`` is given).

        Every version shares the table's bounded Lance session, which is renewed when the
        latest version has moved on and the session holds more than it needs
        (:mod:`memwal_query.format.lancecache`)."""
        if version is not None:
            with self._dataset_lock:
                session = self._dataset.session()  # the table's bounded Lance caches
            return lance.dataset(
                self.uri, version=version, storage_options=self.storage_options, session=session
            )
        # A LanceDataset object must not be used from two threads at once (PyO3 borrow
        # panics), so every caller gets its own object, checked out under a lock.
        with self._dataset_lock:
            latest = self._dataset.latest_version
            if self._renewal.renew(latest, self._dataset.session()):
                # the old session's superseded entries go with its last dataset
                self._dataset = open_dataset(self.uri, self.storage_options)
                latest = self._dataset.version
            return self._dataset.checkout_version(latest)

    def index(self, dataset: lance.LanceDataset | None = None) -> mwindex.MemWalIndex:
        """The MemWAL index of ``dataset``'s version (default: the latest version).

        Reads only: the index the spec and region properties answer from is not
        changed (see :meth:`refresh_index`). Pass the dataset you read so that data and
        merge progress come from the same version (reading "latest" twice could pair
        old data with newer progress).

        Raises
        ------
        NotInitializedError
            The version has no MemWAL index.
        """
        ds = dataset if dataset is not None else self.dataset()
        idx = mwindex.read_index(self.io, ds)
        if idx is None:
            raise NotInitializedError(f"{self.uri}: the MemWAL index disappeared")
        progress = read_progress(self.io, self.uri)
        if progress.index_catchup:
            mwindex.max_progress(idx.details, progress)
        return idx

    def refresh_index(self) -> mwindex.MemWalIndex:
        """Read the latest MemWAL index and make it the one :attr:`region_spec`,
        :attr:`region_specs`, :attr:`spec_change_pending`, :attr:`maintained_indexes`
        and :attr:`lineage` answer from; returns it.

        Raises
        ------
        NotInitializedError
            The index disappeared.
        """
        idx = self.index()
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
    def region_specs(self) -> dict[int, RegionSpec]:
        """Every region spec the index records, by spec id (the current one included).

        A region keeps the spec it was created with (``region_spec_id`` in its
        manifest); regions of older specs are sealed and merged when the spec changes
        (:meth:`memwal_query.table.Maintenance.set_region_spec`).
        """
        specs = self._index.details.region_specs
        cached = self._specs_cache
        if cached is not None and cached[0] is specs:
            return cached[1]
        from memwal_query.regions.spec import RegionSpec

        current = self.region_spec
        by_id = {s.spec_id: RegionSpec.from_proto(s) for s in specs}
        if current is not None:
            by_id[current.spec_id] = current  # one object per spec
        self._specs_cache = (specs, by_id)
        return by_id

    @property
    def spec_change_pending(self) -> bool:
        """Whether the current spec replaced an older one whose regions are not all
        sealed and merged yet (see :mod:`memwal_query.maintain.specs`): writers of the
        current spec wait until they are."""
        details = self._index.details
        if len(details.region_specs) <= 1:
            return False
        current = max(s.spec_id for s in details.region_specs)
        return details.writer_config_defaults.get(SPEC_READY_KEY, "") != str(current)

    @property
    def maintained_indexes(self) -> list[str]:
        """Base-table index names also built for flushed generations."""
        return list(self._index.details.maintained_indexes)

    # -- schema ------------------------------------------------------------------------
    def schema_changes(self, dataset: lance.LanceDataset | None = None) -> list[str]:
        """Columns of the base table (``dataset``, default the latest version) that
        :attr:`schema` lacks or has with another type: non-empty when another process
        changed the schema (e.g. ``t.alter.add_columns``) since this catalog read it."""
        ds = dataset if dataset is not None else self.dataset()
        current = ds.schema
        if current.equals(self.schema, check_metadata=True):
            return []
        return [
            f.name
            for f in current
            if self.schema.get_field_index(f.name) < 0 or self.schema.field(f.name).type != f.type
        ]

    def refresh_schema(self) -> list[str]:
        """Take the latest base schema as :attr:`schema` (and :attr:`lance_schema`);
        returns the columns that were added or changed (see :meth:`schema_changes`).

        Reads and searches that started before keep the columns they started with;
        writers opened before refuse rows of the new schema (:class:`SchemaChangedError`)
        and are opened again by the table.
        """
        ds = self.dataset()
        changed = self.schema_changes(ds)
        if changed or not ds.schema.equals(self.schema, check_metadata=True):
            self.lance_schema = ds.lance_schema
            self.schema = ds.schema
        return changed

    # -- regions -----------------------------------------------------------------------
    @property
    def lineage(self) -> str:
        """The token :meth:`initialize` recorded for this life of the table ("" when the
        index was written by pylance or an older memwal_query)."""
        return self._index.details.writer_config_defaults.get(LINEAGE_KEY, "")

    def region_ids(self) -> list[str]:
        """Ids of every region that has a directory under ``_mem_wal/``."""
        return region_dirs(self.io, self.uri)

    def check_region_ids(self, ids: Iterable[str]) -> list[str]:
        """``ids`` (region ids a caller named), each checked.

        Parameters
        ----------
        ids : iterable of str

        Returns
        -------
        list of str
            The ids, in order.

        Raises
        ------
        InvalidPathError
            An id is malformed.
        RegionNotFoundError
            An id names no region of the table.
        """
        wanted = [paths.validate_region_id(r) for r in ids]
        existing = set(self.region_ids())
        missing = [r for r in wanted if r not in existing]
        if missing:
            raise RegionNotFoundError(f"{self.uri}: no region {', '.join(missing)}")
        return wanted

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

    def known_region_manifest(self, region_id: str) -> RegionManifest | None:
        """The manifest of a region read last by :meth:`region_manifest` (no storage
        access; None when none was read yet). It may be outdated."""
        return self._manifests.get(region_id)

    def region_values(
        self, region_id: str, manifest: RegionManifest | None = None
    ) -> tuple[int, dict[str, Any]] | None:
        """``(spec_id, {field_id: value})`` recorded in a region's manifest, or None.

        Values are read from the manifest's ``region_field_entries`` (as pylance's
        native writer records them) and decoded by the region's own spec (which may be
        an older one than the current spec: compare ``spec_id``); None for manual
        regions and regions of a spec the index does not record. ``manifest``: the
        region's manifest when the caller has just read it.
        """
        if manifest is None:
            manifest = self.region_manifest(region_id)
        if manifest is None:
            return None
        spec = self.spec_for(manifest.region_spec_id)
        if spec is None:
            return None
        cached = self._values_cache.get(region_id)
        if cached is not None and cached[0] is manifest and cached[1] is spec:
            return cached[2]
        raw = dict(manifest.region_field_entries)
        values = {}
        for f in spec.fields:
            entry = raw.get(f.field_id)
            values[f.field_id] = (
                None if entry is None else fieldvalues.decode(entry, self.field_type(f))
            )
        self._values_cache[region_id] = (manifest, spec, (spec.spec_id, values))
        return spec.spec_id, values

    def known_region_values(self, region_id: str) -> tuple[int, dict[str, Any]] | None:
        """The values :meth:`region_values` last read for a region (under its own
        spec), without reading anything (a region's values are fixed when it is
        created), or None when not read yet."""
        cached = self._values_cache.get(region_id)
        if cached is None:
            return None
        if self.spec_for(cached[2][0]) is not cached[1]:
            return None
        return cached[2]

    def spec_for(self, spec_id: int) -> RegionSpec | None:
        """The region spec with id ``spec_id`` (None when the index records none)."""
        if not self._index.details.region_specs:
            spec = self.routing_spec()
            return spec if spec.spec_id == spec_id else None
        return self.region_specs.get(spec_id)

    def field_type(self, f: Any) -> pa.DataType:
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

    def field_entries(self, values: dict[str, Any]) -> tuple[tuple[str, bytes], ...]:
        spec = self.routing_spec()
        out = []
        for f in spec.fields:
            raw = fieldvalues.encode(values.get(f.field_id), self.field_type(f))
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


class HasCatalog(Protocol):
    """An object holding a :class:`Catalog` (the :class:`~memwal_query.table.MemWalTable`
    facade)."""

    @property
    def catalog(self) -> Catalog: ...


def as_catalog(table: Catalog | HasCatalog) -> Catalog:
    """The :class:`Catalog` of ``table``: itself, or the one it holds (``t.catalog``).

    For the entry points users hand a table to by name (the SQL functions'
    registries); the functions of the lower layers take a ``Catalog``.
    """
    return table if isinstance(table, Catalog) else table.catalog


def one_region(spec: RegionSpec) -> dict[str, Any]:
    """The region values of the only region of an ``unsharded`` spec."""
    return {f.field_id: 0 for f in spec.fields}


def region_dirs(io: FileIO, uri: str) -> list[str]:
    """Ids of the region directories under ``uri``'s ``_mem_wal/``."""
    paths.check_mem_wal_root(io, uri)
    out = []
    for name in io.list(paths.mem_wal_root(uri)):
        try:
            out.append(paths.validate_region_id(name))
        except InvalidPathError:
            continue
    return out


def open_dataset(uri: str, storage_options: dict[str, str]) -> lance.LanceDataset:
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
        return lance.dataset(
            uri, storage_options=storage_options or None, session=lancecache.new_session()
        )
    except (ValueError, OSError, RuntimeError) as e:
        text = str(e)
        if "was not found" in text or "LanceError(IO)" not in text:
            raise TableNotFoundError(
                f"{uri}: no Lance table here ({without_source_locations(text)})"
            ) from e
        raise StorageError(f"{uri}: cannot open the Lance table: {store_error(text)}") from e
