"""Bounded Lance caches for the base tables memwal_query opens.

Every ``lance.dataset(...)`` opened without a session gets its own
:class:`lance.Session`, whose caches are bounded at 6 GiB (index) and 1 GiB (metadata).
A table that streams changes gets a new base version every few seconds: each merge,
compaction and index catch-up writes new data files and index segments, and Lance
caches the metadata and index pages of each new one under new keys. The old entries
are never read again, but they stay until those bounds evict them, so a reader that
follows the latest version grows for hours (``benchmarks/scale.py``'s streaming
section: the base table's session grew by ~15 MB a minute at 3,000 rows/s, and would
have gone on to 7 GiB).

memwal_query opens each table's base dataset with its own session bounded by
:data:`INDEX_CACHE_BYTES` and :data:`METADATA_CACHE_BYTES` (the environment variables
``MEMWAL_LANCE_INDEX_CACHE_MB`` / ``MEMWAL_LANCE_METADATA_CACHE_MB`` override them), and
every version of that table it checks out shares that session: the least recently used
entries (superseded versions' files and index segments) are evicted first. One session
per opened table, not one per process, so that a table opened again sees storage as it
is now (a rewritten or damaged file is read again, not served from another handle's
cache).
"""

from __future__ import annotations

import lance

from memwal_query.storage.cache import env_megabytes

INDEX_CACHE_BYTES = 256 << 20
"""Default bound of a table's index cache (IVF partitions, inverted lists, B-tree pages)."""
METADATA_CACHE_BYTES = 64 << 20
"""Default bound of a table's metadata cache (manifests, file footers, fragment metadata)."""


def cache_bounds() -> tuple[int, int]:
    """(index cache bytes, metadata cache bytes) of the sessions :func:`new_session` makes."""
    return (
        env_megabytes("MEMWAL_LANCE_INDEX_CACHE_MB", INDEX_CACHE_BYTES),
        env_megabytes("MEMWAL_LANCE_METADATA_CACHE_MB", METADATA_CACHE_BYTES),
    )


def new_session() -> lance.Session:
    """A Lance session with bounded caches (see the module docs)."""
    index_bytes, metadata_bytes = cache_bounds()
    return lance.Session(
        index_cache_size_bytes=index_bytes, metadata_cache_size_bytes=metadata_bytes
    )
