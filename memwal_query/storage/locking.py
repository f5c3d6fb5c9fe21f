"""Serializing memwal_query's commits to the MemWAL index of a base table.

Lance rebases a ``CreateIndex`` commit over concurrent commits without treating a
concurrent change of the MemWAL index as a conflict, so an index-details update computed
from version ``V`` (region snapshots, index catch-up progress) could silently overwrite
``merged_generations`` that a merger committed after ``V`` (measured with pylance 14).
memwal_query therefore:

1. takes the table's **index lock** around every commit that changes the MemWAL index
   (merger commits, snapshot refresh, catch-up), and for a details update re-reads the
   latest version *inside* the lock, so none of our own commits can interleave; and
2. after a details commit, checks that no other commit landed between the version it
   read and its own (a process not using the lock, e.g. pylance's native merger); if
   one did and it changed merge progress, it re-commits the progress monotonically
   (max per region) at once, inside the lock.

The lock is an advisory ``flock`` on ``_mem_wal/.index.lock`` for local tables; on object
stores (``s3://``, ``gs://``, ``az://``) it is a lease object at the same path, or the
configured external commit lock (see :func:`memwal_query.storage.lease.index_lease`).
Do not run pylance's native merger concurrently with memwal_query's snapshot refresh or
catch-up on the same table.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator

from memwal_query.storage.io import FileIO
from memwal_query.storage.paths import mem_wal_root

_LOCK_FILE = ".index.lock"
_thread_locks: dict[str, threading.RLock] = {}
_guard = threading.Lock()
_held = threading.local()


@contextlib.contextmanager
def index_lock(table_uri: str, io: FileIO | None = None) -> Iterator[None]:
    """Exclusive (across threads and processes) right to commit MemWAL index changes.

    Re-entrant within a thread. ``io`` (the table's FileIO) is required for tables on
    object stores, where the lock is a lease object.
    """
    local = table_uri[len("file://") :] if table_uri.startswith("file://") else table_uri
    depth = getattr(_held, table_uri, 0)
    if depth:
        setattr(_held, table_uri, depth + 1)
        try:
            yield
        finally:
            setattr(_held, table_uri, depth)
        return
    with _guard:
        tlock = _thread_locks.setdefault(table_uri, threading.RLock())
    with tlock:
        if "://" in table_uri and not table_uri.startswith("file://"):
            from memwal_query.storage.lease import index_lease

            with index_lease(io, table_uri):
                setattr(_held, table_uri, 1)
                try:
                    yield
                finally:
                    setattr(_held, table_uri, 0)
            return
        root = mem_wal_root(local)
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            setattr(_held, table_uri, 1)
            try:
                yield
            finally:
                setattr(_held, table_uri, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
