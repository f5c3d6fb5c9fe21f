"""Lease locks on object stores: mutual exclusion between processes on any host, as one
object updated with conditional puts (see :class:`LeaseLock`); :func:`index_lease` is the
index lock of a table on an object store (:func:`memwal_query.storage.locking.index_lock`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError, StorageError
from memwal_query.storage.io import FileIO, join
from memwal_query.storage.objectstore import ObjectStoreFileIO
from memwal_query.storage.options import (
    DEFAULT_LOCK_TTL,
    DOCS,
    INDEX_LOCK_NAME,
    OPT_COMMIT_LOCK,
    ConcurrentModificationError,
    ConditionalPutUnsupportedError,
    LockTimeoutError,
)
from memwal_query.storage.paths import mem_wal_root

log = logging.getLogger(__name__)


# -- lease lock -------------------------------------------------------------------------------
def _owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class LeaseLock:
    """A mutual-exclusion lease stored as one object, for processes on any host.

    The object holds JSON ``{"owner", "expires_at", "ttl", "released"}``.

    - **Acquire**: create it with a create-only put; if it exists and is released or
      expired (``expires_at + skew < now``), replace it conditionally on the version
      read (``If-Match: <etag>``; the generation on GCS), so exactly one contender
      takes it over. Otherwise poll with
      exponential backoff (``poll`` doubling up to ``max_poll``, jittered) until
      ``timeout`` (:class:`LockTimeoutError`).
    - **Renew**: a daemon thread extends ``expires_at`` every ``ttl / 3`` with
      the same condition. If that fails the lease was taken over (the holder stalled for
      longer than ``ttl``): :attr:`lost` is set and a warning logged.
    - **Release**: mark it released conditionally (never clobbering a successor).

    Hosts' clocks must agree to within ``skew`` seconds. A crashed holder blocks others
    for at most ``ttl + skew`` seconds.

    Parameters
    ----------
    io : ObjectStoreFileIO
    path : str
        URI of the lease object (``s3://``, ``gs://``, ``az://``...).
    ttl, skew, poll, max_poll : float
        Seconds.
    timeout : float or None
        Give up acquiring after this many seconds (None: wait forever).
    """

    def __init__(
        self,
        io: ObjectStoreFileIO,
        path: str,
        ttl: float = DEFAULT_LOCK_TTL,
        *,
        skew: float = 2.0,
        poll: float = 0.02,
        max_poll: float = 0.5,
        timeout: float | None = 600.0,
    ) -> None:
        self.io = io
        self.path = path
        self.ttl = ttl
        self.skew = skew
        self.poll = poll
        self.max_poll = max_poll
        self.timeout = timeout
        self.owner = _owner_id()
        self.lost = False
        self.took_over: str | None = None
        self._version: str | None = None
        self._held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _body(self, released: bool = False) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "owner": self.owner,
                "expires_at": 0.0 if released else now + self.ttl,
                "ttl": self.ttl,
                "released": released,
            }
        ).encode()

    @staticmethod
    def _parse(data: bytes) -> dict[str, Any] | None:
        try:
            lease = json.loads(data)
            float(lease["expires_at"])
            return lease
        except (ValueError, KeyError, TypeError):
            return None  # corrupt: treated as free

    def acquire(self) -> None:
        """Block until the lease is ours (see the class docs)."""
        if self._held:
            raise StorageError(f"{self.path}: lease already held by this object")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = self.poll
        holder = "?"
        while True:
            try:
                outcome = self._attempt()
            except ConditionalPutUnsupportedError:
                raise
            except StorageError as e:  # transient (network, 5xx): keep trying
                if deadline is not None and time.monotonic() > deadline:
                    raise
                log.debug("%s: lease attempt failed: %s", self.path, e)
                outcome = "wait"
            if outcome == "acquired":
                break
            if outcome != "retry":
                holder = outcome
                if deadline is not None and time.monotonic() > deadline:
                    raise LockTimeoutError(
                        f"{self.path}: lock held by {holder}; gave up after {self.timeout} s"
                    )
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.max_poll)
        if self._version is None:  # a store that returned no version on the put
            _, self._version = self.io.read_versioned(self.path)
        self._held = True
        self.lost = False
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="memwal-lease", daemon=True)
        self._renewer.start()

    def _attempt(self) -> str:
        """One try: ``"acquired"``, ``"retry"`` (at once) or the holder's description."""
        try:
            data, version = self.io.read_versioned(self.path)
        except ObjectNotFoundError:
            try:
                self._version = self.io.create(self.path, self._body())
                return "acquired"
            except AlreadyExistsError:
                return "retry"
        lease = self._parse(data)
        expires_at = 0.0 if lease is None else float(lease["expires_at"])
        if (
            lease is not None
            and not lease.get("released")
            and expires_at + self.skew >= time.time()
        ):
            return f"{lease.get('owner')} (expires in {expires_at - time.time():.1f} s)"
        if version is None:
            raise ConditionalPutUnsupportedError(
                f"{self.path}: the store returns no object version, so a lease cannot "
                f"be taken over safely; configure {OPT_COMMIT_LOCK} (see {DOCS})"
            )
        try:
            self._version = self.io.put_if_match(self.path, self._body(), version)
        except ConcurrentModificationError:
            return "retry"
        if lease is not None and not lease.get("released"):
            self.took_over = str(lease.get("owner"))
            log.warning("%s: took over the expired lease of %s", self.path, self.took_over)
        return "acquired"

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                try:
                    self._version = self.io.put_if_match(self.path, self._body(), self._version)
                except ConcurrentModificationError:
                    self.lost = True
                    log.warning("%s: lease lost (taken over after expiry)", self.path)
                    return
                except StorageError as e:  # transient: try again at the next tick
                    log.debug("%s: lease renewal failed: %s", self.path, e)

    def release(self) -> None:
        """Stop renewing and mark the lease released (unless it was lost)."""
        if not self._held:
            return
        self._stop.set()
        with self._mutex:
            self._held = False
            if not self.lost:
                try:
                    self.io.put_if_match(self.path, self._body(released=True), self._version)
                except ConcurrentModificationError:
                    self.lost = True
                    log.warning("%s: lease was taken over before release", self.path)
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def index_lease(io: FileIO | None, table_uri: str) -> Iterator[None]:
    """The cross-process index lock of a table on an object store.

    A :class:`LeaseLock` on ``{table}/_mem_wal/.index.lock``, or the external commit
    lock (``"index:{table_uri}"``) when the store has no conditional put.
    """
    if not isinstance(io, ObjectStoreFileIO):
        raise StorageError(
            f"{table_uri}: the index lock on an object store needs the table's ObjectStoreFileIO"
        )
    if not io.conditional_put:
        assert io.commit_lock is not None
        with io.commit_lock(f"index:{table_uri}"):
            yield
        return
    path = join(mem_wal_root(table_uri), INDEX_LOCK_NAME)
    with LeaseLock(io, path, ttl=io.settings.lock_ttl):
        yield
