"""A maintenance pass whose merges run as Spark tasks.

:func:`maintain` runs :func:`memwal_query.maintain.policy.maintain` on the driver with
one difference: the regions the policy chooses to merge are merged by
:func:`memwal_query.spark.merge.merge` (one task per region, commits coordinated as
described there). Index catch-up, the snapshot refresh and GC are single metadata
commits and file deletions: they run on the driver, after the merge job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memwal_query.exceptions import CommitConflictError
from memwal_query.spark._common import open_table
from memwal_query.spark.merge import MergeSummary
from memwal_query.spark.merge import merge as spark_merge

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from memwal_query.maintain.merger import MergeResult
    from memwal_query.maintain.policy import (
        MaintenancePolicy,
        MaintenanceReport,
        Progress,
        RegionPlan,
    )


@dataclass(frozen=True)
class MaintainSummary:
    """Result of :func:`maintain`.

    Attributes
    ----------
    report : MaintenanceReport
        What the pass did (``report.merged``: the generations the Spark tasks merged).
    merge : MergeSummary or None
        The Spark merge job's summary (None when no region needed merging, or a dry run).
    """

    report: MaintenanceReport
    merge: MergeSummary | None


def maintain(
    spark: SparkSession,
    uri: str,
    *,
    policy: MaintenancePolicy | None = None,
    dry_run: bool = False,
    parallelism: int | None = None,
    max_rounds: int = 5,
    storage_options: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> MaintainSummary:
    """One maintenance pass over the table at ``uri``, merging as Spark tasks.

    Parameters
    ----------
    spark : SparkSession
    uri : str
        Table URI.
    policy : MaintenancePolicy, optional
        Default: ``MaintenancePolicy()`` (see :mod:`memwal_query.maintain.policy`).
    dry_run : bool
        Only report what the pass would do (no Spark job runs).
    parallelism, max_rounds : int
        Passed to :func:`memwal_query.spark.merge.merge`.
    storage_options : dict, optional
        Object-store options of the table.
    progress : callable, optional
        ``progress(step, done, total)`` (driver side).

    Returns
    -------
    MaintainSummary

    Raises
    ------
    MaintenanceFailedError
        Some step failed (a region still pending after the merge rounds counts as a
        failed merge); the other steps were done.
    """
    from memwal_query.maintain.policy import MaintenancePolicy
    from memwal_query.maintain.policy import maintain as maintain_table

    policy = MaintenancePolicy() if policy is None else policy
    table = open_table(uri, storage_options)
    jobs: list[MergeSummary] = []

    def merge(plans: list[RegionPlan]) -> list[MergeResult]:
        from memwal_query.maintain.merger import MergeResult

        summary = spark_merge(
            spark,
            table.uri,
            regions=[p.region_id for p in plans],
            max_retries=policy.retries(),
            max_rounds=max_rounds,
            parallelism=parallelism,
            storage_options=storage_options,
        )
        jobs.append(summary)
        if summary.pending:
            raise CommitConflictError(
                f"{table.uri}: regions still unmerged after {summary.rounds} Spark "
                f"round(s): {summary.pending}"
            )
        return [
            MergeResult(m.region_id, m.generation, m.upserted, m.deleted, m.seconds)
            for m in summary.merged
        ]

    report = maintain_table(table.catalog, policy, dry_run=dry_run, progress=progress, merge=merge)
    return MaintainSummary(report, jobs[0] if jobs else None)
