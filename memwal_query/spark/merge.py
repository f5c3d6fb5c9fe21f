"""Merging flushed generations into the base table as Spark tasks.

:func:`merge` runs one Spark task per region with unmerged generations
(:func:`pending_generations`), each calling
:func:`memwal_query.maintain.merger.merge_region`, and returns a
:class:`MergeSummary`. Regions whose task kept losing commit races are run again in
further rounds with fewer tasks, until every region is merged or a round makes no
progress (``summary.pending``).

Contract: each generation is merged once, in order, never skipped, whatever the
interleaving of tasks, retries and speculative copies: every commit carries its
progress marker, is taken under the table's index lock with ``conflict_retries(0)``,
and a task resumes from the committed progress.

How the commits are coordinated: docs/spark.md ("Merge as Spark jobs") and
docs/maintenance.md ("How a merge commits").
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import CommitConflictError
from memwal_query.spark._common import fault, open_table

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from memwal_query.table import MemWalTable


@dataclass(frozen=True)
class MergedGeneration:
    """One generation merged by a Spark task."""

    region_id: str
    generation: int
    upserted: int
    deleted: int
    seconds: float
    partition: int
    attempt: int


@dataclass
class MergeSummary:
    """Result of :func:`merge`.

    Attributes
    ----------
    merged : list of MergedGeneration
        Generations merged, per region in ascending order.
    rounds : int
        Spark jobs run (more than one when some region lost too many commit races).
    pending : dict
        ``{region_id: unmerged generations}`` left when merging stopped making progress
        (empty on success).
    progress : dict
        ``{region_id: (merged generation before, after)}`` from the MemWAL index: the
        authoritative record (``merged`` misses generations committed by a task
        attempt that failed afterwards; its retry continued after them).
    seconds : float
        Wall-clock time.
    """

    merged: list[MergedGeneration] = field(default_factory=list)
    rounds: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0

    def by_region(self) -> dict[str, list[int]]:
        """``{region_id: [generations merged, ascending]}``."""
        from memwal_query.maintain.merger import generations_by_region

        return generations_by_region(self.merged)


def pending_generations(table: MemWalTable) -> dict[str, int]:
    """Flushed generations not merged yet, per region.

    Parameters
    ----------
    table : MemWalTable

    Returns
    -------
    dict
        ``{region_id: number of generations}``, regions with none left out.
    """
    merged = table.catalog.index().merged_generations()
    out = {}
    for region_id in table.catalog.region_ids():
        manifest = table.catalog.region_manifest(region_id)
        if manifest is None:
            continue
        done = merged.get(region_id, 0)
        n = sum(1 for g in manifest.flushed_generations if g.generation > done)
        if n:
            out[region_id] = n
    return out


def merge(
    spark: SparkSession,
    uri: str,
    *,
    regions: list[str] | None = None,
    max_generations: int | None = None,
    max_retries: int = 20,
    max_rounds: int = 5,
    parallelism: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> MergeSummary:
    """Merge all regions' flushed generations into the base table, one task per region.

    Parameters
    ----------
    spark : SparkSession
    uri : str
        Table URI.
    regions : list of str, optional
        Only these regions (default: every region with unmerged generations).
    max_generations : int, optional
        At most this many generations per region per round.
    max_retries : int
        Commit races a task tolerates per region before reporting a conflict.
    max_rounds : int
        Spark jobs at most (a round re-runs regions that lost too many races).
    parallelism : int, optional
        Tasks of the first round (default: one per region). Later rounds halve it.
    storage_options : dict, optional
        Object-store options of the table.

    Returns
    -------
    MergeSummary

    Raises
    ------
    InvalidPathError
        A region id of ``regions`` is malformed.
    RegionNotFoundError
        A region id of ``regions`` names no region of the table (nothing merged).
    """
    started = time.perf_counter()
    table = open_table(uri, storage_options)
    options = {
        "uri": table.uri,
        "storage_options": dict(storage_options or {}),
        "max_generations": max_generations,
        "max_retries": max_retries,
    }
    summary = MergeSummary()
    before = table.catalog.index().merged_generations()
    wanted = None if regions is None else set(table.catalog.check_region_ids(regions))
    todo = {r: n for r, n in pending_generations(table).items() if wanted is None or r in wanted}
    touched = set(todo)
    slices = parallelism
    while todo and summary.rounds < max_rounds:
        summary.rounds += 1
        ids = sorted(todo)
        n = max(1, min(len(ids), slices or len(ids)))

        def task(it: Iterable[str]) -> Iterable[dict[str, Any]]:
            return merge_partition(iter(it), options)

        rows = spark.sparkContext.parallelize(ids, n).mapPartitions(task).collect()
        conflicts = False
        for r in rows:
            if r["kind"] == "merged":
                summary.merged.append(MergedGeneration(**r["merged"]))
            else:
                conflicts = True
        if not conflicts or max_generations is not None:
            break
        last = todo
        todo = {r: c for r, c in pending_generations(table).items() if r in last}
        if todo == last:
            break  # no progress at all: give up, report what is pending
        slices = max(1, n // 2)
    if max_generations is None:
        summary.pending = {r: c for r, c in pending_generations(table).items() if r in touched}
    after = table.catalog.index().merged_generations()
    summary.progress = {r: (before.get(r, 0), after.get(r, 0)) for r in sorted(touched)}
    summary.merged.sort(key=lambda m: (m.region_id, m.generation))
    summary.seconds = time.perf_counter() - started
    return summary


def merge_partition(region_ids: Iterator[str], options: dict[str, Any]) -> Iterator[dict]:
    """Executor side: merge each region of this partition, generation by generation."""
    from memwal_query.maintain.merger import merge_region
    from memwal_query.spark.ingest_tasks import _task_info

    partition, attempt = _task_info()
    table = open_table(options["uri"], options["storage_options"])
    for region_id in region_ids:
        budget = options["max_generations"]
        while budget is None or budget > 0:
            try:
                done = merge_region(table.catalog, region_id, 1, options["max_retries"])
            except CommitConflictError as e:
                yield {"kind": "conflict", "region_id": region_id, "error": str(e)}
                break
            if not done:
                break
            for m in done:
                yield {
                    "kind": "merged",
                    "merged": {
                        "region_id": m.region_id,
                        "generation": m.generation,
                        "upserted": m.upserted,
                        "deleted": m.deleted,
                        "seconds": m.seconds,
                        "partition": partition,
                        "attempt": attempt,
                    },
                }
            if budget is not None:
                budget -= len(done)
            fault("merge.after_generation")
