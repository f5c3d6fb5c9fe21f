"""Every exception memwal_query raises on purpose, in one place.

All inherit from :class:`MemWalError`, so ``except mq.MemWalError`` catches any of them.
Each message names the file, column, region or value concerned.
"""

from __future__ import annotations

import re
from typing import Any

_SOURCE_LOCATION = re.compile(r"(?:,\s*|\s+at\s+|\s+)?[\w./-]*/[\w.-]+\.rs:\d+(?::\d+)?")


def without_source_locations(text: str) -> str:
    """``text`` without the Rust source locations a library build leaves in its messages
    (Lance's ``, /home/runner/work/lance/.../commit.rs:653:26``): nothing a user can
    act on, so messages quoting a library's error drop them."""
    return _SOURCE_LOCATION.sub("", text)


class MemWalError(Exception):
    """Base class of every error raised by memwal_query."""


class StorageError(MemWalError):
    """An object-store operation failed (I/O error, permission, missing bucket...)."""


class AlreadyExistsError(StorageError):
    """A put-if-not-exists found the object already present."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """An object that must exist does not."""


class CorruptFileError(MemWalError):
    """A file exists but cannot be decoded (truncated, garbage, wrong format).

    Attributes
    ----------
    path : str
        The offending file.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class WalCorruptError(CorruptFileError):
    """A WAL entry is truncated or unreadable. Nothing is silently skipped."""


class ManifestCorruptError(CorruptFileError):
    """A region manifest version cannot be decoded or is inconsistent (a counter beyond
    any reachable value, ``current_generation`` not above a flushed generation...)."""


class BloomCorruptError(CorruptFileError):
    """A generation's ``bloom_filter.bin`` fails its checks (size, checksum, a key of the
    generation it says is absent). Readers do not raise it: they warn
    (:class:`BloomFilterWarning`) and check keys exactly; ``memwal fsck`` reports it."""


class FencedError(MemWalError):
    """This writer's epoch is older than the region's: another writer claimed the region."""

    def __init__(self, region_id: str, local_epoch: int, stored_epoch: int | None) -> None:
        stored = "unknown" if stored_epoch is None else str(stored_epoch)
        super().__init__(
            f"writer of region {region_id} was fenced: local epoch {local_epoch}, "
            f"stored epoch {stored}"
        )
        self.region_id = region_id
        self.local_epoch = local_epoch
        self.stored_epoch = stored_epoch


class JobEndedError(FencedError):
    """A task attempt of a Spark write job that already ended (a speculative loser or a
    zombie copy) tried to claim a region: it must not write (see ``ingest`` docs).

    A :class:`~memwal_query.exceptions.FencedError`: the attempt is superseded.
    ``local_epoch`` is the epoch it claimed with (None when it did not claim).
    """

    def __init__(self, region_id: str, job: str, local_epoch: int | None = None) -> None:
        MemWalError.__init__(
            self,
            f"region {region_id}: write job {job} already ended; this task attempt (a "
            "speculative or zombie copy) must not write",
        )
        self.region_id = region_id
        self.job = job
        self.local_epoch = local_epoch  # type: ignore[assignment]
        self.stored_epoch = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.region_id, self.job, self.local_epoch))


class CommitConflictError(MemWalError):
    """A versioned commit lost a race and ran out of retries."""


class TableNotFoundError(MemWalError, FileNotFoundError):
    """No Lance table at the given URI."""


class NotInitializedError(MemWalError):
    """The base table has no MemWAL index; call ``MemWalTable.initialize`` first."""


class AlreadyInitializedError(MemWalError):
    """The base table already has a MemWAL index."""


class SchemaError(MemWalError, ValueError):
    """Input does not match the table schema (missing/extra column, wrong type...)."""


class SchemaChangedError(SchemaError):
    """The table gained columns since this object read its schema (another process
    added them): nothing was written; open the table again (``MemWalTable.open``)."""


class PrimaryKeyError(SchemaError):
    """The table has no primary key, or input has a missing/NULL primary-key value."""


class RegionSpecError(MemWalError, ValueError):
    """A region spec or region field is invalid, or cannot be evaluated."""


class ReadOnlySqlError(MemWalError, ValueError):
    """``memwal sql`` refused a statement that writes or changes the session (COPY TO,
    CREATE EXTERNAL TABLE, INSERT, SET...) because ``--allow-write`` was not given."""


class WrongRegionError(MemWalError, ValueError):
    """A row's region value belongs to another region than the writer's."""


class SpecChangedError(WrongRegionError):
    """The table's region spec changed after rows were routed: the region they were
    routed to belongs to an older spec and takes no new rows.

    :meth:`MemWalTable.write` and :meth:`MemWalTable.delete` route such rows again by
    the current spec themselves; a caller of :meth:`MemWalTable.writer` routes them
    again (``region_values`` of the current spec). ``expected`` is the spec id the rows
    were routed by, ``current`` the table's current spec id.
    """

    def __init__(self, uri: str, expected: int, current: int, region_id: str = "") -> None:
        where = f" (region {region_id})" if region_id else ""
        super().__init__(
            f"{uri}: rows were routed by region spec {expected}{where}, but the table's "
            f"current region spec is {current}; route them again by the current spec"
        )
        self.uri = uri
        self.expected = expected
        self.current = current
        self.region_id = region_id


class InvalidPathError(MemWalError, ValueError):
    """A region id, generation path or name is malformed or escapes its directory."""


class RegionNotFoundError(MemWalError, LookupError):
    """A region id given by the caller (``regions=`` of a merge) names no region of the
    table."""


class WriterClosedError(MemWalError):
    """The writer was closed (or failed) and accepts no more writes."""


class GenerationGoneError(MemWalError):
    """A flushed generation was garbage collected while a reader still needed it."""


class BaseVersionGoneError(MemWalError):
    """The base-table version a read was planned on was cleaned up while it ran.

    Lance's ``cleanup_old_versions`` (e.g. ``t.maintenance.gc(cleanup_older_than=...)``)
    deletes the data files of older versions; a query still reading one fails. Running
    it again plans it on the current version. Lookups and searches do that once by
    themselves.
    """


class MergeFailedError(MemWalError):
    """Merging all regions: some regions failed (the others were merged).

    Attributes
    ----------
    errors : dict
        ``{region_id: exception}`` of the regions that failed.
    results : list
        The :class:`~memwal_query.maintain.merger.MergeResult` of every generation that was
        merged, failed regions included (up to their failure).
    """

    def __init__(self, uri: str, errors: dict, results: list) -> None:
        detail = "; ".join(f"{rid}: {type(e).__name__}: {e}" for rid, e in sorted(errors.items()))
        super().__init__(
            f"{uri}: merging failed for {len(errors)} region(s) ({sorted(errors)}); the "
            f"other regions were merged. {detail}"
        )
        self.errors = errors
        self.results = results
        self.__cause__ = next(iter(errors.values()), None)


class LeftoverRegionsError(MemWalError):
    """``_mem_wal/`` holds regions that the table's MemWAL index does not know.

    They belong to an earlier lineage of the base table (for example it was overwritten
    with Lance and initialized again): mixing them in would resurrect old rows.
    ``MemWalTable.initialize(..., reset=True)`` (``memwal init --reset``) removes them.

    Attributes
    ----------
    regions : list of str
        The region ids found.
    """

    def __init__(self, message: str, regions: list[str]) -> None:
        super().__init__(message)
        self.regions = list(regions)


class ChangesGoneError(MemWalError):
    """The change feed cannot continue from a cursor: what it needs was garbage collected.

    The WAL entries (and the generations flushed from them) after the cursor's
    position in a region were removed by GC (see ``docs/changes.md``: register the
    consumer with ``t.consumers.register`` so GC keeps them). Never a
    shorter answer: the consumer must resynchronise (e.g. from a base version).

    Attributes
    ----------
    region_id : str
        The region concerned.
    position : int
        The first WAL position the cursor needs that is gone.
    path : str
        That WAL entry's path.
    """

    def __init__(self, region_id: str, position: int, path: str, detail: str = "") -> None:
        super().__init__(
            f"{path}: WAL entry {position} of region {region_id}, needed by the cursor, "
            f"was garbage collected{': ' + detail if detail else ''}"
        )
        self.region_id = region_id
        self.position = position
        self.path = path


class VersionGoneError(BaseVersionGoneError):
    """A time-travel read (``as_of``) needs a base version, region manifest version or
    generation that GC removed; the message names it. Keep it with
    ``gc(retain_versions_for=...)``."""


class CursorError(MemWalError, ValueError):
    """A change-feed cursor (or ``since``/``as_of`` value) cannot be read, or belongs to
    another table; the message quotes it."""


class BackpressureError(MemWalError):
    """A put waited longer than ``backpressure_timeout`` for unflushed MemTables to drain.

    The rows of that put were not written (not acknowledged); retry it later.
    """


class WriteIncompleteError(MemWalError):
    """A :meth:`MemWalTable.write` / ``delete`` over several regions failed in some.

    Each region's rows are written atomically (one WAL entry); regions are independent,
    so the regions in ``written`` are durable (and visible to readers) while the ones in
    ``errors`` are not. Upserts and deletes are idempotent: retrying the whole call
    converges to the same table.

    Attributes
    ----------
    written : dict
        ``{region_id: rows}`` made durable.
    errors : dict
        ``{region_id: exception}`` of the regions that failed.
    """

    def __init__(self, uri: str, written: dict, errors: dict) -> None:
        detail = "; ".join(f"{rid}: {type(e).__name__}: {e}" for rid, e in sorted(errors.items()))
        super().__init__(
            f"{uri}: the write failed in {len(errors)} region(s) and is durable in "
            f"{len(written)} ({sorted(written)}); retrying it is safe. {detail}"
        )
        self.written = dict(written)
        self.errors = dict(errors)
        self.__cause__ = next(iter(errors.values()), None)


class RegionSpecWarning(UserWarning):
    """A region spec reads columns outside the primary key (see ``MemWalTable.initialize``).

    Each key must live in exactly one region; with such a spec that holds only if a key's
    value in those columns never changes once written.
    """


class BloomFilterWarning(UserWarning):
    """A generation's bloom filter is missing or corrupt: its keys are checked exactly
    (same answers, slower). ``memwal repair URI`` writes it again."""
