"""The one in-process cache of memwal_query: a thread-safe, bounded LRU map.

Everything memwal_query keeps in memory between queries (decoded generation columns,
deduplicated views of flushed generations and MemTables, generation index metadata,
bloom filters, index statistics) is an :class:`LRUCache`, bounded by a number of entries
and optionally by bytes, so memory stays bounded however many generations a long-running
process reads. Entries are only ever things that cannot change under their key
(immutable generations, a base version, a MemTable snapshot identified by its batches).

The caches registered with a ``name`` and measured in bytes (the read path's: decoded
generation columns and WAL entries, views of generations and MemTables, key flags,
overwritten base rows) also share one process-wide budget, :func:`cache_size_bytes`
(default :data:`CACHE_SIZE_BYTES`, 512 MiB; the environment variable ``MEMWAL_CACHE_MB``
or :func:`set_cache_size_bytes` change it): when their sum passes it, the least
recently used entry of all of them goes first, whichever cache holds it. Each cache's
own bound still caps that cache alone. A cache made with ``budget=False`` is bounded by
its own bounds only: the WAL tails (:data:`memwal_query.read.waltail.TAILS`), which
every read at the default consistency reads again and which the views built from them
would otherwise push out (each read then decoded every WAL entry again and rebuilt the
views and key indexes tied to the tails' batches). After storing an entry they give the C heap's
free pages back to the system (:func:`memwal_query.storage.heap.release_free_heap`).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from memwal_query.exceptions import MemWalError
from memwal_query.storage.heap import release_free_heap

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
    name : str, optional
        Register the cache under this name in :func:`named_caches` (what
        :func:`memwal_query.memory_usage` reports, by name).
    budget : bool, default True
        Whether a named cache measured in bytes counts towards (and is evicted to keep)
        :func:`cache_size_bytes`.
    keep_newest : bool, default True
        Whether the most recent entry is kept whatever the bounds (False: a cache whose
        entries only save work, which the budget may empty).
    """

    def __init__(
        self,
        max_items: int,
        max_bytes: int | None = None,
        sizeof: Callable[[V], int] | None = None,
        *,
        name: str | None = None,
        budget: bool = True,
        keep_newest: bool = True,
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
        self._ticks: dict[K, int] = {}  # when each entry was last used (process-wide)
        self._bytes = 0
        self.budget_evictions = 0  # entries evicted to keep cache_size_bytes()
        self._lock = threading.Lock()
        self.name = name
        self._budget = budget
        self._floor = 1 if keep_newest else 0  # entries never evicted
        if name is not None:
            _NAMED[name] = self

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` (now the most recent entry), or ``default``."""
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            self._ticks[key] = next(_TICKS)
            return self._items[key]

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` as the most recent entry; evict the oldest entries
        beyond the bounds. Returns ``value``."""
        with self._lock:
            self._bytes -= self._sizes.pop(key, 0)
            self._items[key] = value
            self._items.move_to_end(key)
            self._ticks[key] = next(_TICKS)
            if self._sizeof is not None:
                size = self._sizeof(value)
                self._sizes[key] = size
                self._bytes += size
            while len(self._items) > self._floor and (
                len(self._items) > self.max_items
                or (self.max_bytes is not None and self._bytes > self.max_bytes)
            ):
                self._evict_oldest_locked()
        if self.budgeted:
            _keep_budget()
            release_free_heap()  # what was evicted, and what the query freed
        return value

    def shrink_to(self, max_bytes: int) -> None:
        """Bound the cache to ``max_bytes`` from now on, evicting its least recently used
        entries beyond it (but the newest, with ``keep_newest``)."""
        with self._lock:
            self.max_bytes = max_bytes
            while len(self._items) > self._floor and self._bytes > max_bytes:
                self._evict_oldest_locked()

    @property
    def budgeted(self) -> bool:
        """Whether the cache counts towards :func:`cache_size_bytes` (named, by bytes)."""
        return self._budget and self.name is not None and self._sizeof is not None

    def _evict_oldest_locked(self) -> None:
        old, _ = self._items.popitem(last=False)
        self._bytes -= self._sizes.pop(old, 0)
        self._ticks.pop(old, None)

    def _oldest_tick(self) -> int | None:
        """When the least recently used entry was last used; None when the cache holds
        no entry it may evict (with ``keep_newest``, its newest is always kept)."""
        with self._lock:
            if len(self._items) <= self._floor:
                return None
            return self._ticks.get(next(iter(self._items)), 0)

    def _evict_oldest(self) -> None:
        with self._lock:
            if len(self._items) > self._floor:
                self._evict_oldest_locked()
                self.budget_evictions += 1

    def pop(self, key: K) -> V | None:
        """Remove ``key``; return its value (None when absent)."""
        with self._lock:
            self._bytes -= self._sizes.pop(key, 0)
            self._ticks.pop(key, None)
            return self._items.pop(key, None)

    def discard_where(self, gone: Callable[[K], bool]) -> int:
        """Remove every entry whose key ``gone(key)`` holds; how many were removed."""
        return self.keep_recent(gone, 0)

    def keep_recent(self, belongs: Callable[[K], bool], n: int) -> int:
        """Remove all but the ``n`` most recently used entries whose key ``belongs(key)``
        holds; how many were removed."""
        with self._lock:
            keys = [k for k in self._items if belongs(k)]  # least recently used first
            gone = keys[: max(0, len(keys) - n)]
            for k in gone:
                self._bytes -= self._sizes.pop(k, 0)
                self._ticks.pop(k, None)
                del self._items[k]
            return len(gone)

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._items.clear()
            self._sizes.clear()
            self._ticks.clear()
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


_TICKS = itertools.count(1)
_NAMED: dict[str, LRUCache[Any, Any]] = {}
_BUDGET_LOCK = threading.Lock()

CACHE_SIZE_BYTES = 512 << 20
"""Default of :func:`cache_size_bytes`: 512 MiB for the read path's caches of a process
(on top of each open table's Lance caches, see :mod:`memwal_query.format.lancecache`).
Under a stream most of what they would otherwise hold is superseded (views of
generation sets a merge replaced, WAL entries since flushed): a reader of a
10,000,000-row table under a 20,000 rows/s stream filled 0.55-0.72 GB without the
budget (``benchmarks/scale_stream.py``)."""
CACHE_SIZE_ENV = "MEMWAL_CACHE_MB"
_size_set: list[int] = []  # set_cache_size_bytes's value, when called


def cache_size_bytes() -> int:
    """Most bytes the process-wide caches of the read path hold together.

    Returns
    -------
    int
        The value of :func:`set_cache_size_bytes` when called, else ``MEMWAL_CACHE_MB``
        (MB) when set, else :data:`CACHE_SIZE_BYTES`.

    Raises
    ------
    MemWalError
        ``MEMWAL_CACHE_MB`` is not a positive number.
    """
    if _size_set:
        return _size_set[0]
    return env_megabytes(CACHE_SIZE_ENV, CACHE_SIZE_BYTES)


def env_megabytes(name: str, default: int) -> int:
    """Bytes from the environment variable ``name``, a positive finite number of MB
    (``default`` bytes when unset or empty; at least one byte).

    Raises
    ------
    MemWalError
        The variable is not a positive finite number.
    """
    value = os.environ.get(name)
    if not value:
        return default
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not (mb > 0 and math.isfinite(mb)):
        raise MemWalError(f"{name}={value!r}: expected a positive number of MB")
    return max(1, int(mb * (1 << 20)))


def set_cache_size_bytes(size_bytes: int | None) -> None:
    """Set the budget of the process-wide caches of the read path (evicting the least
    recently used entries now when they hold more).

    Parameters
    ----------
    size_bytes : int or None
        Most bytes; None goes back to ``MEMWAL_CACHE_MB`` or the default.

    Raises
    ------
    ValueError
        ``size_bytes`` is not a positive integer.
    """
    if size_bytes is not None and (
        isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 1
    ):
        raise ValueError(f"size_bytes must be a positive integer, got {size_bytes!r}")
    _size_set[:] = [] if size_bytes is None else [size_bytes]
    _keep_budget()


def cached_bytes() -> int:
    """Bytes held now by the caches under :func:`cache_size_bytes`."""
    return sum(c.nbytes for c in _NAMED.values() if c.budgeted)


def _keep_budget() -> None:
    """Evict the least recently used entries of the budgeted caches until they hold at
    most :func:`cache_size_bytes` (each keeps its newest entry). Takes one cache's lock
    at a time."""
    budget = cache_size_bytes()
    if cached_bytes() <= budget:
        return
    with _BUDGET_LOCK:
        while cached_bytes() > budget:
            oldest: tuple[int, LRUCache[Any, Any]] | None = None
            for cache in list(_NAMED.values()):
                if cache.budgeted:
                    tick = cache._oldest_tick()
                    if tick is not None and (oldest is None or tick < oldest[0]):
                        oldest = (tick, cache)
            if oldest is None:
                return
            oldest[1]._evict_oldest()


def named_caches() -> dict[str, LRUCache[Any, Any]]:
    """Every cache made with a ``name``, by name (the process-wide caches)."""
    return dict(_NAMED)
