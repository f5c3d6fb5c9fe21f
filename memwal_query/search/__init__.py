"""Indexed reads of a MemWAL table: point lookup, vector search, full-text search.

Every search reads the sources a scan reads (base table, the flushed generations of each
region, the MemTables of the writers handed in) from the same pinned view, and answers
as the scan would: the newest live version of each key, never a superseded or deleted
row. :func:`lookup` returns rows by primary key, :func:`vector_search` the ``k`` nearest
rows by exact distance, :func:`fts_search` the ``k`` best rows by BM25 over global
statistics; :func:`register_search_functions` registers them as DataFusion table
functions. Pass ``debug={}`` to a search for its plan and per-source counters. How the
sources are combined (staleness, over-fetch, global BM25, the indexed read plan):
``docs/search.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memwal_query.search.common import BLOOM_FILE, DISTANCE, ROWID, SCORE

if TYPE_CHECKING:
    from memwal_query.search.caches import clear_caches
    from memwal_query.search.fulltext import fts_search
    from memwal_query.search.plan import SearchPlan, resolve_search
    from memwal_query.search.pointlookup import lookup
    from memwal_query.search.sqlfunctions import register_search_functions
    from memwal_query.search.vector import vector_search

# Loaded on first use: opening a table (which needs the constants of search.common)
# loads no search module, so a process that only scans (a Spark reader) imports none.
_LAZY = {
    "clear_caches": "caches",
    "fts_search": "fulltext",
    "SearchPlan": "plan",
    "resolve_search": "plan",
    "lookup": "pointlookup",
    "register_search_functions": "sqlfunctions",
    "vector_search": "vector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memwal_query.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memwal_query.search.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BLOOM_FILE",
    "DISTANCE",
    "ROWID",
    "SCORE",
    "SearchPlan",
    "clear_caches",
    "fts_search",
    "lookup",
    "register_search_functions",
    "resolve_search",
    "vector_search",
]
