"""Validated names and paths of the MemWAL storage layout.

Everything below ``{table}/_mem_wal/`` is built here, from validated parts: a region id
must be a UUID, a generation directory must be ``{8 hex}_gen_{n}`` with no separator, so
a crafted manifest cannot point a reader or the garbage collector outside its region.
"""

from __future__ import annotations

import functools
import re
import secrets
import uuid

from memwal_query.exceptions import InvalidPathError
from memwal_query.storage.io import FileIO, join

MEM_WAL_DIR = "_mem_wal"
_GEN_DIR = re.compile(r"^[0-9a-f]{8}_gen_([1-9][0-9]*)$")


def validate_region_id(region_id: str | uuid.UUID) -> str:
    """Return the canonical lowercase string of a region UUID, or raise InvalidPathError."""
    if isinstance(region_id, uuid.UUID):
        return str(region_id)
    if not isinstance(region_id, str):
        raise InvalidPathError(f"region id must be a UUID string, got {type(region_id).__name__}")
    return _validate_region_id_str(region_id)


@functools.lru_cache(maxsize=4096)
def _validate_region_id_str(region_id: str) -> str:
    """:func:`validate_region_id` of a string (cached: a read checks every region's id
    for each of its generations; errors are not cached)."""
    try:
        parsed = uuid.UUID(region_id)
    except ValueError as e:
        raise InvalidPathError(f"region id {region_id!r} is not a UUID") from e
    if str(parsed) != region_id.lower():
        raise InvalidPathError(f"region id {region_id!r} is not a canonical UUID string")
    return str(parsed)


def region_id_from_bytes(raw: bytes) -> str:
    """Region id string from the 16 bytes stored in protobuf ``UUID`` messages."""
    if len(raw) != 16:
        raise InvalidPathError(f"region id must be 16 bytes, got {len(raw)}")
    return str(uuid.UUID(bytes=bytes(raw)))


def region_id_to_bytes(region_id: str) -> bytes:
    """16 raw bytes of a region id string."""
    return uuid.UUID(validate_region_id(region_id)).bytes


def validate_generation_dir(name: str, generation: int | None = None) -> str:
    """Check a flushed generation directory name (``{8 hex}_gen_{n}``)."""
    m = _GEN_DIR.match(name) if isinstance(name, str) else None
    if m is None:
        raise InvalidPathError(
            f"generation path {name!r} is not of the form '{{8 hex}}_gen_{{n}}' "
            "inside the region directory"
        )
    if generation is not None and int(m.group(1)) != generation:
        raise InvalidPathError(f"generation path {name!r} does not match generation {generation}")
    return name


def new_generation_dir(generation: int) -> str:
    """A fresh ``{random 8 hex}_gen_{generation}`` directory name."""
    return f"{secrets.token_hex(4)}_gen_{generation}"


def mem_wal_root(table_uri: str) -> str:
    """``{table}/_mem_wal``."""
    return join(table_uri, MEM_WAL_DIR)


def region_dir(table_uri: str, region_id: str) -> str:
    """``{table}/_mem_wal/{region_id}``."""
    return join(table_uri, MEM_WAL_DIR, validate_region_id(region_id))


def manifest_dir(table_uri: str, region_id: str) -> str:
    """``{table}/_mem_wal/{region_id}/manifest``."""
    return join(region_dir(table_uri, region_id), "manifest")


def wal_dir(table_uri: str, region_id: str) -> str:
    """``{table}/_mem_wal/{region_id}/wal``."""
    return join(region_dir(table_uri, region_id), "wal")


def generation_path(table_uri: str, region_id: str, gen_dir: str) -> str:
    """``{table}/_mem_wal/{region_id}/{gen_dir}`` after validating ``gen_dir``."""
    return join(region_dir(table_uri, region_id), validate_generation_dir(gen_dir))


def check_mem_wal_root(io: FileIO, table_uri: str) -> None:
    """InvalidPathError when ``_mem_wal`` exists but is not a directory inside the table.

    A file there would otherwise read as "no regions" (a silently shorter answer).
    """
    _check_dirs(io, table_uri, [mem_wal_root(table_uri)])


def check_region_layout(io: FileIO, table_uri: str, region_id: str) -> None:
    """InvalidPathError when a region's directories are not directories inside the table.

    A symbolic link out of the table would make writers and the garbage collector
    write and delete elsewhere. Checked for the root, the region directory and its
    ``manifest`` and ``wal`` directories (one ``lstat`` each on a local file system;
    nothing on object stores, which have no links).
    """
    region = region_dir(table_uri, region_id)
    _check_dirs(
        io,
        table_uri,
        [mem_wal_root(table_uri), region, join(region, "manifest"), join(region, "wal")],
    )


def _check_dirs(io: FileIO, table_uri: str, dirs: list[str]) -> None:
    if not io.has_links:
        return
    for path in dirs:
        problem = io.directory_problem(path, table_uri)
        if problem is not None:
            raise InvalidPathError(f"{path}: {problem} (the MemWAL layout is damaged)")
