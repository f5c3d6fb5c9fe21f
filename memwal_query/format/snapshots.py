"""Encoding of the region snapshots held by the MemWAL index (``eventual`` reads).

One row per region with the spec's schema (``region_id`` as ``fixed_size_binary(16)``,
the manifest fields, ``flushed_generations`` as ``list<struct<generation, path>>`` and
one ``region_field_{field_id}`` column per region field), serialized as a Lance file:
inline in ``MemWalIndexDetails.inline_snapshots`` up to :data:`INLINE_THRESHOLD`
regions, else at ``_indices/{index uuid}/index.lance``. Writing them (and carrying the
external file forward across merge commits) is maintenance: see
:mod:`memwal_query.maintain.snapshots`; reading them is here, so readers need nothing
above the format layer.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pyarrow as pa

from memwal_query.exceptions import CorruptFileError, ObjectNotFoundError
from memwal_query.format.index import MemWalIndex, read_index_at
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, join

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


def to_lance_bytes(t: pa.Table) -> bytes:
    from lance.file import LanceFileWriter

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, SNAPSHOT_FILE)
        writer = LanceFileWriter(path, t.schema)
        writer.write_batch(t)
        writer.close()
        with open(path, "rb") as f:
            return f.read()


def from_lance_bytes(data: bytes, where: str) -> pa.Table:
    from lance.file import LanceFileReader

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, SNAPSHOT_FILE)
        with open(path, "wb") as f:
            f.write(data)
        try:
            return LanceFileReader(path).read_all().to_table()
        except Exception as e:  # noqa: BLE001
            raise CorruptFileError(where, f"cannot read region snapshots: {e}") from e


def snapshot_path(uri: str, index_uuid: str) -> str:
    """Spec location of the external snapshot file of an index uuid."""
    return join(uri, "_indices", index_uuid, SNAPSHOT_FILE)


def is_external(index: MemWalIndex) -> bool:
    d = index.details
    return not d.HasField("inline_snapshots") and d.num_regions > 0


def read_external(io: FileIO, uri: str, index: MemWalIndex) -> tuple[str, bytes] | None:
    """(path, bytes) of ``index``'s external snapshot file, wherever it now is.

    First ``_indices/{index.uuid}/``; then the uuids of the preceding base versions whose
    MemWAL index holds the same snapshot (the version that wrote it and the merges after
    it). None when no copy is left.
    """
    path = snapshot_path(uri, index.uuid)
    try:
        return path, io.read(path)
    except ObjectNotFoundError:
        pass
    ts = index.details.snapshot_ts_millis
    seen = {index.uuid}
    version = index.dataset_version - 1
    stop = max(0, index.dataset_version - 1 - MAX_HISTORY_VERSIONS)
    while version > stop:
        try:
            older = read_index_at(io, uri, version)
        except ObjectNotFoundError:
            return None  # older versions were cleaned up
        if older is None or older.details.snapshot_ts_millis != ts or not is_external(older):
            return None  # before the refresh that wrote this snapshot
        if older.uuid not in seen:
            seen.add(older.uuid)
            path = snapshot_path(uri, older.uuid)
            try:
                return path, io.read(path)
            except ObjectNotFoundError:
                pass
        version -= 1
    return None


def read_snapshots(
    io: FileIO, uri: str, index: MemWalIndex, spec_id: int | None, field_ids: list[str]
) -> States | None:
    """Region states from the index snapshots, or None when there are none to read
    (never written, or an external file no longer found anywhere: see module docs).

    Region values are read for regions of spec ``spec_id`` (the current spec, whose
    region fields are ``field_ids``); None when the table has no spec."""
    d = index.details
    if d.HasField("inline_snapshots"):
        snap = from_lance_bytes(d.inline_snapshots, f"{uri} (inline snapshots)")
    elif d.num_regions > 0:
        found = read_external(io, uri, index)
        if found is None:
            return None
        snap = from_lance_bytes(found[1], found[0])
    else:
        return None
    states: States = {}
    cols = snap.to_pydict()
    for i in range(snap.num_rows):
        region_id = paths.region_id_from_bytes(cols["region_id"][i])
        region_spec_id = cols["region_spec_id"][i]
        values = None
        if spec_id is not None and region_spec_id == spec_id:
            values = (
                spec_id,
                {fid: cols[f"region_field_{fid}"][i] for fid in field_ids},
            )
        gens = [(g["generation"], g["path"]) for g in cols["flushed_generations"][i]]
        for _, p in gens:
            paths.validate_generation_dir(p)
        states[region_id] = (values, gens)
    return states
