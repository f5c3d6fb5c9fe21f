"""The MemWAL index of a base table (``__lance_mem_wal``).

The index is an entry of the base table's index section whose ``index_details`` is a
``google.protobuf.Any`` with type URL ``/lance.table.MemWalIndexDetails`` holding a
:class:`MemWalIndexDetails` message, exactly as pylance's ``initialize_mem_wal`` writes
it (so either side reads the other's tables).

pylance does not expose the raw details bytes, so :func:`read_details` reads them from
the dataset's manifest file (Lance file layout: the last 16 bytes are
``u64 manifest_position, u16 major, u16 minor, b"LANC"``; at a position, a ``u32``
length and a protobuf message; the manifest's field 6 is the index section's position).
Writes go through pylance's public ``LanceOperation.CreateIndex`` commit, replacing the
previous index entry, or through ``merge_insert(...).mark_sstables_as_compacted``, which
updates ``merged_generations`` in the same commit as the merged data.
"""

from __future__ import annotations

import struct
import time
import uuid as uuid_mod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import lance
from google.protobuf.message import Message
from lance.dataset import Index, LanceOperation

from memwal_query.exceptions import CorruptFileError, ObjectNotFoundError
from memwal_query.format._proto import lance_table_pb2 as lt
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, join

_M = TypeVar("_M", bound=Message)

INDEX_NAME = "__lance_mem_wal"
TYPE_URL = "/lance.table.MemWalIndexDetails"
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class MemWalIndex:
    """The MemWAL index entry of one base-table version.

    Attributes
    ----------
    uuid : str
        Index UUID (``_indices/{uuid}/`` holds external region snapshots).
    dataset_version : int
        Base-table version the entry was read from.
    details : MemWalIndexDetails
        Decoded details (a fresh copy; mutate and pass to :func:`commit_details`).
    """

    uuid: str
    dataset_version: int
    details: pb.MemWalIndexDetails

    def merged_generations(self) -> dict[str, int]:
        """``{region_id: last merged generation}``."""
        return {
            paths.region_id_from_bytes(m.region_id.uuid): m.generation
            for m in self.details.merged_generations
        }

    def index_catchup(self) -> dict[str, dict[str, int]]:
        """``{index_name: {region_id: caught-up generation}}``."""
        return {
            p.index_name: {
                paths.region_id_from_bytes(m.region_id.uuid): m.generation
                for m in p.caught_up_generations
            }
            for p in self.details.index_catchup
        }


def manifest_path(io: FileIO, uri: str, version: int) -> str:
    """Path of the manifest file of a base-table version (ObjectNotFoundError if none)."""
    v2 = join(uri, "_versions", f"{_U64_MAX - version}.manifest")
    if io.exists(v2):
        return v2
    v1 = join(uri, "_versions", f"{version}.manifest")
    if io.exists(v1):
        return v1
    raise ObjectNotFoundError(f"{uri}: no manifest file for version {version}")


def _read_message(path: str, data: bytes, pos: int, cls: type[_M]) -> _M:
    if pos + 4 > len(data):
        raise CorruptFileError(path, f"message position {pos} is past the end of the file")
    (length,) = struct.unpack_from("<I", data, pos)
    if pos + 4 + length > len(data):
        raise CorruptFileError(path, f"message at {pos} runs past the end of the file")
    return cls.FromString(data[pos + 4 : pos + 4 + length])


def read_index(io: FileIO, dataset: lance.LanceDataset) -> MemWalIndex | None:
    """The MemWAL index of ``dataset``'s version, or None when not initialized."""
    return read_index_at(io, dataset.uri, dataset.version)


def read_index_at(io: FileIO, uri: str, version: int) -> MemWalIndex | None:
    """The MemWAL index of a version of the base table at ``uri`` (no dataset opened).

    Raises ObjectNotFoundError when that version's manifest does not exist (any more).
    """
    path = manifest_path(io, uri, version)
    data = io.read(path)
    if len(data) < 16 or data[-4:] != b"LANC":
        raise CorruptFileError(path, "not a Lance manifest file")
    (pos,) = struct.unpack_from("<Q", data, len(data) - 16)
    head = _read_message(path, data, pos, lt.ManifestHead)
    if not head.HasField("index_section"):
        return None
    section = _read_message(path, data, head.index_section, lt.IndexSection)
    for meta in section.indices:
        if meta.name == INDEX_NAME:
            details = pb.MemWalIndexDetails()
            if meta.index_details.value:
                details.ParseFromString(meta.index_details.value)
            return MemWalIndex(
                uuid=str(uuid_mod.UUID(bytes=meta.uuid.uuid)),
                dataset_version=version,
                details=details,
            )
    return None


def _index_entry(index_uuid: str, dataset_version: int, details: pb.MemWalIndexDetails) -> Index:
    return Index(
        uuid=index_uuid,
        name=INDEX_NAME,
        fields=[],
        dataset_version=dataset_version,
        fragment_ids=set(),  # type: ignore[arg-type]  # pylance accepts a set
        index_version=0,
        index_details=(TYPE_URL, details.SerializeToString(deterministic=True)),
    )


def commit_details(
    dataset: lance.LanceDataset,
    details: pb.MemWalIndexDetails,
    previous: MemWalIndex | None,
    new_uuid: str | None = None,
    storage_options: dict[str, str] | None = None,
) -> lance.LanceDataset:
    """Commit ``details`` as the MemWAL index, replacing ``previous`` (one transaction).

    The commit is based on ``dataset.version``; a concurrent commit touching the index
    makes it fail with Lance's commit-conflict error, which callers retry after
    re-reading.
    """
    index_uuid = new_uuid or (previous.uuid if previous else str(uuid_mod.uuid4()))
    removed = []
    if previous is not None:
        removed.append(_index_entry(previous.uuid, previous.dataset_version, previous.details))
    op = LanceOperation.CreateIndex(
        new_indices=[_index_entry(index_uuid, dataset.version, details)],
        removed_indices=removed,
    )
    return lance.LanceDataset.commit(
        dataset.uri, op, read_version=dataset.version, storage_options=storage_options or None
    )


def new_details(
    region_specs: list[pb.RegionSpec], maintained_indexes: list[str]
) -> pb.MemWalIndexDetails:
    """Fresh index details with configuration and no progress."""
    return pb.MemWalIndexDetails(
        snapshot_ts_millis=int(time.time() * 1000),
        num_regions=0,
        region_specs=region_specs,
        maintained_indexes=maintained_indexes,
    )


def max_progress(target: pb.MemWalIndexDetails, other: pb.MemWalIndexDetails) -> None:
    """Raise ``target.merged_generations`` / ``index_catchup`` to at least ``other``'s."""
    merged = {m.region_id.uuid: m.generation for m in target.merged_generations}
    for m in other.merged_generations:
        if m.generation > merged.get(m.region_id.uuid, 0):
            merged[m.region_id.uuid] = m.generation
    del target.merged_generations[:]
    for rid, gen in sorted(merged.items()):
        target.merged_generations.add(region_id=pb.UUID(uuid=rid), generation=gen)
    catch = {
        p.index_name: {m.region_id.uuid: m.generation for m in p.caught_up_generations}
        for p in target.index_catchup
    }
    for p in other.index_catchup:
        regions = catch.setdefault(p.index_name, {})
        for m in p.caught_up_generations:
            if m.generation > regions.get(m.region_id.uuid, -1):
                regions[m.region_id.uuid] = m.generation
    del target.index_catchup[:]
    for name, regions in sorted(catch.items()):
        entry = target.index_catchup.add(index_name=name)
        for rid, gen in sorted(regions.items()):
            entry.caught_up_generations.add(region_id=pb.UUID(uuid=rid), generation=gen)


def update_details(
    io: FileIO,
    uri: str,
    mutate: Callable[[pb.MemWalIndexDetails], object],
    storage_options: dict[str, str] | None = None,
    new_uuid: str | None = None,
    max_rounds: int = 10,
) -> MemWalIndex:
    """Read-modify-write the MemWAL index details without losing merge progress.

    ``mutate(details)`` edits a copy of the latest details in place. Runs under the
    table's index lock (see :mod:`memwal_query.storage.locking`); if a commit from outside the
    lock slipped in between, merge and catch-up progress are re-raised monotonically.
    """
    from memwal_query.storage.locking import index_lock

    carry: pb.MemWalIndexDetails | None = None
    with index_lock(uri, io):
        for _ in range(max_rounds):
            ds = lance.dataset(uri, storage_options=storage_options or None)
            current = read_index(io, ds)
            if current is None:
                raise ObjectNotFoundError(f"{uri}: the table has no MemWAL index")
            details = pb.MemWalIndexDetails()
            details.CopyFrom(current.details)
            mutate(details)
            if carry is not None:
                max_progress(details, carry)
            max_progress(details, current.details)  # mutate may not lower progress
            new_ds = commit_details(
                ds, details, current, new_uuid=new_uuid, storage_options=storage_options
            )
            if new_ds.version == ds.version + 1:
                return read_index(io, new_ds)  # type: ignore[return-value]
            # Someone committed between our read and our commit: keep their progress.
            between = read_index(
                io,
                lance.dataset(
                    uri, version=new_ds.version - 1, storage_options=storage_options or None
                ),
            )
            if between is None or (
                list(between.details.merged_generations) == list(details.merged_generations)
                and list(between.details.index_catchup) == list(details.index_catchup)
            ):
                return read_index(io, new_ds)  # type: ignore[return-value]
            carry = between.details
    raise CorruptFileError(uri, "could not commit MemWAL index details without conflicts")
