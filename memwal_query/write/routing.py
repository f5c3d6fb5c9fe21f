"""Routing rows to their regions' writers: what :meth:`MemWalTable.write` and
:meth:`MemWalTable.delete` do.

Rows are split by region value (:func:`split_by_region`), each region's part goes through
that region's writer (one per region, opened on first use and shared by every thread),
concurrently; a writer fenced by another writer of its region is claimed again and the
call retried (:meth:`RoutedWriters._retry_fenced`).

When the interpreter exits normally, the writers still open are flushed and closed
(:func:`_flush_at_exit`), so rows written by a script that never called ``close`` reach
a generation (they are durable and visible before that, in the WAL).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.catalog import one_region, region_id_for
from memwal_query.exceptions import (
    FencedError,
    JobEndedError,
    SpecChangedError,
    WriteIncompleteError,
    WriterClosedError,
)
from memwal_query.write.background import exit_deadline, wait_for_runners, warn_unflushed
from memwal_query.write.opening import WriterOpener, WriterOptions

if TYPE_CHECKING:
    from memwal_query.regions.spec import RegionSpec
    from memwal_query.write.writer import RegionWriter

DEFAULT_FENCE_RETRIES = 5
"""How many times a region is claimed again after its writer was fenced by another writer
of it (exponential backoff from 50 ms, at most 2 s): the default everywhere (Python
``fence_retries``, Spark ``option("fence_retries")``)."""

DEFAULT_BUFFER_ROWS = 200_000
"""Rows a bulk loader buffers per region before putting them as one durable WAL entry:
the default everywhere (``memwal ingest --buffer-rows``, Spark ``buffer_rows``)."""


@dataclasses.dataclass
class PartsWritten:
    """What :meth:`RoutedWriters.write_parts` wrote.

    Attributes
    ----------
    written : dict
        ``{region_id: rows written}``, every region in it durable.
    unwritten : list of pyarrow.Table
        Parts not written because their spec stopped being the current one (to route
        again by the new spec); empty when everything was written.
    spec_changed : SpecChangedError or None
        Why ``unwritten`` is not empty.
    """

    written: dict[str, int]
    unwritten: list[pa.Table] = dataclasses.field(default_factory=list)
    spec_changed: SpecChangedError | None = None


class RoutedWriters:
    """The writers of one table object, one per region, opened on first use.

    Parameters
    ----------
    opener : WriterOpener
        Claims a region of a spec and returns its writer (:class:`SpecChangedError`
        when that spec is no longer the current one).
    """

    def __init__(self, opener: WriterOpener) -> None:
        self.opener = opener
        self.catalog = opener.catalog
        self.options = WriterOptions()
        self.fence_retries = DEFAULT_FENCE_RETRIES
        self._writers: dict[str, RegionWriter] = {}
        # Guards opening writers: two threads routing rows to one region must share one
        # writer (a second claim would fence the first).
        self._writers_lock = threading.Lock()

    def write_parts(
        self,
        parts: list[tuple[dict[str, Any], pa.Table]],
        put: Callable[[RegionWriter, pa.Table], None],
        spec_id: int,
    ) -> PartsWritten:
        """Write each region's part (concurrently) with fencing retries (see
        :meth:`MemWalTable.write` for atomicity).

        ``parts`` were split by region spec ``spec_id``. When that spec stopped being
        the current one and every failed region failed for that reason, the result lists
        the parts not written (``unwritten``) instead of raising.

        Raises
        ------
        WriteIncompleteError
            Some regions were written, others failed (not all by a spec change).
        FencedError, SpecChangedError, MemWalError
            The error of the only failed region(s) when none was written.
        """
        jobs = [(region_id_for(spec_id, values), values, part) for values, part in parts]

        def one(job: tuple[str, dict[str, Any], pa.Table]) -> BaseException | None:
            try:
                self._put_region(*job, put, spec_id)
            except BaseException as e:  # noqa: BLE001 - collected per region
                return e
            return None

        outcomes = [one(jobs[0])] if len(jobs) == 1 else concurrently(one, jobs)
        written: dict[str, int] = {}
        errors: dict[str, BaseException] = {}
        for (region_id, _, part), error in zip(jobs, outcomes):
            if error is None:
                written[region_id] = written.get(region_id, 0) + part.num_rows
            else:
                errors[region_id] = error
        if errors:
            changed = [e for e in errors.values() if isinstance(e, SpecChangedError)]
            if len(changed) == len(errors):
                unwritten = [part for rid, _, part in jobs if rid in errors]
                return PartsWritten(written, unwritten, changed[0])
            if not written:
                raise next(iter(errors.values()))
            raise WriteIncompleteError(self.catalog.uri, written, errors)
        return PartsWritten(written)

    def route(
        self,
        rows: pa.Table,
        put: Callable[[RegionWriter, pa.Table], None],
        check: Callable[[RegionSpec], None],
    ) -> dict[str, int]:
        """Split ``rows`` by the current spec and ``put`` each region's part;
        ``{region_id: rows written}``.

        Rows whose region turned out to belong to an older spec (the spec changed
        meanwhile) are routed again by the new one (``check`` is run on it first), up
        to ``fence_retries`` times.

        Raises
        ------
        SpecChangedError
            The spec kept changing.
        WriteIncompleteError, FencedError, MemWalError
            See :meth:`write_parts`.
        """
        cat = self.catalog
        written: dict[str, int] = {}
        for attempt in range(self.fence_retries + 1):
            spec = cat.routing_spec()
            if attempt:
                check(spec)
            parts = split_by_region(spec, rows, cat.lance_schema)
            result = self.write_parts(parts, put, spec.spec_id)
            for region_id, n in result.written.items():
                written[region_id] = written.get(region_id, 0) + n
            if result.spec_changed is None:
                return written
            if attempt == self.fence_retries:
                raise result.spec_changed
            rows = pa.concat_tables(result.unwritten)
            cat.refresh_index()
        raise AssertionError("unreachable")

    def _put_region(
        self,
        region_id: str,
        values: dict[str, Any],
        part: pa.Table,
        put: Callable[[RegionWriter, pa.Table], None],
        spec_id: int,
    ) -> None:
        """``put`` ``part`` through the region's writer, claiming it again when fenced."""
        self._retry_fenced(region_id, values, spec_id, lambda w: put(w, part))

    def _retry_fenced(
        self,
        region_id: str,
        values: dict[str, Any],
        spec_id: int,
        call: Callable[[RegionWriter], Any],
    ) -> Any:
        """``call`` the region's routed writer; when another writer fenced it, drop it,
        claim the region again (after a backoff) and call again, ``fence_retries``
        times. A fenced call was never acknowledged, so calling again is safe."""
        import random
        import time

        for attempt in range(self.fence_retries + 1):
            w = self._routed_writer(region_id, values, spec_id)
            try:
                return call(w)
            except FencedError as e:
                self._drop_writer(region_id, w)
                if isinstance(e, JobEndedError) or attempt == self.fence_retries:
                    raise
            except WriterClosedError:
                # closed by another thread's drop after its fence: claim again
                self._drop_writer(region_id, w)
                if attempt == self.fence_retries:
                    raise
            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _drop_writer(self, region_id: str, w: RegionWriter) -> None:
        """Forget a fenced writer (its acknowledged rows are in the WAL; the next
        writer of the region replays them)."""
        with self._writers_lock:
            if self._writers.get(region_id) is w:
                del self._writers[region_id]
        try:
            w.close(flush=False)
        except Exception:  # noqa: BLE001 - fenced: nothing of ours left to save
            pass

    def _routed_writer(self, region_id: str, values: dict[str, Any], spec_id: int) -> RegionWriter:
        """The writer :meth:`write`/:meth:`delete` use for a region, opened on first
        use, once per region even when several threads ask at the same time."""
        w = self._writers.get(region_id)
        if w is not None:
            return w
        with self._writers_lock:
            w = self._writers.get(region_id)
            if w is None:
                w = self.opener.open(region_values=values, spec_id=spec_id, options=self.options)
                self._writers[region_id] = w
                _flush_at_exit_later(self)
            return w

    def writers(self) -> list[RegionWriter]:
        """The writers opened so far."""
        return list(self._writers.values())

    def flush(self) -> dict[str, int | None]:
        """Flush every writer opened by :meth:`write` (concurrently); ``{region_id: gen}``.

        A writer fenced by another writer of its region meanwhile is claimed again (as
        :meth:`write` does): its acknowledged rows are in the WAL, and the new claim
        replays and flushes them.
        """
        items = list(self._writers.items())
        gens = concurrently(lambda item: self._flush_routed(*item), items)
        return {rid: g for (rid, _), g in zip(items, gens)}

    def _flush_routed(self, region_id: str, w: RegionWriter) -> int | None:
        values = w.region_values or {}
        try:
            return self._retry_fenced(
                region_id, values, w.region_spec_id, lambda writer: writer.flush()
            )
        except SpecChangedError:
            # A region of an older spec, fenced by the spec change, which drains it:
            # its acknowledged rows are in its WAL, and from there in the base table.
            self._drop_writer(region_id, w)
            return None

    def close(self, flush: bool = True) -> None:
        """Close the writers opened by :meth:`write` (flushing them first by default)."""
        try:
            if flush:
                self.flush()
        finally:
            writers, self._writers = self._writers, {}
            for w in writers.values():
                try:
                    w.close(flush=False)
                except FencedError:
                    pass  # its acknowledged rows are in the WAL: the region's next writer has them


log = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[RoutedWriters] = weakref.WeakSet()
_exit_hook = threading.Lock()
_hooked = False


def _flush_at_exit_later(routed: RoutedWriters) -> None:
    """Have ``routed``'s writers flushed and closed when the interpreter exits.

    The hook is a *threading* exit hook: those run before the interpreter joins its
    threads, while new threads may still start (an ``atexit`` hook runs after that).
    """
    global _hooked
    _OPEN.add(routed)
    with _exit_hook:
        if _hooked:
            return
        import atexit

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading exit hooks")
            register(_flush_at_exit)
        except RuntimeError:
            atexit.register(_flush_at_exit)
        _hooked = True


def _flush_at_exit() -> None:
    """Flush and close every table's writers opened by ``MemWalTable.write``, and let
    the writers' background flushes finish, until
    :func:`~memwal_query.write.background.exit_deadline`.

    The work runs on daemon threads (this hook's, :func:`concurrently`'s and the
    writers' :class:`~memwal_query.write.background.DaemonRunner`), which the
    interpreter does not join: past the deadline one warning names the regions left
    unflushed, and the interpreter exits.
    Their rows stay durable in the WAL, as do those of a flush that failed (logged).
    """
    deadline = exit_deadline()
    tables = [(routed, routed.writers()) for routed in list(_OPEN)]
    closing = threading.Thread(target=_close_all, args=(tables,), name="memwal-exit-flush")
    closing.daemon = True
    closing.start()
    closing.join(max(deadline - time.monotonic(), 0.0))
    left = set(wait_for_runners(deadline))
    if closing.is_alive():
        left.update(w.region_id for _, writers in tables for w in writers if not w._closed)
        left.update(w.region_id for routed, _ in tables for w in routed.writers())
    warn_unflushed(left)


def _close_all(tables: list[tuple[RoutedWriters, list[RegionWriter]]]) -> None:
    for routed, _ in tables:
        try:
            routed.close(flush=True)
        except Exception as e:  # noqa: BLE001 - exiting: report, never raise
            log.warning("%s: writers not flushed at exit: %s", routed.catalog.uri, e)


def concurrently(fn: Callable[[Any], Any], items: Iterable[Any], max_workers: int = 8) -> list[Any]:
    """``[fn(x) for x in items]`` run in threads (flushes overlap their I/O and the
    GIL-free parts of Lance and numpy); every call finishes, then the first error is
    raised.

    The threads are daemon threads: a call blocked in storage at interpreter exit
    (the exit flush, :func:`_flush_at_exit`) does not hold the interpreter's exit.
    """
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    todo = iter(range(len(items)))
    taking = threading.Lock()

    def work() -> None:
        while True:
            with taking:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - raised by the caller below
                errors[i] = e

    threads = [
        threading.Thread(target=work, name="memwal-concurrently", daemon=True)
        for _ in range(min(max_workers, len(items)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def split_by_region(
    spec: RegionSpec, rows: pa.Table, lance_schema: Any
) -> list[tuple[dict[str, Any], pa.Table]]:
    """Split ``rows`` by region value: ``[(values, rows_of_that_region), ...]``."""
    from memwal_query.regions.spec import is_unsharded

    if rows.num_rows == 0:
        return []
    if is_unsharded(spec):
        return [(one_region(spec), rows)]
    values = pa.Table.from_batches([spec.evaluate(rows, lance_schema)])
    field_ids = values.column_names

    keyed = values.append_column("__row", pa.array(np.arange(rows.num_rows, dtype=np.int64)))
    # NULL region values form their own group, as they form their own region.
    groups = keyed.group_by(field_ids, use_threads=False).aggregate([("__row", "list")])
    out = []
    for i in range(groups.num_rows):
        region = {f: groups.column(f)[i].as_py() for f in field_ids}
        idx = groups.column("__row_list")[i].values
        out.append((region, rows.take(pc.cast(idx, pa.int64()))))
    return out
