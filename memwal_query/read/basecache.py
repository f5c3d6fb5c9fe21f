"""Decoded rows of the base fragments written while a process reads the table.

Before a merge, a reader holds the newest rows of the flushed generations decoded in
its cache; the merge moves those rows into the base, as a new fragment. Without this
cache a reader kept open across the merge decodes that fragment again on every full
read, where it took the same rows from memory before. A fragment written after the
first version the process read of the table (by a merge, an append or a compaction),
with no deletion file when first read, and read whole by an unfiltered scan of every
column, is kept decoded (every physical row with its row address) in the process-wide
cache budget, at most a quarter of it in all (:data:`FRAGMENTS`). Later scans,
unfiltered or with a filter that cannot fail on a value
(:func:`memwal_query.read.deletions.total_filter`), take its rows from there, filtered
as the newer rows are (a filter pyarrow cannot evaluate on them leaves the fragment to
Lance's scan). A deletion file it gets later is applied by the reader
(:func:`memwal_query.read.deletions.deleted_flags`). Keyed by the fragment's data files
(:func:`memwal_query.read.deletions.signature`: immutable) and the table schema's names
and types, so a column added, renamed or retyped is a miss. Bases with stable row ids
are never cached (their row ids are not the addresses). Rationale and figures:
``docs/architecture.md``, "The DataFusion provider".
"""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

from memwal_query.read import deletions
from memwal_query.storage.cache import LRUCache, cache_size_bytes

BUDGET_SHARE = 4
"""The cached fragments hold at most ``1 / BUDGET_SHARE`` of
:func:`memwal_query.storage.cache.cache_size_bytes`."""

MAX_NEW_FRAGMENTS = 8
"""A scan meeting more new fragments than this (a compaction's output, a long history of
appends) caches none of them: they would push each other out."""

FRAGMENTS: LRUCache[tuple[Any, ...], pa.Table] = LRUCache(
    1024,
    max_bytes=1 << 62,
    sizeof=lambda table: table.nbytes,
    name="base_fragments",
    keep_newest=False,
)
"""Decoded base fragments, per (table URI, fragment signature, schema)."""

_IDS: LRUCache[str, set[int]] = LRUCache(1024)
"""Per table URI: the ids of the fragments ever cached (a lookup of any other is a miss
without computing its key)."""

_IDS_LOCK = threading.Lock()

_FIRST: LRUCache[str, int] = LRUCache(1024)
"""Per table URI: the first fragment id not in the first base version the process read."""


def note_first(table: str, base: Any) -> None:
    """Remember, on the process's first read of ``table``, which fragments its base
    version ``base`` (a Lance dataset) already had."""
    if _FIRST.get(table) is None:
        ids = [f.fragment_id for f in base.get_fragments()]
        _FIRST.put(table, max(ids, default=-1) + 1)


def _key(table: str, fragment: Any, schema: pa.Schema) -> tuple[Any, ...]:
    return (
        table,
        deletions.signature(fragment),
        tuple((f.name, str(f.type)) for f in schema),
    )


def usable(base: Any) -> bool:
    """Whether scans of ``base`` (a Lance dataset) may use the cache at all."""
    return not base.has_stable_row_ids


def cached_ids(table: str) -> frozenset[int]:
    """The ids of the fragments of ``table`` that may be cached (none: no lookup needed),
    once the cache holds at most its share of the budget (which may be lower now)."""
    with _IDS_LOCK:
        ids = _IDS.get(table)
        found = frozenset(ids) if ids else frozenset()
    if found:
        FRAGMENTS.shrink_to(cache_size_bytes() // BUDGET_SHARE)
    return found


def cached(table: str, fragment: Any, schema: pa.Schema) -> pa.Table | None:
    """The cached physical rows of ``fragment`` (all columns of ``schema`` and
    ``_rowaddr``), or None."""
    return FRAGMENTS.get(_key(table, fragment, schema))


def new_fragments(table: str, fragments: list[Any]) -> list[Any]:
    """Those of ``fragments`` written after the first base version the process read of
    ``table``, without a deletion file, or none when they are more than
    :data:`MAX_NEW_FRAGMENTS`."""
    first = _FIRST.get(table)
    if first is None:
        return []
    found = [f for f in fragments if f.fragment_id >= first and not f.num_deletions]
    return found if len(found) <= MAX_NEW_FRAGMENTS else []


def keep(table: str, fragment: Any, schema: pa.Schema, rows: pa.Table) -> pa.Table:
    """Cache ``rows``, the physical rows of ``fragment`` as read (every column of
    ``schema``, then ``_rowaddr``), unless larger than the cache's share of the
    budget. Returns ``rows``."""
    limit = cache_size_bytes() // BUDGET_SHARE
    FRAGMENTS.shrink_to(limit)
    if rows.nbytes <= limit:
        with _IDS_LOCK:
            ids = _IDS.get(table)
            if ids is None:
                ids = _IDS.put(table, set())
            ids.add(fragment.fragment_id)
        FRAGMENTS.put(_key(table, fragment, schema), rows)
    return rows


def live(table: str, fragment: Any, rows: pa.Table, read: Any) -> pa.Table | None:
    """``rows`` (a fragment's cached physical rows) without those its deletion file
    deletes, or None when that file cannot be read or decoded (the fragment is then
    scanned)."""
    if not fragment.num_deletions:
        return rows
    flags = deletions.deleted_flags(table, fragment, read)
    if flags is None:
        return None
    return rows.filter(pa.array(~flags))
