"""Automatic maintenance: one pass of recover, merge, compact, index catch-up, snapshot
refresh and GC.

:func:`maintain` runs the steps of :data:`STEPS` that a :class:`MaintenancePolicy`
asks for, reusing :mod:`memwal_query.maintain` (no step is reimplemented here), and
returns a :class:`MaintenanceReport`. A step with nothing to do commits nothing, so a
pass over a quiet table writes nothing. A step that fails because the table moved is
retried on the newer state; a failure that remains does not stop the other steps, and
:func:`maintain` then raises :class:`MaintenanceFailedError` carrying the report.

What each step does, the defaults and why the pass is safe alongside writers, readers
and other maintainers: docs/maintenance.md ("The steps", "Policy defaults", "Running
alongside writers, readers and other maintainers").
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from memwal_query.exceptions import MemWalError

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.maintain.merger import MergeResult
    from memwal_query.maintain.recover import Recovered

# The merger (and Lance) are imported when a pass runs, not with this module: the
# ``memwal`` command line imports it for its option defaults on every start.

Progress = Callable[[str, int, int], None]
"""``progress(step, done, total)``: called as a step advances (``step`` is one of
:data:`STEPS`); a progress bar or a log line per call."""

STEPS = (
    "recovering",
    "planning",
    "merging",
    "compacting",
    "catching up",
    "refreshing snapshots",
    "collecting",
)

DEFAULT_MAX_GENERATIONS = 4
DEFAULT_MAX_ROWS = 100_000
DEFAULT_RETENTION = dt.timedelta(hours=1)
DEFAULT_COMPACT_FRAGMENTS = 16
DEFAULT_COMPACT_DELETED_SHARE = 0.1
DEFAULT_COMPACT_REWRITE_ROWS = 2_000_000
DEFAULT_MAX_INDEX_SEGMENTS = 4
DEFAULT_ABANDONED_AFTER = dt.timedelta(minutes=5)

_T = TypeVar("_T")


class MaintenanceFailedError(MemWalError):
    """A maintenance pass finished with failed steps (the other steps were done).

    Attributes
    ----------
    report : MaintenanceReport
        What the pass did, with ``errors`` naming each failed step or region.
    """

    def __init__(self, report: MaintenanceReport, cause: BaseException | None) -> None:
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(report.errors.items()))
        super().__init__(f"{report.uri}: maintenance failed ({detail})")
        self.report = report
        self.__cause__ = cause


@dataclass(frozen=True)
class MaintenancePolicy:
    """What a maintenance pass does (every field has a documented default).

    Parameters
    ----------
    merge_over_generations : int
        Merge a region with **more than** this many unmerged generations (default 4;
        vector search pays ~4 ms per unmerged generation, so this bounds that cost).
        ``0`` merges every region with anything unmerged.
    merge_over_rows : int
        Merge a region with more than this many unmerged rows (default 100,000; counted
        from the manifest's ``physical_rows`` statistic, a generation without it counts
        0 rows and is merged by ``merge_over_generations``).
    merge_batch_rows : int, optional
        Generations (consecutive ones of a region, and of several regions) up to this
        many rows, and :data:`~memwal_query.maintain.merger.DEFAULT_BATCH_BYTES` (256
        MiB), are merged by one commit (``0``: one commit per generation). None
        (default): the merger's :data:`~memwal_query.maintain.merger.DEFAULT_BATCH_ROWS`
        (4,000,000).
    max_retries : int, optional
        Commit races a region's merge tolerates, and how often a step is retried while
        the base table moves under it. None (default): the merger's
        :data:`~memwal_query.maintain.merger.DEFAULT_MAX_RETRIES` (20).
    compact_fragments : int, optional
        Compact the base table's data files (Lance ``compact_files``, indexes remapped)
        when **more than** this many of its fragments are smaller than Lance's target
        of 1,048,576 rows (default 16; every merge adds small fragments, and searches
        and scans pay per fragment). A pass also compacts for the other read costs a
        merge leaves (``compact_deleted_share``, ``compact_rewrite_rows``). None: never
        compact.
    compact_deleted_share : float, optional
        Rewrite the base fragments whose share of deleted rows is above this (default
        0.1, Lance's own ``materialize_deletions_threshold``). 0.0: every fragment with
        a deletion file, each pass (reads as fast as a clean base, at the cost of
        rewriting every fragment a merge touched). None: only for the other reasons.
    compact_rewrite_rows : int, optional
        Rewrite every fragment with a deletion file (a merge leaves one on each fragment
        holding an updated or deleted key, and Lance's filtered scans of such a fragment
        are ~1.6-2x slower already at 0.2% deleted rows) when those fragments hold at
        most this many rows, or at most
        :data:`~memwal_query.maintain.basefiles.REWRITE_ROWS_PER_MERGED_ROW` times the
        rows the pass merged (default 2,000,000: a bounded rewrite per pass that keeps
        small and mid-size tables as fast to read after a pass as a clean base). None:
        only the rule by merged rows. The same bound caps what any compaction of a pass
        rewrites (Lance's plan, the fragments with the largest deleted share first;
        the rest waits for the next pass), except with ``compact_deleted_share=0.0``.
    max_index_segments : int, optional
        When catch-up finds a maintained index with more than this many segments (Lance
        adds a delta segment to a vector index per catch-up, and a search probes every
        segment), it merges them into one (default 4). None: never merge.
    catch_up : bool
        Extend the maintained base indexes over merged data when they are behind, and
        the other base indexes (the primary-key BTREE) when they leave rows unindexed
        (default True).
    refresh_snapshots : bool
        Refresh the region snapshots of the MemWAL index when they are stale (default
        True).
    gc : bool
        Garbage collect generations and WAL entries (default True).
    retention : datetime.timedelta or None
        GC's retention window (default 1 hour): base versions older than this are
        removed, except those that were the latest within it, so a reader's pinned
        view stays readable for ``retention`` after it was resolved (time travel to
        older versions is lost). None: keep every base version (GC then frees only
        what every version ever retained has merged, usually nothing).
    abandoned_after : datetime.timedelta or None
        Recover a region whose writer has shown no sign of life (heartbeat, see
        :mod:`memwal_query.write.liveness`) for longer than this and that has unflushed
        WAL entries: claim, replay, flush, close, then merge it (default 5 minutes,
        thirty heartbeat intervals). None: never recover.
    max_generations, max_rows : int, optional
        Deprecated spellings of ``merge_over_generations`` and ``merge_over_rows``
        (``max_generations`` is the *limit* of :meth:`Maintenance.merge`).
    """

    merge_over_generations: int = DEFAULT_MAX_GENERATIONS
    merge_over_rows: int = DEFAULT_MAX_ROWS
    merge_batch_rows: int | None = None
    max_retries: int | None = None
    compact_fragments: int | None = DEFAULT_COMPACT_FRAGMENTS
    compact_deleted_share: float | None = DEFAULT_COMPACT_DELETED_SHARE
    compact_rewrite_rows: int | None = DEFAULT_COMPACT_REWRITE_ROWS
    max_index_segments: int | None = DEFAULT_MAX_INDEX_SEGMENTS
    catch_up: bool = True
    refresh_snapshots: bool = True
    gc: bool = True
    retention: dt.timedelta | None = DEFAULT_RETENTION
    abandoned_after: dt.timedelta | None = DEFAULT_ABANDONED_AFTER

    @property
    def max_generations(self) -> int:
        """Deprecated spelling of ``merge_over_generations``."""
        _deprecated_field("max_generations", "merge_over_generations")
        return self.merge_over_generations

    @property
    def max_rows(self) -> int:
        """Deprecated spelling of ``merge_over_rows``."""
        _deprecated_field("max_rows", "merge_over_rows")
        return self.merge_over_rows

    def __post_init__(self) -> None:
        optional = (
            "merge_batch_rows",
            "max_retries",
            "compact_fragments",
            "compact_rewrite_rows",
            "max_index_segments",
        )
        for name in ("merge_over_generations", "merge_over_rows", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MaintenancePolicy.{name} must be an int >= 0, got {value!r}")
        share = self.compact_deleted_share
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1
        ):
            raise ValueError(
                f"MaintenancePolicy.compact_deleted_share must be in [0, 1] or None, got {share!r}"
            )
        for name in ("retention", "abandoned_after"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, dt.timedelta) or value < dt.timedelta(0)
            ):
                raise ValueError(
                    f"MaintenancePolicy.{name} must be a timedelta >= 0 or None, got {value!r}"
                )

    def batch_rows(self) -> int:
        """``merge_batch_rows``, or the merger's default."""
        from memwal_query.maintain.merger import DEFAULT_BATCH_ROWS

        return DEFAULT_BATCH_ROWS if self.merge_batch_rows is None else self.merge_batch_rows

    def retries(self) -> int:
        """``max_retries``, or the merger's default."""
        from memwal_query.maintain.merger import DEFAULT_MAX_RETRIES

        return DEFAULT_MAX_RETRIES if self.max_retries is None else self.max_retries

    def wants_merge(self, generations: int, rows: int) -> str | None:
        """Why a region with this much unmerged work is merged (None: it is not)."""
        if generations > self.merge_over_generations:
            return f"{generations} unmerged generations > {self.merge_over_generations}"
        if rows > self.merge_over_rows:
            return f"{rows} unmerged rows > {self.merge_over_rows}"
        return None


def _deprecated_field(old: str, new: str) -> None:
    import warnings

    warnings.warn(
        f"MaintenancePolicy.{old} is deprecated and will be removed in the next release; "
        f"use MaintenancePolicy.{new}",
        DeprecationWarning,
        stacklevel=3,
    )


_policy_init = MaintenancePolicy.__init__


def _init_with_old_names(
    self: MaintenancePolicy,
    *args: Any,
    max_generations: int | None = None,
    max_rows: int | None = None,
    **kwargs: Any,
) -> None:
    """The dataclass's ``__init__``, also taking the deprecated spellings
    ``max_generations`` and ``max_rows`` (one release)."""
    for old, new, value in (
        ("max_generations", "merge_over_generations", max_generations),
        ("max_rows", "merge_over_rows", max_rows),
    ):
        if value is not None:
            _deprecated_field(old, new)
            kwargs.setdefault(new, value)
    _policy_init(self, *args, **kwargs)


MaintenancePolicy.__init__ = _init_with_old_names  # type: ignore[method-assign]


@dataclass(frozen=True)
class RegionPlan:
    """A region's unmerged work as a pass found it, and whether the policy merges it."""

    region_id: str
    generations: list[int]
    rows: int
    reason: str | None

    @property
    def merge(self) -> bool:
        """Whether the policy merges this region."""
        return self.reason is not None


@dataclass
class MaintenanceReport:
    """What :func:`maintain` did (or, with ``dry_run``, would do).

    Attributes
    ----------
    uri : str
    dry_run : bool
    recovered : list of Recovered
        Regions whose gone writer's WAL was flushed (or, in a dry run, would be).
    regions : list of RegionPlan
        Every region with unmerged generations when the pass started.
    merged : list of MergeResult
        Generations merged by this pass (empty in a dry run).
    small_fragments : int
        Small base fragments counted by the compaction step (0 when it did not look).
    compact_due : bool
        The base table's read cost called for a compaction (done, or would be).
    compact_reason : str or None
        Why (see :func:`memwal_query.maintain.basefiles.compaction_reason`).
    compacted : dict
        Lance's compaction metrics (``fragments_removed``...; empty when none ran) and
        ``fragments_left``, fragments left for the next pass by the row bound.
    catch_up : list of str
        Maintained indexes that were behind (caught up, or would be).
    extended : list of str
        Other base indexes that left rows unindexed (extended, or would be).
    index_catchup : dict
        ``{index: {region_id: generation}}`` of the maintained indexes, recorded after
        catch-up (empty if none ran).
    snapshots_refreshed : bool
        The region snapshots were stale (and were refreshed, unless a dry run).
    gc_paths : list of str
        Paths GC removed (or would remove).
    collected : bool
        The GC step ran (the policy's ``gc``).
    errors : dict
        ``{step or "merge <region>": error text}`` of what failed.
    seconds : float
    """

    uri: str
    dry_run: bool
    recovered: list[Recovered] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    merged: list[MergeResult] = field(default_factory=list)
    small_fragments: int = 0
    compact_due: bool = False
    compact_reason: str | None = None
    compacted: dict[str, int] = field(default_factory=dict)
    catch_up: list[str] = field(default_factory=list)
    extended: list[str] = field(default_factory=list)
    index_catchup: dict[str, dict[str, int]] = field(default_factory=dict)
    snapshots_refreshed: bool = False
    gc_paths: list[str] = field(default_factory=list)
    collected: bool = False
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No step failed."""
        return not self.errors

    @property
    def to_merge(self) -> list[RegionPlan]:
        """The regions the policy chose to merge."""
        return [r for r in self.regions if r.merge]

    def lines(self) -> list[str]:
        """One human-readable line per action (what ``memwal maintain`` prints)."""
        would = "would " if self.dry_run else ""
        out: list[str] = []
        for rec in self.recovered:
            silent = (
                "no sign of life" if rec.silent_for is None else f"silent {rec.silent_for:.0f} s"
            )
            into = "" if rec.generation is None else f" into generation {rec.generation}"
            out.append(f"{rec.region_id}: {would}recover its gone writer's WAL{into} ({silent})")
        merged: dict[str, list[int]] = {}
        for m in self.merged:
            merged.setdefault(m.region_id, []).append(m.generation)
        for r in self.regions:
            if not r.merge:
                out.append(
                    f"{r.region_id}: {len(r.generations)} unmerged generation(s), "
                    f"{r.rows} row(s): below the policy, left"
                )
            elif self.dry_run:
                out.append(f"{r.region_id}: would merge {r.generations} ({r.reason})")
            else:
                out.append(f"{r.region_id}: merged {merged.get(r.region_id, [])} ({r.reason})")
        if self.compact_due:
            done = self.compacted.get("fragments_removed", self.small_fragments)
            out.append(f"{would}compact {done} base fragment(s) ({self.compact_reason})")
        if self.catch_up:
            out.append(f"{would}catch up indexes {self.catch_up}")
        if self.extended:
            out.append(f"{would}extend indexes {self.extended}")
        if self.snapshots_refreshed:
            out.append(f"{would}refresh region snapshots")
        if self.collected:
            out.append(f"{would}remove {len(self.gc_paths)} path(s)")
        for k, v in sorted(self.errors.items()):
            out.append(f"failed: {k}: {v}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``memwal maintain --json``)."""
        return {
            "uri": self.uri,
            "dry_run": self.dry_run,
            "recovered": [
                {"region_id": r.region_id, "silent_for": r.silent_for, "generation": r.generation}
                for r in self.recovered
            ],
            "regions": [
                {
                    "region_id": r.region_id,
                    "unmerged_generations": r.generations,
                    "unmerged_rows": r.rows,
                    "merge": r.merge,
                    "reason": r.reason,
                }
                for r in self.regions
            ],
            "merged": [{"region_id": m.region_id, "generation": m.generation} for m in self.merged],
            "small_fragments": self.small_fragments,
            "compact_due": self.compact_due,
            "compact_reason": self.compact_reason,
            "compacted": self.compacted,
            "catch_up": self.catch_up,
            "extended": self.extended,
            "index_catchup": self.index_catchup,
            "snapshots_refreshed": self.snapshots_refreshed,
            "gc_paths": self.gc_paths,
            "collected": self.collected,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
        }


def plan_regions(
    table: Catalog, policy: MaintenancePolicy, recovered: frozenset[str] = frozenset()
) -> list[RegionPlan]:
    """Every region with unmerged generations, and whether ``policy`` merges it
    (``recovered`` regions, whose writer is gone, are merged whatever their size).

    Reads the latest MemWAL index once (``merged_generations``) and each region's newest
    manifest; changes nothing.
    """
    merged = table.index().merged_generations()
    plans: list[RegionPlan] = []
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is None:
            continue
        done = merged.get(region_id, 0)
        pending = sorted(
            (g for g in manifest.flushed_generations if g.generation > done),
            key=lambda g: g.generation,
        )
        if not pending:
            continue
        rows = sum(g.physical_rows or 0 for g in pending)
        gens = [g.generation for g in pending]
        reason = policy.wants_merge(len(gens), rows)
        if reason is None and region_id in recovered:
            reason = "writer gone: recovered"
        plans.append(RegionPlan(region_id, gens, rows, reason))
    return plans


def indexes_behind(table: Catalog) -> list[str]:
    """Maintained indexes whose recorded catch-up is below ``merged_generations``.

    An index with no record at all is behind as soon as anything was merged (GC treats
    it as caught up, as the spec says, but its data is not indexed).
    """
    index = table.index()
    merged = {r: g for r, g in index.merged_generations().items() if g > 0}
    catchup = index.index_catchup()
    behind = []
    for name in table.maintained_indexes:
        done = catchup.get(name)
        if done is None:
            if merged:
                behind.append(name)
        elif any(done.get(r, 0) < g for r, g in merged.items()):
            behind.append(name)
    return behind


def snapshots_stale(table: Catalog) -> bool:
    """Whether the MemWAL index's region snapshots miss a region or a flushed generation
    that the region manifests list (or list one the manifests no longer do)."""
    from memwal_query.format.snapshots import read_snapshots

    current: dict[str, list[tuple[int, str]]] = {}
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is not None:
            current[region_id] = [(g.generation, g.path) for g in manifest.flushed_generations]
    spec = table.region_spec
    states = read_snapshots(
        table.io,
        table.uri,
        table.index(),
        spec.spec_id if spec is not None else None,
        [f.field_id for f in spec.fields] if spec is not None else [],
    )
    if states is None:
        return bool(current)
    return {r: sorted(gens) for r, (_, gens) in states.items()} != {
        r: sorted(gens) for r, gens in current.items()
    }


def _version(table: Catalog) -> int | None:
    """The base table's latest version (None when it cannot be read just now: the
    version found latest was cleaned up before it could be opened)."""
    try:
        return table.dataset().version
    except Exception:  # noqa: BLE001 - the caller decides
        return None


def _retrying(table: Catalog, step: Callable[[], _T], attempts: int) -> _T:
    """Run ``step``; again (up to ``attempts`` times in all) while it fails with the
    base table moving under it (another maintainer committed, or cleaned up the version
    the step was reading): each retry reads the newer state. A failure on an unchanged
    table propagates."""
    for attempt in range(1, attempts + 1):
        before = _version(table)
        try:
            return step()
        except Exception:
            after = _version(table)
            moved = before is None or (after is not None and after != before)
            if not moved or attempt >= attempts:
                raise
    raise AssertionError("unreachable")  # pragma: no cover - attempts >= 1


def _note(progress: Progress | None, step: str, done: int, total: int) -> None:
    if progress is not None:
        progress(step, done, total)


def _merge_step(
    table: Catalog,
    plans: list[RegionPlan],
    policy: MaintenancePolicy,
    report: MaintenanceReport,
    progress: Progress | None,
) -> BaseException | None:
    """Merge the chosen regions, at most the number of generations planned for each,
    in as few commits as the merger's budgets allow (several regions share a commit);
    a failed region is tried once more on its own (again while the table moves under
    it), then recorded in ``report.errors``; the others go on."""
    from memwal_query.exceptions import MergeFailedError
    from memwal_query.maintain.merger import merge_region, merge_regions

    chosen = [p for p in plans if p.merge]
    # At most the generations planned (a fast writer cannot keep the pass busy); fewer
    # when another maintainer merged some of them meanwhile.
    rooms: dict[str, int | None] = {p.region_id: len(p.generations) for p in chosen}
    failed: dict[str, BaseException] = {}
    try:
        report.merged.extend(merge_regions(table, rooms, policy.retries(), policy.batch_rows()))
    except MergeFailedError as e:
        report.merged.extend(e.results)
        failed = dict(e.errors)
    _note(progress, "merging", len(chosen) - len(failed), len(chosen))
    first: BaseException | None = None
    for region_id in failed:
        room = rooms[region_id] or 0
        room -= sum(m.region_id == region_id for m in report.merged)
        try:
            report.merged.extend(
                _retrying(
                    table,
                    lambda rid=region_id, room=room: merge_region(  # type: ignore[misc]
                        table, rid, room, policy.retries(), policy.batch_rows()
                    ),
                    max(1, policy.retries()),
                )
            )
        except Exception as e:  # noqa: BLE001 - reported; the other regions go on
            report.errors[f"merge {region_id}"] = f"{type(e).__name__}: {e}"
            first = first or e
    _note(progress, "merging", len(chosen), len(chosen))
    return first


def _compact_step(
    table: Catalog,
    policy: MaintenancePolicy,
    report: MaintenanceReport,
    dry_run: bool,
    attempts: int,
) -> None:
    """Compact the base table when the read cost its fragments leave calls for it
    (:func:`memwal_query.maintain.basefiles.compaction_reason`), so a read after the
    pass is not slower than before it; at most ``max(compact_rewrite_rows, 2 x merged
    rows)`` rows are rewritten (all with ``compact_deleted_share=0.0``)."""
    from memwal_query.maintain.basefiles import (
        REWRITE_ROWS_PER_MERGED_ROW,
        compact_base,
        compaction_reason,
        read_cost,
    )

    cost = read_cost(table)
    report.small_fragments = cost.small
    if dry_run:
        merged_rows = sum(r.rows for r in report.to_merge)
    else:
        merged_rows = sum(m.upserted + m.deleted for m in report.merged)
    limit = policy.compact_fragments if policy.compact_fragments is not None else cost.fragments
    reason, share = compaction_reason(
        cost, limit, policy.compact_deleted_share, merged_rows, policy.compact_rewrite_rows
    )
    report.compact_due, report.compact_reason = reason is not None, reason
    if reason is None or dry_run:
        return
    # A pass rewrites at most this many rows (share 0.0: everything, each pass).
    budget = (
        None
        if policy.compact_deleted_share == 0.0
        else max(policy.compact_rewrite_rows or 0, REWRITE_ROWS_PER_MERGED_ROW * merged_rows)
    )
    report.compacted = _retrying(
        table, lambda: compact_base(table, deleted_share=share, budget_rows=budget), attempts
    )
    left = report.compacted.get("fragments_left", 0)
    if left:
        report.compact_reason = (
            f"{reason}; {report.compacted['fragments_removed']} fragment(s) rewritten "
            f"within {budget} row(s), {left} left for the next pass"
        )


def _extend_step(
    table: Catalog,
    policy: MaintenancePolicy,
    report: MaintenanceReport,
    dry_run: bool,
    attempts: int,
) -> None:
    """Extend the base indexes that are not maintained (the primary-key BTREE) over the
    rows they leave unindexed; their names are added to ``report.extended``."""
    from memwal_query.maintain.basefiles import extend_indexes, indexes_to_extend

    names = _retrying(table, lambda: indexes_to_extend(table), attempts)
    if names and not dry_run:
        _retrying(table, lambda: extend_indexes(table, names, policy.max_index_segments), attempts)
    report.extended = list(dict.fromkeys([*report.extended, *names]))


def maintain(
    table: Catalog,
    policy: MaintenancePolicy | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    merge: Callable[[list[RegionPlan]], list[MergeResult]] | None = None,
) -> MaintenanceReport:
    """Run one maintenance pass over ``table`` (see the module docs for the steps).

    The pass ends, whatever happened, by giving the free pages of the C heap and of
    Arrow's memory pool back to the system
    (:func:`memwal_query.storage.heap.release_unused_memory`).

    Parameters
    ----------
    table : Catalog
    policy : MaintenancePolicy, optional
        Default: ``MaintenancePolicy()`` (the documented defaults).
    dry_run : bool
        Only report what the pass would do; nothing is written or deleted. Later steps
        are planned on the current state (a dry run does not see its own merges).
    progress : callable, optional
        ``progress(step, done, total)`` as steps advance (see :data:`Progress`).
    merge : callable, optional
        Runs the merges instead of the in-process merger (``memwal_query.spark`` merges
        as Spark tasks): receives the regions to merge, returns what it merged, raises
        on failure.

    Returns
    -------
    MaintenanceReport

    Raises
    ------
    MaintenanceFailedError
        Some step failed (its ``report`` says which; the other steps were done). A
        corrupt file met while *planning* raises its own typed error, table unchanged.
    """
    policy = MaintenancePolicy() if policy is None else policy
    try:
        return _maintain(table, policy, dry_run, progress, merge)
    finally:
        # A pass's working set (merge sources, Lance's joins and rewrites) is freed by
        # now, but the C heap and Arrow's pool keep its pages: give them back, so a
        # ``--watch`` maintainer holds between passes what it keeps, not its largest
        # pass (docs/maintenance.md, "Memory of a long-running maintainer").
        from memwal_query.storage.heap import release_unused_memory

        release_unused_memory()


def _maintain(
    table: Catalog,
    policy: MaintenancePolicy,
    dry_run: bool,
    progress: Progress | None,
    merge: Callable[[list[RegionPlan]], list[MergeResult]] | None,
) -> MaintenanceReport:
    """The pass of :func:`maintain` (its parameters, returns and raises)."""
    started = time.perf_counter()
    report = MaintenanceReport(table.uri, dry_run)
    attempts = max(1, policy.retries())
    first: BaseException | None = None
    if policy.abandoned_after is not None:
        from memwal_query.maintain.recover import recover_abandoned

        _note(progress, "recovering", 0, 1)
        try:
            report.recovered = recover_abandoned(
                table,
                policy.abandoned_after.total_seconds(),
                getattr(table, "writer", None),
                dry_run=dry_run,
            )
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["recover"] = f"{type(e).__name__}: {e}"
            first = e
        _note(progress, "recovering", 1, 1)
    if not dry_run:
        from memwal_query.maintain.mergeintent import repair

        try:  # a merger killed after its own Update: never leave its rows twice
            repair(table)
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["merge"] = f"{type(e).__name__}: {e}"
            first = first or e
    recovered = frozenset(r.region_id for r in report.recovered)
    _note(progress, "planning", 0, 1)
    report.regions = _retrying(table, lambda: plan_regions(table, policy, recovered), attempts)
    _note(progress, "planning", 1, 1)

    if not dry_run and report.to_merge:
        if merge is None:
            first = _merge_step(table, report.regions, policy, report, progress)
        else:
            try:
                report.merged.extend(merge(report.to_merge))
            except Exception as e:  # noqa: BLE001 - reported; the other steps go on
                report.errors["merge"] = f"{type(e).__name__}: {e}"
                first = e

    if report.merged:
        # the merger read the merged generations through the shared column cache: a
        # long-running maintainer (``--watch``) would keep them until its byte bound
        from memwal_query.search.forget import forget_merged

        with contextlib.suppress(Exception):  # only a cache: never fails a pass
            forget_merged(table.uri, table.index().merged_generations())

    if report.merged and policy.catch_up and policy.compact_fragments is not None:
        # The merged rows are outside the primary-key index until it is extended: extend
        # it before compacting (the longest step), so lookups meanwhile do not scan them.
        try:
            _extend_step(table, policy, report, dry_run, attempts)
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["catch up"] = f"{type(e).__name__}: {e}"
            first = first or e

    if policy.compact_fragments is not None:
        try:
            _compact_step(table, policy, report, dry_run, attempts)
            _note(progress, "compacting", 1, 1)
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["compact"] = f"{type(e).__name__}: {e}"
            first = first or e

    if policy.catch_up:
        try:
            report.catch_up = indexes_behind(table)
            if report.catch_up and not dry_run:
                from memwal_query.maintain.catchup import catch_up_indexes

                names = report.catch_up
                recorded = _retrying(
                    table,
                    lambda: catch_up_indexes(table, names, policy.max_index_segments),
                    attempts,
                )
                # Lance records progress for the other indexes it extended too: only
                # the maintained indexes' is the catch-up's
                maintained = set(table.maintained_indexes)
                report.index_catchup = {n: g for n, g in recorded.items() if n in maintained}
            _extend_step(table, policy, report, dry_run, attempts)
            _note(progress, "catching up", 1, 1)
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["catch up"] = f"{type(e).__name__}: {e}"
            first = first or e

    if policy.refresh_snapshots:
        try:
            report.snapshots_refreshed = snapshots_stale(table)
            if report.snapshots_refreshed and not dry_run:
                from memwal_query.maintain.snapshots import refresh

                _retrying(table, lambda: refresh(table), attempts)
            _note(progress, "refreshing snapshots", 1, 1)
        except Exception as e:  # noqa: BLE001 - reported; the other steps go on
            report.errors["refresh snapshots"] = f"{type(e).__name__}: {e}"
            first = first or e

    if policy.gc:
        from memwal_query.maintain.gc import gc

        def collect(done: int, total: int) -> None:
            _note(progress, "collecting", done, total)

        try:
            report.gc_paths = _retrying(
                table,
                lambda: gc(
                    table,
                    dry_run=dry_run,
                    cleanup_older_than=policy.retention,
                    min_age=policy.retention,
                    progress=collect,
                ),
                attempts,
            )
            report.collected = True
        except Exception as e:  # noqa: BLE001 - reported below
            report.errors["gc"] = f"{type(e).__name__}: {e}"
            first = first or e

    report.seconds = time.perf_counter() - started
    if report.errors:
        raise MaintenanceFailedError(report, first)
    return report
