"""The process-wide caches of the searches, each named for what it holds.

Every cache is a :class:`~memwal_query.storage.cache.LRUCache` bounded by entries, keyed
by things that cannot change under the key (a generation directory, a base version, a
MemTable's region and generation). :func:`clear_caches` empties them all;
:func:`cache_entries` counts their entries (:func:`memwal_query.search.memory.memory_usage`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from memwal_query.storage.cache import LRUCache

if TYPE_CHECKING:
    from memwal_query.format.postings import Postings
    from memwal_query.search.fulltext import _IndexFtsStats
    from memwal_query.search.genblock import GenBlock
    from memwal_query.search.generations import _GenInfo
    from memwal_query.search.memkeys import _MemKeyIndex
    from memwal_query.search.textindex import _TokenIndex

V = TypeVar("V")

GENERATION_CACHE_SIZE = 256
MEMTABLE_CACHE_SIZE = 64


class MemTableCache(LRUCache[tuple[Any, ...], V]):
    """An :class:`LRUCache` of per-MemTable entries keyed ``(table uri, region id,
    generation, ...)``."""

    def put_newest(self, key: tuple[Any, ...], value: V, keep: int = 2) -> V:
        """:meth:`put`, and drop the entries of that region's MemTables older than the
        ``keep`` newest generations: a MemTable older than the one being written and the
        one being flushed has become a flushed generation, read through that
        generation's own caches, so its entry would never be read again."""
        uri, region, generation = key[0], key[1], key[2]
        self.discard_where(lambda k: k[0] == uri and k[1] == region and k[2] <= generation - keep)
        return self.put(key, value)


OPEN_GENERATIONS: LRUCache[str, _GenInfo] = LRUCache(GENERATION_CACHE_SIZE, name="open_generations")
"""Opened flushed generations (Lance dataset, bloom filter, key index), by directory."""
GENERATION_TOKEN_INDEXES: LRUCache[tuple[str, str, str], Postings] = LRUCache(
    4 * GENERATION_CACHE_SIZE, name="generation_token_indexes"
)
"""Token postings of a generation's text column, by (directory, column, tokenizer)."""
MEMTABLE_TOKEN_INDEXES: MemTableCache[_TokenIndex] = MemTableCache(
    MEMTABLE_CACHE_SIZE, name="memtable_token_indexes"
)
"""Growing token indexes of MemTables, by (table, region, generation, column, tokenizer)."""
MEMTABLE_KEY_INDEXES: MemTableCache[_MemKeyIndex] = MemTableCache(
    MEMTABLE_CACHE_SIZE, name="memtable_key_indexes"
)
"""Growing primary-key indexes of MemTables, by (table, region, generation, ...)."""
BASE_FTS_STATS: LRUCache[tuple[str, int, str], _IndexFtsStats] = LRUCache(1024)
"""Document and token counts of a base INVERTED index, by (base URI, version, index)."""
GENERATION_BLOCKS: LRUCache[Hashable, GenBlock] = LRUCache(4, name="generation_blocks")
"""Many generations read as one deduplicated block (:mod:`memwal_query.search.genblock`)."""

_ALL: dict[str, LRUCache[Any, Any]] = {
    "open_generations": OPEN_GENERATIONS,
    "generation_token_indexes": GENERATION_TOKEN_INDEXES,
    "memtable_token_indexes": MEMTABLE_TOKEN_INDEXES,
    "memtable_key_indexes": MEMTABLE_KEY_INDEXES,
    "index_stats_entries": BASE_FTS_STATS,
    "generation_blocks": GENERATION_BLOCKS,
}


def cache_entries() -> dict[str, int]:
    """Entry count of every search cache, by name."""
    return {name: len(cache) for name, cache in _ALL.items()}


def clear_caches() -> None:
    """Forget cached key indexes (generations, MemTables), token indexes, BM25 stats and
    generation blocks."""
    for cache in _ALL.values():
        cache.clear()
