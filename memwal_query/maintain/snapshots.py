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

import os
import tempfile
import time
import uuid as uuid_mod
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.exceptions import AlreadyExistsError, CorruptFileError, ObjectNotFoundError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.index import MemWalIndex, read_index_at, update_details
from memwal_query.storage import paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.table import MemWalTable

INLINE_THRESHOLD = 100
SNAPSHOT_FILE = "index.lance"
MAX_HISTORY_VERSIONS = 1000  # how far back a reader looks for a moved snapshot file

_GEN_STRUCT = pa.struct([pa.field("generation", pa.uint64()), pa.field("path", pa.string())])
BASE_FIELDS = [
    pa.field("region_id", pa.binary(16)),
    pa.field("version", pa.uint64()),
    pa.field("region_spec_id", pa.uint32()),
    pa.field("writer_epoch", pa.uint64()),
    pa.field("replay_after_wal_entry_position", pa.uint64()),
    pa.field("wal_entry_position_last_seen", pa.uint64()),
    pa.field("current_generation", pa.uint64()),
    pa.field("flushed_generations", pa.list_(_GEN_STRUCT)),
]

States = dict[str, tuple[Any, list[tuple[int, str]]]]


def snapshot_table(table: MemWalTable) -> pa.Table:
    """Build the region snapshot table from the current region manifests."""
    spec = table.region_spec
    field_ids = [f.field_id for f in spec.fields] if spec else []
    rows: dict[str, list] = {f.name: [] for f in BASE_FIELDS}
    region_cols: dict[str, list] = {fid: [] for fid in field_ids}
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
        arr = pa.array(region_cols[f.field_id], table._field_type(f))
        arrays.append(arr)
        fields.append(pa.field(f"region_field_{f.field_id}", arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _to_lance_bytes(t: pa.Table) -> bytes:
    from lance.file import LanceFileWriter

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, SNAPSHOT_FILE)
        writer = LanceFileWriter(path, t.schema)
        writer.write_batch(t)
        writer.close()
        with open(path, "rb") as f:
            return f.read()


def _from_lance_bytes(data: bytes, where: str) -> pa.Table:
    from lance.file import LanceFileReader

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, SNAPSHOT_FILE)
        with open(path, "wb") as f:
            f.write(data)
        try:
            return LanceFileReader(path).read_all().to_table()
        except Exception as e:  # noqa: BLE001
            raise CorruptFileError(where, f"cannot read region snapshots: {e}") from e


def refresh(table: MemWalTable) -> MemWalIndex:
    """Write fresh region snapshots into the MemWAL index (one base-table commit).

    Inline up to :data:`INLINE_THRESHOLD` regions, else an ``index.lance`` file under a
    new index uuid. Merge progress committed concurrently is never lost (see
    :func:`memwal_query.format.index.update_details`).
    """
    snap = snapshot_table(table)
    data = _to_lance_bytes(snap)
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


def snapshot_path(table: MemWalTable, index_uuid: str) -> str:
    """Spec location of the external snapshot file of an index uuid."""
    return join(table.uri, "_indices", index_uuid, SNAPSHOT_FILE)


def _is_external(index: MemWalIndex) -> bool:
    d = index.details
    return not d.HasField("inline_snapshots") and d.num_regions > 0


def _read_external(table: MemWalTable, index: MemWalIndex) -> tuple[str, bytes] | None:
    """(path, bytes) of ``index``'s external snapshot file, wherever it now is.

    First ``_indices/{index.uuid}/``; then the uuids of the preceding base versions whose
    MemWAL index holds the same snapshot (the version that wrote it and the merges after
    it). None when no copy is left.
    """
    path = snapshot_path(table, index.uuid)
    try:
        return path, table.io.read(path)
    except ObjectNotFoundError:
        pass
    ts = index.details.snapshot_ts_millis
    seen = {index.uuid}
    version = index.dataset_version - 1
    stop = max(0, index.dataset_version - 1 - MAX_HISTORY_VERSIONS)
    while version > stop:
        try:
            older = read_index_at(table.io, table.uri, version)
        except ObjectNotFoundError:
            return None  # older versions were cleaned up
        if older is None or older.details.snapshot_ts_millis != ts or not _is_external(older):
            return None  # before the refresh that wrote this snapshot
        if older.uuid not in seen:
            seen.add(older.uuid)
            path = snapshot_path(table, older.uuid)
            try:
                return path, table.io.read(path)
            except ObjectNotFoundError:
                pass
        version -= 1
    return None


def carry_forward(table: MemWalTable, before: MemWalIndex) -> None:
    """After a commit based on ``before``'s version: keep the external snapshot file at
    ``_indices/{uuid}/`` of the (possibly new) index uuid of the latest version.

    Call it under the index lock. A no-op for inline snapshots, when the uuid did not
    change, when another snapshot was written meanwhile, or when the file already exists.
    """
    if not _is_external(before):
        return
    latest = read_index_at(table.io, table.uri, table.dataset().version)
    if (
        latest is None
        or latest.uuid == before.uuid
        or not _is_external(latest)
        or latest.details.snapshot_ts_millis != before.details.snapshot_ts_millis
    ):
        return
    target = snapshot_path(table, latest.uuid)
    if table.io.exists(target):
        return
    found = _read_external(table, before)
    if found is None:
        return  # nothing left to copy: readers fall back to the region manifests
    try:
        table.io.put_if_not_exists(target, found[1])
    except AlreadyExistsError:
        pass


def read_snapshots(table: MemWalTable, index: MemWalIndex) -> States | None:
    """Region states from the index snapshots, or None when there are none to read
    (never written, or an external file no longer found anywhere: see module docs)."""
    d = index.details
    if d.HasField("inline_snapshots"):
        snap = _from_lance_bytes(d.inline_snapshots, f"{table.uri} (inline snapshots)")
    elif d.num_regions > 0:
        found = _read_external(table, index)
        if found is None:
            return None
        snap = _from_lance_bytes(found[1], found[0])
    else:
        return None
    spec = table.region_spec
    states: States = {}
    cols = snap.to_pydict()
    for i in range(snap.num_rows):
        region_id = paths.region_id_from_bytes(cols["region_id"][i])
        spec_id = cols["region_spec_id"][i]
        values = None
        if spec is not None and spec_id == spec.spec_id:
            values = (
                spec_id,
                {f.field_id: cols[f"region_field_{f.field_id}"][i] for f in spec.fields},
            )
        gens = [(g["generation"], g["path"]) for g in cols["flushed_generations"][i]]
        for _, p in gens:
            paths.validate_generation_dir(p)
        states[region_id] = (values, gens)
    return states
