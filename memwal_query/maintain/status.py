"""Table status: per region, how far flushing and merging lag behind the writes.

:func:`status` reads the MemWAL index, every region's newest manifest, WAL and
heartbeat, and the table as a default reader sees it; it changes nothing
(``memwal status``, :meth:`MemWalTable.status`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import ObjectNotFoundError
from memwal_query.format.schema import storage_schema
from memwal_query.format.wal import Wal
from memwal_query.maintain.policy import DEFAULT_ABANDONED_AFTER
from memwal_query.maintain.recover import region_life
from memwal_query.read import waltail
from memwal_query.storage import paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


@dataclass(frozen=True)
class RegionStatus:
    """One region's state.

    Attributes
    ----------
    region_values : dict or None
        The region's field values (None: a manual region, or one of an unknown spec).
    region_spec_id : int
    sealed : bool
        A region of an older spec (see :mod:`memwal_query.maintain.specs`).
    manifest_version, writer_epoch, current_generation : int
    flushed_generations : list of int
        Generations not merged yet, or merged but not garbage collected yet (those GC
        removed are not listed, although the manifest may still name them).
    merged_generation : int
        Highest generation merged into the base table.
    replay_after_wal_entry_position : int
        WAL entries up to it are in flushed generations.
    wal_first_position, wal_last_position, wal_entries : int
        The WAL entries in storage (0, 0, 0 when none).
    unflushed_wal_entries, unflushed_rows : int
        Durable WAL entries (and their rows) not flushed yet: acknowledged writes
        default readers read from the WAL.
    oldest_unflushed_age : float or None
        Seconds since the oldest unflushed WAL entry was written (None: none).
    writer_alive : bool
        A writer refreshed the region's heartbeat within ``abandoned_after`` seconds.
    writer_silent_for : float or None
        Seconds since the writer's last sign of life (heartbeat; without one, the
        newest unflushed WAL entry); None when there is none.
    generation_bytes, wal_bytes : int
        Bytes of the listed generations and of the WAL entries in storage.
    """

    region_values: dict[str, Any] | None
    region_spec_id: int
    sealed: bool
    manifest_version: int
    writer_epoch: int
    current_generation: int
    flushed_generations: list[int]
    merged_generation: int
    replay_after_wal_entry_position: int
    wal_first_position: int
    wal_last_position: int
    wal_entries: int
    unflushed_wal_entries: int
    unflushed_rows: int
    oldest_unflushed_age: float | None
    writer_alive: bool
    writer_silent_for: float | None
    generation_bytes: int
    wal_bytes: int


@dataclass(frozen=True)
class TableStatus:
    """The state of a table (:func:`status`).

    Attributes
    ----------
    uri : str
    base_version : int
    live_rows : int
        Rows of the table as a default reader sees it (newest row per key, deletes
        applied, unflushed acknowledged writes included).
    base_rows : int
        Rows of the base table's latest version (what plain Lance reads).
    primary_key : list of str
    region_spec : str
        The current region spec as people write it (``bucket(id, 4)``, ``one region``).
    maintained_indexes : list of str
    index_catchup : dict
    snapshot_regions : int
    regions : dict of str to RegionStatus
    """

    uri: str
    base_version: int
    live_rows: int
    base_rows: int
    primary_key: list[str]
    region_spec: str
    maintained_indexes: list[str]
    index_catchup: dict[str, dict[str, int]]
    snapshot_regions: int
    regions: dict[str, RegionStatus] = field(default_factory=dict)

    @property
    def unflushed_rows(self) -> int:
        """Unflushed rows over all regions."""
        return sum(r.unflushed_rows for r in self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``memwal status --json``)."""
        return asdict(self)


def status(
    table: Catalog, abandoned_after: float = DEFAULT_ABANDONED_AFTER.total_seconds()
) -> TableStatus:
    """The :class:`TableStatus` of ``table`` (``abandoned_after``: seconds of silence
    after which a region's writer counts as gone)."""
    from memwal_query.read.view import modified_at

    index = table.index()
    merged = index.merged_generations()
    schema = storage_schema(table.schema)
    now = time.time()
    regions = {}
    for region_id in table.region_ids():
        m = table.region_manifest(region_id)
        if m is None:
            continue
        wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
        region_dir = paths.region_dir(table.uri, region_id)
        # a sealed region ends at its flush position (later entries: never acknowledged)
        tail = [] if m.sealed else waltail.tail(table, region_id, m, schema)
        unflushed_rows = sum(s.num_rows for s in tail)
        unflushed_entries = 0
        oldest_age = None
        first = m.replay_after_wal_entry_position + 1
        stored = wal.positions()
        if tail:
            present = set(stored)
            last = first
            while last + 1 in present:
                last += 1
            unflushed_entries = last - first + 1
            try:
                oldest_age = max(0.0, now - modified_at(table.io, wal.path(first)))
            except (ObjectNotFoundError, FileNotFoundError):
                oldest_age = None
        listed = [
            g
            for g in m.flushed_generations
            if g.generation > merged.get(region_id, 0) or table.io.is_dir(join(region_dir, g.path))
        ]
        life = region_life(table, region_id, m, now=now)
        values = table.region_values(region_id, m)
        last_position = m.replay_after_wal_entry_position + unflushed_entries
        regions[region_id] = RegionStatus(
            region_values=values[1] if values else None,
            region_spec_id=m.region_spec_id,
            sealed=m.sealed,
            manifest_version=m.version,
            writer_epoch=m.writer_epoch,
            current_generation=m.current_generation,
            flushed_generations=[g.generation for g in listed],
            merged_generation=merged.get(region_id, 0),
            replay_after_wal_entry_position=m.replay_after_wal_entry_position,
            wal_first_position=min(stored, default=0),
            # the span of entries in storage is empty (0, 0) when none is left (all
            # flushed and garbage collected)
            wal_last_position=last_position if stored else 0,
            wal_entries=len(stored),
            unflushed_wal_entries=unflushed_entries,
            unflushed_rows=unflushed_rows,
            oldest_unflushed_age=oldest_age,
            writer_alive=life.alive(abandoned_after),
            writer_silent_for=life.silent_for,
            generation_bytes=sum(table.io.tree_size(join(region_dir, g.path)) for g in listed),
            wal_bytes=table.io.tree_size(wal.dir),
        )
    ds = table.dataset()
    from memwal_query.read.provider import MemWalDataset

    return TableStatus(
        uri=table.uri,
        base_version=ds.version,
        live_rows=MemWalDataset(table).count_rows(),
        base_rows=ds.count_rows(),
        primary_key=list(table.primary_key),
        region_spec="one region"
        if table.region_spec is None
        else table.region_spec.describe(table.lance_schema),
        maintained_indexes=list(table.maintained_indexes),
        index_catchup=index.index_catchup(),
        snapshot_regions=index.details.num_regions,
        regions=regions,
    )
