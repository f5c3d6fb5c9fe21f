"""RegionWriter: durable puts and deletes into one region's WAL and MemTable.

Life of a write
---------------
1. ``put``/``delete`` coerce the input to the table schema (typed errors, nothing
   written on failure) and check that every row belongs to this writer's region.
2. Durable mode (default): the rows join a queue; one caller at a time becomes the
   *leader*, takes everything queued (group commit), writes it as ONE WAL entry with
   put-if-not-exists (fsync'd on local disk), appends it to the MemTable and wakes the
   others. ``put`` returns only once its rows are in the WAL.
   Non-durable mode: rows go to the MemTable at once and to the WAL when the buffer
   passes ``max_wal_buffer_bytes``, every ``wal_flush_interval`` seconds, or on
   ``sync()``.
3. When the MemTable passes ``max_memtable_rows``/``max_memtable_bytes`` (or on
   ``flush()``) it is *sealed*: swapped for an empty one under the lock (the only time
   puts wait), and flushed in a background thread as generation ``i`` (see
   :mod:`memwal_query.write.flush`). Then the region manifest is updated, fenced by epoch.

Recovery: opening a writer claims the region (epoch + 1) and replays WAL entries after
``replay_after_wal_entry_position`` into the MemTable before accepting writes. A WAL
entry found at the writer's next position that was written by an older (fenced) writer,
or by this writer in a write whose outcome was unknown, is adopted, not lost (spec,
Appendix 1); one by a newer writer fences this one. Entries are validated against the
table schema when replayed or adopted (:func:`~memwal_query.format.wal.conform_entry`).

Fencing on the write path (a deliberate addition to the spec): after each WAL entry is
written and before the put is acknowledged, the writer HEADs the region manifest version
after the newest one it knows (:meth:`RegionWriter._check_superseded`); see there why.

Background errors: a failed background flush (or, in non-durable mode, a failed
background WAL write) is raised once by the next ``put``/``delete``, before it writes
anything, and the failed work is retried. ``flush()`` and ``sync()`` retry it themselves
and raise only if that retry fails. Once fenced, every call raises :class:`FencedError`.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    FencedError,
    MemWalError,
    SchemaChangedError,
    SpecChangedError,
    WriterClosedError,
    WrongRegionError,
)
from memwal_query.format.manifest import RegionManifest, RegionManifestStore
from memwal_query.format.schema import (
    coerce_keys,
    coerce_partial_rows,
    coerce_rows,
    dictionary_capacity,
    storage_schema,
    tombstone_rows,
    with_tombstone,
)
from memwal_query.format.wal import Wal, WalEntry
from memwal_query.storage import paths
from memwal_query.write import liveness
from memwal_query.write.background import DaemonRunner
from memwal_query.write.liveness import DEFAULT_HEARTBEAT_INTERVAL
from memwal_query.write.memtable import DictionaryCounts, MemTable, MemTableSnapshot
from memwal_query.write.walpath import _WalPath
from memwal_query.write.writer_state import (
    DEFAULT_MAX_MEMTABLE_AGE,
    DEFAULT_MAX_MEMTABLE_BYTES,
    DEFAULT_MAX_MEMTABLE_ROWS,
    DEFAULT_MAX_UNFLUSHED_MEMTABLES,
    DEFAULT_MAX_WAL_BUFFER_BYTES,
    DEFAULT_MAX_WAL_ENTRIES,
    DEFAULT_WAL_FLUSH_INTERVAL,
    DictionaryValues,
    PartialLookup,
    WriterStats,
    _Request,
)

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


class RegionWriter(_WalPath):
    """The single writer of one region. Obtain one with :meth:`MemWalTable.writer`.

    Parameters
    ----------
    table : Catalog
        The table.
    region_id : str
        Region UUID.
    durable : bool
        ``True``: ``put``/``delete`` return once the rows are in a WAL entry.
    max_memtable_rows, max_memtable_bytes : int
        Seal and flush the MemTable when it passes either limit.
    max_wal_buffer_bytes : int
        Non-durable mode: write a WAL entry when this many bytes are buffered.
    wal_flush_interval : float
        Non-durable mode: write buffered rows to the WAL at least this often (seconds).
    max_unflushed_memtables : int
        Backpressure: at most this many sealed MemTables wait for their flush; a put
        beyond it blocks until a flush completes (default 4). Sustained throughput is
        then flush throughput and memory stays bounded.
    backpressure_timeout : float, optional
        Longest a put waits for room (seconds); then it raises
        :class:`BackpressureError` without writing anything. None (default): no limit.
    max_wal_entries : int
        Seal and flush the MemTable once it holds this many writes (WAL entries in
        durable mode; default 1,000), so that many tiny puts leave a bounded WAL tail
        to replay and to read.
    max_memtable_age : float
        Seal and flush the MemTable once its oldest row is this old (seconds, default
        60), so an idle writer does not keep rows only in the WAL.
    heartbeat_interval : float
        Seconds between refreshes of the region's heartbeat (default 10), which tells
        maintainers this writer is alive (:mod:`memwal_query.write.liveness`).
    region_values : dict, optional
        Region field values of this region (``{field_id: value}``); rows whose region
        value differs are rejected with :class:`WrongRegionError`. None: a region the
        table's spec does not own (a manual region of an older table, or one of another
        spec): it can be replayed, flushed and closed, but refuses new rows.
    region_spec_id : int
        Spec id recorded when the region is created (0: manual region).
    region_field_entries : tuple
        ``(field_id, value bytes)`` recorded in the manifest when the region is created.
    lookup : PartialLookup, optional
        ``lookup(keys, columns=..., writers=[self])`` returning the keys' current rows
        (:class:`~memwal_query.write.writer_state.PartialLookup`): partial updates read
        the columns they do not set through it. Without it they are refused.
    dictionary_values : DictionaryValues, optional
        The values the table holds in its dictionary columns of 8- or 16-bit indices
        (:class:`~memwal_query.write.writer_state.DictionaryValues`): a write whose new
        values would make them more than the index type holds is refused. Without it,
        only the values of this writer's own rows count.

    Raises
    ------
    SpecChangedError
        ``region_values`` are given and the table's current region spec, re-read after
        the claim, is not ``region_spec_id`` (see :mod:`memwal_query.maintain.specs`).

    Attributes
    ----------
    region_spec_id : int
        The spec id recorded in the region's manifest.
    """

    def __init__(
        self,
        table: Catalog,
        region_id: str,
        *,
        durable: bool = True,
        max_memtable_rows: int = DEFAULT_MAX_MEMTABLE_ROWS,
        max_memtable_bytes: int = DEFAULT_MAX_MEMTABLE_BYTES,
        max_wal_buffer_bytes: int = DEFAULT_MAX_WAL_BUFFER_BYTES,
        wal_flush_interval: float = DEFAULT_WAL_FLUSH_INTERVAL,
        max_unflushed_memtables: int = DEFAULT_MAX_UNFLUSHED_MEMTABLES,
        backpressure_timeout: float | None = None,
        max_wal_entries: int = DEFAULT_MAX_WAL_ENTRIES,
        max_memtable_age: float = DEFAULT_MAX_MEMTABLE_AGE,
        region_values: dict[str, Any] | None = None,
        region_spec_id: int = 0,
        region_field_entries: tuple[tuple[str, bytes], ...] = (),
        lookup: PartialLookup | None = None,
        dictionary_values: DictionaryValues | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    ) -> None:
        self.table = table
        self._lookup = lookup
        self.region_id = paths.validate_region_id(region_id)
        self.durable = durable
        self.max_memtable_rows = max_memtable_rows
        self.max_memtable_bytes = max_memtable_bytes
        self.max_wal_buffer_bytes = max_wal_buffer_bytes
        self.wal_flush_interval = wal_flush_interval
        if max_unflushed_memtables < 1:
            raise ValueError(f"max_unflushed_memtables must be >= 1, got {max_unflushed_memtables}")
        if max_wal_entries < 1:
            raise ValueError(f"max_wal_entries must be >= 1, got {max_wal_entries}")
        if not max_memtable_age > 0:
            raise ValueError(f"max_memtable_age must be > 0, got {max_memtable_age}")
        if not heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.heartbeat_interval = heartbeat_interval
        self.max_unflushed_memtables = max_unflushed_memtables
        self.backpressure_timeout = backpressure_timeout
        self.max_wal_entries = max_wal_entries
        self.max_memtable_age = max_memtable_age
        self.region_values = dict(region_values) if region_values else None
        self.stats = WriterStats()

        self._schema = table.schema
        self._pk = table.primary_key
        self._storage_schema = storage_schema(self._schema)
        self._store = RegionManifestStore(table.io, table.uri, self.region_id)
        self._wal = Wal(table.io, paths.wal_dir(table.uri, self.region_id), self.region_id)

        self._cond = threading.Condition()
        self._wal_busy = False
        self._partial_busy = False  # a partial put holds the WAL token across its lookup
        self._pending: list[_Request] = []
        self._unsynced: list[pa.Table] = []
        self._unsynced_bytes = 0
        self._sealed: list[MemTable] = []
        self._flush_active = False  # a drain task is queued or running on the executor
        # Errors of background work, raised once by the next put/delete (see module doc).
        self._flush_error: BaseException | None = None
        self._wal_error: BaseException | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._executor = DaemonRunner(f"memwal-flush-{region_id[:8]}", region_id)

        # The WAL to replay is read and checked before the claim: a hole or a corrupt
        # entry (WalCorruptError) is refused with the table unchanged.
        latest = self._store.load_latest()
        early: list[tuple[WalEntry, pa.Table]] = []
        if latest is not None:
            # (the epoch bound is checked against the claimed epoch in _replay)
            entries = self._wal.replay(latest.replay_after_wal_entry_position, 1 << 64)
            early = [(e, self._conform(e)) for e in entries]
        self._check_schema(claimed=False)
        # Alive before claiming: a maintainer never takes over a region whose heartbeat
        # is fresh, and the new claim is covered from its first moment.
        self._heartbeat_owner = liveness.new_heartbeat(0, heartbeat_interval).owner
        self.epoch = latest.writer_epoch + 1 if latest is not None else 1
        self._last_beat = time.time()
        self._heartbeat: liveness.Observed | None = liveness.beat(
            table.io, table.uri, self.region_id, self._new_beat(self._last_beat)
        )
        manifest = self._store.claim(
            region_spec_id, region_field_entries=region_field_entries, lineage=table.lineage
        )
        self._check_schema(claimed=True)
        if latest is None or (
            manifest.replay_after_wal_entry_position != latest.replay_after_wal_entry_position
        ):
            early = []  # flushed meanwhile: replay from the claimed manifest
        self.epoch = manifest.writer_epoch
        self._stream_batches = dict(manifest.stream_batches)
        # Newest region manifest version known to be this writer's (its claim, then its
        # flushes): the fencing check after each WAL write HEADs the version after it.
        self._known_version = manifest.version
        # Distinct values of the dictionary columns of 8- or 16-bit indices: the table's
        # when this writer opened, then every row it adds (all its MemTables share it,
        # and the other writers of the table object when dictionary_values shares it).
        narrow = [f.name for f in self._storage_schema if dictionary_capacity(f.type)]
        counts = dictionary_values(narrow) if narrow and dictionary_values else {}
        if not isinstance(counts, DictionaryCounts):
            own = DictionaryCounts()
            own.update(counts)
            counts = own
        self._dictionaries = counts
        self._active = MemTable(
            self.region_id, manifest.current_generation, self._storage_schema, self._dictionaries
        )
        self._next_wal_position = manifest.replay_after_wal_entry_position + 1
        self._replay(manifest, early)
        self.region_spec_id = manifest.region_spec_id
        if self.region_values is not None:
            self._check_spec_after_claim(region_spec_id)

        self._ticker = threading.Thread(
            target=_tick_loop,
            args=(weakref.ref(self), self._tick_interval()),
            name=f"memwal-wal-{region_id[:8]}",
            daemon=True,
        )
        self._ticker.start()
        liveness.HEARTBEATS.add(self)

    def _check_schema(self, claimed: bool) -> None:
        """SchemaChangedError (and this writer closed) when the base table has columns
        the table's schema lacks: another process changed the schema since it was read.

        Checked after the claim (and before it, to not fence a live writer for
        nothing): a schema change committed before the claim is seen; one committed
        after it comes with the claim of a writer that knows the new columns, which
        fences this one. So every row of a region written after a column was added
        either carries the column or comes before (in WAL order) every row that does.
        """
        changed = self.table.schema_changes()
        if changed:
            self._closed = True
            self._executor.shutdown(wait=False)
            if claimed:
                self._beat(closed=True)  # the region is free for the next writer
            raise SchemaChangedError(
                f"{self.table.uri}: the table's column(s) {changed} were added or changed "
                "after this table object read its schema; nothing was written. Open the "
                "table again (MemWalTable.open) to write with the new schema"
                + (" (the region was claimed)" if claimed else "")
            )

    def _check_spec_after_claim(self, routed_spec_id: int) -> None:
        """SpecChangedError (and this writer closed) when the table's current region
        spec, re-read now that the region is claimed, is not the one its rows are
        routed by: see :mod:`memwal_query.maintain.specs` for why after the claim."""
        self.table.refresh_index()
        current = self.table.routing_spec().spec_id
        if current != routed_spec_id:
            self._closed = True
            self._executor.shutdown(wait=False)
            raise SpecChangedError(self.table.uri, routed_spec_id, current, self.region_id)

    def _new_beat(self, now: float, closed: bool = False) -> liveness.Heartbeat:
        return liveness.Heartbeat(
            self._heartbeat_owner, self.epoch, now, self.heartbeat_interval, closed=closed
        )

    def _beat(self, closed: bool = False) -> None:
        """Refresh this writer's heartbeat, or mark it ``closed``
        (:mod:`memwal_query.write.liveness`): a compare-and-swap of its previous beat.
        A fenced writer, or one whose heartbeat was taken over, stops beating. A
        failed refresh is retried at the next beat."""
        with self._cond:
            seen = self._heartbeat
            if seen is None or self._failed is not None or (self._closed and not closed):
                liveness.HEARTBEATS.discard(self)
                return
        now = time.time()
        try:
            new = liveness.swap(
                self.table.io, self.table.uri, self.region_id, seen, self._new_beat(now, closed)
            )
            if new is None:
                new = self._own_beat_landed(now, closed)
        except Exception:  # noqa: BLE001 - transient: the next beat tries again
            self.stats.heartbeat_errors += 1
            return
        with self._cond:
            self._heartbeat = new
        if new is None:  # taken over by a maintainer: this writer is about to be fenced
            liveness.HEARTBEATS.discard(self)
            return
        self._last_beat = now

    def _own_beat_landed(self, now: float, closed: bool) -> liveness.Observed | None:
        """After a failed compare-and-swap: when the stored heartbeat is this writer's own
        (an earlier write applied although it was reported failed, e.g. a lost answer or a
        retried conditional put), swap from it; None when another owner (a maintainer)
        wrote it or it is gone."""
        io, uri = self.table.io, self.table.uri
        current = liveness.read(io, uri, self.region_id)
        hb = current.heartbeat
        if hb is None or hb.owner != self._heartbeat_owner or hb.recovering:
            return None
        return liveness.swap(io, uri, self.region_id, current, self._new_beat(now, closed))

    # -- recovery --------------------------------------------------------------------
    def _replay(
        self, manifest: RegionManifest, early: Sequence[tuple[WalEntry, pa.Table]] = ()
    ) -> None:
        """Replay the WAL after the manifest's position: ``early`` (entries read and
        conformed before the claim), then whatever follows them."""
        after = manifest.replay_after_wal_entry_position
        for entry, rows in early:
            if entry.writer_epoch > self.epoch:
                raise FencedError(self.region_id, self.epoch, entry.writer_epoch)
            self._replay_one(entry, rows)
            after = entry.position
        for entry in self._wal.replay(after, self.epoch):
            self._replay_one(entry, self._conform(entry))

    def _replay_one(self, entry: WalEntry, rows: pa.Table) -> None:
        self._active.append(rows, entry.position)
        self._active.note_batch(entry.batch)
        if entry.written_at is not None:
            self._active.backdate(entry.written_at)  # max_memtable_age counts from the entry
        self._next_wal_position = entry.position + 1
        self.stats.replayed_entries += 1
        self.stats.replayed_rows += entry.table.num_rows

    # -- public API ------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Generation number of the active MemTable."""
        return self._active.generation

    def put(self, data: Any, partial: bool = False) -> None:
        """Upsert rows.

        Parameters
        ----------
        data : pa.Table, pa.RecordBatch, pa.RecordBatchReader or pandas.DataFrame
            Whole rows: every column must be given (NULL explicitly where meant).
        partial : bool
            Missing columns keep the key's current value instead (NULL, or an error
            for a non-nullable column, when the key does not exist yet), as Apache
            Paimon's ``partial-update`` merge engine does; it costs one lookup of the
            written keys per put, and such puts are serialized with the others of
            this writer.

        Raises
        ------
        SchemaError, PrimaryKeyError, WrongRegionError
            The rows do not fit the table or this region (nothing written).
        MemWalError
            An error of earlier background work (a flush, or a non-durable WAL
            write), raised once, also before anything is written.
        """
        if partial:
            from memwal_query.regions.spec import check_partial_sources

            rows, missing = coerce_partial_rows(data, self._schema, self._pk)
            check_partial_sources(self.table.routing_spec(), missing, self.table.lance_schema)
        else:
            rows, missing = coerce_rows(data, self._schema, self._pk), []
        self._check_region(rows)
        self._put_routed(rows, missing)

    def _put_routed(
        self,
        rows: pa.Table,
        missing: Sequence[str] = (),
        batch: tuple[str, int] | None = None,
    ) -> None:
        """Put rows already coerced and routed to this region (used by table.write);
        ``missing``: columns of a partial update, filled from the keys' current rows;
        ``batch``: the ``(stream, batch)`` these rows are (:meth:`applied_batch`).
        SchemaChangedError when they were coerced to another schema than this writer's
        (the table's schema changed in between; nothing written)."""
        if rows.schema.names != self._schema.names:
            raise SchemaChangedError(
                f"{self.table.uri}: the rows have columns {rows.schema.names}, this writer "
                f"of region {self.region_id} writes {self._schema.names} (the schema "
                "changed meanwhile); nothing was written"
            )
        if missing:
            self._write_partial(rows, list(missing), batch)
        else:
            self._write(with_tombstone(rows, False).cast(self._storage_schema), batch)
        self.stats.put_rows += rows.num_rows

    def _put_and_delete_routed(
        self,
        rows: pa.Table,
        keys: pa.Table,
        order: pa.Array,
        batch: tuple[str, int] | None = None,
    ) -> None:
        """Upserts and deletes already coerced (full rows; key columns) and routed to
        this region, written as ONE write (one WAL entry in durable mode): row ``i`` of
        the write is row ``order[i]`` of the upserts followed by the deletes' tombstones,
        so a batch of interleaved upserts and deletes keeps its order without one WAL
        entry per run; ``batch`` as for :meth:`_put_routed`."""
        stored = pa.concat_tables(
            [
                with_tombstone(rows, False).cast(self._storage_schema),
                tombstone_rows(keys, self._schema).cast(self._storage_schema),
            ]
        )
        self._write(stored.take(order), batch)
        self.stats.put_rows += rows.num_rows
        self.stats.delete_rows += keys.num_rows

    def delete(self, keys: Any) -> None:
        """Delete rows by primary key.

        Parameters
        ----------
        keys : array-like, pa.Table or dict
            The primary-key column(s).
        """
        key_table = coerce_keys(keys, self._schema, self._pk)
        self._check_region(key_table)
        self._delete_routed(key_table)

    def _delete_routed(self, keys: pa.Table, batch: tuple[str, int] | None = None) -> None:
        """Delete keys already coerced and routed to this region; ``batch`` as for
        :meth:`_put_routed`."""
        self._write(tombstone_rows(keys, self._schema).cast(self._storage_schema), batch)
        self.stats.delete_rows += keys.num_rows

    def applied_batch(self, stream: str) -> int | None:
        """The newest batch of ``stream`` whose rows are durable in this region, or None.

        A write given ``batch=(stream, n)`` records it in its WAL entry, and a flush
        records the newest batch per stream of the flushed rows in the region manifest.
        So this covers the rows replayed when the writer claimed the region, the rows
        it wrote, and the generations flushed before: a writer replaying batch ``n``
        of a stream (a retried Spark task, a restarted streaming query) skips a region
        where ``applied_batch(stream) == n``. Only the last write of a batch should
        carry it (a batch written as several writes is otherwise applied in part).
        """
        with self._cond:
            found = [self._stream_batches.get(stream)]
            found += [m.batches.get(stream) for m in (*self._sealed, self._active)]
        numbers = [n for n in found if n is not None]
        return max(numbers) if numbers else None

    def sync(self) -> None:
        """Write every buffered row to the WAL now (non-durable mode); no-op otherwise.

        Rows whose earlier (background) WAL write failed are still buffered and written
        here; this raises only if this write fails.
        """
        self._check_open()
        with self._wal_token():
            with self._cond:
                self._wal_error = None  # superseded by this attempt's outcome
            self._sync_locked_token()

    def flush(self) -> int | None:
        """Seal the MemTable and flush it (and any earlier sealed one) as generations.

        Returns the newest generation flushed during this call, or None when there was
        nothing to flush. Sealed MemTables whose background flush failed are retried
        here; this raises only if this attempt fails (FencedError when fenced).
        """
        self._check_open()
        with self._cond:
            done_before = len(self.stats.flushed_generations)
            self._wal_error = None  # _seal syncs every buffered row first
            # Superseded by this attempt's outcome. Cleared before sealing: the drain
            # _seal starts may fail before we wait for it, and that error is this
            # attempt's to raise.
            self._flush_error = None
        self._seal(force=True)
        return self._wait_flushed(done_before)

    def flush_due(self) -> int | None:
        """Flush the MemTable only if it is due, and wait for every pending flush.

        Due means what makes a writer flush on its own: ``max_memtable_rows``,
        ``max_memtable_bytes``, ``max_wal_entries`` or ``max_memtable_age`` passed
        (rows replayed from the WAL count, with the age of their entries). Otherwise
        the rows stay in the WAL, where every default reader sees them, and the next
        writer of the region replays them. Used by writers that live for one batch of a
        longer stream (a Spark task of a streaming micro-batch), so a stream makes
        generations by size and age, not by batch.

        Returns
        -------
        int or None
            The newest generation flushed during this call, or None.

        Raises
        ------
        FencedError
            Another writer claimed the region.
        """
        self._check_open()
        with self._cond:
            done_before = len(self.stats.flushed_generations)
            self._flush_error = None  # superseded by this attempt's outcome
        self._seal(force=False)
        return self._wait_flushed(done_before)

    def _wait_flushed(self, done_before: int) -> int | None:
        """Wait until no sealed MemTable is left (retrying failed flushes once); the
        newest generation flushed since ``stats.flushed_generations[done_before]``."""
        with self._cond:
            while True:
                while self._flush_active:
                    self._cond.wait()
                if self._failed is not None:
                    break
                if self._flush_error is not None:
                    error, self._flush_error = self._flush_error, None
                    raise error
                if not self._sealed:
                    done = self.stats.flushed_generations[done_before:]
                    return done[-1] if done else None
                self._schedule_flush_locked()
                if not self._flush_active:  # could not start: closed meanwhile
                    break
        self._check_open()  # raises FencedError / WriterClosedError
        raise WriterClosedError(f"writer of region {self.region_id} is closed")

    def close(self, flush: bool = True, *, handoff: bool = False) -> None:
        """Close the writer.

        Parameters
        ----------
        flush : bool
            Flush the MemTable first (default). With False, unflushed rows stay in
            the WAL (durable) and the next writer of the region replays them.
        handoff : bool
            The region's next writer is expected soon (the next batch of a stream, as
            the Spark sink's tasks are), so the heartbeat keeps its last beat instead
            of saying ``closed``: maintenance recovers the region's WAL only once no
            writer has beaten for ``abandoned_after``, not at its next pass.
        """
        if self._closed:
            return
        try:
            if self._failed is None:
                if flush:
                    self.flush()
                else:
                    self.sync()
        finally:
            self._closed = True
            liveness.HEARTBEATS.discard(self)
            if not handoff:
                self._beat(closed=True)
            self._executor.shutdown(wait=True)
            with self._cond:
                self._cond.notify_all()

    def __enter__(self) -> RegionWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close(flush=False)
            except MemWalError:
                pass

    def memtables(self) -> list[MemTableSnapshot]:
        """Snapshots of the unflushed MemTables (sealed ones first, then the active one).

        Readers use these for read-your-writes; rows are visible once acknowledged.
        """
        with self._cond:
            tables = [m.snapshot() for m in self._sealed]
            tables.append(self._active.snapshot())
        return [t for t in tables if t.batches]

    def manifest(self) -> RegionManifest:
        """The region's newest manifest (re-read from storage)."""
        latest = self._store.load_latest()
        assert latest is not None
        return latest

    @property
    def unflushed_rows(self) -> int:
        """Rows in the active and sealed MemTables."""
        with self._cond:
            return self._active.num_rows + sum(m.num_rows for m in self._sealed)

    # -- internals -------------------------------------------------------------------
    def _check_region(self, rows: pa.Table) -> None:
        from memwal_query.regions.spec import is_unsharded

        if rows.num_rows == 0:
            return
        if self.region_values is None:
            key = {k: rows.column(k)[0].as_py() for k in self._pk}
            raise WrongRegionError(
                f"region {self.region_id} is not a region of the table's region spec (a "
                "manual region of an older table, or one of another spec): it can be "
                "replayed, flushed and merged, but new rows go to the region the spec "
                f"gives their key (first row's key {key}); write with MemWalTable.write "
                "or MemWalTable.writer(region_values=...)"
            )
        spec = self.table.routing_spec()
        if is_unsharded(spec):
            return
        values = spec.evaluate(rows, self.table.lance_schema)
        for field_id, expected in self.region_values.items():
            col = values.column(field_id)
            scalar = pa.scalar(expected, type=col.type) if expected is not None else None
            if scalar is None:
                bad = pc.is_valid(col)
            elif (
                pa.types.is_floating(col.type)
                and isinstance(expected, float)
                and math.isnan(expected)
            ):
                bad = pc.invert(pc.fill_null(pc.is_nan(col), False))  # NaN's region: NaN rows
            else:
                bad = pc.invert(pc.fill_null(pc.equal(col, scalar), False))
            n_bad = pc.sum(bad.cast(pa.int64())).as_py() or 0
            if n_bad:
                idx = pc.index(bad, True).as_py()
                key = {k: rows.column(k)[idx].as_py() for k in self._pk}
                raise WrongRegionError(
                    f"{n_bad} row(s) belong to another region than {self.region_id} "
                    f"({field_id}={expected!r}); first: row {idx}, key {key}, has "
                    f"{field_id}={col[idx].as_py()!r}"
                )


def _tick_loop(ref: weakref.ref[RegionWriter], interval: float) -> None:
    """A writer's background thread; holds the writer only weakly, so a writer that is
    dropped without ``close()`` is still collected (and its thread ends)."""
    while True:
        time.sleep(interval)
        writer = ref()
        if writer is None or not writer._tick():
            return
        del writer
