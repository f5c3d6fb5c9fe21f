"""Scanning base fragments that carry deletion files: read the deleted rows too and drop
them with the reader's own mask.

Lance turns a fragment's deletion vector into the list of row ranges between deleted
rows and decodes each range on its own: a fragment with rows deleted at random (what a
merge of random-key upserts leaves on every fragment) becomes tens of thousands of
ranges of a few rows each, and its scan costs 2-4x a clean fragment's. Asked for the
deleted rows as well (``include_deleted_rows``), Lance decodes every fragment as one
range and marks the deleted rows with a null ``_rowid``; the reader drops them with
the same boolean mask (and the same copy) that drops the base rows newer sources
overwrote. Lance still reads every deletion file to mark the rows, so a missing or
damaged one is an error, never a longer answer. Measurements: ``docs/architecture.md``
(the DataFusion provider, deletion files).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

ROWID_COLUMN = "_rowid"
"""The row-id column Lance adds (``with_row_id``); null on a deleted row when the scan
includes deleted rows."""

READ_DELETED_MAX_SHARE = 0.5
"""A scan reads the deleted rows of its fragments when they are at most this share of
the physical rows of the fragments with deletion files (above it, decoding the deleted
rows costs more than Lance's ranges save)."""


def reads_deleted(fragments: Iterable[Any]) -> bool:
    """Whether a scan of ``fragments`` (Lance fragments) should include their deleted rows
    and drop them itself: some fragment has a deletion file, and the deleted rows are at
    most :data:`READ_DELETED_MAX_SHARE` of those fragments' physical rows. Reads only
    the fragments' metadata (the manifest), never a deletion file."""
    deleted = physical = 0
    for fragment in fragments:
        n = fragment.num_deletions
        if n:
            deleted += n
            physical += fragment.physical_rows
    return 0 < deleted <= physical * READ_DELETED_MAX_SHARE


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
    with_deleted = reads_deleted(base.get_fragments())
    if with_deleted:
        options = {**options, "with_row_id": True, "include_deleted_rows": True}
    for batch in base.scanner(columns=columns, **options).to_batches():
        yield batch, deleted_rows(batch) if with_deleted else None
