"""Index catch-up: extend base-table indexes over merged data, record the progress.

``catch_up_indexes`` opens one base version ``V``, reads ``merged_generations`` *of that
version*, extends the named base indexes (default: the maintained indexes) over ``V``'s
fragments (Lance ``optimize_indices`` on ``V``), and records ``index_catchup[name] =
merged_generations`` of ``V``. A merge committed after ``V`` is neither indexed nor
recorded, so the index may cover more than recorded, never less. The indexed read plan
then switches back to base indexes for those generations, and GC may delete them.

Where the progress is stored
----------------------------
The spec keeps it in ``MemWalIndexDetails.index_catchup``, but pylance (14) strips that
field from any index commit that is not its own repair path, so a value written
through ``CreateIndex`` does not survive. memwal_query therefore records it in
``_mem_wal/_index_catchup/{bit_reversed_version}.binpb`` (a ``MemWalIndexDetails``
message holding only ``index_catchup``; versions written with put-if-not-exists and
only ever raised), and :meth:`MemWalTable.index` merges it into the details it returns,
so readers see it where the spec says it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwal_query.exceptions import CommitConflictError, NotInitializedError, ObjectNotFoundError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.index import _max_progress
from memwal_query.format.naming import MANIFEST_SUFFIX, from_bit_reversed, manifest_name
from memwal_query.storage import crashpoints, paths
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


def record_progress(io: FileIO, uri: str, update: pb.MemWalIndexDetails, retries: int = 20):
    """Raise the recorded progress to at least ``update`` (a new version)."""
    for _ in range(retries):
        versions = [from_bit_reversed(n) for n in io.list(_dir(uri)) if n.endswith(MANIFEST_SUFFIX)]
        latest = max(versions, default=0)
        current = read_progress(io, uri)
        merged = pb.MemWalIndexDetails()
        merged.index_catchup.extend(current.index_catchup)
        _max_progress(merged, update)
        try:
            io.put_if_not_exists(
                join(_dir(uri), manifest_name(latest + 1)),
                merged.SerializeToString(deterministic=True),
            )
            return merged
        except Exception as e:  # noqa: BLE001 - lost the race: re-read and retry
            from memwal_query.exceptions import AlreadyExistsError

            if not isinstance(e, AlreadyExistsError):
                raise
    raise CommitConflictError(f"{uri}: could not record index catch-up progress")


if TYPE_CHECKING:
    from memwal_query.table import MemWalTable


def catch_up_indexes(table: MemWalTable, names: list[str] | None = None) -> dict[str, dict]:
    """Rebuild/extend base indexes and record ``index_catchup``; return the progress."""
    names = list(names if names is not None else table.maintained_indexes)
    if not names:
        return {}
    ds = table.dataset()
    existing = {d.name for d in ds.describe_indices()}
    missing = [n for n in names if n not in existing]
    if missing:
        raise NotInitializedError(f"{table.uri}: no base index named {missing}")
    # Progress of exactly the version the rebuild indexes: Lance extends the indexes
    # over the fragments of ``ds``'s version, so a merge committed after it (not
    # covered) must not be recorded as caught up (GC would delete its generation early).
    merged = table.index(ds).merged_generations()
    ds.optimize.optimize_indices(index_names=names)
    crashpoints.point("catchup.mid")

    update = pb.MemWalIndexDetails()
    for name in names:
        entry = update.index_catchup.add(index_name=name)
        for region_id, gen in sorted(merged.items()):
            entry.caught_up_generations.add(
                region_id=pb.UUID(uuid=paths.region_id_to_bytes(region_id)), generation=gen
            )
    record_progress(table.io, table.uri, update)
    return table.index().index_catchup()
