"""Keeping the base table's files and indexes in shape under a stream of merges.

Every merge is a Lance merge-insert: it writes the upserted rows as new fragments and
marks their old copies deleted. Under a steady stream the base table therefore gathers
small fragments with deletion files, and its indexes cover less and less of it (Lance
scans unindexed fragments). Measured (``benchmarks/scale.py``'s streaming section, a
50k-row base after 40 merges of 5,000 rows): a single-key lookup went from 9 to 59 ms
because the primary-key BTREE covered 5% of the rows, and vector / full-text search
took 3x longer over 33 fragments than over one. Two steps of :func:`maintain
<memwal_query.maintain.policy.maintain>` fix that:

- :func:`compact_base`: Lance ``compact_files`` when more than a threshold of the base
  table's fragments are small (below Lance's target of 1,048,576 rows). It runs under
  the table's index lock, so no merge commit of memwal_query interleaves with it (Lance
  rebases a rewrite over other commits, remapping the indexes; the MemWAL index and its
  ``merged_generations`` are carried over unchanged, which the tests check).
- :func:`extend_indexes`: Lance ``optimize_indices`` on the base indexes that are *not*
  maintained (maintained ones are caught up with their progress record by
  :mod:`memwal_query.maintain.catchup`) and do not cover every row: the primary-key
  BTREE that :meth:`MemWalTable.initialize` creates, and any other index of the user's.

Neither changes what a reader sees: compaction rewrites the same live rows, and index
optimisation only adds coverage. Readers pinned to an older base version keep reading
its files until GC removes that version (after the retention window).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memwal_query.format.index import INDEX_NAME
from memwal_query.storage.locking import index_lock

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

TARGET_ROWS_PER_FRAGMENT = 1024 * 1024
"""Lance's default target of ``compact_files``: fragments with fewer rows are small."""


def small_fragments(table: Catalog, target_rows: int = TARGET_ROWS_PER_FRAGMENT) -> int:
    """How many fragments of the latest base version hold fewer than ``target_rows``
    physical rows (manifest metadata only; no data file is read)."""
    return sum(1 for f in table.dataset().get_fragments() if f.metadata.physical_rows < target_rows)


def compact_base(table: Catalog, target_rows: int = TARGET_ROWS_PER_FRAGMENT) -> dict[str, int]:
    """Compact the base table's small fragments (Lance ``compact_files``, indexes
    remapped) under the table's index lock; the compaction metrics as a dict."""
    with index_lock(table.uri, table.io):
        metrics = table.dataset().optimize.compact_files(target_rows_per_fragment=target_rows)
    return {
        "fragments_removed": metrics.fragments_removed,
        "fragments_added": metrics.fragments_added,
        "files_removed": metrics.files_removed,
        "files_added": metrics.files_added,
    }


def indexes_to_extend(table: Catalog) -> list[str]:
    """Base indexes that are not maintained (nor the MemWAL index) and leave rows of
    the latest version unindexed."""
    ds = table.dataset()
    maintained = set(table.maintained_indexes)
    out = []
    for d in ds.describe_indices():
        if d.name == INDEX_NAME or d.name in maintained or d.name in out:
            continue
        stats: dict[str, Any] = ds.stats.index_stats(d.name)
        if stats.get("num_unindexed_rows", 0):
            out.append(d.name)
    return out


def extend_indexes(table: Catalog, names: list[str]) -> None:
    """Extend the named base indexes over the latest version's unindexed rows."""
    table.dataset().optimize.optimize_indices(index_names=names)
