"""What a process that reads memwal_query tables holds in memory, by holder.

:func:`memory_usage` reports the process-wide caches of memwal_query (each bounded; see
:mod:`memwal_query.storage.cache`), the Arrow memory pool, and, for a table, the bytes
of its base dataset's Lance caches (bounded per table, see
:mod:`memwal_query.format.lancecache`). ``benchmarks/scale.py``'s streaming section prints
these per minute next to the process's resident set size, so a long run shows which
holder (if any) keeps growing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from memwal_query.catalog import as_catalog
from memwal_query.read import newer, provider, sources, waltail  # noqa: F401 (their caches)
from memwal_query.search import caches
from memwal_query.storage.cache import cache_size_bytes, cached_bytes, named_caches

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog, HasCatalog


def memory_usage(table: Catalog | HasCatalog | None = None) -> dict[str, int]:
    """Bytes and entry counts held by memwal_query's caches in this process.

    Parameters
    ----------
    table : Catalog or MemWalTable, optional
        Also report this table's Lance caches.

    Returns
    -------
    dict
        ``arrow_pool_bytes`` (Arrow's default memory pool: decoded columns, MemTable
        batches, query results still referenced), ``generation_columns_bytes`` and
        ``generation_columns_entries`` (decoded columns of flushed generations),
        ``open_generations`` (opened generation handles: a Lance dataset, its bloom
        filter and key index each), ``generation_token_indexes``,
        ``memtable_token_indexes``, ``memtable_key_indexes``, ``index_stats_entries``
        and ``generation_blocks``; ``NAME_bytes`` of every cache bounded by bytes
        (decoded WAL entries and tails, views of generations and MemTables, key flags,
        overwritten base rows), ``caches_bytes``, their sum, ``caches_limit_bytes``, the
        budget they share (:func:`memwal_query.set_cache_size_bytes`), and
        ``cache_budget_evictions``, the entries evicted to keep it; with ``table``,
        ``lance_cache_bytes`` (its base dataset's Lance index and metadata caches) and
        ``lance_cache_limit_bytes`` (their bound).
    """
    out = {
        "arrow_pool_bytes": int(pa.total_allocated_bytes()),
        "generation_columns_bytes": sources.GENERATION_CACHE.nbytes,
        "generation_columns_entries": len(sources.GENERATION_CACHE),
        **caches.cache_entries(),
    }
    named = named_caches()
    for name, cache in named.items():
        if cache.max_bytes is not None:
            out[f"{name}_bytes"] = cache.nbytes
    out["caches_bytes"] = cached_bytes()
    out["caches_limit_bytes"] = cache_size_bytes()
    out["cache_budget_evictions"] = sum(c.budget_evictions for c in named.values())
    if table is not None:
        from memwal_query.format.lancecache import cache_bounds

        out["lance_cache_bytes"] = int(as_catalog(table).dataset().session().size_bytes())
        out["lance_cache_limit_bytes"] = sum(cache_bounds())
    return out
