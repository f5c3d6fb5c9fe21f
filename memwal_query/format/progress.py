"""Index catch-up progress: which generations each maintained index already covers.

Stored as versioned ``MemWalIndexDetails`` messages (only ``index_catchup`` set) under
``_mem_wal/_index_catchup/`` with bit-reversed names, next to the MemWAL index (whose own
``index_catchup`` pylance's ``optimize_indices`` also writes: readers take the maximum).
"""

from __future__ import annotations

from memwal_query.exceptions import AlreadyExistsError, CommitConflictError, ObjectNotFoundError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.index import max_progress
from memwal_query.format.naming import MANIFEST_SUFFIX, from_bit_reversed, manifest_name
from memwal_query.storage import paths
from memwal_query.storage.io import FileIO, join

CATCHUP_DIR = "_index_catchup"


def _dir(uri: str) -> str:
    return join(paths.mem_wal_root(uri), CATCHUP_DIR)


def read_progress(io: FileIO, uri: str) -> pb.MemWalIndexDetails:
    """The latest recorded catch-up progress (an empty message when none)."""
    versions = []
    for name in io.list(_dir(uri)):
        if name.endswith(MANIFEST_SUFFIX):
            try:
                versions.append(from_bit_reversed(name))
            except ValueError:
                continue
    out = pb.MemWalIndexDetails()
    for v in sorted(versions, reverse=True):
        try:
            out.ParseFromString(io.read(join(_dir(uri), manifest_name(v))))
            return out
        except (ObjectNotFoundError, Exception):  # noqa: BLE001 - try the one before
            continue
    return out


def record_progress(
    io: FileIO, uri: str, update: pb.MemWalIndexDetails, retries: int = 20
) -> pb.MemWalIndexDetails:
    """Raise the recorded progress to at least ``update`` (a new version)."""
    for _ in range(retries):
        versions = [from_bit_reversed(n) for n in io.list(_dir(uri)) if n.endswith(MANIFEST_SUFFIX)]
        latest = max(versions, default=0)
        current = read_progress(io, uri)
        merged = pb.MemWalIndexDetails()
        merged.index_catchup.extend(current.index_catchup)
        max_progress(merged, update)
        try:
            io.put_if_not_exists(
                join(_dir(uri), manifest_name(latest + 1)),
                merged.SerializeToString(deterministic=True),
            )
            return merged
        except AlreadyExistsError:  # lost the race: re-read and retry
            continue
    raise CommitConflictError(f"{uri}: could not record index catch-up progress")
