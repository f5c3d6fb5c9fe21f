"""Key runs of the base table's data files: ``_mem_wal/_base_keys/{data file}.bin``.

``count(*)`` of an LSM table is the base's row count, less its rows whose key a newer
source holds, plus the newer sources' live rows. The middle term needs the base's
keys: one scan of its key column (at 10M rows ~0.1 s and ~45 MB, Lance's first scan in
a process included), where plain Lance counts from metadata alone.

A base loaded in key order with consecutive integer keys (an auto-increment id, a
sorted bulk load) has keys that are a few runs ``start, start + 1, ...`` in each data
file. For such a data file :func:`write` stores those runs (``start``, ``length``, in
row order, covering every physical row), framed like the generation sidecars
(:func:`memwal_query.format.rowfile.seal`: CRC-32 and the magic ``MWB1``), with the
key column's name and field id and the file's physical row count in the metadata. A
reader then counts the newer keys falling in each run instead of reading the keys.

The file is named after the Lance data file holding the key column, which Lance never
rewrites in place (a compaction or an update writes new data files): a summary cannot
go stale, it can only go unused. It is an optimisation only: a fragment without one,
with a deletion file (the runs include deleted rows), whose key column is in another
data file, or with a damaged or mismatching file (a warning) is scanned. Written for
the base's fragments when the MemWAL index is created (:func:`summarize`); data files
whose keys are not a few runs get none.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import StorageError
from memwal_query.format.rowfile import read_sealed, seal, unseal
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, join

BASE_KEYS_DIR = "_base_keys"
_MAGIC = b"MWB1"
_WHAT = "a base keys summary"
_META = b"memwal.base_keys"
MAX_RUNS = 1024
"""Most runs a data file's summary holds, and at most one per 16 rows (more: no
summary, the fragment is scanned)."""
_DATA_FILE = re.compile(r"^[0-9A-Za-z_-]{1,200}\.lance$")


def summary_path(table_uri: str, data_file: str) -> str | None:
    """Where the summary of the data file ``data_file`` (a path relative to the
    table's ``data/``) lives, or None when its name is not a plain Lance file name
    (nothing outside ``_mem_wal/_base_keys/`` is ever read or written)."""
    if not _DATA_FILE.match(data_file):
        return None
    return join(paths.mem_wal_root(table_uri), BASE_KEYS_DIR, data_file + ".bin")


def runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(starts, lengths)`` of the runs of consecutive values of ``keys`` (int64, in
    row order), or None when there are more than :data:`MAX_RUNS` or than one per 16
    keys."""
    if len(keys) == 0:
        return None
    # int64 differences wrap: the largest key then the smallest differ by 1 too
    step = np.diff(keys) != 1
    step |= keys[1:] == np.iinfo(np.int64).min
    breaks = np.flatnonzero(step) + 1
    if len(breaks) + 1 > max(1, min(MAX_RUNS, len(keys) // 16)):
        return None
    firsts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([firsts, [len(keys)]]))
    return keys[firsts].astype(np.int64), lengths.astype(np.int64)


def encode(
    key: str, field_id: int, physical_rows: int, starts: np.ndarray, lengths: np.ndarray
) -> bytes:
    """The summary bytes of one data file's key runs."""
    meta = {"key": key, "field_id": int(field_id), "physical_rows": int(physical_rows)}
    t = pa.table({"start": pa.array(starts, pa.int64()), "length": pa.array(lengths, pa.int64())})
    return seal(t.replace_schema_metadata({_META: json.dumps(meta).encode()}), _MAGIC)


def decode(
    data: bytes | pa.Buffer, path: str, key: str, field_id: int, physical_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of summary bytes; ValueError naming ``path`` when the
    framing or CRC is wrong, or the summary is of another key column or row count."""
    return _checked(unseal(data, path, _MAGIC, _WHAT), path, key, field_id, physical_rows)


def _checked(
    t: pa.Table, path: str, key: str, field_id: int, physical_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """The runs of a summary's table, checked (see :func:`decode`)."""
    try:
        meta = json.loads((t.schema.metadata or {})[_META])
        starts = t.column("start").to_numpy().astype(np.int64, copy=False)
        lengths = t.column("length").to_numpy().astype(np.int64, copy=False)
    except (KeyError, ValueError, TypeError, pa.ArrowException) as e:
        raise ValueError(f"{path}: unreadable base keys summary: {e}") from e
    if meta.get("key") != key or meta.get("field_id") != field_id:
        raise ValueError(f"{path}: summary of key {meta.get('key')!r}, not {key!r}")
    if meta.get("physical_rows") != physical_rows or int(lengths.sum()) != physical_rows:
        raise ValueError(
            f"{path}: summary of {meta.get('physical_rows')} rows ({int(lengths.sum())} in "
            f"its runs), the data file has {physical_rows}"
        )
    if len(lengths) and int(lengths.min()) <= 0:
        raise ValueError(f"{path}: a run of no row")
    if bool(np.any(starts > np.iinfo(np.int64).max - (lengths - 1))):
        raise ValueError(f"{path}: a run past the int64 range")
    return starts, lengths


def key_file(fragment: Any, field_id: int) -> str | None:
    """The data file of a fragment (``LanceFragment``) holding the key field, or None
    when there is none, or several."""
    files = [f for f in fragment.metadata.files if field_id in list(f.fields)]
    return files[0].path if len(files) == 1 else None


def listed(io: FileIO, table_uri: str) -> set[str]:
    """Names of the summaries stored (one listing; none when it fails: a warning)."""
    root = join(paths.mem_wal_root(table_uri), BASE_KEYS_DIR)
    try:
        return set(io.list(root))
    except StorageError as e:
        warnings.warn(f"{root}: not listed ({e}); scanning the keys", RuntimeWarning, stacklevel=2)
        return set()


def read(
    io: FileIO,
    table_uri: str,
    fragment: Any,
    key: str,
    field_id: int,
    present: set[str] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The key runs of a base fragment without deletions, or None when it has none (a
    deletion file, no summary, a damaged or mismatching one: a warning then).
    ``present``: the summaries stored (:func:`listed`); no request for one not in it."""
    meta = fragment.metadata
    if meta.deletion_file is not None:
        return None
    name = key_file(fragment, field_id)
    path = summary_path(table_uri, name) if name is not None else None
    if path is None or (present is not None and f"{name}.bin" not in present):
        return None
    t = read_sealed(io, path, _MAGIC, _WHAT, "scanning the keys")
    if t is None:
        return None
    try:
        return _checked(t, path, key, field_id, meta.physical_rows)
    except ValueError as e:
        warnings.warn(f"{e}; scanning the keys", RuntimeWarning, stacklevel=2)
        return None


def summarize(io: FileIO, table_uri: str, ds: Any, key: str) -> int:
    """Write the summary of every data file of ``ds`` (a ``LanceDataset``, single
    integer key ``key``) whose fragment has no deletions and whose keys are at most
    :data:`MAX_RUNS` runs (one fragment's keys read at a time). A failed write is a
    warning (the summary is optional). Returns how many were written."""
    field = ds.lance_schema.field(key)
    t = ds.schema.field(key).type
    if field is None or not pa.types.is_integer(t) or t == pa.uint64():
        return 0
    written = 0
    for fragment in ds.get_fragments():
        meta = fragment.metadata
        name = key_file(fragment, field.id())
        path = summary_path(table_uri, name) if name is not None else None
        if meta.deletion_file is not None or path is None:
            continue
        keys = fragment.to_table(columns=[key]).column(key)
        if len(keys) != meta.physical_rows:
            continue
        got = runs(keys.to_numpy().astype(np.int64, copy=False))
        if got is None:
            continue
        try:
            io.write(path, encode(key, field.id(), meta.physical_rows, *got))
        except StorageError as e:
            warnings.warn(f"{path}: not written ({e})", RuntimeWarning, stacklevel=2)
            continue
        written += 1
    return written
