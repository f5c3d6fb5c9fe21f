"""Bounded Lance caches for the base tables memwal_query opens.

Every ``lance.dataset(...)`` opened without a session gets its own
:class:`lance.Session`, whose caches are bounded at 6 GiB (index) and 1 GiB (metadata).
A table that streams changes gets a new base version every few seconds: each merge,
compaction and index catch-up writes new data files and index segments, and Lance
caches the metadata and index pages of each new one under new keys. The old entries
are never read again, but they stay until those bounds evict them, so a reader that
follows the latest version grows for hours (``benchmarks/scale.py``'s streaming
section: the base table's session grew by ~15 MB a minute at 3,000 rows/s, and would
have gone on to 7 GiB).

memwal_query opens each table's base dataset with its own session bounded by
:data:`INDEX_CACHE_BYTES` and :data:`METADATA_CACHE_BYTES` (the environment variables
``MEMWAL_LANCE_INDEX_CACHE_MB`` / ``MEMWAL_LANCE_METADATA_CACHE_MB`` override them), and
every version of that table it checks out shares that session: the least recently used
entries (superseded versions' files and index segments) are evicted first. One session
per opened table, not one per process, so that a table opened again sees storage as it
is now (a rewritten or damaged file is read again, not served from another handle's
cache).

Bounds alone leave a reader that follows a streaming table holding up to the whole
bound in superseded entries (the ``scale_stream.py`` reader's session grew by ~9 MB a
minute, to 270 MB in 30 minutes), where the entries its queries use take a few tens of
MB. So the session is also renewed: when the table has moved on to a new version and
the session holds more than the larger of :data:`RENEW_MIN_BYTES` and twice what it
held once it had served two versions (about the working set of the table's queries),
the next versions are checked out with a new session and the old one goes with the
last dataset that uses it. Only entries that are still current are read again.
"""

from __future__ import annotations

import lance

from memwal_query.storage.cache import env_megabytes

INDEX_CACHE_BYTES = 256 << 20
"""Default bound of a table's index cache (IVF partitions, inverted lists, B-tree pages)."""
METADATA_CACHE_BYTES = 64 << 20
"""Default bound of a table's metadata cache (manifests, file footers, fragment metadata)."""
RENEW_MIN_BYTES = 64 << 20
"""Default size under which a table's session is never renewed
(``MEMWAL_LANCE_RENEW_MB`` overrides it)."""


def cache_bounds() -> tuple[int, int]:
    """(index cache bytes, metadata cache bytes) of the sessions :func:`new_session` makes."""
    return (
        env_megabytes("MEMWAL_LANCE_INDEX_CACHE_MB", INDEX_CACHE_BYTES),
        env_megabytes("MEMWAL_LANCE_METADATA_CACHE_MB", METADATA_CACHE_BYTES),
    )


def new_session() -> lance.Session:
    """A Lance session with bounded caches (see the module docs)."""
    index_bytes, metadata_bytes = cache_bounds()
    return lance.Session(
        index_cache_size_bytes=index_bytes, metadata_cache_size_bytes=metadata_bytes
    )


class SessionRenewal:
    """Decides when a table's Lance session is replaced by a new one (module docs).

    One per table handle; the caller serializes calls (the handle's dataset lock). The
    renewal size is read when it is made (``MEMWAL_LANCE_RENEW_MB``).

    Raises
    ------
    MemWalError
        ``MEMWAL_LANCE_RENEW_MB`` is not a positive number.
    """

    def __init__(self) -> None:
        self._min_bytes = env_megabytes("MEMWAL_LANCE_RENEW_MB", RENEW_MIN_BYTES)
        self._version: int | None = None
        self._versions = 0  # versions served by the current session
        self._settled: int | None = None  # its size once it had served two versions

    def renew(self, version: int, session: lance.Session) -> bool:
        """Whether ``version``, the table's latest, should be checked out with a new
        session; True resets the count for that new session.

        Parameters
        ----------
        version : int
            The latest version of the table.
        session : lance.Session
            The session the table's datasets use now.

        Returns
        -------
        bool
            True when the table moved on from the last version seen and ``session``
            holds more than the larger of the renewal size and twice what it held once
            it had served two versions.
        """
        if version == self._version:
            return False
        self._version = version
        self._versions += 1
        if self._versions < 2:
            return False
        size = int(session.size_bytes())
        if self._settled is None:
            self._settled = size
        if size <= max(self._min_bytes, 2 * self._settled):
            return False
        self._versions, self._settled = 1, None
        return True
