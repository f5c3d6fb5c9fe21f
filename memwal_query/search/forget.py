"""Forgetting the cached state of generations merged into the base table.

Searches and lookups cache per generation directory: the opened generation
(:class:`memwal_query.search.generations._GenInfo`: a Lance dataset, its bloom filter and
key index), its token indexes and its decoded columns
(:data:`memwal_query.read.sources.GENERATION_CACHE`), its key index file as key-pinned
reads read it (:data:`memwal_query.read.pointview.KEY_INDEXES`); the generation blocks of the
searches and the newest rows' columns of unfiltered reads
(:data:`memwal_query.read.newer.NEWEST_COLUMNS`) cache per set of generations. Under a
stream, generations are flushed, merged and collected all the time; their entries would
stay until the caches' count bounds evicted them, and those bounds (256 generations,
1,024 token indexes) are far larger in bytes than a reader needs: a 10-minute stream of
1,000 rows/s grew a reader by ~100 MB a minute (``benchmarks/scale.py``'s streaming section).

:func:`forget_merged` drops the entries of every generation that the base version just
resolved has merged (``generation <= merged_generations[region]``), and every block holding
one of them: a view resolved from
now on never reads them. A query still running on an older view that needs one reads
it again from storage (it stays until GC removes it), so this changes no answer.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from memwal_query.read.newer import NEWEST_COLUMNS
from memwal_query.read.pointview import KEY_INDEXES
from memwal_query.read.sources import GENERATION_CACHE
from memwal_query.search.caches import (
    GENERATION_BLOCKS,
    GENERATION_TOKEN_INDEXES,
    OPEN_GENERATIONS,
)

_GEN_DIR = re.compile(r"/([^/]+)/[0-9a-f]{8}_gen_([1-9][0-9]*)/?$")
_applied: dict[str, tuple[tuple[str, int], ...]] = {}
_lock = threading.Lock()


def forget_merged(table_uri: str, merged: dict[str, int]) -> int:
    """Drop cached entries of the generations of ``table_uri`` that ``merged``
    (``{region_id: merged generation}``) covers; how many entries were dropped.

    Does nothing when ``merged`` is what the last call for this table applied.
    """
    state = tuple(sorted(merged.items()))
    gone = _merged_test(table_uri, merged)
    with _lock:
        if _applied.get(table_uri) == state:
            return 0
        _applied[table_uri] = state
    return (
        OPEN_GENERATIONS.discard_where(gone)
        + GENERATION_TOKEN_INDEXES.discard_where(lambda key: gone(key[0]))
        + GENERATION_CACHE.discard_where(gone)
        + NEWEST_COLUMNS.discard_where(lambda key: any(gone(uri) for uri in key[0]))
        + KEY_INDEXES.discard_where(gone)
        + forget_merged_blocks(table_uri, merged)
    )


def forget_merged_blocks(table_uri: str, merged: dict[str, int]) -> int:
    """Drop the cached search blocks holding a generation of ``table_uri`` that
    ``merged`` covers; how many were dropped.

    A block caches one set of generations; no view resolved after the merge reads that
    set again, and a block is the largest of the per-generation states, so the merging
    process drops them at once.
    """
    gone = _merged_test(table_uri, merged)

    def holds_gone(key: Any) -> bool:  # key: ((region rank, generation uri), ...), ...
        return any(gone(uri) for _, uri in key[0])

    return GENERATION_BLOCKS.discard_where(holds_gone)


def _merged_test(table_uri: str, merged: dict[str, int]) -> Callable[[str], bool]:
    """Whether a generation directory of ``table_uri`` is covered by ``merged``."""
    prefix = table_uri.rstrip("/") + "/_mem_wal/"

    def gone(uri: str) -> bool:
        if not uri.startswith(prefix):
            return False
        m = _GEN_DIR.search(uri)
        return m is not None and int(m.group(2)) <= merged.get(m.group(1), 0)

    return gone
