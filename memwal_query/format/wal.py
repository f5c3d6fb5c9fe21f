"""The region write-ahead log: one Arrow IPC stream file per WAL entry.

Entry ``N`` (positions start at 1) lives at
``_mem_wal/{region}/wal/{bit_reversed(N)}.arrow`` and is written put-if-not-exists.
:func:`encode_entry` writes an entry whose schema metadata carries ``writer_epoch``,
``generation``, ``num_rows``, ``written_at_ms``, a ``checksum`` and, for a write of
one batch of a stream (a Spark streaming sink's micro-batch), ``memwal_batch``
(``{stream}:{batch}``); rows carry a
non-null ``_tombstone`` column. :func:`decode_entry` reads one back as a
:class:`WalEntry` (entries written by pylance, without ``num_rows``,
``written_at_ms`` or ``checksum``, are accepted); :class:`Wal` reads, writes and
replays a region's entries.

Raises :class:`~memwal_query.exceptions.WalCorruptError` naming the entry for a
truncated or corrupted entry, and for a missing position followed by later entries
(a hole), never a shorter replay.

Format: docs/compatibility.md; checks, holes and repair: docs/hostile-storage.md ("WAL").
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from memwal_query.exceptions import (
    AlreadyExistsError,
    FencedError,
    ObjectNotFoundError,
    WalCorruptError,
)
from memwal_query.format.naming import WAL_SUFFIX, numbers_in, wal_entry_name
from memwal_query.format.rowfile import aligned
from memwal_query.storage import crashpoints
from memwal_query.storage.io import FileIO, join

TOMBSTONE = "_tombstone"
EPOCH_KEY = b"writer_epoch"
GENERATION_KEY = b"generation"
NUM_ROWS_KEY = b"num_rows"
WRITTEN_AT_KEY = b"written_at_ms"
BATCH_KEY = b"memwal_batch"
CHECKSUM_KEY = b"checksum"
REPAIR_KEY = b"memwal_repair"  # set on the empty entry that fills a repaired hole
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
    written_at : float | None
        When the entry was written (epoch seconds, the writer's clock), when recorded.
    batch : tuple[str, int] | None
        ``(stream, batch)`` of a write of one batch of a stream, when recorded.
    """

    position: int
    writer_epoch: int
    generation: int | None
    table: pa.Table
    written_at: float | None = None
    batch: tuple[str, int] | None = None


def encode_entry(
    table: pa.Table, writer_epoch: int, generation: int, batch: tuple[str, int] | None = None
) -> bytes:
    """Serialize rows (with ``_tombstone``) as an Arrow IPC stream with epoch metadata;
    ``batch``: the ``(stream, batch)`` whose rows these are, recorded as ``memwal_batch``."""
    metadata = dict(table.schema.metadata or {})
    metadata[EPOCH_KEY] = str(writer_epoch).encode()
    metadata[GENERATION_KEY] = str(generation).encode()
    metadata[NUM_ROWS_KEY] = str(table.num_rows).encode()
    metadata[WRITTEN_AT_KEY] = str(int(time.time() * 1000)).encode()
    metadata.pop(CHECKSUM_KEY, None)
    metadata.pop(BATCH_KEY, None)
    if batch is not None:
        metadata[BATCH_KEY] = f"{batch[0]}:{int(batch[1])}".encode()
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    # The record batches do not depend on the schema's metadata: swap in a schema
    # message carrying the checksum of everything else.
    body = data[_schema_message_end(data) :]
    # The checksum goes first: a damaged key-value count that drops trailing keys
    # leaves it in place, so the loss is detected rather than read as "no checksum".
    metadata = {CHECKSUM_KEY: _checksum(table.schema, body).encode(), **metadata}
    head = table.schema.with_metadata(metadata).serialize().to_pybytes()
    return head + body


def _schema_message_end(data: bytes) -> int:
    """Offset just past the first (schema) message of an Arrow IPC stream (0 if unsure)."""
    if len(data) < 8 or data[:4] != b"\xff\xff\xff\xff":
        return 0
    end = 8 + int.from_bytes(data[4:8], "little", signed=True)
    return end if 8 <= end <= len(data) else 0


def _checksum(schema: pa.Schema, body: bytes | memoryview) -> str:
    """``crc32:{hex}`` over the fields, the metadata but the checksum, and ``body``."""
    meta = sorted((k, v) for k, v in (schema.metadata or {}).items() if k != CHECKSUM_KEY)
    fields = schema.remove_metadata().to_string(show_field_metadata=True)
    crc = zlib.crc32(fields.encode())
    crc = zlib.crc32(repr(meta).encode(), crc)
    return f"crc32:{zlib.crc32(body, crc):08x}"


def _int_meta(path: str, meta: dict[bytes, bytes], key: bytes, required: bool) -> int | None:
    """A non-negative decimal integer from the entry's schema metadata."""
    raw = meta.get(key)
    if raw is None:
        if required:
            raise WalCorruptError(path, f"WAL entry has no {key.decode()} metadata")
        return None
    if not (isinstance(raw, bytes) and raw.isdigit() and len(raw) <= 20):
        raise WalCorruptError(
            path, f"WAL entry metadata {key.decode()}={raw!r} is not a non-negative integer"
        )
    return int(raw)


def decode_entry(path: str, position: int, data: bytes) -> WalEntry:
    """Decode and validate one entry; raise WalCorruptError naming ``path``.

    Checks the framing, that the Arrow data is well formed (full validation, so a
    damaged buffer cannot turn into wrong rows later), the integer metadata, and a
    non-null boolean ``_tombstone`` column. Checks against the table schema are
    :func:`conform_entry`'s.
    """
    if not data.endswith(_EOS):
        raise WalCorruptError(path, "truncated WAL entry (no end-of-stream marker)")
    try:
        table = aligned(pa.ipc.open_stream(pa.py_buffer(data)).read_all())
        table.validate(full=True)
        schema = table.schema
        meta = schema.metadata or {}
    except (pa.ArrowException, OSError, ValueError, NotImplementedError) as e:
        # ArrowException covers ArrowInvalid, ArrowKeyError, ArrowNotImplementedError...;
        # ValueError includes UnicodeDecodeError from damaged metadata.
        raise WalCorruptError(path, f"unreadable WAL entry: {type(e).__name__}: {e}") from e
    stored = meta.get(CHECKSUM_KEY)
    if stored is not None:
        end = _schema_message_end(data)
        want = _checksum(schema, memoryview(data)[end:]) if end else None
        if stored.decode("latin-1") != want:
            raise WalCorruptError(
                path, f"WAL entry checksum mismatch (stored {stored!r}, computed {want!r})"
            )
    epoch = _int_meta(path, meta, EPOCH_KEY, required=True)
    generation = _int_meta(path, meta, GENERATION_KEY, required=False)
    num_rows = _int_meta(path, meta, NUM_ROWS_KEY, required=False)
    written_ms = _int_meta(path, meta, WRITTEN_AT_KEY, required=False)
    if num_rows is not None and num_rows != table.num_rows:
        raise WalCorruptError(
            path, f"WAL entry holds {table.num_rows} rows, its header says {num_rows}"
        )
    at = schema.get_field_index(TOMBSTONE)  # -1: missing, or more than one
    if at < 0:
        raise WalCorruptError(path, f"WAL entry has no (single) {TOMBSTONE} column")
    tomb = table.column(at)
    if not pa.types.is_boolean(tomb.type):
        raise WalCorruptError(path, f"WAL entry column {TOMBSTONE} is {tomb.type}, not bool")
    if tomb.null_count:
        raise WalCorruptError(path, f"WAL entry column {TOMBSTONE} holds {tomb.null_count} NULL(s)")
    assert epoch is not None
    written_at = None if written_ms is None else written_ms / 1000.0
    return WalEntry(position, epoch, generation, table, written_at, _batch(path, meta))


def _batch(path: str, meta: dict[bytes, bytes]) -> tuple[str, int] | None:
    """The entry's ``memwal_batch`` as ``(stream, batch)``, or None."""
    raw = meta.get(BATCH_KEY)
    if raw is None:
        return None
    stream, _, number = raw.rpartition(b":")
    if not stream or not number.isdigit() or len(number) > 20:
        raise WalCorruptError(path, f"WAL entry metadata {BATCH_KEY.decode()}={raw!r} is malformed")
    try:
        return stream.decode(), int(number)
    except UnicodeDecodeError as e:
        raise WalCorruptError(path, f"WAL entry metadata {BATCH_KEY.decode()} is not UTF-8") from e


def conform_entry(
    path: str, table: pa.Table, storage_schema: pa.Schema, primary_key: list[str]
) -> pa.Table:
    """The rows of a decoded entry in ``storage_schema``; WalCorruptError naming ``path``.

    Columns added to the table after the entry was written read as NULL; columns the
    table no longer has are dropped. Primary-key columns must be present with exactly
    the table's type (a cast could silently turn one key into another), and no
    non-nullable column (the keys, ``_tombstone``) may hold a NULL: such an entry
    could be replayed but never flushed.
    """
    if table.schema.equals(storage_schema, check_metadata=False):
        # the same fields: only the schema's metadata differs (no cast, no copy)
        out = pa.Table.from_batches(table.to_batches(), schema=storage_schema)
        _check_not_null(path, out, storage_schema)
        return out
    else:
        columns = []
        for f in storage_schema:
            if f.name not in table.column_names:
                if f.name in primary_key:
                    raise WalCorruptError(path, f"WAL entry has no primary-key column {f.name!r}")
                columns.append(pa.nulls(table.num_rows, f.type))
                continue
            col = table.column(f.name)
            if col.type != f.type:
                if f.name in primary_key:
                    raise WalCorruptError(
                        path,
                        f"WAL entry primary-key column {f.name!r} is {col.type}, "
                        f"the table's is {f.type}",
                    )
                try:
                    col = col.cast(f.type)
                except (pa.ArrowException, ValueError, NotImplementedError) as e:
                    raise WalCorruptError(
                        path,
                        f"WAL entry column {f.name!r}: cannot read {col.type} as {f.type}: {e}",
                    ) from e
            columns.append(col)
        out = pa.Table.from_arrays(columns, schema=storage_schema)
    _check_not_null(path, out, storage_schema)
    return out.cast(storage_schema)


_NOT_NULL: dict[int, tuple[pa.Schema, list[int]]] = {}


def _check_not_null(path: str, rows: pa.Table, storage_schema: pa.Schema) -> None:
    """WalCorruptError naming ``path`` when a non-nullable column holds a NULL."""
    known = _NOT_NULL.get(id(storage_schema))
    if known is None or known[0] is not storage_schema:
        if len(_NOT_NULL) >= 64:
            _NOT_NULL.clear()
        known = (storage_schema, [i for i, f in enumerate(storage_schema) if not f.nullable])
        _NOT_NULL[id(storage_schema)] = known
    for i in known[1]:
        nulls = rows.column(i).null_count
        if nulls:
            raise WalCorruptError(
                path,
                f"WAL entry column {storage_schema.field(i).name!r} holds {nulls} NULL(s) "
                "but is non-nullable",
            )


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

    def positions(self) -> list[int]:
        """Sorted positions of the entries in storage (one LIST)."""
        return numbers_in(self.io.list(self.dir), WAL_SUFFIX)

    def check_end(self, missing: int) -> None:
        """WalCorruptError if any entry exists beyond the missing position ``missing``.

        Replay ends at the first missing position; entries after it were acknowledged
        and would be lost silently (an older value would win).
        """
        beyond = [p for p in self.positions() if p > missing]
        if beyond:
            raise WalCorruptError(
                self.path(missing),
                f"WAL entry {missing} of region {self.region_id} is missing but "
                f"{len(beyond)} later entr{'y' if len(beyond) == 1 else 'ies'} "
                f"({beyond[0]}..{beyond[-1]}) exist: acknowledged writes would be lost. "
                f"`memwal repair URI --region {self.region_id} --accept-loss` moves past it",
            )

    def replay(self, after: int, current_epoch: int) -> Iterator[WalEntry]:
        """Yield entries ``after + 1, after + 2, ...`` until one is missing.

        Entries written by older (fenced) writers are replayed, not dropped (spec,
        Appendix 1). An entry with an epoch above ``current_epoch`` means a newer writer
        exists: FencedError. A missing position followed by later entries is a
        WalCorruptError (:meth:`check_end`).
        """
        position = after + 1
        while True:
            try:
                entry = self.read(position)
            except ObjectNotFoundError:
                self.check_end(position)
                return
            if entry.writer_epoch > current_epoch:
                raise FencedError(self.region_id, current_epoch, entry.writer_epoch)
            yield entry
            position += 1
