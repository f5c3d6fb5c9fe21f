"""Initializing a table: writing the MemWAL index into an existing Lance table.

What :meth:`memwal_query.table.MemWalTable.initialize` and ``memwal init`` do before the
table is opened: check the base table (primary key, no MemWAL index yet, region spec,
maintained indexes, leftover regions), optionally reset ``_mem_wal/``, build the
primary-key index, then commit the index. Everything is checked before anything is
changed.
"""

from __future__ import annotations

import uuid as uuid_mod
from collections.abc import Iterable
from typing import TYPE_CHECKING

from memwal_query.catalog import LINEAGE_KEY, open_dataset, region_dirs
from memwal_query.exceptions import (
    AlreadyInitializedError,
    LeftoverRegionsError,
    NotInitializedError,
    RegionSpecError,
)
from memwal_query.format import index as mwindex
from memwal_query.format.schema import require_primary_key
from memwal_query.storage import paths
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import FileIO

if TYPE_CHECKING:
    from memwal_query.regions.spec import RegionSpec


def check_no_leftover_regions(io: FileIO, uri: str, reset: bool) -> None:
    """LeftoverRegionsError when ``uri``'s ``_mem_wal/`` holds regions (before a new
    MemWAL index is written) and ``reset`` does not allow removing them."""
    leftovers = region_dirs(io, uri)
    if leftovers and not reset:
        more = ", ..." if len(leftovers) > 5 else ""
        raise LeftoverRegionsError(
            f"{uri}: _mem_wal/ holds {len(leftovers)} region(s) of an earlier MemWAL of "
            f"this table ({', '.join(leftovers[:5])}{more}); their rows would be read on "
            "top of the current base table. Pass reset=True (memwal init --reset) to "
            "remove them first.",
            leftovers,
        )


def write_index(
    norm: str,
    options: dict[str, str],
    *,
    region_spec: RegionSpec | None = None,
    maintained_indexes: Iterable[str] | None = None,
    primary_key_index: bool = True,
    reset: bool = False,
) -> None:
    """Write a new MemWAL index into the Lance table at ``norm``.

    Parameters are those of :meth:`memwal_query.table.MemWalTable.initialize` (``norm``:
    the normalized URI, ``options``: its storage options). Everything is checked before
    anything is changed.

    Raises
    ------
    TableNotFoundError, PrimaryKeyError, AlreadyInitializedError, RegionSpecError,
    NotInitializedError, LeftoverRegionsError
    """
    from memwal_query.regions.checks import check_spec_sources, warn_non_key_sources

    io = file_io_for(norm, options)
    ds = open_dataset(norm, options)
    pk = require_primary_key(ds.schema, norm)
    if mwindex.read_index(io, ds) is not None:
        raise AlreadyInitializedError(f"{norm}: the table already has a MemWAL index")
    from memwal_query.regions.spec import unsharded_spec

    if region_spec is None:
        region_spec = unsharded_spec()
    if region_spec.spec_id <= 0:
        raise RegionSpecError(f"region spec id must be positive, got {region_spec.spec_id}")
    check_spec_sources(region_spec, ds.lance_schema, norm, ds.schema)
    warn_non_key_sources(region_spec, ds.lance_schema, pk, norm)
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
    key_lance_field = ds.lance_schema.field(pk[0])
    assert key_lance_field is not None  # require_primary_key found it
    key_field = key_lance_field.id()
    if primary_key_index and not any(list(i.fields) == [key_field] for i in ds.describe_indices()):
        ds.create_scalar_index(pk[0], "BTREE")
        ds = open_dataset(norm, options)
    details = mwindex.new_details(specs, names)
    details.writer_config_defaults[LINEAGE_KEY] = uuid_mod.uuid4().hex
    mwindex.commit_details(ds, details, None, storage_options=options)
