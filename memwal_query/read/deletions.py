"""Scanning base fragments that carry deletion files: read the deleted rows too and drop
them with the reader's own mask.

Lance turns a fragment's deletion vector into the list of row ranges between deleted
rows and decodes each range on its own: a fragment with rows deleted at random (what a
merge of random-key upserts leaves on every fragment) becomes tens of thousands of
ranges of a few rows each, and its scan costs 2-4x a clean fragment's. Asked for the
deleted rows as well (``include_deleted_rows``), Lance decodes every fragment as one
range and marks the deleted rows with a null ``_rowid``; the reader drops them with
the same boolean mask (and the same copy) that drops the base rows newer sources
overwrote. Range deletes, which leave few runs of deleted rows, stay on Lance's path
(:func:`reads_deleted`). Lance still reads every deletion file to mark the rows, so a
missing or damaged one is an error, never a longer answer. Measurements: ``docs/architecture.md``
(the DataFusion provider, deletion files).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_query.format.rowaddrs import roaring32_runs
from memwal_query.storage.cache import LRUCache

ROWID_COLUMN = "_rowid"
"""The row-id column Lance adds (``with_row_id``); null on a deleted row when the scan
includes deleted rows."""

READ_DELETED_ROWS = True
"""False: every scan leaves fragments with deletion files to Lance's own path (what the
benchmarks compare against)."""

READ_DELETED_MAX_SHARE = 0.5
"""Without the deletion files' contents (:func:`reads_deleted` given no reader): a scan
reads the deleted rows of its fragments when they are at most this share of the
physical rows of the fragments with deletion files."""

RANGE_ROWS = 32
"""What one range of Lance's deletion path costs, in rows decoded (measured on a
1M-row fragment: ~1.3 us per range against ~0.04 us per row)."""

_RUNS: LRUCache[str, int] = LRUCache(4096)
"""Runs of deleted rows per deletion file read (deletion files are immutable: keyed by
table URI and path)."""


def reads_deleted(
    fragments: Iterable[Any], read: Callable[[str], bytes] | None = None, table: str = ""
) -> bool:
    """Whether a scan of ``fragments`` (Lance fragments) should include their deleted rows
    and drop them itself.

    Parameters
    ----------
    fragments : iterable of lance.LanceFragment
        The fragments the scan reads.
    read : callable, optional
        Reads a deletion file (its path relative to the table). With it, the deleted
        rows are read when Lance's ranges would cost more than decoding them and
        copying the kept rows: ``runs * RANGE_ROWS > deleted + live / 2``, ``runs``
        the runs of consecutive deleted rows in the deletion files (read once per
        file, cached). A range delete leaves few runs and stays on Lance's path;
        deletes at random keys leave about one run per deleted row. A deletion file it
        cannot read or decode leaves the scan to Lance (which reports it). Without
        ``read``, only the metadata: the deleted rows are at most
        :data:`READ_DELETED_MAX_SHARE` of the fragments with deletion files.
    table : str
        The table's URI (with ``read``: what the runs read are cached under, with the
        file's path).

    Returns
    -------
    bool
        False when no fragment has a deletion file.
    """
    if not READ_DELETED_ROWS:
        return False
    deleted = physical = runs = 0
    for fragment in fragments:
        n = fragment.num_deletions
        if not n:
            continue
        deleted += n
        physical += fragment.physical_rows
        if read is not None:
            found = _runs(table, fragment.deletion_file(), read)
            if found is None:
                return False
            runs += found
    if not deleted:
        return False
    if read is None:
        return deleted <= physical * READ_DELETED_MAX_SHARE
    return runs * RANGE_ROWS > deleted + (physical - deleted) // 2


def _runs(table: str, path: str | None, read: Callable[[str], bytes]) -> int | None:
    """Runs of consecutive deleted rows in the deletion file ``path`` of ``table`` (a
    Roaring bitmap or an Arrow IPC file of row offsets), or None when it cannot be read
    or decoded."""
    if path is None:
        return None
    key = f"{table}\x00{path}"
    hit = _RUNS.get(key)
    if hit is None:
        try:
            data = read(path)
            if path.endswith(".arrow"):
                rows = pa.ipc.open_file(pa.BufferReader(data)).read_all()
                offsets = np.sort(rows.column(0).to_numpy().astype(np.int64))
                hit = int(len(offsets) > 0) + int(np.count_nonzero(np.diff(offsets) != 1))
            else:
                hit = roaring32_runs(data)[1]
        except Exception:  # noqa: BLE001 - Lance's own read reports a bad file, typed
            return None  # not cached: the next scan asks again
        _RUNS.put(key, hit)
    return hit


def deleted_rows(batch: pa.RecordBatch) -> np.ndarray | None:
    """The deleted rows of a batch read with ``include_deleted_rows`` (a boolean mask, true
    where ``_rowid`` is null), or None when the batch holds none."""
    ids = batch.column(ROWID_COLUMN)
    if not ids.null_count:
        return None
    return np.asarray(ids.is_null())


def live_values(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """``column`` (``_rowid`` or ``_rowaddr``) of ``batch`` as uint64, the deleted rows'
    nulls read as 0 (the caller drops those rows whatever the value)."""
    values = batch.column(column)
    if values.null_count:
        values = values.fill_null(0)
    return values.to_numpy().astype(np.uint64, copy=False)


def scan(
    base: Any, columns: list[str], **options: Any
) -> Iterator[tuple[pa.RecordBatch, np.ndarray | None]]:
    """The batches of a scan of ``base`` (a Lance dataset) reading ``columns`` with
    Lance scanner ``options``, each with the mask of its deleted rows (None when it
    holds none): when :func:`reads_deleted` says so, the deleted rows are read and
    the caller drops them (by the mask), else Lance leaves them out itself."""
    fragments = options.get("fragments")
    with_deleted = reads_deleted(base.get_fragments() if fragments is None else fragments)
    if with_deleted:
        options = {**options, "with_row_id": True, "include_deleted_rows": True}
    for batch in base.scanner(columns=columns, **options).to_batches():
        yield batch, deleted_rows(batch) if with_deleted else None
