"""Giving the C heap's free pages back to the operating system.

The Lance and DataFusion extensions and numpy allocate through the C library's
``malloc``. glibc keeps what a process frees for reuse, and under a reader that follows
a stream (every query decodes new generations and WAL entries, every merge a new base
version) the free-but-kept part grows to as much as the part in use: 0.4-0.8 GB of a
10,000,000-row reader's resident memory (``benchmarks/scale_stream.py``). Two things
bound it in every process that reads, with nothing for the user to configure:

- from a process's second read on (:func:`note_read`, once per view resolved), or on
  the first cache store of a process that resolves no view (a Spark executor, a
  maintainer), the read path fixes glibc's trim and mmap thresholds
  (:data:`READ_TRIM_THRESHOLD_BYTES`, :data:`MMAP_THRESHOLD_BYTES`). glibc trims the
  top of its per-thread arenas only when a free leaves more than the trim threshold
  there, a threshold it raises (up to 64 MiB per arena) each time a large block is
  freed, and ``malloc_trim`` never trims those tops: a reader whose queries run on
  many worker threads keeps up to 64 MiB per arena. Fixed, each keeps at most the
  threshold. A process's first read runs with glibc's own rule, which maps large
  buffers apart until their frees raise the threshold: fixed from the start, the first
  full read of a 10,000,000-row table peaked 60-120 MB higher (its buffers kept in the
  arenas), and a one-off query gains nothing from the fixed thresholds.
  ``GLIBC_TUNABLES``, ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the
  environment leave glibc's settings alone;
- :func:`release_free_heap` returns the free pages inside the heaps
  (``malloc_trim``); it is called after the read path's caches store an entry, at most
  once per :data:`RELEASE_EVERY_SECONDS`.

Elsewhere (another C library) both do nothing.

A process that runs a heavy step now and then (the maintainer: a pass merges, compacts
and extends indexes, then sleeps until the next) calls :func:`release_unused_memory`
after each step: the free pages of the C heap and of Arrow's memory pool go back to the
system, so its resident memory between steps is what it holds, not the largest step's
high-water mark. Arrow's default pool (mimalloc) keeps freed pages of its worker
threads; a process that is a long-running maintainer and nothing else (``memwal
maintain --watch``) calls :func:`bound_process_heap` once first: a lower trim threshold
(:data:`TRIM_THRESHOLD_BYTES`, which would cost a reader's queries CPU) and Arrow's
system pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from typing import Any

RELEASE_EVERY_SECONDS = 5.0
"""Least seconds between two :func:`release_free_heap` calls that trim (a trim walks the
heap's free chunks: a few milliseconds for a gigabyte)."""

TRIM_THRESHOLD_BYTES = 1 << 20
"""glibc's ``M_TRIM_THRESHOLD`` set by :func:`bound_process_heap`: a free that leaves more
than this at the top of a heap gives it back at once (fixed: not raised by large frees)."""
READ_TRIM_THRESHOLD_BYTES = 16 << 20
"""glibc's ``M_TRIM_THRESHOLD`` the read path fixes in every process from its second read
on (:func:`note_read`; in a process that resolves no view, on its first cache store),
unless the environment or :func:`bound_process_heap` chose:
large enough that a query's buffers, freed and allocated again by the next query, are
not given back and faulted in again (8 MiB cost a 10,000,000-row reader 3-20% more
CPU per query, 1 MiB a fifth more on a 2,000,000-row one), small enough that a heap
keeps at most this much at its top instead of up to 64 MiB."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ``M_MMAP_THRESHOLD`` set by :func:`bound_process_heap`: the largest value glibc
raises it to by itself, so large buffers are reused from the heap as by default."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The environment variables that set what bound_process_heap would: when any is set, the
# user chose, and that part is left alone.
_GLIBC_ENV = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
_ARROW_ENV = "ARROW_DEFAULT_MEMORY_POOL"

_LOCK = threading.Lock()
_last = [float("-inf")]
_trim: list[Any] = []  # [malloc_trim or None], resolved on first use
_thresholds: list[str] = []  # who fixed glibc's thresholds in this process, once done
_reads = [0]  # views resolved in this process, counted until the thresholds are fixed


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


def _fix_thresholds(trim_bytes: int, who: str) -> bool:
    """Fix glibc's ``M_TRIM_THRESHOLD`` at ``trim_bytes`` and ``M_MMAP_THRESHOLD`` at
    :data:`MMAP_THRESHOLD_BYTES` (ending glibc's raising of both after large frees),
    unless the environment sets them; remembers ``who`` did. Returns whether set."""
    with _LOCK:
        if _thresholds and who == "read path":
            return False  # a caller chose already
        if any(k in os.environ for k in _GLIBC_ENV):
            _thresholds[:] = ["environment"]
            return False
        _thresholds[:] = [who]
        if _malloc_trim() is None:
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is None:
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        return bool(
            mallopt(_M_TRIM_THRESHOLD, trim_bytes)
            and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        )


def heap_thresholds() -> str | None:
    """Who chose glibc's trim and mmap thresholds in this process.

    Returns
    -------
    str or None
        ``"read path"`` (the default, :data:`READ_TRIM_THRESHOLD_BYTES`, fixed from the
        second read on, :func:`note_read`, or on the first cache store of a process that
        resolves no view), ``"bound_process_heap"`` (:data:`TRIM_THRESHOLD_BYTES`),
        ``"environment"`` (``GLIBC_TUNABLES``, ``MALLOC_TRIM_THRESHOLD_`` or
        ``MALLOC_MMAP_THRESHOLD_`` is set: left alone), or None (nothing read yet).
    """
    return _thresholds[0] if _thresholds else None


def note_read() -> None:
    """Count a read of this process (the read path calls it once per view resolved): from
    the second on, glibc's thresholds are fixed for the read path (see the module docs),
    unless :func:`bound_process_heap` or the environment chose them. The first read runs
    with glibc's own rule."""
    if _thresholds:
        return
    _reads[0] += 1
    if _reads[0] >= 2:
        _fix_thresholds(READ_TRIM_THRESHOLD_BYTES, "read path")


def release_free_heap(force: bool = False) -> bool:
    """Return the C heap's free pages to the operating system (glibc's ``malloc_trim``);
    in a process that has resolved no view yet, the first call also fixes glibc's
    thresholds for the read path (see the module docs) unless :func:`bound_process_heap`
    or the environment chose them (a process that has resolved one runs with glibc's
    own rule until its second: :func:`note_read`).

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
    if not _thresholds and _reads[0] != 1:
        _fix_thresholds(READ_TRIM_THRESHOLD_BYTES, "read path")
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


def bound_process_heap() -> list[str]:
    """Make this process's allocators give freed memory back (for a process that runs
    heavy steps for hours, e.g. ``memwal maintain --watch``; call once, first).

    - glibc: fixed ``M_TRIM_THRESHOLD`` (:data:`TRIM_THRESHOLD_BYTES`) and
      ``M_MMAP_THRESHOLD`` (:data:`MMAP_THRESHOLD_BYTES`), unless ``GLIBC_TUNABLES``,
      ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` set them;
    - Arrow: its default memory pool becomes the system allocator (whose free pages
      :func:`release_unused_memory` returns), unless ``ARROW_DEFAULT_MEMORY_POOL`` names
      one.

    Returns
    -------
    list of str
        What was set (empty where the C library is not glibc and Arrow's pool was
        chosen by the environment).
    """
    import pyarrow as pa

    done: list[str] = []
    if _fix_thresholds(TRIM_THRESHOLD_BYTES, "bound_process_heap"):
        done.append("malloc thresholds")
    if _ARROW_ENV not in os.environ:
        pa.set_memory_pool(pa.system_memory_pool())
        done.append("arrow system pool")
    return done
