"""Writer liveness: one heartbeat object per region, refreshed while its writer lives.

``{table}/_mem_wal/{region_id}/heartbeat.json`` holds JSON ``{"owner", "epoch",
"beat_at", "interval", "recovering", "closed"}``: who wrote it (host, pid, a random
token), the epoch of its writer's claim (the epoch it is about to claim for the first
beat), when (epoch seconds, the writer's clock), how often it is refreshed, whether a
maintainer wrote it to recover the region, and whether its writer was closed. A region
writer writes it before it claims the region, then every
:data:`DEFAULT_HEARTBEAT_INTERVAL` seconds from one background thread per process
(:class:`Heartbeats`), each refresh a compare-and-swap of its own previous beat (a writer
whose heartbeat was taken over stops refreshing it: it is about to be fenced), and marks
it ``closed`` when it is closed. The object sits beside the region's ``manifest/`` and ``wal/``
directories; readers and pylance's native MemWAL do not read it.

A maintainer recovers a region (claims it, replays and flushes its WAL, closes it) only
when its heartbeat is older than ``abandoned_after``, and only through
:func:`take_over`: a compare-and-swap of exactly the heartbeat it judged stale (``If-Match``
of its ETag on an object store; a lock on the region directory on a local file system).
A writer that refreshed its heartbeat in between makes the swap fail, so a writer whose
heartbeat is fresh is never fenced by a maintainer. A writer whose refresh stalled for
longer than ``abandoned_after`` (a stopped process) counts as gone; if it comes back it is
fenced as by any other writer (:class:`FencedError`; ``MemWalTable.write`` claims again).
Hosts' clocks must agree to well within ``abandoned_after``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, LocalFileIO, join

if TYPE_CHECKING:
    from memwal_query.write.writer import RegionWriter

log = logging.getLogger(__name__)

HEARTBEAT_NAME = "heartbeat.json"
DEFAULT_HEARTBEAT_INTERVAL = 10.0
"""Seconds between two refreshes of a writer's heartbeat."""


def heartbeat_path(table_uri: str, region_id: str) -> str:
    """``{table}/_mem_wal/{region_id}/heartbeat.json``."""
    return join(paths.region_dir(table_uri, region_id), HEARTBEAT_NAME)


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat (see the module docs)."""

    owner: str
    epoch: int
    beat_at: float
    interval: float
    recovering: bool = False
    closed: bool = False

    def age(self, now: float | None = None) -> float:
        """Seconds since the beat (never negative)."""
        return max(0.0, (time.time() if now is None else now) - self.beat_at)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat | None:
        """The heartbeat in ``data``; None when it cannot be read (counts as no beat)."""
        try:
            raw = json.loads(data)
            return cls(
                str(raw["owner"]),
                int(raw["epoch"]),
                float(raw["beat_at"]),
                float(raw["interval"]),
                bool(raw.get("recovering", False)),
                bool(raw.get("closed", False)),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Observed:
    """A heartbeat as read, with what :func:`take_over` compares against."""

    heartbeat: Heartbeat | None
    token: Any  # the ETag, the bytes read, or None when there was no object


def read(io: FileIO, table_uri: str, region_id: str) -> Observed:
    """The region's heartbeat (``heartbeat`` None when there is none or it is damaged)."""
    path = heartbeat_path(table_uri, region_id)
    versioned = getattr(io, "read_versioned", None)
    try:
        if versioned is not None:
            data, etag = versioned(path)
            token: Any = etag if etag is not None else data
        else:
            data = io.read(path)
            token = data
    except ObjectNotFoundError:
        return Observed(None, None)
    return Observed(Heartbeat.decode(data), token)


@contextlib.contextmanager
def _region_lock(io: FileIO, path: str) -> Iterator[None]:
    """On a local file system: an exclusive ``flock`` on the region directory, held by
    every heartbeat write, so a compare-and-swap is atomic between processes."""
    if not isinstance(io, LocalFileIO):
        yield
        return
    import fcntl

    directory = os.path.dirname(io._local(path))
    os.makedirs(directory, exist_ok=True)  # a new region's first beat precedes its claim
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def beat(io: FileIO, table_uri: str, region_id: str, heartbeat: Heartbeat) -> Observed:
    """Write ``heartbeat`` unconditionally (a writer's first beat, before its claim);
    returns it as observed, for the next :func:`swap`."""
    path = heartbeat_path(table_uri, region_id)
    data = heartbeat.encode()
    with _region_lock(io, path):
        io.write(path, data)
    if isinstance(io, LocalFileIO):
        return Observed(heartbeat, data)
    return read(io, table_uri, region_id)


def can_take_over(io: FileIO) -> bool:
    """Whether :func:`swap` is atomic on ``io`` (otherwise nothing is recovered)."""
    if isinstance(io, LocalFileIO):
        return True
    return bool(getattr(io, "conditional_put", False)) and hasattr(io, "put_if_match")


def swap(
    io: FileIO, table_uri: str, region_id: str, seen: Observed, heartbeat: Heartbeat
) -> Observed | None:
    """Replace the heartbeat ``seen`` by ``heartbeat``, only if it is still the one
    seen (or, when there was none, if there still is none); the new heartbeat as
    observed, or None when it had changed (nothing written)."""
    path = heartbeat_path(table_uri, region_id)
    data = heartbeat.encode()
    if seen.token is None:
        try:
            io.put_if_not_exists(path, data)
        except AlreadyExistsError:
            return None
        return (
            Observed(heartbeat, data)
            if isinstance(io, LocalFileIO)
            else read(io, table_uri, region_id)
        )
    if isinstance(io, LocalFileIO):
        with _region_lock(io, path):
            try:
                current = io.read(path)
            except ObjectNotFoundError:
                return None
            if current != seen.token:
                return None
            io.write(path, data)
        return Observed(heartbeat, data)
    from memwal_query.storage.options import ConcurrentModificationError

    if isinstance(seen.token, bytes):  # a store that returned no ETag
        return None
    try:
        etag = io.put_if_match(path, data, seen.token)  # type: ignore[attr-defined]
    except ConcurrentModificationError:
        return None
    return Observed(heartbeat, etag) if etag is not None else read(io, table_uri, region_id)


def take_over(
    io: FileIO, table_uri: str, region_id: str, seen: Observed, heartbeat: Heartbeat
) -> bool:
    """:func:`swap` for a maintainer: True when the heartbeat ``seen`` (judged stale)
    was replaced by ``heartbeat``; False when its writer refreshed it meanwhile."""
    return swap(io, table_uri, region_id, seen, heartbeat) is not None


class Heartbeats:
    """The process's heartbeat thread: refreshes the heartbeat of every live writer
    every ``interval`` seconds (writers are held weakly)."""

    def __init__(self) -> None:
        self._writers: weakref.WeakSet[RegionWriter] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.hook: Callable[[RegionWriter], None] | None = None
        """Called before each refresh (tests pause a refresh with it)."""

    def add(self, writer: RegionWriter) -> None:
        with self._lock:
            self._writers.add(writer)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="memwal-heartbeat", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's writers (their copies must not beat
        the parent's heartbeats) and its thread (not running in the child)."""
        self._writers = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None

    def discard(self, writer: RegionWriter) -> None:
        with self._lock:
            self._writers.discard(writer)

    def _run(self) -> None:
        pause = 0.5
        while True:
            self._wake.wait(pause)
            self._wake.clear()
            pause = self._beat_due()

    def _beat_due(self) -> float:
        """Refresh the heartbeats that are due; the seconds until the next look (often
        enough for the shortest interval). Holds no writer afterwards: a writer dropped
        without ``close()`` is still collected."""
        with self._lock:
            writers = list(self._writers)
        now = time.time()
        for w in writers:
            if now - w._last_beat >= w.heartbeat_interval:
                try:
                    if self.hook is not None:
                        self.hook(w)
                    w._beat()
                except Exception:  # the thread refreshes every writer: it never ends
                    log.exception("heartbeat of region %s not refreshed", w.region_id)
        return min([0.5] + [w.heartbeat_interval / 4 for w in writers])


HEARTBEATS = Heartbeats()
"""The process's :class:`Heartbeats`."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HEARTBEATS._after_fork)


def new_heartbeat(epoch: int, interval: float, recovering: bool = False) -> Heartbeat:
    """A heartbeat of a new owner of this process, now."""
    return Heartbeat(_owner(), epoch, time.time(), interval, recovering)
