"""The rows sidecar of a flushed generation: ``memwal_rows.bin``.

Opening a generation's Lance table and scanning it costs about 2 ms of fixed overhead
however small the generation, so a search over 192 unmerged generations spent most of
its first query opening them. At flush, next to ``bloom_filter.bin``, the writer also
stores the generation's rows as one Arrow IPC file: every stored column (with
``_tombstone``) plus ``_rowaddr``, the row address of each row in the generation's
Lance table (what Lance's ``with_row_address`` returns: ``fragment id << 32 | offset``).
Readers read it in one request and decode it without copying.

Layout: the Arrow IPC *file* bytes, then an 8-byte trailer: the CRC-32 of those bytes
(little-endian ``uint32``) and the magic ``MWR1``. A reader checks the trailer and the
CRC before decoding, so a truncated or corrupted sidecar is detected. The Arrow schema
metadata names the generation directory the file was written for
(``memwal.generation_dir``): a sidecar copied into another generation's directory is
refused like a damaged one (files without the name, from older writers, are read).

The sidecar is an optimisation only, never the source of truth: the Lance table is.
A generation without one (written by pylance's native MemWAL or an older memwal_query,
or a flush that died between the two) or with a damaged one is read from its Lance
table, so answers never depend on it. The file is extra: pylance's native reader
ignores it, and GC removes it with the generation's directory.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import ObjectNotFoundError, StorageError
from memwal_query.format.schema import ROWADDR_COLUMN
from memwal_query.storage.io import FileIO, join

T = TypeVar("T")

ROWS_FILE = "memwal_rows.bin"
_MAGIC = b"MWR1"
_TRAILER = struct.Struct("<I4s")
OWNER_KEY = b"memwal.generation_dir"
"""Schema metadata key of a sealed sidecar: the name of the generation directory it
was written for."""


def dir_name(uri: str) -> str:
    """The last path segment of ``uri`` (a generation directory's name)."""
    return uri.rstrip("/").rsplit("/", 1)[-1]


def row_addresses(fragments: list[tuple[int, int]]) -> np.ndarray:
    """Row addresses of a Lance table's rows in scan order, from its fragments' ``(id,
    physical rows)`` (a table without deletions, as a flushed generation is)."""
    parts = [
        (np.uint64(fid) << np.uint64(32)) + np.arange(n, dtype=np.uint64) for fid, n in fragments
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def encode(rows: pa.Table, addresses: np.ndarray, owner: str | None = None) -> bytes:
    """The sidecar bytes of ``rows`` (stored columns) with their row ``addresses``,
    stamped with the generation directory name ``owner`` (see :func:`seal`)."""
    if len(addresses) != rows.num_rows:
        raise ValueError(f"{len(addresses)} row addresses for {rows.num_rows} rows")
    t = rows.append_column(ROWADDR_COLUMN, pa.array(addresses, pa.uint64()))
    return seal(t, _MAGIC, owner)


def decode(data: bytes | pa.Buffer, path: str) -> pa.Table:
    """The rows (with ``_rowaddr``) of sidecar bytes; ValueError naming ``path`` when
    the trailer, the CRC or the Arrow data is wrong."""
    t = unseal(data, path, _MAGIC, "a rows sidecar")
    if ROWADDR_COLUMN not in t.column_names:
        raise ValueError(f"{path}: no {ROWADDR_COLUMN} column")
    return t


def seal(t: pa.Table, magic: bytes, owner: str | None = None) -> bytes:
    """``t`` as Arrow IPC file bytes followed by the trailer: their CRC-32 and ``magic``
    (4 bytes). The framing of every memwal_query sidecar. With ``owner`` (the name of
    the generation directory the file is written into), the schema metadata records it
    (:data:`OWNER_KEY`) and :func:`unseal` refuses the file anywhere else.

    An IPC file holds one dictionary per field: the batches of a dictionary-encoded
    column share one (``unify_dictionaries``), and a column with dictionaries inside
    (a list or struct of them) is joined into one chunk (one dictionary each).
    """
    if any(pa.types.is_dictionary(f.type) for f in t.schema):
        t = t.unify_dictionaries()
    for i, f in enumerate(t.schema):
        if not pa.types.is_dictionary(f.type) and _has_dictionary(f.type):
            t = t.set_column(i, f, pa.chunked_array([t.column(i).combine_chunks()], f.type))
    if owner is not None:
        t = t.replace_schema_metadata({**(t.schema.metadata or {}), OWNER_KEY: owner.encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    body = sink.getvalue().to_pybytes()
    return body + _TRAILER.pack(zlib.crc32(body), magic)


_WIDE_ALIGNMENT = 16
"""The alignment Lance's Rust side (arrow-rs) requires of 128- and 256-bit decimal
values; an Arrow IPC body aligns buffers to 8 bytes only."""


def _wide(t: pa.DataType) -> bool:
    """Whether ``t`` is or holds a 128- or 256-bit decimal."""
    if pa.types.is_decimal128(t) or pa.types.is_decimal256(t):
        return True
    if pa.types.is_dictionary(t):
        return _wide(t.value_type)
    return any(_wide(t.field(i).type) for i in range(t.num_fields))


def aligned(table: pa.Table) -> pa.Table:
    """``table`` with every column of decimals whose buffers an IPC reader left at an
    8-byte boundary copied to aligned memory (Lance's Rust side panics on such values
    when it is handed the rows); every other column as it was, without a copy.

    Parameters
    ----------
    table : pyarrow.Table
        Rows as read from Arrow IPC bytes without a copy.

    Returns
    -------
    pyarrow.Table
    """
    for i, field in enumerate(table.schema):
        if not _wide(field.type):
            continue
        column = table.column(i)
        if all(
            b is None or b.address % _WIDE_ALIGNMENT == 0
            for chunk in column.chunks
            for b in chunk.buffers()
        ):
            continue
        copied = pa.chunked_array([pa.concat_arrays([c]) for c in column.chunks], field.type)
        table = table.set_column(i, field, copied)
    return table


def unseal(data: bytes | pa.Buffer, path: str, magic: bytes, what: str) -> pa.Table:
    """The table of :func:`seal`'s bytes (decoded without a copy); ValueError naming
    ``path`` when the trailer, the magic, the CRC or the Arrow data is wrong, or when
    the file was sealed for another generation directory than the one ``path`` is in
    (copied there). The owner stamp is not in the returned schema's metadata."""
    buf = pa.py_buffer(data) if not isinstance(data, pa.Buffer) else data
    if buf.size < _TRAILER.size:
        raise ValueError(f"{path}: {buf.size} bytes, too short for {what}")
    crc, found = _TRAILER.unpack(buf.slice(buf.size - _TRAILER.size).to_pybytes())
    body = buf.slice(0, buf.size - _TRAILER.size)
    if found != magic:
        raise ValueError(f"{path}: not {what} (magic {found!r})")
    if zlib.crc32(memoryview(body)) != crc:
        raise ValueError(f"{path}: CRC mismatch (corrupt or truncated)")
    try:
        t = pa.ipc.open_file(body).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: unreadable Arrow data: {e}") from e
    t = aligned(t)
    meta = t.schema.metadata
    if not meta or OWNER_KEY not in meta:
        return t
    owner = meta[OWNER_KEY].decode(errors="replace")
    here = dir_name(path.rstrip("/").rsplit("/", 1)[0]) if "/" in path.rstrip("/") else ""
    if owner != here:
        raise ValueError(
            f"{path}: {what} written for generation directory {owner!r}, not {here!r} "
            "(copied from another generation)"
        )
    rest = {k: v for k, v in meta.items() if k != OWNER_KEY}
    return t.replace_schema_metadata(rest or None)


def _has_dictionary(t: pa.DataType) -> bool:
    """Whether ``t`` is or holds a dictionary type (at any depth)."""
    if pa.types.is_dictionary(t):
        return True
    return any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def read_sealed(io: FileIO, path: str, magic: bytes, what: str, instead: str) -> pa.Table | None:
    """The table of the sealed file ``path``, or None when there is none or it is
    damaged (then with a warning naming the file and what is done ``instead``: the
    caller uses the source of truth)."""
    return read_checked(io, path, lambda data: unseal(data, path, magic, what), instead)


def read_checked(io: FileIO, path: str, decode: Callable[[pa.Buffer], T], instead: str) -> T | None:
    """``decode`` of the bytes of the file ``path``, or None when there is none, it
    cannot be fetched or ``decode`` raises ValueError (then with a warning naming the
    file, the reason and what is done ``instead``)."""
    try:
        data = io.read_buffer(path)
    except ObjectNotFoundError:
        return None
    except StorageError as e:
        warnings.warn(f"{path}: not used ({e}); {instead}", RuntimeWarning, stacklevel=3)
        return None
    try:
        return decode(data)
    except ValueError as e:
        warnings.warn(f"{e}; {instead}", RuntimeWarning, stacklevel=3)
        return None


def write(io: FileIO, gen_uri: str, rows: pa.Table, addresses: np.ndarray) -> None:
    """Write the sidecar of the generation at ``gen_uri`` (before its manifest commit)."""
    io.write(join(gen_uri, ROWS_FILE), encode(rows, addresses, dir_name(gen_uri)))


def read(io: FileIO, gen_uri: str) -> pa.Table | None:
    """The generation's rows from its sidecar, or None when there is none or it is
    damaged (a warning then; the caller reads the Lance table instead)."""
    path = join(gen_uri, ROWS_FILE)
    return read_sealed(io, path, _MAGIC, "a rows sidecar", "reading the Lance table")
