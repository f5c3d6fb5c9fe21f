"""The state of a region writer and its background-flush path (see
:mod:`memwal_query.write.writer`, whose :class:`RegionWriter` builds on these classes:
``RegionWriter(_WalPath(_FlushPath(_WriterState)))``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from memwal_query.exceptions import (
    FencedError,
    MemWalError,
    WriterClosedError,
)
from memwal_query.format import keyfile
from memwal_query.format.keyfile import RegionKeysPart
from memwal_query.format.manifest import (
    RegionManifest,
    RegionManifestStore,
    merged_stream_batches,
)
from memwal_query.format.wal import Wal, WalEntry, conform_entry
from memwal_query.storage import paths
from memwal_query.write.background import DaemonRunner
from memwal_query.write.memtable import MemTable

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


class PartialLookup(Protocol):
    """Reads the current rows of some keys for a partial update.

    A writer calls it with the keys (a table of the primary-key columns), the columns to
    return (the key columns and the missing ones) and ``writers=[that writer]``, whose
    unflushed rows must be seen; it returns the keys' newest live rows (a key without a
    live row has none).
    """

    def __call__(
        self, keys: pa.Table, *, columns: Sequence[str], writers: Sequence[Any]
    ) -> pa.Table: ...


class DictionaryValues(Protocol):
    """Reads the distinct values the table's rows hold in some dictionary columns.

    A writer calls it once, when it opens, with its dictionary columns of 8- or 16-bit
    indices; it returns, per column, the values of every row a reader sees (or more):
    with the writer's own rows they must fit the index type (see
    :meth:`memwal_query.write.memtable.MemTable.dictionary_errors`). A
    :class:`~memwal_query.write.memtable.DictionaryCounts` it returns is counted into
    as is: the writers given the same one count each other's rows.
    """

    def __call__(self, columns: Sequence[str]) -> dict[str, pa.Array]: ...


DEFAULT_MAX_MEMTABLE_ROWS = 100_000
DEFAULT_MAX_MEMTABLE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_WAL_BUFFER_BYTES = 8 * 1024 * 1024
DEFAULT_WAL_FLUSH_INTERVAL = 0.1
DEFAULT_MAX_UNFLUSHED_MEMTABLES = 4
DEFAULT_MAX_WAL_ENTRIES = 1_000
DEFAULT_MAX_MEMTABLE_AGE = 60.0


@dataclass
class _Request:
    rows: pa.Table
    batch: tuple[str, int] | None = None
    done: bool = False
    error: BaseException | None = None


@dataclass
class WriterStats:
    """Counters of one writer (all since it was opened)."""

    put_rows: int = 0
    delete_rows: int = 0
    wal_entries: int = 0
    wal_bytes: int = 0
    replayed_entries: int = 0
    replayed_rows: int = 0
    adopted_entries: int = 0
    memtable_flushes: int = 0
    flushed_rows: int = 0
    flush_seconds: float = 0.0
    flushed_generations: list[int] = field(default_factory=list)
    flush_errors: int = 0
    wal_write_errors: int = 0
    heartbeat_errors: int = 0


class _WriterState:
    """Fields of a writer and the checks every path makes."""

    # Set by RegionWriter.__init__ (see there).
    table: Catalog
    region_id: str
    durable: bool
    epoch: int
    stats: WriterStats
    max_memtable_rows: int
    max_memtable_bytes: int
    max_wal_buffer_bytes: int
    wal_flush_interval: float
    max_unflushed_memtables: int
    backpressure_timeout: float | None
    max_wal_entries: int
    max_memtable_age: float
    _lookup: PartialLookup | None
    _dictionaries: dict[str, pa.Array]
    _schema: pa.Schema
    _pk: list[str]
    _storage_schema: pa.Schema
    _store: RegionManifestStore
    _wal: Wal
    _cond: threading.Condition
    _wal_busy: bool
    _partial_busy: bool
    _pending: list[_Request]
    _unsynced: list[pa.Table]
    _unsynced_bytes: int
    _sealed: list[MemTable]
    _flush_active: bool
    _flush_error: BaseException | None
    _wal_error: BaseException | None
    _failed: BaseException | None
    _closed: bool
    _executor: DaemonRunner
    _known_version: int
    _active: MemTable
    _next_wal_position: int
    _stream_batches: dict[str, int]
    _region_keys: list[RegionKeysPart] | None = None  # see _unmerged_keys

    def _check_open(self) -> None:
        failed = self._failed
        if failed is not None:
            if isinstance(failed, FencedError):
                # Keep the type, so callers can tell "fenced" from "closed"; a fresh
                # exception each time (re-raising one object grows its traceback).
                raise FencedError(
                    failed.region_id, failed.local_epoch, failed.stored_epoch
                ) from failed
            raise WriterClosedError(
                f"writer of region {self.region_id} failed earlier: {failed}"
            ) from failed
        if self._closed:
            raise WriterClosedError(f"writer of region {self.region_id} is closed")

    def _fenced(self, err: FencedError) -> FencedError:
        """Record that this writer is fenced (every later call raises FencedError)."""
        with self._cond:
            if self._failed is None:
                self._failed = err
            self._cond.notify_all()
        return err

    def _conform(self, entry: WalEntry) -> pa.Table:
        """An entry's rows in the current storage schema; WalCorruptError if hostile."""
        return conform_entry(
            self._wal.path(entry.position), entry.table, self._storage_schema, self._pk
        )


class _FlushPath(_WriterState):
    """Sealing MemTables and flushing them in the background, in generation order."""

    def _raise_background_error(self) -> None:
        """Raise, once, the error of failed background work; schedule a flush retry."""
        if self._flush_error is None and self._wal_error is None:
            return  # unlocked fast path; the locked check below decides
        with self._cond:
            if self._wal_error is not None:
                error, self._wal_error = self._wal_error, None  # the ticker keeps retrying
            elif self._flush_error is not None:
                error, self._flush_error = self._flush_error, None
                self._schedule_flush_locked()
            else:
                return
        raise error

    def _too_old(self, memtable: MemTable) -> bool:
        started = memtable.first_append_at
        return started is not None and time.monotonic() - started >= self.max_memtable_age

    def _full(self, memtable: MemTable) -> bool:
        """Whether ``memtable`` is due for a flush (size, row, write-count or age limit)."""
        return (
            memtable.num_rows >= self.max_memtable_rows
            or memtable.nbytes >= self.max_memtable_bytes
            or memtable.appends >= self.max_wal_entries
            or self._too_old(memtable)
        )

    def _swap_locked(self, force: bool) -> None:
        """Seal the active MemTable (caller holds the WAL token and the condition)."""
        active = self._active
        if active.num_rows == 0:
            return
        if not force and not self._full(active):
            return
        self._sealed.append(active)
        self._active = MemTable(
            self.region_id, active.generation + 1, self._storage_schema, self._dictionaries
        )
        self._schedule_flush_locked()

    def _schedule_flush_locked(self) -> None:
        """Start a drain of the sealed MemTables unless one is running (holds _cond).

        One drain flushes every sealed MemTable, oldest first, including those sealed
        while it runs; a failed one stays queued and the next drain retries it.
        """
        if self._flush_active or not self._sealed or self._failed is not None:
            return
        try:
            self._executor.submit(self._drain_flushes)
        except RuntimeError:  # executor shut down: closed writer
            return
        self._flush_active = True

    def _drain_flushes(self) -> None:
        """Flush sealed MemTables in order until none is left (runs on the flush thread)."""
        try:
            while True:
                with self._cond:
                    if not self._sealed or self._failed is not None:
                        return
                    memtable = self._sealed[0]
                self._flush_one(memtable)
        except FencedError as e:
            self._fenced(e)
        except BaseException as e:  # noqa: BLE001 - surfaced by the next put/delete/flush
            with self._cond:
                self._flush_error = e
            self.stats.flush_errors += 1
        finally:
            with self._cond:
                self._flush_active = False
                self._cond.notify_all()

    def _unmerged_keys(self) -> list[RegionKeysPart]:
        """The keys of the region's generations flushed before (oldest first, as the
        last flush wrote them in its region keys file; on a writer's first flush, read
        from the file of the newest generation its manifest lists: those of the
        generations the manifest still lists)."""
        if self._region_keys is None:
            self._region_keys = []
            try:
                manifest = self._store.load_latest()
            except Exception:  # noqa: BLE001 - an optimisation: the commit reports it
                return self._region_keys
            listed = (
                {(g.generation, g.path) for g in manifest.flushed_generations}
                if manifest
                else set()
            )
            if listed:
                newest = max(listed)
                uri = paths.generation_path(self.table.uri, self.region_id, newest[1])
                parts = keyfile.read_region(self.table.io, uri) or []
                self._region_keys = [p for p in parts if (p.generation, p.path) in listed]
        return self._region_keys

    def _flush_one(self, memtable: MemTable) -> None:
        """Flush the oldest sealed MemTable and commit the region manifest."""
        from memwal_query.write.flush import write_generation

        started = time.perf_counter()
        gen_dir = paths.new_generation_dir(memtable.generation)
        merged = self.table.index().merged_generations().get(self.region_id, 0)
        region_keys = [p for p in self._unmerged_keys() if p.generation > merged]
        flushed = write_generation(self.table, self.region_id, gen_dir, memtable, region_keys)

        region_dir = paths.region_dir(self.table.uri, self.region_id)

        def update(current: RegionManifest) -> RegionManifest:
            # Generations merged and already garbage collected leave the list.
            kept = tuple(
                g
                for g in current.flushed_generations
                if g.generation > merged or self.table.io.is_dir(f"{region_dir}/{g.path}")
            )
            if current.current_generation != memtable.generation:
                raise MemWalError(
                    f"region {self.region_id}: manifest expects generation "
                    f"{current.current_generation}, flushing {memtable.generation}"
                )
            return current.replace(
                flushed_generations=kept + (flushed,),
                current_generation=memtable.generation + 1,
                replay_after_wal_entry_position=memtable.last_wal_position
                or current.replay_after_wal_entry_position,
                wal_entry_position_last_seen=max(
                    current.wal_entry_position_last_seen, self._next_wal_position - 1
                ),
                stream_batches=merged_stream_batches(current.stream_batches, memtable.batches),
            )

        committed = self._store.commit_update(self.epoch, update)
        self._region_keys = region_keys
        with self._cond:
            self._stream_batches = dict(committed.stream_batches)
            self._known_version = max(self._known_version, committed.version)
            self._sealed.pop(0)
            self._cond.notify_all()  # puts waiting for room (backpressure)
            self.stats.memtable_flushes += 1
            self.stats.flushed_rows += memtable.num_rows
            self.stats.flush_seconds += time.perf_counter() - started
            self.stats.flushed_generations.append(memtable.generation)
