"""Convenience registration of MemWAL tables (and their search functions) in DataFusion."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datafusion

    from memwal_query.table import MemWalTable
    from memwal_query.write.writer import RegionWriter


def register(
    ctx: datafusion.SessionContext,
    name: str,
    uri: str | os.PathLike | MemWalTable,
    consistency: str = "latest",
    writers: Sequence[RegionWriter] | None = None,
    meta_columns: bool = False,
    storage_options: dict[str, str] | None = None,
    max_staleness: float | None = None,
    as_of: Any = None,
) -> MemWalTable:
    """Register the MemWAL table at ``uri`` as ``name`` in ``ctx``; return the table.

    Also registers the SQL table functions ``vector_search``, ``fts_search`` and
    ``lookup`` (see :mod:`memwal_query.search`) and ``changes`` (the change feed, see
    :mod:`memwal_query.read.changes_sql`); for ``name`` they read the MemTables of
    ``writers`` too.

    Parameters
    ----------
    ctx : datafusion.SessionContext
    name : str
        The SQL table name.
    uri : str, os.PathLike or MemWalTable
        The table, or its location.
    consistency : str
        ``"latest"`` (default): every acknowledged write of every process;
        ``"strong"``: flushed rows only; ``"eventual"``: the region snapshots of the
        MemWAL index, falling back to the region manifests while no snapshot has been
        written or when it is older than ``max_staleness`` (see
        :mod:`memwal_query.read.view`).
    writers : list of RegionWriter, optional
        Writers whose in-memory rows are read too (read-your-writes, also of
        non-durable writers).
    meta_columns : bool
        Expose ``_gen`` and ``_rowaddr``.
    storage_options : dict, optional
        Object-store options, when ``uri`` is a location.
    max_staleness : float, optional
        ``"eventual"``: seconds after which a snapshot is too old (default
        :data:`memwal_query.read.view.DEFAULT_MAX_STALENESS`).
    as_of : int, datetime or str, optional
        Register the table as it was at that base version or moment (time travel).

    Returns
    -------
    MemWalTable
        The table registered.

    Raises
    ------
    TableNotFoundError, PrimaryKeyError, NotInitializedError
        No Lance table at ``uri``; it has no primary key; it has no MemWAL index
        (nothing registered).
    ManifestCorruptError, MemWalError
        The sources cannot be resolved now (they are resolved once as a check;
        nothing registered).

    Notes
    -----
    Errors raised while DataFusion runs a query (e.g. a region manifest corrupted or a
    generation garbage collected after registration) reach the caller as DataFusion's
    own ``Exception``; its message carries the original type name and message (which
    names the file concerned). Catch by type only around :func:`register` and the
    :class:`MemWalTable` methods.
    """
    from memwal_query.table import MemWalTable

    table = uri if isinstance(uri, MemWalTable) else _open(uri, storage_options)
    provider = table.provider(
        consistency=consistency, writers=writers, meta_columns=meta_columns, as_of=as_of
    )
    provider.max_staleness = max_staleness
    provider.check()
    ctx.register_table(name, provider)
    _registered(ctx)[name] = table.catalog
    registered_writers = _registered(ctx, "_memwal_writers")
    routed = _registered(ctx, "_memwal_routed")
    if writers is None:
        registered_writers.pop(name, None)
    else:
        registered_writers[name] = list(writers)
    routed[name] = table  # its writers() are read when a function runs
    from memwal_query.search import register_search_functions

    # The functions look the dicts up at call time: tables and writers registered
    # later on this context are found too.
    register_search_functions(ctx, writers=registered_writers, routed=routed)
    from memwal_query.read.changes_sql import register_changes_function

    register_changes_function(ctx, _registered(ctx))
    return table


def _open(uri: str | os.PathLike, storage_options: dict[str, str] | None) -> MemWalTable:
    """Open a table; a base table without primary key raises PrimaryKeyError (not
    NotInitializedError: it could never be initialized)."""
    from memwal_query.catalog import open_dataset
    from memwal_query.exceptions import NotInitializedError
    from memwal_query.format.schema import require_primary_key
    from memwal_query.storage.io import normalize_uri
    from memwal_query.table import MemWalTable

    try:
        return MemWalTable.open(uri, storage_options)
    except NotInitializedError:
        norm = normalize_uri(uri)
        require_primary_key(open_dataset(norm, dict(storage_options or {})).schema, norm)
        raise


def _registered(ctx: Any, attr: str = "_memwal_tables") -> dict[str, Any]:
    """Catalogs (``_memwal_tables``), writers (``_memwal_writers``) or the tables whose
    current ``writers()`` are read (``_memwal_routed``) registered through
    :func:`register` on ``ctx``, by name (for the search functions)."""
    from memwal_query.search.sqlfunctions import registry

    return registry(ctx, attr)
