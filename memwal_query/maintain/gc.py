"""Garbage collection of flushed generations and WAL entries.

A flushed generation ``g`` of a region (and the WAL entries it was built from) is
deleted only when all of these hold (spec, "Garbage Collector"):

1. ``g <= merged_generations[region]`` in **every retained version** of the base table
   (a version that has not merged ``g`` still needs it for time travel; versions
   from before MemWAL initialization count as "nothing merged", so run
   ``gc(cleanup_older_than=...)`` or Lance's ``cleanup_old_versions`` to let GC
   reclaim space);
2. every maintained index has caught up to ``g`` (``index_catchup``). An index with no
   record at all counts as caught up (spec); a region missing from an index's record
   counts as caught up to generation 0: :func:`memwal_query.maintain.catchup.catch_up_indexes`
   records every region merged at the version it indexed, so a region absent there
   had nothing merged (and indexed) yet.

3. no registered change-feed consumer still needs ``g``: a consumer at WAL position
   ``p`` of the region keeps the generation holding entry ``p + 1`` and every later one
   (:func:`memwal_query.read.consumers.consumer_limits`, ``docs/changes.md``).

Directories of failed flush attempts (a ``*_gen_i`` directory no manifest lists, with
``i`` below the region's ``current_generation``) are removed too. The region
manifests are not rewritten (they belong to the writers); readers skip listed
generations at or below the merged generation, and writers drop them from the list at
their next flush.

WAL entries: a manifest version whose ``current_generation`` is ``g + 1`` (the flush of
``g``) recorded ``replay_after_wal_entry_position = P``; entries ``1..P`` are covered by
generations ``<= g`` and are deleted with them. Versions that cannot be read are
skipped, and no version beyond ``g + 1`` is ever used, so WAL entries of
flushed-but-unmerged generations and of the unflushed MemTable are never deleted.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from memwal_query.exceptions import InvalidPathError, ObjectNotFoundError
from memwal_query.format.index import read_index
from memwal_query.format.manifest import RegionManifestStore
from memwal_query.format.wal import Wal
from memwal_query.storage import crashpoints, paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

_GEN_DIR = re.compile(r"^[0-9a-f]{8}_gen_([1-9][0-9]*)$")


def gc_limits(table: Catalog) -> dict[str, int]:
    """Per region, the highest generation that may be garbage collected."""
    ds = table.dataset()
    versions = [v["version"] for v in ds.versions()]
    per_version: list[dict[str, int] | None] = []
    for v in versions:
        idx = read_index(table.io, table.dataset(version=v))
        per_version.append(None if idx is None else idx.merged_generations())
    latest = table.index()
    catchup = latest.index_catchup()
    limits = {}
    for region_id in table.region_ids():
        limit = (
            min((0 if m is None else m.get(region_id, 0)) for m in per_version)
            if per_version
            else 0
        )
        for name in table.maintained_indexes:
            if name in catchup:
                limit = min(limit, catchup[name].get(region_id, 0))
        limits[region_id] = limit
    from memwal_query.read.consumers import consumer_limits

    for region_id, limit in consumer_limits(table).items():
        if region_id in limits:
            limits[region_id] = min(limits[region_id], limit)
    return limits


def _wal_bound(store: RegionManifestStore, limit: int) -> int:
    """WAL position covered by generations ``<= limit`` (0 if none).

    A manifest version with ``current_generation = c`` records in
    ``replay_after_wal_entry_position`` the WAL entries flushed into generations
    ``< c``. Only versions with ``c <= limit + 1`` are used, so the bound never covers
    an entry of a generation above ``limit`` (flushed but not merged or not caught up)
    nor of the unflushed MemTable, even when some versions cannot be read: an unreadable
    version only makes the bound smaller (keeps more WAL), never larger.
    """
    if limit <= 0:
        return 0
    bound = 0
    for version in range(1, store.latest_version() + 1):
        try:
            m = store.load(version)
        except Exception:  # noqa: BLE001 - unreadable version: skip it (bound stays safe)
            continue
        if m.current_generation > limit + 1:
            break  # current_generation never decreases: later versions are beyond too
        bound = max(bound, m.replay_after_wal_entry_position)
    return bound


def pinned_versions(table: Catalog, min_age: dt.timedelta) -> int:
    """How many of the newest base versions a reader may still be reading: every version
    that was the *latest* within ``min_age`` (the one after it was committed less than
    ``min_age`` ago), and the latest. A view resolved on version ``V`` reads ``V`` and
    the generations ``V`` has not merged; keeping ``V`` keeps those generations too
    (rule 1 above)."""
    versions = table.dataset().versions()
    if not versions:
        return 1
    stamps: list[dt.datetime] = [v["timestamp"] for v in versions]  # type: ignore[misc]
    now = dt.datetime.now(stamps[-1].tzinfo) if stamps[-1].tzinfo else dt.datetime.now()
    keep = 1
    for i in range(len(stamps) - 1, 0, -1):
        # version i-1 stopped being the latest when version i was committed
        if now - stamps[i] < min_age:
            keep += 1
        else:
            break
    return keep


def _plan(table: Catalog) -> list[tuple[str, bool]]:
    """Everything the rules allow to delete: ``(path, is_tree)``; changes nothing.

    Reads (and so validates) the MemWAL index of every retained base version, the
    newest manifest of every region and the layout (a region directory that is a file
    or a link out of the table is an InvalidPathError): anything corrupt raises here.
    """
    plan: list[tuple[str, bool]] = []
    limits = gc_limits(table)
    for region_id, limit in limits.items():
        store = RegionManifestStore(table.io, table.uri, region_id)
        manifest = store.load_latest()
        if manifest is None:
            continue
        region_dir = paths.region_dir(table.uri, region_id)
        listed = {g.path for g in manifest.flushed_generations}
        for name in table.io.list(region_dir):
            m = _GEN_DIR.match(name)
            if m is None:
                continue
            gen = int(m.group(1))
            orphan = name not in listed and gen < manifest.current_generation
            if gen <= limit or orphan:
                path = join(region_dir, name)
                if not table.io.resolves_inside(path, region_dir):
                    raise InvalidPathError(
                        f"{path}: is a link that leads out of the region directory"
                    )
                plan.append((path, True))
        bound = _wal_bound(store, limit)
        if bound:
            wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
            plan.extend((wal.path(p), False) for p in wal.positions() if p <= bound)
    return plan


def gc(
    table: Catalog,
    dry_run: bool = False,
    cleanup_older_than: dt.timedelta | None = None,
    min_age: dt.timedelta | None = None,
    progress: Callable[[int, int], None] | None = None,
    retain_versions_for: dt.timedelta | None = None,
    sizes: dict[str, int] | None = None,
) -> list[str]:
    """Delete what the rules above allow; return the paths removed (or that would be).

    ``progress(done, total)`` is called as paths are deleted (progress bars). ``sizes``,
    when given, is filled with the size in bytes of each of those paths (a generation
    directory: all its files), measured before anything is deleted.

    Everything GC depends on (index of every retained version, region manifests,
    layout) is read and checked before anything is deleted, base versions included: a
    corrupt file raises its typed error with the table unchanged.

    ``cleanup_older_than`` first removes base versions older than that with Lance, but
    never one that was the *latest* version within ``min_age`` (default:
    ``cleanup_older_than`` itself). Lance ages a version from its own commit, so a
    version committed long ago and replaced a moment ago counted as old, and a reader
    that had just resolved its view on it lost it (and, through rule 1, the generations
    it had not merged). Here the window starts when a version stopped being the latest:
    a view used within ``min_age`` of its resolution reads all its pieces (see
    :mod:`memwal_query.read.view`); later, a typed error, never a shorter answer.

    ``retain_versions_for`` widens that window for time travel: every version that was
    the latest within it is kept (and, by rule 1, the generations it has not merged),
    so ``as_of`` any moment in the window reads all it needs.
    """
    plan = _plan(table)
    if cleanup_older_than is not None and not dry_run:
        window = cleanup_older_than if min_age is None else min_age
        keep = pinned_versions(table, window)
        if retain_versions_for is not None:
            keep = max(keep, pinned_versions(table, retain_versions_for))
        table.dataset().cleanup_old_versions(older_than=cleanup_older_than, retain_versions=keep)
        plan = _plan(table)  # fewer retained versions: more may go
    if sizes is not None:
        for path, is_tree in plan:
            try:
                sizes[path] = table.io.tree_size(path) if is_tree else table.io.size(path)
            except ObjectNotFoundError:  # gone meanwhile (another gc): nothing to free
                sizes[path] = 0
    if not dry_run:
        for done, (path, is_tree) in enumerate(plan, 1):
            if is_tree:
                table.io.delete_tree(path)
                crashpoints.point("gc.mid")
            else:
                table.io.delete(path)
            if progress is not None:
                progress(done, len(plan))
    return [path for path, _ in plan]
