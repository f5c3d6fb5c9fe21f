"""Shared pieces of the searches: column names, tuning constants, the caches."""

from __future__ import annotations

import collections
import threading
from typing import Any

DISTANCE = "_distance"
ROWID = "_rowid"
SCORE = "_score"
K1 = 1.2
B = 0.75
BLOOM_FILE = "bloom_filter.bin"
_PROBE = "__memwal_probe"
_IDX = "__memwal_idx"
_SRC = "__memwal_src"
_GEN_CACHE_SIZE = 256
_MEM_FTS_CACHE_SIZE = 64
_PRUNE_MAX_KEYS = 64
_SMALL_MATCH = 64  # key pairs compared as Python values (see _match_keys)
_BASE_LOOKUP_CHUNK = 20_000
# Lookups of many keys scan the base's key columns instead (see _use_base_key_scan).
_BASE_KEY_SCAN_MIN_KEYS = 20_000
_BASE_KEY_SCAN_ROWS_PER_KEY = 50
_BASE_KEY_SCAN_MAX_ROWS = 32_000_000
_MAX_ROUNDS = 12
_BOUND_SLACK = 1e-5  # relative: float32 scores, and df recovered from a rounded score
_BOUND_MAX_FETCH = 256  # rows (or 16 k) a full-text source is re-asked for at most


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def put_newest(self, key: Any, value: Any, keep: int = 2) -> None:
        """:meth:`put` for an entry of one MemTable, keyed ``(table uri, region id,
        generation, ...)``: also drop the entries of that region's MemTables older than
        the ``keep`` newest generations. A MemTable older than the one being written and
        the one being flushed has become a flushed generation, read through that
        generation's own caches: its entry would never be read again, but would stay
        until the count bound evicts it (64 MemTables' token postings, ~550 MB under a
        stream of 3,000 rows/s)."""
        uri, region, generation = key[0], key[1], key[2]
        with self._lock:
            stale = [
                k
                for k in self._items
                if k[0] == uri and k[1] == region and k[2] <= generation - keep
            ]
            for k in stale:
                del self._items[k]
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def discard(self, key: Any) -> None:
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def discard_where(self, gone: Any) -> int:
        """Drop every entry whose key ``gone(key)`` holds; how many were dropped."""
        with self._lock:
            keys = [k for k in self._items if gone(k)]
            for k in keys:
                del self._items[k]
            return len(keys)


_GENERATIONS = _LRU(_GEN_CACHE_SIZE)
_MEM_FTS = _LRU(_MEM_FTS_CACHE_SIZE)
_INDEX_STATS = _LRU(1024)

_MEM_KEYS = _LRU(_MEM_FTS_CACHE_SIZE)
_GEN_TOKENS = _LRU(4 * _GEN_CACHE_SIZE)  # token indexes of generations, by directory
_BLOCKS = _LRU(4)  # generation blocks (see genblock)


def clear_caches() -> None:
    """Forget cached key indexes (generations, MemTables), token indexes and BM25 stats."""
    _GENERATIONS.clear()
    _MEM_FTS.clear()
    _MEM_KEYS.clear()
    _INDEX_STATS.clear()
    _GEN_TOKENS.clear()
    _BLOCKS.clear()
