"""Several batch streams read at once, with bounded memory (the partitions of a scan
outside DataFusion: :meth:`memwal_query.read.provider.MemWalDataset.scanner`, which
DuckDB and Polars call, and ``to_table``).

DataFusion runs the partitions of a ``MemWalDataset`` on its own threads; a plain
pyarrow consumer iterates one stream. :func:`concurrent_streams` gives that consumer the
same concurrency: every stream is produced by its own thread (Lance's scans and pyarrow's
kernels release the GIL), at most ``depth`` items ahead of the consumer, and the items
come out stream by stream, in order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

_END = object()  # a stream is exhausted
_POLL_SECONDS = 0.05  # how often a blocked producer checks whether the consumer left


class _Failed:
    """What a producer hands over when its stream raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def concurrent_streams(
    streams: Sequence[Callable[[], Iterator[T]]], depth: int | None = 2
) -> Iterator[T]:
    """The items of every stream (``streams`` are called to start them), stream by
    stream in the order given, each produced by its own thread up to ``depth`` items
    ahead of the consumer (None: without bound, for a consumer that keeps every item
    anyway, such as one building a table: no stream then waits for the ones before
    it to be taken).

    An error of a stream is raised to the consumer when it reaches that stream (the
    items before it are returned first). When the consumer stops early (``LIMIT``, an
    error, a closed generator), the producers stop at their next item and close their
    streams (releasing what a stream holds: open files, a ``with`` block).
    """
    if len(streams) <= 1:
        for make in streams:
            yield from make()
        return
    stop = threading.Event()
    size = 0 if depth is None else max(1, depth)  # a Queue of maxsize 0 has no bound
    queues: list[queue.Queue[object]] = [queue.Queue(maxsize=size) for _ in streams]

    def hand_over(q: queue.Queue[object], item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce(make: Callable[[], Iterator[T]], q: queue.Queue[object]) -> None:
        it: Iterator[T] | None = None
        try:
            it = make()
            for item in it:
                if not hand_over(q, item):
                    return
            hand_over(q, _END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            hand_over(q, _Failed(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    threads = [
        threading.Thread(target=produce, args=(make, q), name="memwal-scan", daemon=True)
        for make, q in zip(streams, queues)
    ]
    for t in threads:
        t.start()
    try:
        for q in queues:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # type: ignore[misc]
    finally:
        stop.set()
