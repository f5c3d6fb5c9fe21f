"""The change feed: every acknowledged change of a MemWAL table, once, in per-region order.

:func:`changes` returns a :class:`Changes` batch: one row per put or delete read from
the regions' WAL entries, with ``_region``, ``_seq`` (``position * 2**32 + row``,
increasing within a region in write order), ``_change_type`` (``"upsert"`` or
``"delete"``; a delete's non-key columns are NULL) and ``_gen``, plus a
:class:`Cursor` that, passed back as ``since``, returns exactly what follows. Regions
of older region specs come first. :func:`start_cursor` reads ``since`` (a cursor
string, a base version or a moment), :func:`version_cursor` gives the cursor of a base
version and :func:`end_cursor` the cursor of everything acknowledged so far.

Raises :class:`~memwal_query.exceptions.ChangesGoneError` naming a WAL entry a cursor
needs that GC removed, never a shorter answer, and
:class:`~memwal_query.exceptions.CursorError` for a ``since`` that is not a cursor of
this table, a base version or a moment.

Consistency modes, cursor format, retention and registered consumers: docs/changes.md.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    ChangesGoneError,
    CursorError,
    ManifestCorruptError,
    MemWalError,
    ObjectNotFoundError,
)
from memwal_query.format.manifest import RegionManifest, RegionManifestStore
from memwal_query.format.schema import storage_schema
from memwal_query.format.wal import TOMBSTONE, Wal, conform_entry
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.storage import paths

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter

CHANGE_TYPE = "_change_type"
REGION = "_region"
GEN = "_gen"
SEQ = "_seq"
CHANGE_FIELDS = [
    pa.field(CHANGE_TYPE, pa.string(), nullable=False),
    pa.field(REGION, pa.string(), nullable=False),
    pa.field(GEN, pa.uint64(), nullable=False),
    pa.field(SEQ, pa.int64(), nullable=False),
]
"""The columns the feed adds to the table's columns."""

CURSOR_PREFIX = "mwc1."
SEQ_SHIFT = 32
"""``_seq = position << SEQ_SHIFT | row`` (a WAL entry holds fewer than 2**32 rows)."""
CONSUMERS_DIR = "_consumers"
_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MODES = ("latest", "strong")


# -- cursors ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Cursor:
    """A position in the change feed: per region, the last WAL position consumed.

    A region absent from ``positions`` has had nothing consumed (its feed starts at
    position 1). Encoded as ``mwc1.`` + URL-safe base64 of a JSON object
    (``{"l": lineage, "r": {region: position}}``); see :meth:`encode`.

    Attributes
    ----------
    positions : dict
        ``{region_id: last WAL position consumed}``.
    lineage : str
        The table's lineage token (a cursor of another table is refused).
    """

    positions: dict[str, int] = field(default_factory=dict)
    lineage: str = ""

    def encode(self) -> str:
        """The cursor as a string (pass it as ``since``)."""
        body = json.dumps(
            {"l": self.lineage, "r": dict(sorted(self.positions.items()))},
            separators=(",", ":"),
        )
        return CURSOR_PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """Parse :meth:`encode`'s output; :class:`CursorError` quoting it otherwise."""
        if not isinstance(text, str) or not text.startswith(CURSOR_PREFIX):
            raise CursorError(
                f"not a change-feed cursor (must start with {CURSOR_PREFIX!r}): {text!r}"
            )
        raw = text[len(CURSOR_PREFIX) :]
        try:
            data = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            lineage = data["l"]
            regions = data["r"]
            if not isinstance(lineage, str) or not isinstance(regions, dict):
                raise ValueError("bad fields")
            positions = {}
            for region, pos in regions.items():
                if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos < 1 << 31:
                    raise ValueError(f"position {pos!r}")
                positions[paths.validate_region_id(region)] = pos
        except (ValueError, KeyError, TypeError, binascii.Error, MemWalError) as e:
            raise CursorError(f"unreadable change-feed cursor {text!r}: {e}") from e
        return cls(positions, lineage)

    def advanced(self, region_id: str, position: int) -> Cursor:
        """A copy with ``region_id`` consumed through ``position``."""
        positions = dict(self.positions)
        positions[region_id] = max(position, positions.get(region_id, 0))
        return Cursor(positions, self.lineage)


@dataclass(frozen=True)
class Changes:
    """The result of one :func:`changes` call.

    Attributes
    ----------
    table : pa.Table
        The changes: the table's columns, then ``_change_type``, ``_region``, ``_gen``
        and ``_seq``; per region in ``_seq`` order (regions one after the other).
    cursor : str
        Pass it as ``since`` to the next call to get what follows.
    complete : bool
        False when ``max_rows`` stopped the read early (call again from ``cursor``).
    """

    table: pa.Table
    cursor: str
    complete: bool = True

    @property
    def num_rows(self) -> int:
        """Number of changes."""
        return self.table.num_rows

    def __len__(self) -> int:
        return self.table.num_rows


def change_schema(schema: pa.Schema) -> pa.Schema:
    """Schema of :attr:`Changes.table` for a table of ``schema``."""
    stored = storage_schema(schema)
    fields = [f for f in stored if f.name != TOMBSTONE]
    return pa.schema(fields + CHANGE_FIELDS, metadata=schema.metadata)


# -- what ``since`` means --------------------------------------------------------------
def start_cursor(table: Catalog, since: Any) -> Cursor | None:
    """The cursor ``since`` stands for (None: the earliest change still available).

    ``since`` may be a cursor string or :class:`Cursor`, a base version (int: the
    changes not merged into that version), or a ``datetime`` (the changes not merged
    into the base version that was the latest at that moment).
    """
    if since is None:
        return None
    if isinstance(since, Cursor):
        cursor = since
    elif isinstance(since, str) and since.startswith(CURSOR_PREFIX):
        cursor = Cursor.decode(since)
    else:
        point = parse_point(since, "since")
        if isinstance(point, dt.datetime):
            point = version_at(table, point)
        return version_cursor(table, point)
    if cursor.lineage and table.lineage and cursor.lineage != table.lineage:
        raise CursorError(
            f"the cursor belongs to another table or an earlier life of {table.uri} "
            f"(lineage {cursor.lineage}, the table's is {table.lineage})"
        )
    return cursor


def parse_point(value: Any, what: str) -> int | dt.datetime:
    """A base version (int, or a string of digits) or a moment (``datetime``, or an
    ISO-8601 string) from ``value``; :class:`CursorError` naming ``what`` otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.strip())
        except ValueError as e:
            raise CursorError(
                f"{what}={value!r} is neither a cursor, a base version nor an ISO timestamp"
            ) from e
    if isinstance(value, dt.datetime) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CursorError(f"{what}={value!r} is not a cursor, a base version or a timestamp")


def version_at(table: Catalog, moment: dt.datetime) -> int:
    """The base version that was the latest at ``moment`` (naive: local time).

    Raises :class:`~memwal_query.exceptions.VersionGoneError` when that version was
    cleaned up, :class:`CursorError` when the table has no version that early.
    """
    from memwal_query.exceptions import VersionGoneError

    when = _epoch(moment)
    listed = [(v["version"], _epoch(v["timestamp"])) for v in table.dataset().versions()]
    before = [v for v, ts in listed if ts <= when]
    if not before:
        if listed and min(v for v, _ in listed) > 1:
            raise VersionGoneError(
                f"{table.uri}: the base version that was the latest at {moment.isoformat()} "
                f"was cleaned up; versions kept: {[v for v, _ in listed]}"
            )
        raise CursorError(f"{table.uri}: no base version at or before {moment.isoformat()}")
    version = max(before)
    later = [v for v, _ in listed if v > version]
    if later and min(later) != version + 1:
        raise VersionGoneError(
            f"{table.uri}: base version {version + 1} (possibly the latest at "
            f"{moment.isoformat()}) was cleaned up; versions kept: {[v for v, _ in listed]}"
        )
    return version


def _epoch(moment: Any) -> float:
    """Seconds since the epoch of a datetime (naive: local time) or a number."""
    if isinstance(moment, dt.datetime):
        return moment.timestamp()
    return float(moment)


def version_cursor(table: Catalog, version: int) -> Cursor:
    """The cursor just after base version ``version``: per region, the WAL position
    flushed into the generations that version has merged."""
    from memwal_query.exceptions import VersionGoneError

    try:
        base = table.dataset(version=version)
    except (ValueError, OSError, RuntimeError) as e:
        kept = sorted(v["version"] for v in table.dataset().versions())
        raise VersionGoneError(
            f"{table.uri}: base version {version} is not available (cleaned up, or never "
            f"written); versions kept: {kept}"
        ) from e
    from memwal_query.format.index import read_index

    index = read_index(table.io, base)  # None: from before initialize, nothing merged
    merged = {} if index is None else index.merged_generations()
    positions = {}
    for region_id, gen in merged.items():
        history = ManifestHistory(RegionManifestStore(table.io, table.uri, region_id))
        positions[region_id] = history.flushed_through(gen)
    return Cursor(positions, table.lineage)


class ManifestHistory:
    """Binary searches over a region's manifest versions (immutable, so cached).

    ``replay_after_wal_entry_position`` and ``current_generation`` never decrease from
    one version to the next; a flush of generation ``g`` commits the version where
    ``current_generation`` becomes ``g + 1`` and the replay position becomes the last
    WAL position of ``g``.
    """

    def __init__(self, store: RegionManifestStore) -> None:
        self.store = store
        self._cache: dict[int, RegionManifest] = {}
        self._latest: int | None = None

    def latest(self) -> int:
        """Newest version number (read once)."""
        if self._latest is None:
            self._latest = self.store.latest_version()
        return self._latest

    def load(self, version: int) -> RegionManifest:
        """Manifest ``version`` (cached)."""
        m = self._cache.get(version)
        if m is None:
            m = self.store.load(version)
            self._cache[version] = m
        return m

    def _first(self, pred: Callable[[RegionManifest], bool]) -> RegionManifest | None:
        """The first version satisfying a monotone predicate (None: none does)."""
        lo, hi = 1, self.latest()
        found = None
        while lo <= hi:
            mid = (lo + hi) // 2
            m = self.load(mid)
            if pred(m):
                found, hi = m, mid - 1
            else:
                lo = mid + 1
        return found

    def flushed_through(self, generation: int) -> int:
        """Last WAL position flushed into generations ``<= generation`` (0 if none)."""
        if generation <= 0:
            return 0
        after = self._first(lambda m: m.current_generation > generation + 1)
        last = after.version - 1 if after is not None else self.latest()
        return self.load(last).replay_after_wal_entry_position if last >= 1 else 0

    def generation_of(self, position: int) -> int | None:
        """The generation WAL ``position`` was flushed into (None: not flushed)."""
        m = self._first(lambda m: m.replay_after_wal_entry_position >= position)
        return None if m is None else m.current_generation - 1

    def last_generation_within(self, position: int) -> int | None:
        """The highest generation whose WAL entries all lie at or below ``position``
        (None: no bound, nothing after ``position`` is flushed)."""
        m = self._first(lambda m: m.replay_after_wal_entry_position > position)
        return None if m is None else m.current_generation - 2


# -- reading ---------------------------------------------------------------------------
def changes(
    table: Catalog,
    since: Any = None,
    *,
    consistency: str = DEFAULT_CONSISTENCY,
    writers: Sequence[RegionWriter] | None = None,
    regions: Sequence[str] | None = None,
    max_rows: int | None = None,
    until: Any = None,
) -> Changes:
    """Every change after ``since`` (see module docs).

    Parameters
    ----------
    table : Catalog
    since : str, Cursor, int, datetime or None
        A cursor from an earlier call, a base version, a timestamp, or None for the
        earliest change still available.
    consistency : str
        ``"latest"`` (default: flushed changes and the durable WAL entries not
        flushed yet) or ``"strong"`` (flushed changes only).
    writers : list of RegionWriter, optional
        Their regions are read as with ``"latest"`` (read-your-writes).
    regions : list of str, optional
        Only these regions (the cursor keeps the others' positions).
    max_rows : int, optional
        Stop after the WAL entry that reaches this many rows (whole entries only);
        :attr:`Changes.complete` is then False.
    until : str or Cursor, optional
        Read no further than this cursor (e.g. :func:`end_cursor` taken earlier: a
        distributed reader splits ``(since, until]`` by region); every entry up to it
        must still exist.

    Raises
    ------
    ChangesGoneError
        An entry the cursor needs was garbage collected.
    CursorError
        ``since`` cannot be read or belongs to another table.
    WalCorruptError
        A WAL entry is damaged.
    """
    if consistency not in _MODES:
        raise MemWalError(f"consistency must be one of {_MODES} for changes, got {consistency!r}")
    if max_rows is not None and max_rows <= 0:
        raise MemWalError(f"max_rows must be positive, got {max_rows}")
    start = start_cursor(table, since)
    stop = None if until is None else start_cursor(table, until)
    cursor = start if start is not None else Cursor({}, table.lineage)
    cursor = Cursor(dict(cursor.positions), table.lineage)
    writer_regions = set()
    for w in writers or ():
        if w.table.uri != table.uri:
            raise MemWalError(f"writer of region {w.region_id} writes another table {w.table.uri}")
        writer_regions.add(w.region_id)
    wanted = (
        table.region_ids() if regions is None else [paths.validate_region_id(r) for r in regions]
    )
    out_schema = change_schema(table.schema)
    parts: list[pa.Table] = []
    rows = 0
    complete = True
    for region_id in sorted(set(wanted), key=lambda r: (_spec_rank(table, r), r)):
        budget = None if max_rows is None else max_rows - rows
        if budget is not None and budget <= 0:
            complete = False
            break
        unbounded = consistency == "latest" or region_id in writer_regions
        reader = _RegionFeed(table, region_id, out_schema)
        after = cursor.positions.get(region_id, 0) if start is not None else None
        end = None if stop is None else stop.positions.get(region_id, 0)
        for position, part in reader.read(after, unbounded, budget, end):
            parts.append(part)
            rows += part.num_rows
            cursor = cursor.advanced(region_id, position)
        if reader.stopped_early:
            complete = False
        if start is None and region_id not in cursor.positions and reader.floor is not None:
            cursor = cursor.advanced(region_id, reader.floor)
    table_out = pa.concat_tables(parts) if parts else out_schema.empty_table()
    return Changes(table_out, cursor.encode(), complete)


class _RegionFeed:
    """Reads one region's changes after a position (see :func:`changes`)."""

    def __init__(self, table: Catalog, region_id: str, out_schema: pa.Schema) -> None:
        self.table = table
        self.region_id = region_id
        self.out_schema = out_schema
        self.wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
        self.store = RegionManifestStore(table.io, table.uri, region_id)
        self.history = ManifestHistory(self.store)
        self.schema = storage_schema(table.schema)
        self.stopped_early = False
        self.floor: int | None = None  # since=None: the position before the earliest read

    def read(
        self, after: int | None, unbounded: bool, budget: int | None, end: int | None = None
    ) -> Iterator[tuple[int, pa.Table]]:
        """``(position, changes of that entry)`` for the entries after ``after`` (None:
        from the earliest one stored) and up to ``end`` (None: the manifest's flush
        position, or with ``unbounded`` the end of the WAL), in position order."""
        manifest = self.table.region_manifest(self.region_id)
        if manifest is None:
            return
        # A sealed region (region spec change) ends at its flush position: a later
        # entry was written by a writer the seal fenced, never acknowledged.
        bounded = manifest.sealed or not unbounded
        limit = manifest.replay_after_wal_entry_position if bounded else None
        if end is not None:
            limit = end
        if after is None:
            stored = self.wal.positions()
            first = min(stored) if stored else manifest.replay_after_wal_entry_position + 1
            after = first - 1
            self.floor = after
        position = after + 1
        rows = 0
        while limit is None or position <= limit:
            if budget is not None and rows >= budget:
                self.stopped_early = True
                return
            try:
                entry = self.wal.read(position)
            except ObjectNotFoundError:
                if limit is not None:
                    raise ChangesGoneError(
                        self.region_id,
                        position,
                        self.wal.path(position),
                        f"flushed (the manifest replays after {limit})",
                    ) from None
                fresh = RegionManifestStore(self.table.io, self.table.uri, self.region_id)
                newest = fresh.load_latest(manifest)
                if newest is not None and newest.replay_after_wal_entry_position >= position:
                    # Flushed after we read the manifest and removed since: gone.
                    raise ChangesGoneError(
                        self.region_id,
                        position,
                        self.wal.path(position),
                        "flushed, merged and collected while the feed read the region",
                    ) from None
                return  # the end of the WAL
            part = self._changes(position, entry.table, entry.generation, manifest)
            rows += part.num_rows
            yield position, part
            position += 1

    def _changes(
        self, position: int, raw: pa.Table, entry_gen: int | None, manifest: RegionManifest
    ) -> pa.Table:
        rows = conform_entry(self.wal.path(position), raw, self.schema, self.table.primary_key)
        n = rows.num_rows
        gen: int | None = None
        if position <= manifest.replay_after_wal_entry_position:
            try:
                gen = self.history.generation_of(position)
            except (ObjectNotFoundError, ManifestCorruptError):
                gen = None  # a manifest version is unreadable: the entry's own record
        if gen is None:
            gen = entry_gen if entry_gen is not None else manifest.current_generation
        tomb = rows.column(TOMBSTONE)
        kind = pc.if_else(tomb, pa.scalar("delete"), pa.scalar("upsert"))
        seq = np.arange(n, dtype=np.int64) + (np.int64(position) << np.int64(SEQ_SHIFT))
        out = rows.drop_columns([TOMBSTONE])
        out = out.append_column(CHANGE_FIELDS[0], kind)
        out = out.append_column(
            CHANGE_FIELDS[1], pa.repeat(pa.scalar(self.region_id, pa.string()), n)
        )
        out = out.append_column(CHANGE_FIELDS[2], pa.array(np.full(n, gen, np.uint64)))
        out = out.append_column(CHANGE_FIELDS[3], pa.array(seq))
        return out.cast(self.out_schema)


def _spec_rank(table: Catalog, region_id: str) -> int:
    """Regions of older specs first: a key that moved to a region of a newer spec
    (:mod:`memwal_query.maintain.specs`) was written there only after every change of
    its old region, so applying the feed in its row order applies them in order."""
    manifest = table.region_manifest(region_id)
    return 0 if manifest is None else manifest.region_spec_id


def end_cursor(table: Catalog, consistency: str = DEFAULT_CONSISTENCY) -> Cursor:
    """The cursor at the end of the feed now (per region: the flush position, or with
    ``"latest"`` the last contiguous WAL entry), without reading any change."""
    if consistency not in _MODES:
        raise MemWalError(f"consistency must be one of {_MODES} for changes, got {consistency!r}")
    positions = {}
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is None:
            continue
        position = manifest.replay_after_wal_entry_position
        if consistency == "latest" and not manifest.sealed:
            wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
            position = wal.last_position(position)
        positions[region_id] = position
    return Cursor(positions, table.lineage)


# -- registered consumers --------------------------------------------------------------
