"""Region snapshots in the MemWAL index (read by ``eventual`` consistency).

One row per region with the spec's schema (``region_id`` as ``fixed_size_binary(16)``,
the manifest fields, ``flushed_generations`` as ``list<struct<generation, path>>`` and
one ``region_field_{field_id}`` column per region field), serialized as a Lance file:
inline in ``MemWalIndexDetails.inline_snapshots`` up to :data:`INLINE_THRESHOLD`
regions, else at ``_indices/{index uuid}/index.lance`` (a new index uuid per refresh, so
a file is never overwritten while readers use it).

A merge commit (``mark_sstables_as_compacted``) gives the MemWAL index a new uuid while
keeping the details, so the external file would no longer be where the spec says (and
Lance's ``cleanup_old_versions`` deletes ``_indices/{old uuid}/``). Therefore:

- the merger copies the file forward to ``_indices/{new uuid}/index.lance`` right after
  each of its commits (:func:`carry_forward`, under the index lock), so the spec layout
  holds for every version memwal_query writes;
- a reader that does not find the file under the current uuid (a commit by another
  merger, or a crash between commit and copy) looks for it under the uuids of the
  preceding versions that hold the same snapshot (same ``snapshot_ts_millis``), and if
  it is gone altogether (cleaned up) reads the region manifests instead, as before any
  snapshot was written (fresher than a snapshot, never staler).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid as uuid_mod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.exceptions import AlreadyExistsError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.index import MemWalIndex, read_index_at, update_details
from memwal_query.format.snapshots import (
    BASE_FIELDS,
    INLINE_THRESHOLD,
    SNAPSHOT_FILE,
    is_external,
    read_external,
    snapshot_path,
    to_lance_bytes,
)
from memwal_query.storage import paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


def snapshot_table(table: Catalog) -> pa.Table:
    """Build the region snapshot table from the current region manifests."""
    spec = table.region_spec
    field_ids = [f.field_id for f in spec.fields] if spec else []
    rows: dict[str, list[Any]] = {f.name: [] for f in BASE_FIELDS}
    region_cols: dict[str, list[Any]] = {fid: [] for fid in field_ids}
    for region_id in table.region_ids():
        m = table.region_manifest(region_id)
        if m is None:
            continue
        rows["region_id"].append(paths.region_id_to_bytes(region_id))
        rows["version"].append(m.version)
        rows["region_spec_id"].append(m.region_spec_id)
        rows["writer_epoch"].append(m.writer_epoch)
        rows["replay_after_wal_entry_position"].append(m.replay_after_wal_entry_position)
        rows["wal_entry_position_last_seen"].append(m.wal_entry_position_last_seen)
        rows["current_generation"].append(m.current_generation)
        rows["flushed_generations"].append(
            [{"generation": g.generation, "path": g.path} for g in m.flushed_generations]
        )
        known = table.region_values(region_id)
        values = known[1] if known and spec and known[0] == spec.spec_id else {}
        for fid in field_ids:
            region_cols[fid].append(values.get(fid))
    arrays = [pa.array(rows[f.name], f.type) for f in BASE_FIELDS]
    fields = list(BASE_FIELDS)
    for f in spec.fields if spec else []:
        # The region field's result type (spec: "region_field_{field_id}: varies"), not
        # whatever pyarrow would infer from the values (int64 for a bucket's int32).
        arr = pa.array(region_cols[f.field_id], table.field_type(f))
        arrays.append(arr)
        fields.append(pa.field(f"region_field_{f.field_id}", arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


@dataclass(frozen=True)
class SnapshotRefresh:
    """What :func:`refresh` wrote (``t.maintenance.refresh_snapshots()``).

    Attributes
    ----------
    dataset_version : int
        The base-table version whose MemWAL index holds the snapshots.
    regions : int
        Regions in the snapshot.
    taken_at : datetime.datetime
        When the snapshot was taken (UTC).
    """

    dataset_version: int
    regions: int
    taken_at: dt.datetime

    @classmethod
    def of(cls, index: MemWalIndex) -> SnapshotRefresh:
        """The refresh recorded in ``index``."""
        d = index.details
        taken = dt.datetime.fromtimestamp(d.snapshot_ts_millis / 1000, tz=dt.timezone.utc)
        return cls(index.dataset_version, d.num_regions, taken)


def refresh(table: Catalog) -> MemWalIndex:
    """Write fresh region snapshots into the MemWAL index (one base-table commit).

    Inline up to :data:`INLINE_THRESHOLD` regions, else an ``index.lance`` file under a
    new index uuid. Merge progress committed concurrently is never lost (see
    :func:`memwal_query.format.index.update_details`).
    """
    snap = snapshot_table(table)
    data = to_lance_bytes(snap)
    new_uuid = str(uuid_mod.uuid4())
    if snap.num_rows > INLINE_THRESHOLD:
        table.io.write(join(table.uri, "_indices", new_uuid, SNAPSHOT_FILE), data)

    def mutate(details: pb.MemWalIndexDetails) -> None:
        details.snapshot_ts_millis = int(time.time() * 1000)
        details.num_regions = snap.num_rows
        if snap.num_rows <= INLINE_THRESHOLD:
            details.inline_snapshots = data
        else:
            details.ClearField("inline_snapshots")

    return update_details(table.io, table.uri, mutate, table.storage_options, new_uuid=new_uuid)


def carry_forward(table: Catalog, before: MemWalIndex) -> None:
    """After a commit based on ``before``'s version: keep the external snapshot file at
    ``_indices/{uuid}/`` of the (possibly new) index uuid of the latest version.

    Call it under the index lock. A no-op for inline snapshots, when the uuid did not
    change, when another snapshot was written meanwhile, or when the file already exists.
    """
    if not is_external(before):
        return
    latest = read_index_at(table.io, table.uri, table.dataset().version)
    if (
        latest is None
        or latest.uuid == before.uuid
        or not is_external(latest)
        or latest.details.snapshot_ts_millis != before.details.snapshot_ts_millis
    ):
        return
    target = snapshot_path(table.uri, latest.uuid)
    if table.io.exists(target):
        return
    found = read_external(table.io, table.uri, before)
    if found is None:
        return  # nothing left to copy: readers fall back to the region manifests
    try:
        table.io.put_if_not_exists(target, found[1])
    except AlreadyExistsError:
        pass
