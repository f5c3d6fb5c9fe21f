"""Registered change-feed consumers: a consumer's cursor holds GC back (GC keeps every
generation and WAL entry after it). Stored in ``_mem_wal/_consumers/{name}.json``; see
:mod:`memwal_query.read.changes`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import (
    CursorError,
    ObjectNotFoundError,
)
from memwal_query.format.manifest import RegionManifestStore
from memwal_query.format.wal import Wal
from memwal_query.read.changes import (
    _CONSUMER_NAME,
    CONSUMERS_DIR,
    Cursor,
    ManifestHistory,
    start_cursor,
)
from memwal_query.storage import paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


def _consumers_dir(uri: str) -> str:
    return join(paths.mem_wal_root(uri), CONSUMERS_DIR)


def _consumer_path(uri: str, name: str) -> str:
    if not isinstance(name, str) or not _CONSUMER_NAME.match(name):
        raise CursorError(f"consumer name {name!r} must be 1-128 letters, digits, '_', '.' or '-'")
    return join(_consumers_dir(uri), f"{name}.json")


def register_consumer(table: Catalog, name: str, cursor: Any = None) -> str:
    """Record consumer ``name`` at ``cursor`` (GC keeps what it still needs); returns
    the cursor stored. ``cursor=None``: the earliest change still available. Call it
    again with each cursor the consumer has processed (committing its progress).

    GC runs that start after this call keep every WAL entry and generation after the
    cursor; a GC run already under way may still remove them, which the consumer's
    next :func:`changes` reports as :class:`ChangesGoneError`.
    """
    path = _consumer_path(table.uri, name)
    start = start_cursor(table, cursor)
    if start is None:
        start = Cursor(_earliest_positions(table), table.lineage)
    text = Cursor(dict(start.positions), table.lineage).encode()
    table.io.write(path, json.dumps({"name": name, "cursor": text}).encode())
    return text


def _earliest_positions(table: Catalog) -> dict[str, int]:
    """Per region, the position before its earliest stored WAL entry."""
    out = {}
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is None:
            continue
        wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
        stored = wal.positions()
        out[region_id] = (
            min(stored) if stored else manifest.replay_after_wal_entry_position + 1
        ) - 1
    return out


def drop_consumer(table: Catalog, name: str) -> None:
    """Forget consumer ``name`` (GC no longer keeps anything for it)."""
    table.io.delete(_consumer_path(table.uri, name))


def consumers(table: Catalog) -> dict[str, Cursor]:
    """The registered consumers and their cursors.

    A consumer file that cannot be read raises :class:`CursorError` naming it: GC
    must not guess what a consumer needs.
    """
    out: dict[str, Cursor] = {}
    directory = _consumers_dir(table.uri)
    for file_name in table.io.list(directory):
        if not file_name.endswith(".json"):
            continue
        path = join(directory, file_name)
        try:
            raw = table.io.read(path)
        except ObjectNotFoundError:
            continue  # dropped meanwhile
        try:
            data = json.loads(raw)
            cursor = Cursor.decode(data["cursor"])
        except (ValueError, KeyError, TypeError) as e:
            raise CursorError(f"{path}: unreadable consumer record: {e}") from e
        out[file_name[: -len(".json")]] = cursor
    return out


def consumer_limits(table: Catalog) -> dict[str, int]:
    """Per region, the highest generation GC may remove without taking a change a
    registered consumer has not consumed (regions absent: no limit).

    A consumer at position ``p`` of a region needs the entries after ``p``: the
    generation holding entry ``p + 1`` and every later one stay, and so do their WAL
    entries (GC removes WAL entries only with their generations). A region the
    consumer's cursor does not name needs everything (limit 0).
    """
    registered = consumers(table)
    if not registered:
        return {}
    out: dict[str, int] = {}
    for region_id in table.region_ids():
        history = ManifestHistory(RegionManifestStore(table.io, table.uri, region_id))
        if history.latest() == 0:
            continue
        for cursor in registered.values():
            position = cursor.positions.get(region_id, 0)
            limit = history.last_generation_within(position)
            if limit is not None:
                out[region_id] = min(out.get(region_id, limit), max(0, limit))
    return out
