"""The write path of a region writer: WAL group commit, fencing checks, backpressure,
partial updates and the background tick (see :mod:`memwal_query.write.writer`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

from memwal_query.exceptions import (
    AlreadyExistsError,
    BackpressureError,
    FencedError,
    MemWalError,
    SchemaError,
)
from memwal_query.format.schema import (
    fill_missing,
    with_tombstone,
)
from memwal_query.format.wal import encode_entry
from memwal_query.write.writer_state import _FlushPath, _Request


class _WalPath(_FlushPath):
    """Puts and deletes: into the WAL (durable) and the active MemTable."""

    @contextmanager
    def _wal_token(self) -> Iterator[None]:
        """Exclusive right to write the WAL and swap MemTables (held briefly)."""
        with self._cond:
            while self._wal_busy:
                self._cond.wait()
            self._wal_busy = True
        try:
            yield
        finally:
            with self._cond:
                self._wal_busy = False
                self._cond.notify_all()

    def _append_wal(self, rows: pa.Table, batch: tuple[str, int] | None = None) -> int | None:
        """Write ``rows`` as the next WAL entry (caller holds the WAL token), recording
        ``batch`` (see :meth:`RegionWriter.applied_batch`).

        Returns its position once it is written and this writer is known not to be
        fenced; only then may the rows be acknowledged. None (only with a ``batch``):
        an entry of the same batch was found at the next position and adopted (another
        attempt of the batch wrote it): the rows are durable there, and neither written
        again nor to be added to the MemTable.
        """
        data = encode_entry(rows, self.epoch, self._active.generation, batch)
        while True:
            position = self._next_wal_position
            try:
                self._wal.write_encoded(position, data)
            except AlreadyExistsError:
                if self._adopt(position) == batch and batch is not None:
                    self._check_superseded()
                    return None
                continue
            # Not advancing _next_wal_position before the check passes: if the check
            # fails for another reason (storage error), the next write finds this entry
            # at the same position and adopts it, so MemTable and WAL still agree.
            self._check_superseded()
            self._next_wal_position = position + 1
            self.stats.wal_entries += 1
            self.stats.wal_bytes += len(data)
            return position

    def _adopt(self, position: int) -> tuple[str, int] | None:
        """Take over the entry someone already wrote at our next position.

        Written by an older (fenced) writer, or by this writer in a write whose outcome
        was unknown (it raised, e.g. a timeout, but the object was stored): the entry
        will be replayed after a crash, so it must be in the MemTable too, in WAL order
        (before rows not yet in the WAL). Written by a newer writer: we are fenced.
        Returns the entry's ``(stream, batch)``, if it records one.
        """
        entry = self._wal.read(position)
        if entry.writer_epoch > self.epoch:
            raise self._fenced(FencedError(self.region_id, self.epoch, entry.writer_epoch))
        table = self._conform(entry)
        with self._cond:
            self._active.adopt(table, position)
            self._active.note_batch(entry.batch)
        self._next_wal_position = position + 1
        self.stats.adopted_entries += 1
        return entry.batch

    def _check_superseded(self) -> None:
        """FencedError if another writer claimed the region since this writer's newest
        known manifest version: one HEAD of version ``known + 1``, after the WAL entry
        is stored and before it is acknowledged. Why this one check suffices to never
        acknowledge a write that no later writer replays: ``docs/writing.md``, "A fenced
        writer never acknowledges a lost write"."""
        try:
            known = self._store.check_superseded(self._known_version, self.epoch)
        except FencedError as e:
            raise self._fenced(e) from None
        if known != self._known_version:
            with self._cond:
                self._known_version = max(self._known_version, known)

    def _wait_for_room(self) -> None:
        """Backpressure: block while ``max_unflushed_memtables`` sealed MemTables wait for
        their flush (BackpressureError after ``backpressure_timeout``)."""
        if len(self._sealed) < self.max_unflushed_memtables:
            return  # unlocked fast path
        deadline = (
            None
            if self.backpressure_timeout is None
            else time.monotonic() + self.backpressure_timeout
        )
        with self._cond:
            while len(self._sealed) >= self.max_unflushed_memtables:
                if self._failed is not None or self._closed:
                    break
                if self._flush_error is not None:
                    break  # raised by _raise_background_error, which retries the flush
                if not self._flush_active:
                    self._schedule_flush_locked()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise BackpressureError(
                        f"region {self.region_id}: {len(self._sealed)} MemTables wait "
                        f"for their flush (max_unflushed_memtables="
                        f"{self.max_unflushed_memtables}) and none finished within "
                        f"{self.backpressure_timeout} s; the put was not written"
                    )
                self._cond.wait(timeout=left if left is not None else 1.0)
        self._check_open()
        self._raise_background_error()

    def _write(self, rows: pa.Table, batch: tuple[str, int] | None = None) -> None:
        self._check_open()
        self._raise_background_error()
        if rows.num_rows == 0:
            return
        self._wait_for_room()
        if self.durable:
            self._durable_write(rows, batch)
            self._seal(force=False)
            return
        if batch is not None:
            raise MemWalError("a write of a stream's batch needs a durable writer")
        with self._cond:
            while self._partial_busy:
                self._cond.wait()
            self._active.check_dictionaries(rows)
            self._active.append(rows, None)
            self._unsynced.append(rows)
            self._unsynced_bytes += rows.nbytes
            over = self._unsynced_bytes >= self.max_wal_buffer_bytes
        # The rows are accepted (non-durable puts never wait for the WAL). A failed WAL
        # write keeps them buffered and is reported by the next call, not this one.
        try:
            if over:
                with self._wal_token():
                    self._sync_locked_token()
            self._seal(force=False)
        except FencedError:
            raise
        except Exception as e:  # noqa: BLE001 - surfaced by the next put/delete
            with self._cond:
                self._wal_error = e
            self.stats.wal_write_errors += 1

    def _write_partial(
        self, rows: pa.Table, missing: list[str], batch: tuple[str, int] | None = None
    ) -> None:
        """A partial update: fill ``missing`` columns from the keys' current rows, then
        write. The WAL token is held from the lookup to the write, so no other put of
        this writer comes between them; a put of another writer fences this one first
        (the write then fails and nothing is acknowledged)."""
        self._check_open()
        self._raise_background_error()
        if rows.num_rows == 0:
            return
        self._wait_for_room()
        with self._wal_token():
            with self._cond:
                self._partial_busy = True
            try:
                if self._lookup is None:
                    raise SchemaError(
                        f"{self.table.uri}: this writer cannot read current rows, so it "
                        f"cannot fill the missing column(s) {missing} of a partial update "
                        "(open writers with MemWalTable.writer)"
                    )
                current = self._lookup(
                    rows.select(self._pk), columns=[*self._pk, *missing], writers=[self]
                )
                full = fill_missing(rows, missing, current, self._pk, self._schema)
                stored = with_tombstone(full, False).cast(self._storage_schema)
                with self._cond:
                    self._active.check_dictionaries(stored)
                if self.durable:
                    position = self._append_wal(stored, batch)
                    if position is not None:  # None: the batch's entry was adopted
                        with self._cond:
                            self._active.append(stored, position)
                            self._active.note_batch(batch)
                elif batch is not None:
                    raise MemWalError("a write of a stream's batch needs a durable writer")
                else:
                    with self._cond:
                        self._active.append(stored, None)
                        self._unsynced.append(stored)
                        self._unsynced_bytes += stored.nbytes
            finally:
                with self._cond:
                    self._partial_busy = False
                    self._cond.notify_all()
        self._seal(force=False)

    def _durable_write(self, rows: pa.Table, batch: tuple[str, int] | None = None) -> None:
        req = _Request(rows, batch)
        with self._cond:
            self._pending.append(req)
            while not req.done and self._wal_busy:
                self._cond.wait()
            if req.done:
                if req.error is not None:
                    raise req.error
                return
            self._wal_busy = True  # leader
            # One entry records one batch: the leader takes the writes of its own batch.
            group = [r for r in self._pending if r.batch == batch]
            self._pending = [r for r in self._pending if r.batch != batch]
        error: BaseException | None = None
        refused: list[SchemaError | None] = [None] * len(group)
        try:
            # Rows whose dictionary values would not fit a flush are refused, each on
            # its own (nothing of them written); the others of the group are written.
            with self._cond:
                refused = self._active.admit_dictionaries([r.rows for r in group])
            admitted = [r.rows for r, refusal in zip(group, refused, strict=True) if not refusal]
            if admitted:
                table = pa.concat_tables(admitted) if len(admitted) > 1 else admitted[0]
                position = self._append_wal(table, batch)
                if position is not None:  # None: the batch's entry was adopted
                    with self._cond:
                        self._active.append(table, position)
                        self._active.note_batch(batch)
        except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
            error = e
        with self._cond:
            for r, refusal in zip(group, refused, strict=True):
                r.done = True
                r.error = refusal or error
            self._wal_busy = False
            self._cond.notify_all()
        if req.error is not None:
            raise req.error

    def _sync_locked_token(self) -> None:
        """Write unsynced rows as one WAL entry (caller holds the WAL token).

        On failure the rows stay buffered (oldest first), so a later sync writes them
        or raises; they are already in the MemTable.
        """
        with self._cond:
            if not self._unsynced:
                return
            rows, self._unsynced = self._unsynced, []
            nbytes, self._unsynced_bytes = self._unsynced_bytes, 0
            active = self._active  # swapped only under the WAL token, which we hold
            active.begin_sync()
        position: int | None = None
        try:
            position = self._append_wal(pa.concat_tables(rows))
        finally:
            with self._cond:
                active.end_sync(position)
                if position is None:
                    self._unsynced[:0] = rows
                    self._unsynced_bytes += nbytes

    def _tick_interval(self) -> float:
        interval = min(self.max_memtable_age / 4, 1.0)
        return interval if self.durable else min(interval, self.wal_flush_interval)

    def _tick(self) -> bool:
        """One background tick: seal a MemTable older than ``max_memtable_age``, and in
        non-durable mode write the buffered rows to the WAL. False: stop ticking.

        Keeps going after a failed write (the rows stay buffered and are retried); the
        error is raised by the next put/delete unless a later write succeeds first.
        """
        if self._closed or self._failed is not None:
            return False
        if self._too_old(self._active):
            try:
                self._seal(force=False)
            except Exception:  # noqa: BLE001 - the next put/flush reports it
                pass
        if self.durable or not self._unsynced:
            return True
        try:
            with self._wal_token():
                self._sync_locked_token()
                with self._cond:
                    self._wal_error = None  # everything buffered is in the WAL now
        except FencedError:
            return False
        except Exception as e:  # noqa: BLE001 - surfaced by the next put/delete/sync
            with self._cond:
                self._wal_error = e
            self.stats.wal_write_errors += 1
        return True

    def _seal(self, force: bool) -> None:
        """Swap the active MemTable for a new one and schedule its flush."""
        if not force and not self._full(self._active):
            return
        with self._wal_token():
            while True:
                self._sync_locked_token()
                with self._cond:
                    if self._unsynced:
                        continue  # rows arrived while syncing: they belong to this MemTable
                    self._swap_locked(force)
                    return
