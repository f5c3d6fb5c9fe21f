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

A first query reads these sidecars by the thousand (one per unmerged generation), so
the flush also writes ``memwal_region_keys.bin`` into the new generation's directory:
the keys sidecars of the region's unmerged generations up to this one (the writer
keeps them in memory; within :data:`REGION_KEYS_MAX_ROWS` rows), concatenated, framed
the same way (magic ``MWG1``), with the ``(generation, directory, rows)`` of each part
in the Arrow schema metadata. A reader reads the file of a region's newest generation
in its view and takes the parts whose generation *and* directory match a generation it
reads (a part of a generation merged since, or of another flush of the same number, is
ignored); the generations it does not cover are read from their own keys sidecars.
Missing or damaged (a warning), it is not used.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import ObjectNotFoundError, StorageError
from memwal_query.format.rowfile import dir_name, read_checked, read_sealed, seal, unseal
from memwal_query.format.schema import ROWADDR_COLUMN, TOMBSTONE, as_int64
from memwal_query.storage.io import FileIO, join

KEYS_FILE = "memwal_keys.bin"
_MAGIC = b"MWK1"


def key_columns(rows: pa.Table, primary_key: list[str], addresses: np.ndarray) -> pa.Table:
    """What the sidecar holds: ``rows``' key columns and ``_tombstone`` (when present)
    with their row ``addresses``."""
    if len(addresses) != rows.num_rows:
        raise ValueError(f"{len(addresses)} row addresses for {rows.num_rows} rows")
    names = [*primary_key, *([TOMBSTONE] if TOMBSTONE in rows.column_names else [])]
    return rows.select(names).append_column(ROWADDR_COLUMN, pa.array(addresses, pa.uint64()))


def encode(rows: pa.Table, primary_key: list[str], addresses: np.ndarray) -> bytes:
    """The sidecar bytes of :func:`key_columns`."""
    return seal(key_columns(rows, primary_key, addresses), _MAGIC)


def decode(data: bytes | pa.Buffer, path: str) -> pa.Table:
    """The columns of sidecar bytes; ValueError naming ``path`` when the trailer, the
    CRC or the Arrow data is wrong."""
    t = unseal(data, path, _MAGIC, "a keys sidecar")
    if ROWADDR_COLUMN not in t.column_names:
        raise ValueError(f"{path}: no {ROWADDR_COLUMN} column")
    return t


def write(
    io: FileIO, gen_uri: str, rows: pa.Table, primary_key: list[str], addresses: np.ndarray
) -> pa.Table:
    """Write the keys sidecar of the generation at ``gen_uri`` (before its manifest
    commit); returns what it holds (:func:`key_columns`)."""
    keys = key_columns(rows, primary_key, addresses)
    io.write(join(gen_uri, KEYS_FILE), seal(keys, _MAGIC, dir_name(gen_uri)))
    return keys


def read(io: FileIO, gen_uri: str) -> pa.Table | None:
    """The generation's key columns, ``_tombstone`` and ``_rowaddr`` from its keys
    sidecar, or None when there is none or it is damaged (a warning then; the caller
    reads the rows sidecar or the Lance table instead)."""
    path = join(gen_uri, KEYS_FILE)
    t = read_sealed(io, path, _MAGIC, "a keys sidecar", "reading the rows instead")
    if t is not None and ROWADDR_COLUMN not in t.column_names:
        return None
    return t


# -- the region's keys: every unmerged generation's keys sidecar in one file ----------
REGION_KEYS_FILE = "memwal_region_keys.bin"
_REGION_MAGIC = b"MWG1"
_PARTS_KEY = b"memwal.generations"
REGION_KEYS_MAX_ROWS = 1 << 18
"""Most rows a region keys file holds (its oldest generations leave first): a flush
rewrites the file, so this bounds what each flush writes on top of its generation
(~4 MB with int64 keys; measured 0.5-0.8 s for 1M keys, fsync included, on a loaded
2-core machine)."""


@dataclass(frozen=True)
class RegionKeysPart:
    """One generation's keys in a region keys file.

    Attributes
    ----------
    generation : int
    path : str
        The generation's directory name (``{8 hex}_gen_{n}``): with the number, what
        identifies the flush the keys come from.
    keys : pa.Table
        Its keys sidecar's columns (key columns, ``_tombstone``, ``_rowaddr``).
    """

    generation: int
    path: str
    keys: pa.Table


def encode_region(parts: Sequence[RegionKeysPart]) -> bytes:
    """The region keys file of ``parts`` (oldest generation first): their keys
    concatenated, and which rows belong to which generation in the schema metadata."""
    if not parts:
        raise ValueError("a region keys file of no generation")
    layout = [[p.generation, p.path, p.keys.num_rows] for p in parts]
    t = pa.concat_tables([p.keys for p in parts])
    newest = _newest_flags(t)
    if newest is not None:
        t = t.append_column(NEWEST_COLUMN, pa.array(newest))
    t = t.replace_schema_metadata({_PARTS_KEY: json.dumps(layout).encode()})
    return seal(t, _REGION_MAGIC)


NEWEST_COLUMN = "__memwal_newest"
"""Region keys file column: whether the row is the last of its key among the file's
rows (the newest version within the region: rows are in generation, then write,
order). Written for a single integer key column; a reader whose view holds exactly
the file's generations takes the newest rows from it instead of deduplicating."""


def _newest_flags(t: pa.Table) -> np.ndarray | None:
    """:data:`NEWEST_COLUMN` of the concatenated parts ``t`` (None unless the key is one
    integer column)."""
    keys = [c for c in t.column_names if c not in (TOMBSTONE, ROWADDR_COLUMN)]
    if len(keys) != 1 or not pa.types.is_integer(t.schema.field(keys[0]).type):
        return None
    ints = as_int64(t.column(keys[0]).combine_chunks()).to_numpy(zero_copy_only=False)
    n = len(ints)
    order = np.argsort(ints, kind="stable")  # equal keys in row order
    ordered = ints[order]
    last = np.ones(n, bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    flags = np.zeros(n, bool)
    flags[order[last]] = True
    return flags


def decode_region(data: bytes | pa.Buffer, path: str) -> list[RegionKeysPart]:
    """The parts of region keys file bytes (zero-copy slices); ValueError naming
    ``path`` when the framing, the CRC, the Arrow data or the layout is wrong."""
    return _decode_region(data, path)[1]


def _decode_region(data: bytes | pa.Buffer, path: str) -> tuple[pa.Table, list[RegionKeysPart]]:
    """The whole table and the parts of region keys file bytes (see
    :func:`decode_region`)."""
    whole = unseal(data, path, _REGION_MAGIC, "a region keys file")
    t = whole.drop_columns([NEWEST_COLUMN]) if NEWEST_COLUMN in whole.column_names else whole
    try:
        layout = json.loads((t.schema.metadata or {})[_PARTS_KEY])
        parts, start = [], 0
        for generation, gen_dir, rows in layout:
            if not (isinstance(generation, int) and isinstance(gen_dir, str)):
                raise TypeError(f"generation {generation!r} at {gen_dir!r}")
            if not isinstance(rows, int) or rows < 0:
                raise TypeError(f"{rows!r} rows")
            parts.append(RegionKeysPart(generation, gen_dir, t.slice(start, rows)))
            start += rows
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable layout: {e}") from e
    if start != t.num_rows or ROWADDR_COLUMN not in t.column_names:
        raise ValueError(f"{path}: layout of {start} rows for {t.num_rows} rows")
    return whole, parts


def write_region(io: FileIO, gen_uri: str, parts: Sequence[RegionKeysPart]) -> list[RegionKeysPart]:
    """Write the region keys file into the directory of the newest generation of
    ``parts`` (``gen_uri``, before its manifest commit), keeping its newest generations
    within :data:`REGION_KEYS_MAX_ROWS` rows; returns the parts written."""
    kept = list(parts)
    while len(kept) > 1 and sum(p.keys.num_rows for p in kept) > REGION_KEYS_MAX_ROWS:
        kept.pop(0)
    io.write(join(gen_uri, REGION_KEYS_FILE), encode_region(kept))
    return kept


def read_region(io: FileIO, gen_uri: str) -> list[RegionKeysPart] | None:
    """The parts of the region keys file in the generation directory ``gen_uri``, or
    None when there is none or it is damaged (a warning then; the caller reads each
    generation's keys sidecar instead)."""
    got = read_region_table(io, gen_uri)
    return None if got is None else got[1]


def read_region_table(io: FileIO, gen_uri: str) -> tuple[pa.Table, list[RegionKeysPart]] | None:
    """:func:`read_region` with the file's whole table (the parts' rows, in order, and
    :data:`NEWEST_COLUMN` when written)."""
    path = join(gen_uri, REGION_KEYS_FILE)
    try:
        data = io.read_buffer(path)
    except ObjectNotFoundError:
        return None
    except StorageError as e:
        warnings.warn(
            f"{path}: not used ({e}); reading each generation's keys instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    try:
        return _decode_region(data, path)
    except ValueError as e:
        warnings.warn(f"{e}; reading each generation's keys instead", RuntimeWarning, stacklevel=2)
        return None


# -- the generation's key index: the newest row of each key, sorted by key -------------
KEY_INDEX_FILE = "memwal_key_index.bin"
_INDEX_MAGIC = b"MWX1"
_INDEX_ROWS_KEY = b"memwal.rows"
_INDEX_PATH_KEY = b"memwal.generation"
INDEX_KEY = "key"
INDEX_ROW = "row"


def index_key_type(key_schema: pa.Schema) -> bool:
    """Whether a generation with primary-key fields ``key_schema`` gets a key index file:
    a single integer key column (indexed by its value as int64)."""
    return len(key_schema) == 1 and pa.types.is_integer(key_schema.field(0).type)


@dataclass(frozen=True)
class KeyIndex:
    """A generation's key index (:func:`read_index`, :func:`build_index`).

    Attributes
    ----------
    keys : np.ndarray
        Distinct key values as int64, strictly increasing.
    rows : np.ndarray
        Position in write order of each key's newest row.
    tombstone : np.ndarray
        Whether that row is a tombstone.
    num_rows : int
        Rows of the generation.
    """

    keys: np.ndarray
    rows: np.ndarray
    tombstone: np.ndarray
    num_rows: int


def build_index(keys: pa.Table, primary_key: list[str]) -> KeyIndex:
    """The key index of a generation whose keys sidecar columns are ``keys`` (rows in
    write order, see :func:`key_columns`; a single integer key column without NULLs):
    one entry per distinct key, sorted by the key's int64 value
    (:func:`memwal_query.format.schema.as_int64`), with the position in write order of
    its newest row and whether that row is a tombstone."""
    ints = as_int64(keys.column(primary_key[0]).combine_chunks()).to_numpy(zero_copy_only=False)
    n = len(ints)
    order = np.argsort(ints)
    ordered = ints[order]
    first = np.ones(n, bool)
    first[1:] = ordered[1:] != ordered[:-1]
    starts = np.flatnonzero(first)
    # the newest row of a key is its last in write order: the largest position
    rows = np.maximum.reduceat(order, starts).astype(np.int64) if n else order.astype(np.int64)
    if TOMBSTONE in keys.column_names:
        tomb = keys.column(TOMBSTONE).combine_chunks().fill_null(False)
        flags = tomb.to_numpy(zero_copy_only=False)[rows]
    else:
        flags = np.zeros(len(rows), bool)
    return KeyIndex(ordered[starts], rows, flags, n)


def index_columns(keys: pa.Table, primary_key: list[str], gen_dir: str) -> pa.Table:
    """What the key index file of the generation in directory ``gen_dir`` (its name)
    holds: :func:`build_index` of its keys sidecar columns ``keys`` as a table, with the
    generation's row count and directory name in the schema metadata."""
    index = build_index(keys, primary_key)
    t = pa.table({INDEX_KEY: index.keys, INDEX_ROW: index.rows, TOMBSTONE: index.tombstone})
    meta = {_INDEX_ROWS_KEY: str(index.num_rows).encode(), _INDEX_PATH_KEY: gen_dir.encode()}
    return t.replace_schema_metadata(meta)


def write_index(io: FileIO, gen_uri: str, keys: pa.Table, primary_key: list[str]) -> None:
    """Write the key index file of the generation at ``gen_uri`` (before its manifest
    commit) from its keys sidecar columns ``keys`` (:func:`index_columns`)."""
    t = index_columns(keys, primary_key, dir_name(gen_uri))
    io.write(join(gen_uri, KEY_INDEX_FILE), seal(t, _INDEX_MAGIC))


def decode_index(
    data: bytes | pa.Buffer, path: str, gen_dir: str, num_rows: int | None
) -> KeyIndex:
    """The key index of key index file bytes; ValueError naming ``path`` when the
    framing, the CRC or the Arrow data is wrong, or the index is not one of the
    generation in directory ``gen_dir`` (its name) of ``num_rows`` rows (None: unknown)
    as :func:`index_columns` writes it."""
    t = unseal(data, path, _INDEX_MAGIC, "a key index file")
    want = {INDEX_KEY: pa.int64(), INDEX_ROW: pa.int64(), TOMBSTONE: pa.bool_()}
    if {f.name: f.type for f in t.schema} != want:
        raise ValueError(f"{path}: columns {t.schema.names} are not a key index's")
    meta = t.schema.metadata or {}
    try:
        rows = int(meta[_INDEX_ROWS_KEY])
        written_for = meta[_INDEX_PATH_KEY].decode()
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: no row count or generation") from e
    if written_for != gen_dir:
        raise ValueError(f"{path}: the key index of generation {written_for!r}, not {gen_dir!r}")
    if num_rows is not None and rows != num_rows:
        raise ValueError(f"{path}: an index of {rows} rows for a generation of {num_rows}")
    if any(t.column(c).null_count for c in want):
        raise ValueError(f"{path}: NULLs in a key index")
    keys = t.column(INDEX_KEY).combine_chunks().to_numpy()
    at = t.column(INDEX_ROW).combine_chunks().to_numpy()
    tomb = t.column(TOMBSTONE).combine_chunks().to_numpy(zero_copy_only=False)
    # O(keys) vectorised checks: a file of another generation or a bad writer is refused
    if len(keys) > rows or (len(keys) == 0) != (rows == 0):
        raise ValueError(f"{path}: {len(keys)} keys for {rows} rows")
    if len(keys) and ((keys[1:] <= keys[:-1]).any() or int(at.min()) < 0 or int(at.max()) >= rows):
        raise ValueError(f"{path}: keys not strictly increasing or rows out of range")
    return KeyIndex(keys, at, tomb, rows)


def read_index(io: FileIO, gen_uri: str, num_rows: int | None) -> KeyIndex | None:
    """The key index of the generation directory ``gen_uri`` (``num_rows``: its row
    count as its region manifest records it, None when unknown), or None when it has
    none, or a damaged one or one that does not match (a warning then; the caller
    builds the index from the generation's keys)."""
    path = join(gen_uri, KEY_INDEX_FILE)
    gen_dir = dir_name(gen_uri)
    return read_checked(
        io,
        path,
        lambda data: decode_index(data, path, gen_dir, num_rows),
        "building the key index from the generation's keys instead",
    )
