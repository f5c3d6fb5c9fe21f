"""The region write-ahead log: one Arrow IPC stream file per WAL entry.

Entry ``N`` lives at ``_mem_wal/{region}/wal/{bit_reversed(N)}.arrow`` and is written
with put-if-not-exists, so it is either wholly present or absent, and a second writer
that races for the same position loses (it has been fenced). Positions start at 1, as
pylance's native writer does: ``replay_after_wal_entry_position == 0`` means "nothing
flushed yet", and replay starts at ``replay_after_wal_entry_position + 1``.

Each entry's schema metadata carries ``writer_epoch`` (spec) and ``generation`` (the
MemTable generation the rows belong to, as pylance writes it). Rows carry a non-null
boolean ``_tombstone`` column: ``true`` marks a delete whose non-key columns are NULL.
We also record ``num_rows`` so a file cut exactly at a message boundary is still
detected as truncated; entries written by pylance (no ``num_rows``) are checked for the
end-of-stream marker only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from . import crashpoints
from .exceptions import AlreadyExistsError, FencedError, ObjectNotFoundError, WalCorruptError
from .io import FileIO, join
from .naming import wal_entry_name

TOMBSTONE = "_tombstone"
EPOCH_KEY = b"writer_epoch"
GENERATION_KEY = b"generation"
NUM_ROWS_KEY = b"num_rows"
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


@dataclass(frozen=True)
class WalEntry:
    """One decoded WAL entry.

    Attributes
    ----------
    position : int
        WAL position (1-based).
    writer_epoch : int
        Epoch of the writer that wrote it.
    generation : int | None
        MemTable generation recorded in the entry, when present.
    table : pa.Table
        The rows, including the ``_tombstone`` column.
    """

    position: int
    writer_epoch: int
    generation: int | None
    table: pa.Table


def encode_entry(table: pa.Table, writer_epoch: int, generation: int) -> bytes:
    """Serialize rows (with ``_tombstone``) as an Arrow IPC stream with epoch metadata."""
    metadata = dict(table.schema.metadata or {})
    metadata[EPOCH_KEY] = str(writer_epoch).encode()
    metadata[GENERATION_KEY] = str(generation).encode()
    metadata[NUM_ROWS_KEY] = str(table.num_rows).encode()
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_entry(path: str, position: int, data: bytes) -> WalEntry:
    """Decode and validate one entry; raise WalCorruptError naming ``path``."""
    if not data.endswith(_EOS):
        raise WalCorruptError(path, "truncated WAL entry (no end-of-stream marker)")
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        table = reader.read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise WalCorruptError(path, f"unreadable WAL entry: {e}") from e
    meta = table.schema.metadata or {}
    try:
        epoch = int(meta[EPOCH_KEY])
    except (KeyError, ValueError) as e:
        raise WalCorruptError(path, "WAL entry has no valid writer_epoch metadata") from e
    generation = int(meta[GENERATION_KEY]) if GENERATION_KEY in meta else None
    if NUM_ROWS_KEY in meta and int(meta[NUM_ROWS_KEY]) != table.num_rows:
        raise WalCorruptError(
            path,
            f"WAL entry holds {table.num_rows} rows, its header says {int(meta[NUM_ROWS_KEY])}",
        )
    if TOMBSTONE not in table.column_names:
        raise WalCorruptError(path, f"WAL entry has no {TOMBSTONE} column")
    return WalEntry(position, epoch, generation, table)


class Wal:
    """Write and replay the WAL of one region.

    Parameters
    ----------
    io : FileIO
        Object store.
    wal_dir : str
        ``_mem_wal/{region}/wal`` of the region.
    region_id : str
        Region id, for error messages.
    """

    def __init__(self, io: FileIO, wal_dir: str, region_id: str) -> None:
        self.io = io
        self.dir = wal_dir
        self.region_id = region_id

    def path(self, position: int) -> str:
        """Path of the entry at ``position``."""
        return join(self.dir, wal_entry_name(position))

    def append(self, position: int, table: pa.Table, writer_epoch: int, generation: int) -> int:
        """Write entry ``position``; FencedError if another writer already wrote it.

        Returns the number of bytes written.
        """
        data = encode_entry(table, writer_epoch, generation)
        try:
            self.write_encoded(position, data)
        except AlreadyExistsError as e:
            raise FencedError(self.region_id, writer_epoch, None) from e
        return len(data)

    def write_encoded(self, position: int, data: bytes) -> None:
        """Put already-encoded entry bytes at ``position``; AlreadyExistsError if taken."""
        self.io.put_if_not_exists(self.path(position), data)
        crashpoints.point("wal.after_write")

    def read(self, position: int) -> WalEntry:
        """Read and decode the entry at ``position``."""
        path = self.path(position)
        return decode_entry(path, position, self.io.read(path))

    def exists(self, position: int) -> bool:
        """HEAD on entry ``position``."""
        return self.io.exists(self.path(position))

    def last_position(self, after: int = 0) -> int:
        """Highest contiguous position present after ``after`` (``after`` if none)."""
        position = after
        while self.exists(position + 1):
            position += 1
        return position

    def replay(self, after: int, current_epoch: int) -> Iterator[WalEntry]:
        """Yield entries ``after + 1, after + 2, ...`` until one is missing.

        Entries written by older (fenced) writers are replayed, not dropped (spec,
        Appendix 1). An entry with an epoch above ``current_epoch`` means a newer writer
        exists: FencedError.
        """
        position = after + 1
        while True:
            try:
                entry = self.read(position)
            except ObjectNotFoundError:
                return
            if entry.writer_epoch > current_epoch:
                raise FencedError(self.region_id, current_epoch, entry.writer_epoch)
            yield entry
            position += 1

    def delete_through(self, position: int, start: int = 1) -> list[str]:
        """Delete entries ``start..position`` (garbage collection); return deleted paths."""
        removed = []
        for p in range(start, position + 1):
            path = self.path(p)
            if self.io.exists(path):
                self.io.delete(path)
                removed.append(path)
        return removed
