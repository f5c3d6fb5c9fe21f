"""The in-memory MemTable of one region generation.

A MemTable is a list of Arrow record batches in write order (storage schema: table
columns + ``_tombstone``). Row ``i`` of the concatenation has row address ``i``, the
same address it gets in the flushed Lance table, so "highest ``_rowaddr`` wins" is
"last write wins" everywhere.

Batches are only appended, and readers take an immutable :class:`MemTableSnapshot`, so
a reader never blocks a writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


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


class MemTable:
    """Mutable MemTable; owned by one :class:`~memwal_query.writer.RegionWriter`.

    Parameters
    ----------
    region_id : str
        Region id.
    generation : int
        Generation number it will be flushed as.
    schema : pa.Schema
        Storage schema (table columns + ``_tombstone``).
    """

    def __init__(self, region_id: str, generation: int, schema: pa.Schema) -> None:
        self.region_id = region_id
        self.generation = generation
        self.schema = schema
        self._batches: list[pa.RecordBatch] = []
        self.num_rows = 0
        self.nbytes = 0
        self.first_wal_position: int | None = None
        self.last_wal_position: int | None = None

    def append(self, table: pa.Table, wal_position: int | None) -> None:
        """Append rows (already in the storage schema) written at ``wal_position``."""
        if table.num_rows:
            for batch in table.combine_chunks().to_batches():
                self._batches.append(batch)
            self.num_rows += table.num_rows
            self.nbytes += table.nbytes
        if wal_position is not None:
            if self.first_wal_position is None:
                self.first_wal_position = wal_position
            self.last_wal_position = wal_position

    def snapshot(self) -> MemTableSnapshot:
        """An immutable view of the rows appended so far."""
        return MemTableSnapshot(self.region_id, self.generation, tuple(self._batches), self.schema)

    def to_table(self) -> pa.Table:
        """All rows in write order."""
        return pa.Table.from_batches(self._batches, schema=self.schema)
