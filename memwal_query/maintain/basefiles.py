"""Keeping the base table's files and indexes in shape under a stream of merges.

- :func:`read_cost`, :func:`small_fragments` and :func:`compaction_reason` measure
  what the base table's fragments cost readers and decide whether to compact;
- :func:`compact_base` runs Lance's compaction under the table's index lock, all of
  it or the most deleted-heavy tasks of its plan within a row budget, carrying the
  MemWAL index and its ``merged_generations`` over unchanged;
- :func:`indexes_to_extend` and :func:`extend_indexes` extend the base indexes that
  are not maintained (the primary-key BTREE among them) over unindexed rows with a
  delta segment, merging segments above ``max_segments``.

Neither changes what a reader sees. Why these steps exist and the figures behind the
thresholds: docs/maintenance.md ("The steps", "Policy defaults").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwal_query.format.index import INDEX_NAME
from memwal_query.maintain import mergeintent
from memwal_query.storage.locking import index_lock

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

TARGET_ROWS_PER_FRAGMENT = 1024 * 1024
"""Lance's default target of ``compact_files``: fragments with fewer rows are small."""


@dataclass(frozen=True)
class ReadCost:
    """What the base table's fragments cost a read (manifest metadata only).

    Attributes
    ----------
    fragments : int
    small : int
        Fragments below the compaction target (a scan and a search pay per fragment).
    rows : int
        Physical rows, deleted ones included.
    deleted : int
        Rows marked deleted (read, then dropped).
    with_deletions : int
        Fragments with a deletion file, which Lance scans slower than one without
        (measured, pylance 14, a 1M-row fragment with scattered deleted rows: a full
        scan 1.08x at 0.2% deleted, 1.3x at 1%, 1.9x at 5%, 2.4x at 10%; a filtered
        scan 1.6x at 0.2%, 2x at 1%, 3.8x at 10%; all columns of a 10M-row base 0.24 s
        without deletion files, 0.6 to 0.77 s after a merge of 1M upserts).
    rows_with_deletions : int
        Physical rows of those fragments (what rewriting them costs).
    worst_deleted_share : float
        The largest share of deleted rows in one fragment.
    """

    fragments: int
    small: int
    rows: int
    deleted: int
    with_deletions: int
    rows_with_deletions: int
    worst_deleted_share: float


def read_cost(table: Catalog, target_rows: int = TARGET_ROWS_PER_FRAGMENT) -> ReadCost:
    """The read cost of the latest base version's fragments (no data file is read)."""
    small = rows = deleted = with_deletions = rows_with_deletions = 0
    worst = 0.0
    frags = table.dataset().get_fragments()
    for f in frags:
        meta = f.metadata
        physical = meta.physical_rows or 0
        rows += physical
        small += physical < target_rows
        gone = meta.deletion_file.num_deleted_rows if meta.deletion_file is not None else 0
        if gone:
            deleted += gone
            with_deletions += 1
            rows_with_deletions += physical
            worst = max(worst, gone / max(physical, 1))
    return ReadCost(len(frags), small, rows, deleted, with_deletions, rows_with_deletions, worst)


def small_fragments(table: Catalog, target_rows: int = TARGET_ROWS_PER_FRAGMENT) -> int:
    """How many fragments of the latest base version hold fewer than ``target_rows``
    physical rows (manifest metadata only; no data file is read)."""
    return read_cost(table, target_rows).small


REWRITE_ROWS_PER_MERGED_ROW = 2
"""A pass rewrites every fragment with a deletion file when they hold at most this many
rows per row the pass merged (or at most the policy's ``compact_rewrite_rows``): a
rewrite costs about what merging as many rows does, so the pass stays within ~2x of its
merge, and reads get back their speed at once."""


def compaction_reason(
    cost: ReadCost,
    small_limit: int,
    deleted_share: float | None,
    merged_rows: int,
    rewrite_rows: int | None = None,
) -> tuple[str | None, float]:
    """Whether the base table is compacted, and Lance's ``materialize_deletions_threshold``.

    Parameters
    ----------
    cost : ReadCost
        The base table's fragments now.
    small_limit : int
        Compact when more than this many fragments are small.
    deleted_share : float or None
        Rewrite the fragments whose share of deleted rows is above this (None: only
        for the other reasons).
    merged_rows : int
        Rows the pass merged.
    rewrite_rows : int or None
        Every fragment with a deletion file is rewritten when they hold at most
        ``max(rewrite_rows, REWRITE_ROWS_PER_MERGED_ROW * merged_rows)`` rows (None:
        at most :data:`REWRITE_ROWS_PER_MERGED_ROW` times ``merged_rows``).

    Returns
    -------
    (str or None, float)
        Why the table is compacted (None: it is not), and the deleted share above which
        ``compact_files`` rewrites a fragment (0.0: every fragment with a deletion file).
    """
    threshold = 0.1 if deleted_share is None else deleted_share  # Lance's default
    by_merge = REWRITE_ROWS_PER_MERGED_ROW * merged_rows
    if cost.with_deletions and cost.rows_with_deletions <= max(rewrite_rows or 0, by_merge):
        bound = (
            f"{REWRITE_ROWS_PER_MERGED_ROW} x {merged_rows} merged"
            if rewrite_rows is None or by_merge >= rewrite_rows
            else f"compact_rewrite_rows {rewrite_rows}"
        )
        return (
            f"{cost.with_deletions} fragment(s) with deletion files, "
            f"{cost.rows_with_deletions} row(s) <= {bound}",
            0.0,
        )
    if deleted_share is not None and cost.worst_deleted_share > deleted_share:
        if deleted_share == 0.0:
            return (
                f"{cost.with_deletions} fragment(s) with deletion files "
                f"({cost.deleted} deleted of {cost.rows_with_deletions} rows)",
                threshold,
            )
        return (
            f"a fragment with {cost.worst_deleted_share:.0%} deleted rows > {deleted_share:.0%}",
            threshold,
        )
    if cost.small > small_limit:
        return f"{cost.small} small fragments > {small_limit}", threshold
    return None, threshold


def _deleted_share(task: Any) -> float:
    """The largest share of deleted rows in one fragment of a Lance compaction task."""
    worst = 0.0
    for meta in task.fragments:
        gone = meta.deletion_file.num_deleted_rows if meta.deletion_file is not None else 0
        worst = max(worst, gone / max(meta.physical_rows or 0, 1))
    return worst


def _budget_rows(task: Any) -> int:
    """What a compaction task counts against a pass's budget: the physical rows of its
    fragments with a deletion file (the rows :func:`compaction_reason` bounds), or of
    all its fragments when none has one (a group of small fragments)."""
    worn = [m.physical_rows or 0 for m in task.fragments if m.deletion_file is not None]
    return sum(worn) if worn else sum(m.physical_rows or 0 for m in task.fragments)


def compact_base(
    table: Catalog,
    target_rows: int = TARGET_ROWS_PER_FRAGMENT,
    deleted_share: float = 0.1,
    budget_rows: int | None = None,
) -> dict[str, int]:
    """Compact the base table (Lance compaction, indexes remapped) under the table's
    index lock: small fragments are merged, and fragments whose share of deleted rows
    is above ``deleted_share`` are rewritten without them (0.0: every fragment with a
    deletion file).

    Parameters
    ----------
    table : Catalog
    target_rows : int
        Lance's ``target_rows_per_fragment``.
    deleted_share : float
        Lance's ``materialize_deletions_threshold``.
    budget_rows : int or None
        None: every task of Lance's plan (one ``compact_files``). Otherwise the plan's
        tasks run in order of their largest deleted-row share (the small-fragment
        groups last) while their rows stay within ``budget_rows`` (a task counts the
        physical rows of its fragments with a deletion file, or of all its fragments
        when none has one; the first task always runs, so every pass makes progress),
        and their results are committed as one Lance compaction; the other tasks are
        left to the next pass.

    Returns
    -------
    dict
        Lance's compaction metrics (``fragments_removed``, ``fragments_added``,
        ``files_removed``, ``files_added``), and ``fragments_left``: fragments of the
        plan left for the next pass (0 when unbounded).

    Raises
    ------
    Exception
        Lance's commit conflict when another process changed the rewritten fragments
        meanwhile (nothing is committed; the caller retries on the newer version).
    """
    from lance.optimize import Compaction

    options: Any = {
        "target_rows_per_fragment": target_rows,
        "materialize_deletions_threshold": deleted_share,
    }
    left = 0
    with index_lock(table.uri, table.io):
        # rows a merger left twice are removed while they are still in its fragments
        mergeintent.repair(table)
        ds = table.dataset()
        if budget_rows is None:
            metrics = ds.optimize.compact_files(**options)
        else:
            tasks = sorted(Compaction.plan(ds, options).tasks, key=_deleted_share, reverse=True)
            chosen, rows = 0, 0
            for task in tasks:
                rows += _budget_rows(task)
                if chosen and rows > budget_rows:
                    break
                chosen += 1
            left = sum(len(task.fragments) for task in tasks[chosen:])
            if not chosen:
                return dict.fromkeys(_METRICS, 0) | {"fragments_left": 0}
            results = [task.execute(ds) for task in tasks[:chosen]]
            metrics = Compaction.commit(ds, results, options)
    return {name: getattr(metrics, name) for name in _METRICS} | {"fragments_left": left}


_METRICS = ("fragments_removed", "fragments_added", "files_removed", "files_added")


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


def extend_indexes(table: Catalog, names: list[str], max_segments: int | None = None) -> None:
    """Extend the named base indexes over the latest version's unindexed rows.

    The new rows get a delta segment of their own (Lance ``num_indices_to_merge=0``:
    0.14 s for 1M new rows on a 10M-row base, where rebuilding the primary-key BTREE
    into one segment takes 0.77 s; measured, pylance 14); when an index then has more
    than ``max_segments`` segments (None: never), its segments are merged into one.
    """
    ds = table.dataset()
    ds.optimize.optimize_indices(index_names=names, num_indices_to_merge=0)
    if max_segments is None:
        return
    ds = table.dataset()
    for d in ds.describe_indices():
        if d.name in names and len(d.segments) > max_segments:
            ds.optimize.optimize_indices(index_names=[d.name], num_indices_to_merge=len(d.segments))
