"""The SQL table function ``changes``: the change feed of a registered MemWAL table.

::

    SELECT * FROM changes('events')                      -- from the earliest change kept
    SELECT * FROM changes('events', 'mwc1.eyJs...')      -- after a cursor
    SELECT * FROM changes('events', '12')                -- not merged into base version 12
    SELECT * FROM changes('events', 'mwc1...', 'latest') -- also unflushed WAL entries

Registered on a DataFusion context by :func:`memwal_query.register`. The result has the
table's columns plus ``_change_type``, ``_region``, ``_gen`` and ``_seq`` (see
:mod:`memwal_query.read.changes`); the cursor to continue from is not a row: use
:meth:`MemWalTable.changes` (or ``memwal changes``) when a consumer needs it, or
continue from the highest ``_seq`` per region yourself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.catalog import as_catalog
from memwal_query.exceptions import MemWalError
from memwal_query.read.view import DEFAULT_CONSISTENCY

if TYPE_CHECKING:
    import datafusion

    from memwal_query.catalog import Catalog, HasCatalog

USAGE = "changes(table [, since [, consistency]])"


def literal_argument(expr: Any, usage: str) -> Any:
    """The Python value of a literal argument of a SQL table function (``usage`` names
    the function in the MemWalError raised for anything else). Shared with the search
    functions (:mod:`memwal_query.search.sqlfunctions`)."""
    fn = getattr(expr, "python_value", None)
    if fn is None:
        raise MemWalError(f"{usage} takes literal arguments, got {expr}")
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - not a literal
        raise MemWalError(f"{usage} takes literal arguments, got {expr}") from e
    return value.as_py() if isinstance(value, pa.Scalar) else value


def register_changes_function(
    ctx: datafusion.SessionContext, tables: Mapping[str, Catalog | HasCatalog]
) -> None:
    """Register ``changes`` on ``ctx``; ``tables`` (looked up at call time) maps the
    names the function accepts to their tables."""
    from datafusion import Table, udtf

    from memwal_query.read.changes import changes

    def sql_changes(*args: Any) -> Any:
        vals = [literal_argument(a, USAGE) for a in args]
        if not 1 <= len(vals) <= 3:
            raise MemWalError(USAGE)
        table = tables.get(str(vals[0]))
        if table is None:
            raise MemWalError(f"no MemWAL table named {vals[0]!r} (known: {sorted(tables)})")
        since = vals[1] if len(vals) > 1 and vals[1] not in (None, "") else None
        consistency = str(vals[2]) if len(vals) > 2 else DEFAULT_CONSISTENCY
        result = changes(as_catalog(table), since, consistency=consistency).table
        import pyarrow.dataset as pads

        return Table(pads.dataset(result))

    ctx.register_udtf(udtf(sql_changes, "changes"))
