"""The SQL table functions ``vector_search``, ``fts_search`` and ``lookup``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from memwal_query.catalog import as_catalog
from memwal_query.exceptions import MemWalError
from memwal_query.read.changes_sql import literal_argument
from memwal_query.search.common import DEFAULT_NPROBES, DEFAULT_REFINE_FACTOR
from memwal_query.search.fulltext import fts_search
from memwal_query.search.pointlookup import lookup
from memwal_query.search.vector import vector_search

if TYPE_CHECKING:
    import datafusion

    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter


class WriterSource(Protocol):
    """Something whose current writers the SQL functions read: ``writers()`` is called
    each time a function runs (a ``MemWalTable``, or a ``RoutedWriters``)."""

    def writers(self) -> Sequence[RegionWriter]: ...


def registry(ctx: Any, attr: str = "_memwal_tables") -> dict[str, Any]:
    """Tables (``_memwal_tables``) or writers (``_memwal_writers``) registered through
    :func:`memwal_query.register` on ``ctx``, by name (for the search functions)."""
    found = getattr(ctx, attr, None)
    if found is None:
        found = {}
        try:
            setattr(ctx, attr, found)
        except AttributeError:  # pragma: no cover - slots
            pass
    return found


def _literal(expr: Any) -> Any:
    """The Python value of a literal DataFusion expression argument."""
    return literal_argument(expr, "search table functions")


def register_search_functions(
    ctx: datafusion.SessionContext,
    tables: dict[str, Catalog] | None = None,
    writers: dict[str, Sequence[RegionWriter]] | None = None,
    default_writers: Callable[[Any], Sequence[RegionWriter]] | None = None,
    routed: Mapping[str, WriterSource] | None = None,
) -> None:
    """Register the SQL table functions ``vector_search``, ``fts_search`` and ``lookup``.

    Parameters
    ----------
    ctx : datafusion.SessionContext
    tables : dict, optional
        ``{name: Catalog or MemWalTable}`` the functions can search. Default: the tables
        registered on ``ctx`` with :func:`memwal_query.register` (looked up at call
        time, so tables registered later are found too).
    writers : dict, optional
        ``{name: [RegionWriter, ...]}``: writers whose MemTables the functions read
        for that table (looked up at call time).
    default_writers : callable, optional
        ``catalog -> writers`` for a table in neither ``writers`` nor ``routed``.
        Default: no MemTables.
    routed : dict, optional
        ``{name: WriterSource}``: for a table not in ``writers``, the MemTables of the
        writers ``source.writers()`` returns when a function runs
        (:func:`memwal_query.register` passes the ``MemWalTable``, whose ``writers()``
        are the ones its ``write`` opened).

    Notes
    -----
    Arguments are literals; optional trailing ones may be omitted::

        SELECT * FROM vector_search('events', 'vec', [0.1, 0.2, ...], 10)
        SELECT * FROM vector_search('events', 'vec', [...], 10, 'x > 5', 40)  -- filter, nprobes
        SELECT id, _score FROM fts_search('events', 'text', 'hello world', 5)
        SELECT * FROM fts_search('events', 'text', 'hello', 5, 'x > 5')       -- filter
        SELECT * FROM lookup('events', 42)
        SELECT * FROM lookup('events', [1, 2, 3])

    The search runs when DataFusion plans the query (the function's result is a
    table), with the default consistency (every acknowledged write) and the MemTables
    of ``writers`` (else of ``default_writers``). An empty filter string means none.
    """
    from datafusion import Table, udtf

    tables_of = registry(ctx) if tables is None else tables
    table_writers = writers if writers is not None else {}

    def table_of(name: Any) -> Catalog:
        t = tables_of.get(str(name))
        if t is None:
            raise MemWalError(f"no MemWAL table named {name!r} (known: {sorted(tables_of)})")
        return as_catalog(t)

    def writers_of(name: Any) -> Sequence[RegionWriter] | None:
        found = table_writers.get(str(name))
        if found is None and routed is not None and str(name) in routed:
            return routed[str(name)].writers()
        if found is None and default_writers is not None:
            return default_writers(table_of(name))
        return found

    def as_table(result: pa.Table) -> Any:
        import pyarrow.dataset as pads

        return Table(pads.dataset(result))

    def sql_vector_search(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) < 3:
            raise MemWalError("vector_search(table, column, query [, k [, filter [, nprobes]]])")
        name, column, query = vals[:3]
        k = int(vals[3]) if len(vals) > 3 else 10
        flt = vals[4] if len(vals) > 4 and vals[4] else None
        nprobes = int(vals[5]) if len(vals) > 5 else DEFAULT_NPROBES
        t = table_of(name)
        return as_table(
            vector_search(
                t, column, query, k, flt, nprobes, DEFAULT_REFINE_FACTOR, writers_of(name)
            )
        )

    def sql_fts_search(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) < 3:
            raise MemWalError("fts_search(table, column, query [, k [, filter]])")
        name, column, query = vals[:3]
        k = int(vals[3]) if len(vals) > 3 else 10
        flt = vals[4] if len(vals) > 4 and vals[4] else None
        t = table_of(name)
        return as_table(fts_search(t, column, str(query), k, flt, writers=writers_of(name)))

    def sql_lookup(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) != 2:
            raise MemWalError("lookup(table, key_or_list_of_keys)")
        return as_table(lookup(table_of(vals[0]), vals[1], writers=writers_of(vals[0])))

    ctx.register_udtf(udtf(sql_vector_search, "vector_search"))
    ctx.register_udtf(udtf(sql_fts_search, "fts_search"))
    ctx.register_udtf(udtf(sql_lookup, "lookup"))
