"""Giving the C heap's free pages back to the operating system.

The Lance and DataFusion extensions and numpy allocate through the C library's
``malloc``. glibc keeps what a process frees for reuse, and under a reader that follows
a stream (every query decodes new generations and WAL entries, every merge a new base
version) the free-but-kept part grows to as much as the part in use: 0.4-0.8 GB of a
10,000,000-row reader's resident memory (``benchmarks/scale_stream.py``). On glibc,
:func:`release_free_heap` returns those free pages (``malloc_trim``); it is called
after the read path's caches store an entry, at most once per
:data:`RELEASE_EVERY_SECONDS`. Elsewhere (another C library) it does nothing.

A process that runs a heavy step now and then (the maintainer: a pass merges, compacts
and extends indexes, then sleeps until the next) calls :func:`release_unused_memory`
after each step: the free pages of the C heap and of Arrow's memory pool go back to the
system, so its resident memory between steps is what it holds, not the largest step's
high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from typing import Any

RELEASE_EVERY_SECONDS = 5.0
"""Least seconds between two :func:`release_free_heap` calls that trim (a trim walks the
heap's free chunks: a few milliseconds for a gigabyte)."""

_LOCK = threading.Lock()
_last = [float("-inf")]
_trim: list[Any] = []  # [malloc_trim or None], resolved on first use


def _malloc_trim() -> Any:
    if not _trim:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _trim.append(fn)
    return _trim[0]


def release_free_heap(force: bool = False) -> bool:
    """Return the C heap's free pages to the operating system (glibc's ``malloc_trim``).

    Parameters
    ----------
    force : bool, default False
        Trim now; otherwise only when :data:`RELEASE_EVERY_SECONDS` have passed since
        the last trim.

    Returns
    -------
    bool
        Whether a trim ran (False also where the C library has no ``malloc_trim``).
    """
    now = time.monotonic()
    if not force and now - _last[0] < RELEASE_EVERY_SECONDS:
        return False
    fn = _malloc_trim()
    if fn is None:
        return False
    if not _LOCK.acquire(blocking=force):
        return False  # another thread is trimming
    try:
        _last[0] = now
        fn(0)
    finally:
        _LOCK.release()
    return True


def release_unused_memory() -> None:
    """Return the free pages of the C heap (:func:`release_free_heap`, forced) and of
    Arrow's default memory pool (``release_unused``) to the operating system.

    Takes milliseconds (a walk of the heap's free chunks); meant for the end of a heavy
    step, not for a hot path.
    """
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    release_free_heap(force=True)
