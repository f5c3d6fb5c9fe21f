"""The in-memory MemTable of one region generation.

A MemTable is a list of Arrow record batches in write order (storage schema: table
columns + ``_tombstone``). Row ``i`` of the concatenation has row address ``i``, the
same address it gets in the flushed Lance table, so "highest ``_rowaddr`` wins" is
"last write wins" everywhere.

Batches are only appended, and readers take an immutable :class:`MemTableSnapshot`, so
a reader never blocks a writer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import SchemaError
from memwal_query.format.schema import dictionary_capacity, dictionary_values, too_many_values


@dataclass(frozen=True)
class MemTableSnapshot:
    """A consistent, immutable view of a MemTable for readers.

    Attributes
    ----------
    region_id : str
        Region the rows belong to.
    generation : int
        Generation the MemTable will be flushed as.
    batches : tuple[pa.RecordBatch, ...]
        Rows in write order, including ``_tombstone``.
    schema : pa.Schema
        Storage schema of the batches.
    """

    region_id: str
    generation: int
    batches: tuple[pa.RecordBatch, ...]
    schema: pa.Schema

    @property
    def num_rows(self) -> int:
        """Number of rows (puts and tombstones)."""
        return sum(b.num_rows for b in self.batches)

    def to_table(self) -> pa.Table:
        """Rows in write order as one table."""
        return pa.Table.from_batches(list(self.batches), schema=self.schema)


class DictionaryCounts(dict[str, pa.Array]):
    """Per dictionary column of 8- or 16-bit indices, the distinct values counted so
    far (:meth:`MemTable.dictionary_errors`), with the lock every MemTable counting
    them holds: the writers of one table share one, so that together they stay within
    the index type."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class MemTable:
    """Mutable MemTable; owned by one :class:`~memwal_query.write.writer.RegionWriter`.

    Rows are kept in WAL order, so flushing the MemTable and replaying the WAL agree on
    which write of a key is the newest. In non-durable mode rows are appended before
    they reach the WAL (``wal_position=None``); a WAL entry of another writer adopted
    while they are being synced goes *before* them (:meth:`adopt`), which is where
    replay puts it.

    Parameters
    ----------
    region_id : str
        Region id.
    generation : int
        Generation number it will be flushed as.
    schema : pa.Schema
        Storage schema (table columns + ``_tombstone``).
    """

    def __init__(
        self,
        region_id: str,
        generation: int,
        schema: pa.Schema,
        dictionaries: dict[str, pa.Array] | None = None,
    ) -> None:
        """``dictionaries``: the distinct values of the dictionary columns of 8- or
        16-bit indices to count this MemTable's rows with (shared with the writer's
        other MemTables, updated in place; a :class:`DictionaryCounts` may be shared by
        several writers too); None: only this MemTable's rows."""
        self.region_id = region_id
        self.generation = generation
        self.schema = schema
        self._batches: list[pa.RecordBatch] = []
        self.num_rows = 0
        self.nbytes = 0
        # Writes appended (one per WAL entry in durable mode) and when the first one
        # arrived (time.monotonic()): the writer flushes by count and by age too.
        self.appends = 0
        self.first_append_at: float | None = None
        self.first_wal_position: int | None = None
        self.last_wal_position: int | None = None
        # Per stream, the newest batch whose rows this MemTable holds (WAL entries
        # recording ``memwal_batch``): its flush records them in the region manifest.
        self.batches: dict[str, int] = {}
        # Index of the first batch not yet in the WAL (None: every batch is), and, while
        # a sync writes them, the end of the batches that sync covers.
        self._unsynced_from: int | None = None
        self._sync_end: int | None = None
        # Per dictionary column of 8- or 16-bit indices, the distinct values of its rows
        # (and of ``dictionaries``): a Lance data file holds one dictionary per column,
        # and flushes, merges, compactions and reads put many writes in one, so they
        # must fit the index type.
        self.dictionaries = DictionaryCounts() if dictionaries is None else dictionaries
        self._dictionary_lock = getattr(self.dictionaries, "lock", None) or threading.Lock()
        with self._dictionary_lock:
            for f in schema:
                if dictionary_capacity(f.type) is not None:
                    self.dictionaries.setdefault(f.name, pa.array([], f.type.value_type))

    def dictionary_errors(self, tables: Sequence[pa.Table]) -> list[SchemaError | None]:
        """For each of ``tables`` (rows about to be appended, in order), the SchemaError
        refusing it because its dictionary values and those of this MemTable's rows and
        of the tables before it not refused are more than a column's index type holds,
        or None. O(dictionary size) per table, not O(rows)."""
        with self._dictionary_lock:
            return self._counted(tables)[0]

    def _counted(
        self, tables: Sequence[pa.Table]
    ) -> tuple[list[SchemaError | None], dict[str, pa.Array]]:
        """:meth:`dictionary_errors` and the values with those of the tables not
        refused (caller holds the lock of :attr:`dictionaries`)."""
        running = dict(self.dictionaries)
        errors: list[SchemaError | None] = []
        for table in tables:
            grown, error = self._grown(running, table)
            errors.append(error)
            if error is None:
                running.update(grown)
        return errors, running

    def admit_dictionaries(self, tables: Sequence[pa.Table]) -> list[SchemaError | None]:
        """:meth:`dictionary_errors`, and the values of the tables not refused counted
        at once (before they are appended): a write of another writer sharing
        :attr:`dictionaries` checked meanwhile counts them. A table admitted and then
        not appended (its WAL write failed) stays counted: later writes are refused
        sooner, never later."""
        with self._dictionary_lock:
            errors, running = self._counted(tables)
            if any(e is None for e in errors):
                self.dictionaries.update(running)
            return errors

    def check_dictionaries(self, table: pa.Table) -> None:
        """SchemaError when ``table`` cannot be appended (see :meth:`dictionary_errors`);
        otherwise its values are counted (:meth:`admit_dictionaries`)."""
        error = self.admit_dictionaries([table])[0]
        if error is not None:
            raise error

    def _grown(
        self, running: dict[str, pa.Array], table: pa.Table
    ) -> tuple[dict[str, pa.Array], SchemaError | None]:
        """The values of ``running``'s columns with the dictionary values of ``table``
        added, and the SchemaError naming the first column whose values no longer fit
        its index type (None: they all fit)."""
        out: dict[str, pa.Array] = {}
        error: SchemaError | None = None
        for name, values in running.items():
            i = table.schema.get_field_index(name)
            if i < 0 or table.num_rows == 0:
                continue
            union = pc.unique(pa.concat_arrays([values, dictionary_values(table.column(i))]))
            t = self.schema.field(name).type
            cap = dictionary_capacity(t)
            if cap is not None and len(union) > cap and error is None:
                scope = "the table's rows with this write have"
                error = too_many_values(name, t, len(union), scope)
            out[name] = union
        return out, error

    def note_batch(self, batch: tuple[str, int] | None) -> None:
        """The rows just added are batch ``batch[1]`` of stream ``batch[0]`` (None: no
        batch recorded)."""
        if batch is not None:
            stream, number = batch
            self.batches[stream] = max(number, self.batches.get(stream, number))

    def _note_position(self, wal_position: int | None) -> None:
        if wal_position is None:
            return
        if self.first_wal_position is None or wal_position < self.first_wal_position:
            self.first_wal_position = wal_position
        if self.last_wal_position is None or wal_position > self.last_wal_position:
            self.last_wal_position = wal_position

    def _insert(self, at: int, table: pa.Table) -> int:
        batches = table.combine_chunks().to_batches() if table.num_rows else []
        if batches:
            self.appends += 1
            if self.first_append_at is None:
                self.first_append_at = time.monotonic()
        self._batches[at:at] = batches
        if self.dictionaries and table.num_rows:
            with self._dictionary_lock:
                self.dictionaries.update(self._grown(self.dictionaries, table)[0])
        self.num_rows += table.num_rows
        self.nbytes += table.nbytes
        return len(batches)

    def append(self, table: pa.Table, wal_position: int | None) -> None:
        """Append rows (already in the storage schema) written at ``wal_position``.

        ``wal_position=None``: the rows are not in the WAL yet (non-durable mode).
        """
        at = len(self._batches)
        if self._insert(at, table) and wal_position is None and self._unsynced_from is None:
            self._unsynced_from = at
        self._note_position(wal_position)

    def backdate(self, written_at: float) -> None:
        """Count this MemTable's age from ``written_at`` (epoch seconds) when that is
        earlier than its first append: rows replayed from a WAL entry are as old as the
        entry, not as the replay."""
        if self.first_append_at is None:
            return
        age = max(0.0, time.time() - written_at)
        self.first_append_at = min(self.first_append_at, time.monotonic() - age)

    def adopt(self, table: pa.Table, wal_position: int) -> None:
        """Add the rows of a WAL entry written before the rows not yet in the WAL.

        They go before the unsynced rows (at the end when there are none), so the
        MemTable stays in WAL order.
        """
        at = len(self._batches) if self._unsynced_from is None else self._unsynced_from
        n = self._insert(at, table)
        if self._unsynced_from is not None:
            self._unsynced_from += n
        if self._sync_end is not None:
            self._sync_end += n
        self._note_position(wal_position)

    def begin_sync(self) -> None:
        """The rows appended so far are being written as one WAL entry."""
        self._sync_end = len(self._batches)

    def end_sync(self, wal_position: int | None) -> None:
        """The sync started by :meth:`begin_sync` finished (None: it failed)."""
        if wal_position is not None and self._sync_end is not None:
            end = self._sync_end
            self._unsynced_from = end if end < len(self._batches) else None
            self._note_position(wal_position)
        self._sync_end = None

    def snapshot(self) -> MemTableSnapshot:
        """An immutable view of the rows appended so far."""
        return MemTableSnapshot(self.region_id, self.generation, tuple(self._batches), self.schema)

    def to_table(self) -> pa.Table:
        """All rows in write order."""
        return pa.Table.from_batches(self._batches, schema=self.schema)
