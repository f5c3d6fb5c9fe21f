"""The one in-process cache of memwal_query: a thread-safe, bounded LRU map.

Everything memwal_query keeps in memory between queries (decoded generation columns,
deduplicated views of flushed generations and MemTables, generation index metadata,
bloom filters, index statistics) is an :class:`LRUCache`, bounded by a number of entries
and optionally by bytes, so memory stays bounded however many generations a long-running
process reads. Entries are only ever things that cannot change under their key
(immutable generations, a base version, a MemTable snapshot identified by its batches).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """Least-recently-used map bounded by ``max_items`` and, with ``sizeof``, by
    ``max_bytes`` (the most recent entry is always kept, even when larger).

    Parameters
    ----------
    max_items : int
        Most entries kept.
    max_bytes : int, optional
        Most bytes kept, as measured by ``sizeof(value)`` when an entry is stored.
    sizeof : callable, optional
        Size of a value in bytes (required with ``max_bytes``).
    """

    def __init__(
        self,
        max_items: int,
        max_bytes: int | None = None,
        sizeof: Callable[[V], int] | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if max_bytes is not None and sizeof is None:
            raise ValueError("max_bytes needs sizeof")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._items: OrderedDict[K, V] = OrderedDict()
        self._sizes: dict[K, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` (now the most recent entry), or ``default``."""
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` as the most recent entry; evict the oldest entries
        beyond the bounds. Returns ``value``."""
        with self._lock:
            self._bytes -= self._sizes.pop(key, 0)
            self._items[key] = value
            self._items.move_to_end(key)
            if self._sizeof is not None:
                size = self._sizeof(value)
                self._sizes[key] = size
                self._bytes += size
            while len(self._items) > 1 and (
                len(self._items) > self.max_items
                or (self.max_bytes is not None and self._bytes > self.max_bytes)
            ):
                old, _ = self._items.popitem(last=False)
                self._bytes -= self._sizes.pop(old, 0)
            return value

    def pop(self, key: K) -> V | None:
        """Remove ``key``; return its value (None when absent)."""
        with self._lock:
            self._bytes -= self._sizes.pop(key, 0)
            return self._items.pop(key, None)

    def discard_where(self, gone: Callable[[K], bool]) -> int:
        """Remove every entry whose key ``gone(key)`` holds; how many were removed."""
        with self._lock:
            keys = [k for k in self._items if gone(k)]
            for k in keys:
                self._bytes -= self._sizes.pop(k, 0)
                del self._items[k]
            return len(keys)

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._items.clear()
            self._sizes.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (0 without ``sizeof``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def items(self) -> list[tuple[K, V]]:
        """The entries, oldest first (a copy: not marked as used)."""
        with self._lock:
            return list(self._items.items())
