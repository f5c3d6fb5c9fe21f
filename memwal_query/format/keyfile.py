"""The keys sidecar of a flushed generation: ``memwal_keys.bin``.

Deduplicating many generations (a scan's first step, ``count(*)``'s only one) and a
lookup's key index need a generation's primary-key columns, ``_tombstone`` and
``_rowaddr`` only, a third of the rows sidecar (:mod:`memwal_query.format.rowfile`) or
less. At flush the writer stores those columns again as one Arrow IPC file, in write
order, framed like the rows sidecar (:func:`memwal_query.format.rowfile.seal`: CRC-32
and the magic ``MWK1``), so a reader that needs keys only reads them in one small
request.

Like the rows sidecar it is an optimisation only: a generation without one (older
writers, pylance's native MemWAL, a flush that died before writing it) or with a
damaged one (a warning) is read from its rows sidecar or its Lance table instead.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from memwal_query.format.rowfile import read_sealed, seal, unseal
from memwal_query.format.schema import ROWADDR_COLUMN, TOMBSTONE
from memwal_query.storage.io import FileIO, join

KEYS_FILE = "memwal_keys.bin"
_MAGIC = b"MWK1"


def encode(rows: pa.Table, primary_key: list[str], addresses: np.ndarray) -> bytes:
    """The sidecar bytes of ``rows``' key columns and ``_tombstone`` (when present) with
    their row ``addresses``."""
    if len(addresses) != rows.num_rows:
        raise ValueError(f"{len(addresses)} row addresses for {rows.num_rows} rows")
    names = [*primary_key, *([TOMBSTONE] if TOMBSTONE in rows.column_names else [])]
    keys = rows.select(names).append_column(ROWADDR_COLUMN, pa.array(addresses, pa.uint64()))
    return seal(keys, _MAGIC)


def decode(data: bytes | pa.Buffer, path: str) -> pa.Table:
    """The columns of sidecar bytes; ValueError naming ``path`` when the trailer, the
    CRC or the Arrow data is wrong."""
    t = unseal(data, path, _MAGIC, "a keys sidecar")
    if ROWADDR_COLUMN not in t.column_names:
        raise ValueError(f"{path}: no {ROWADDR_COLUMN} column")
    return t


def write(
    io: FileIO, gen_uri: str, rows: pa.Table, primary_key: list[str], addresses: np.ndarray
) -> None:
    """Write the keys sidecar of the generation at ``gen_uri`` (before its manifest
    commit)."""
    io.write(join(gen_uri, KEYS_FILE), encode(rows, primary_key, addresses))


def read(io: FileIO, gen_uri: str) -> pa.Table | None:
    """The generation's key columns, ``_tombstone`` and ``_rowaddr`` from its keys
    sidecar, or None when there is none or it is damaged (a warning then; the caller
    reads the rows sidecar or the Lance table instead)."""
    path = join(gen_uri, KEYS_FILE)
    t = read_sealed(io, path, _MAGIC, "a keys sidecar", "reading the rows instead")
    if t is not None and ROWADDR_COLUMN not in t.column_names:
        return None
    return t
