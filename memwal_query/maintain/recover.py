"""Recovery of regions whose writer is gone: nothing waits on a writer that is gone.

A writer that exits without flushing (killed, crashed, or closed with
``flush=False``) leaves acknowledged rows in its region's WAL. Every default reader sees
them (:mod:`memwal_query.read.waltail`), but only a flush puts them in a generation, and
only a merge in the base table. :func:`recover_abandoned` (the first step of
:func:`memwal_query.maintain.policy.maintain`) recovers every region that

1. is not sealed and has a durable WAL entry after its manifest's replay position, and
2. shows no sign of life for longer than ``abandoned_after``: its heartbeat
   (:mod:`memwal_query.write.liveness`) is older than that or says its writer was
   closed, or, for a region whose writer writes no heartbeat (pylance's native writer),
   its newest WAL entry is older than that;

by taking over the heartbeat it judged stale (a compare-and-swap that fails when the
writer refreshed it meanwhile: a writer whose heartbeat is fresh is never fenced), then
claiming the region (epoch + 1, fencing the gone writer), replaying and flushing its WAL
and closing it. The maintenance pass then merges the recovered regions whatever the
policy's thresholds (nobody else will add to them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memwal_query.exceptions import FencedError, ObjectNotFoundError
from memwal_query.format.wal import Wal
from memwal_query.storage import paths
from memwal_query.write import liveness

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.format.manifest import RegionManifest
    from memwal_query.write.writer import RegionWriter


@dataclass(frozen=True)
class RegionLife:
    """What a region's storage says about its writer.

    Attributes
    ----------
    region_id : str
    unflushed : bool
        A durable WAL entry follows the manifest's replay position.
    heartbeat : Heartbeat or None
        The region's heartbeat (None: none, or unreadable).
    silent_for : float or None
        Seconds since the last sign of life: the heartbeat's age, or without one the
        newest WAL entry's age (None: no sign at all).
    """

    region_id: str
    unflushed: bool
    heartbeat: liveness.Heartbeat | None
    silent_for: float | None

    def alive(self, abandoned_after: float) -> bool:
        """A writer showed a sign of life within ``abandoned_after`` seconds and was not
        closed since."""
        if self.heartbeat is not None and self.heartbeat.closed:
            return False
        return self.silent_for is not None and self.silent_for <= abandoned_after


def newest_entry_age(table: Catalog, wal: Wal, now: float) -> float | None:
    """Seconds since the newest WAL entry of a region was written (None: none)."""
    from memwal_query.read.view import modified_at

    positions = wal.positions()
    if not positions:
        return None
    try:
        return max(0.0, now - modified_at(table.io, wal.path(positions[-1])))
    except (ObjectNotFoundError, FileNotFoundError):
        return None  # collected meanwhile


def region_life(
    table: Catalog,
    region_id: str,
    manifest: RegionManifest,
    seen: liveness.Observed | None = None,
    now: float | None = None,
    unflushed: bool | None = None,
) -> RegionLife:
    """The :class:`RegionLife` of a region (``seen``: its heartbeat, ``unflushed``:
    whether it has unflushed WAL entries, when already known)."""
    now = time.time() if now is None else now
    wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
    if unflushed is None:
        unflushed = not manifest.sealed and wal.exists(manifest.replay_after_wal_entry_position + 1)
    if seen is None:
        seen = liveness.read(table.io, table.uri, region_id)
    hb = seen.heartbeat
    if hb is not None:
        silent: float | None = hb.age(now)
    elif unflushed:
        silent = newest_entry_age(table, wal, now)
    else:
        silent = None
    return RegionLife(region_id, unflushed, hb, silent)


@dataclass(frozen=True)
class Recovered:
    """A region recovered (or, in a dry run, to recover).

    Attributes
    ----------
    region_id : str
    silent_for : float or None
        Seconds its writer had been silent.
    generation : int or None
        The generation its WAL was flushed into (None in a dry run).
    """

    region_id: str
    silent_for: float | None
    generation: int | None = None


def recover_abandoned(
    table: Catalog,
    abandoned_after: float,
    open_writer: Callable[[str], RegionWriter] | None = None,
    dry_run: bool = False,
    decided: Callable[[str], None] | None = None,
) -> list[Recovered]:
    """Recover every region with unflushed WAL entries whose writer is gone (see the
    module docs).

    Parameters
    ----------
    table : Catalog
    abandoned_after : float
        Seconds without a sign of life after which a writer counts as gone.
    open_writer : callable, optional
        Claims a region and returns its writer (the table's ``writer``); default a
        :class:`RegionWriter` of the region as it is.
    dry_run : bool
        Only list the regions that would be recovered.
    decided : callable, optional
        Called with the region id once a region was judged abandoned, before its
        heartbeat is taken over (tests pause there).

    Returns
    -------
    list of Recovered
        The regions recovered. A region that a writer claims while it is being recovered
        (the recovering writer is fenced) is not among them and the others are still
        recovered: that writer replays the region's WAL, so nothing waits on a gone one.

    Raises
    ------
    StorageError, WalCorruptError
        Reading or flushing failed.
    """
    from memwal_query.write.writer import RegionWriter

    out = []
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is None or manifest.sealed:
            continue
        wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
        if not wal.exists(manifest.replay_after_wal_entry_position + 1):
            continue  # nothing unflushed: nothing to recover
        seen = liveness.read(table.io, table.uri, region_id)
        life = region_life(table, region_id, manifest, seen, unflushed=True)
        if life.alive(abandoned_after):
            continue
        if dry_run:
            out.append(Recovered(region_id, life.silent_for))
            continue
        if not liveness.can_take_over(table.io):
            continue  # no atomic take-over on this store: never risk a live writer
        if decided is not None:
            decided(region_id)
        claim = liveness.new_heartbeat(
            manifest.writer_epoch + 1, liveness.DEFAULT_HEARTBEAT_INTERVAL, recovering=True
        )
        if not liveness.take_over(table.io, table.uri, region_id, seen, claim):
            continue  # its writer refreshed the heartbeat meanwhile: alive
        try:
            if open_writer is not None:
                w = open_writer(region_id)
            else:
                w = RegionWriter(table, region_id)
            try:
                gen = w.flush()
            finally:
                with contextlib.suppress(FencedError):
                    w.close(flush=False)
        except FencedError:
            continue  # claimed by a writer since the take-over: that writer replays the WAL
        out.append(Recovered(region_id, life.silent_for, gen))
    return out
