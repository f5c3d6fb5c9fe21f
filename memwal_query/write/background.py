"""Background work of writers on daemon threads of their own, and its bound at exit.

A writer flushes sealed MemTables in the background (:class:`DaemonRunner`). Its threads
are daemon threads, unlike a ``ThreadPoolExecutor``'s, which ``concurrent.futures`` joins
at interpreter exit with no bound: a flush blocked in storage that stopped answering
would hang the interpreter's exit forever. Exit is bounded instead by the exit hook
(:func:`memwal_query.write.routing._flush_at_exit`), which waits for the writers' work
up to :func:`exit_flush_timeout` seconds and then lets the interpreter exit. Giving up is
safe: every acknowledged row is already durable in its region's WAL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable

EXIT_FLUSH_TIMEOUT = 30.0
"""Seconds the interpreter's exit waits for writers' flushes (see :func:`exit_flush_timeout`)."""

EXIT_FLUSH_TIMEOUT_ENV = "MEMWAL_EXIT_FLUSH_TIMEOUT"


def exit_flush_timeout() -> float:
    """Seconds the exit flush may take: ``MEMWAL_EXIT_FLUSH_TIMEOUT`` when set to a
    number >= 0, else :data:`EXIT_FLUSH_TIMEOUT`."""
    raw = os.environ.get(EXIT_FLUSH_TIMEOUT_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            return EXIT_FLUSH_TIMEOUT
        if value >= 0:
            return value
    return EXIT_FLUSH_TIMEOUT


_RUNNERS: weakref.WeakSet[DaemonRunner] = weakref.WeakSet()


class DaemonRunner:
    """Runs submitted calls one after another, in submission order, each on a daemon
    thread (what a ``ThreadPoolExecutor(1)`` does, minus the join at interpreter exit).

    Parameters
    ----------
    name : str
        Name of the threads.
    label : str
        What the work is for (a region id), named by :func:`wait_for_runners`.
    """

    def __init__(self, name: str, label: str) -> None:
        self.name = name
        self.label = label
        self._lock = threading.Lock()
        self._last: threading.Thread | None = None
        self._shut = False
        _RUNNERS.add(self)
        _hook_exit()

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` after the calls submitted before it.

        Raises
        ------
        RuntimeError
            After :meth:`shutdown`.
        """
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self.name}: cannot schedule work after shutdown")
            t = threading.Thread(
                target=_run_after, args=(self._last, fn), name=self.name, daemon=True
            )
            t.start()
            self._last = t  # started: wait() may join it

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work; with ``wait``, return once the submitted calls finished."""
        with self._lock:
            self._shut = True
            last = self._last
        if wait and last is not None and last is not threading.current_thread():
            last.join()

    def wait(self, timeout: float) -> bool:
        """Whether the submitted calls finished within ``timeout`` seconds."""
        last = self._last
        if last is None or last is threading.current_thread():
            return True
        last.join(max(timeout, 0.0))
        return not last.is_alive()


def _run_after(previous: threading.Thread | None, fn: Callable[[], object]) -> None:
    if previous is not None:
        previous.join()
    fn()


log = logging.getLogger(__name__)
_hook_lock = threading.Lock()
_hooked = False
_deadline: float | None = None
_warned: set[str] = set()


def exit_deadline() -> float:
    """The ``time.monotonic()`` by which the exit's flushes stop being waited for:
    :func:`exit_flush_timeout` seconds after the first exit hook asked."""
    global _deadline
    with _hook_lock:
        if _deadline is None:
            _deadline = time.monotonic() + exit_flush_timeout()
        return _deadline


def _hook_exit() -> None:
    """Have :func:`_wait_at_exit` run when the interpreter exits (registered once, as
    a *threading* exit hook: those run before the interpreter joins its threads)."""
    global _hooked
    with _hook_lock:
        if _hooked:
            return
        _hooked = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks")
        register(_wait_at_exit)
    except RuntimeError:  # exiting already, or no such hooks
        import atexit

        atexit.register(_wait_at_exit)


def _wait_at_exit() -> None:
    """Let the writers' background flushes finish, until :func:`exit_deadline`."""
    warn_unflushed(wait_for_runners(exit_deadline()))


def warn_unflushed(regions: Iterable[str]) -> None:
    """Log, once per region, that ``regions`` were left unflushed at exit."""
    with _hook_lock:
        new = sorted(set(regions) - _warned)
        _warned.update(new)
    if new:
        log.warning(
            "memwal: writers not flushed at exit within %s s (%s); regions left "
            "unflushed: %s. Their acknowledged rows are durable in the WAL: readers see "
            "them, and the region's next writer, or maintain after abandoned_after, "
            "flushes them",
            exit_flush_timeout(),
            EXIT_FLUSH_TIMEOUT_ENV,
            ", ".join(new),
        )


def wait_for_runners(deadline: float) -> list[str]:
    """Wait until every runner's submitted calls finished or ``deadline``
    (``time.monotonic()``) passed; the labels of the runners still busy."""
    busy = []
    for runner in list(_RUNNERS):
        if not runner.wait(deadline - time.monotonic()):
            busy.append(runner.label)
    return busy
