"""Region manifests: versioned, immutable, put-if-not-exists, with epoch fencing.

A region's state lives in ``_mem_wal/{region}/manifest/{bit_reversed_version}.binpb``
(protobuf ``RegionManifest``), versions starting at 1. The newest version is found from
the best-effort ``version_hint.json`` by probing forward until a version is missing;
a missing, stale or corrupt hint falls back to listing the directory.

A writer *claims* a region by committing the next version with ``writer_epoch + 1``.
Before every later manifest update it re-reads the newest version and raises
:class:`~memwal_query.exceptions.FencedError` if a newer epoch is stored (spec, "Writer
Fencing"). Lost races on a version number are retried a bounded number of times.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from memwal_query.exceptions import (
    AlreadyExistsError,
    CommitConflictError,
    FencedError,
    LeftoverRegionsError,
    ManifestCorruptError,
    ObjectNotFoundError,
)
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.naming import MANIFEST_SUFFIX, manifest_name, numbers_in
from memwal_query.storage import crashpoints, paths
from memwal_query.storage.io import FileIO, join

HINT_FILE = "version_hint.json"
DEFAULT_MAX_RETRIES = 20
# Epochs, versions and WAL positions grow by one per claim / commit / put: a value at or
# above 2**63 cannot be reached honestly (and would overflow the uint64 fields, or
# signed 64-bit readers, on the next increment): the manifest is corrupt.
MAX_COUNTER = (1 << 63) - 1


def foreign_lineage(manifest: RegionManifest, lineage: str) -> bool:
    """Whether ``manifest``'s region was created under another lineage than ``lineage``.

    Regions and tables without a recorded lineage (pylance's, or older memwal_query
    versions') match every lineage.
    """
    return bool(manifest.lineage) and bool(lineage) and manifest.lineage != lineage


@dataclass(frozen=True)
class FlushedGeneration:
    """One flushed MemTable generation listed in a region manifest.

    Parameters
    ----------
    generation : int
        Generation number (1, 2, ...); higher is newer.
    path : str
        Directory name relative to the region directory (``{8 hex}_gen_{n}``).
    in_memory_bytes, physical_rows, primary_key_bytes : int or None
        Statistics that pylance's native writer also records (None when absent).
    """

    generation: int
    path: str
    in_memory_bytes: int | None = None
    physical_rows: int | None = None
    primary_key_bytes: int | None = None


@dataclass(frozen=True)
class RegionManifest:
    """Decoded region manifest (one immutable version).

    Mirrors the ``RegionManifest`` protobuf message of the spec, plus memwal_query's
    ``lineage`` and ``stream_batches`` (``(stream, batch)``: the newest batch of each
    stream whose rows the flushed generations hold; see :func:`merged_stream_batches`).
    """

    region_id: str
    version: int
    writer_epoch: int
    region_spec_id: int = 0
    replay_after_wal_entry_position: int = 0
    wal_entry_position_last_seen: int = 0
    current_generation: int = 1
    flushed_generations: tuple[FlushedGeneration, ...] = field(default_factory=tuple)
    region_field_entries: tuple[tuple[str, bytes], ...] = ()
    sealed: bool = False
    lineage: str = ""
    stream_batches: tuple[tuple[str, int], ...] = ()

    def to_proto(self) -> pb.RegionManifest:
        """The protobuf message for this manifest."""
        return pb.RegionManifest(
            region_id=pb.UUID(uuid=paths.region_id_to_bytes(self.region_id)),
            version=self.version,
            region_spec_id=self.region_spec_id,
            writer_epoch=self.writer_epoch,
            replay_after_wal_entry_position=self.replay_after_wal_entry_position,
            wal_entry_position_last_seen=self.wal_entry_position_last_seen,
            current_generation=self.current_generation,
            flushed_generations=[
                pb.FlushedGeneration(
                    generation=g.generation,
                    path=g.path,
                    in_memory_bytes=g.in_memory_bytes,
                    physical_rows=g.physical_rows,
                    primary_key_bytes=g.primary_key_bytes,
                )
                for g in self.flushed_generations
            ],
            region_field_entries=[
                pb.RegionFieldEntry(field_id=k, value=v) for k, v in self.region_field_entries
            ],
            status=pb.SEALED if self.sealed else pb.ACTIVE,
            lineage=self.lineage,
            stream_batches=[pb.StreamBatch(stream=k, batch=v) for k, v in self.stream_batches],
        )

    def to_bytes(self) -> bytes:
        """Serialized protobuf bytes."""
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_proto(cls, msg: pb.RegionManifest) -> RegionManifest:
        """Decode (and validate) a protobuf message; ValueError when inconsistent.

        Checked: generation paths, counters below 2**63 (:data:`MAX_COUNTER`),
        ``current_generation`` above every flushed generation, no generation twice.
        """
        for name in (
            "version",
            "writer_epoch",
            "replay_after_wal_entry_position",
            "wal_entry_position_last_seen",
            "current_generation",
        ):
            if getattr(msg, name) > MAX_COUNTER:
                raise ValueError(f"{name} {getattr(msg, name)} is beyond any reachable value")
        gens = []
        for g in msg.flushed_generations:
            paths.validate_generation_dir(g.path, g.generation)
            gens.append(
                FlushedGeneration(
                    g.generation,
                    g.path,
                    g.in_memory_bytes if g.HasField("in_memory_bytes") else None,
                    g.physical_rows if g.HasField("physical_rows") else None,
                    g.primary_key_bytes if g.HasField("primary_key_bytes") else None,
                )
            )
        flushed = [g.generation for g in msg.flushed_generations]
        if len(set(flushed)) != len(flushed):
            raise ValueError(f"flushed generations {sorted(flushed)} list a generation twice")
        if flushed and msg.current_generation <= max(flushed):
            raise ValueError(
                f"current_generation {msg.current_generation} is not above flushed "
                f"generation {max(flushed)}"
            )
        return cls(
            region_id=paths.region_id_from_bytes(msg.region_id.uuid),
            version=msg.version,
            writer_epoch=msg.writer_epoch,
            region_spec_id=msg.region_spec_id,
            replay_after_wal_entry_position=msg.replay_after_wal_entry_position,
            wal_entry_position_last_seen=msg.wal_entry_position_last_seen,
            current_generation=msg.current_generation,
            flushed_generations=tuple(sorted(gens, key=lambda g: g.generation)),
            region_field_entries=tuple((e.field_id, e.value) for e in msg.region_field_entries),
            sealed=msg.status == pb.SEALED,
            lineage=msg.lineage,
            stream_batches=tuple((b.stream, b.batch) for b in msg.stream_batches),
        )

    def stream_batch(self, stream: str) -> int | None:
        """The newest batch of ``stream`` the flushed generations hold, or None."""
        return dict(self.stream_batches).get(stream)

    def replace(self, **changes: Any) -> RegionManifest:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


MAX_STREAM_BATCHES = 64
"""Streams a region manifest remembers (:attr:`RegionManifest.stream_batches`); the
least recently written ones are forgotten first."""


def merged_stream_batches(
    recorded: tuple[tuple[str, int], ...], new: dict[str, int]
) -> tuple[tuple[str, int], ...]:
    """``recorded`` with the batches of ``new`` (the newest batch per stream kept), the
    streams just written last, at most :data:`MAX_STREAM_BATCHES` of them."""
    if not new:
        return recorded
    old = dict(recorded)
    kept = [(k, v) for k, v in recorded if k not in new]
    kept += [(k, max(v, old.get(k, v))) for k, v in new.items()]
    return tuple(kept[-MAX_STREAM_BATCHES:])


class RegionManifestStore:
    """Reads and commits the manifest versions of one region.

    Parameters
    ----------
    io : FileIO
        Object store of the table.
    table_uri : str
        Base table URI.
    region_id : str
        Region UUID.
    """

    def __init__(self, io: FileIO, table_uri: str, region_id: str) -> None:
        self.io = io
        self.region_id = paths.validate_region_id(region_id)
        self.dir = paths.manifest_dir(table_uri, self.region_id)
        self._table_uri = table_uri

    # -- reading ---------------------------------------------------------------------
    def path(self, version: int) -> str:
        """Path of manifest ``version``."""
        return join(self.dir, manifest_name(version))

    def load(self, version: int) -> RegionManifest:
        """Load one version; raise ManifestCorruptError if it does not decode."""
        path = self.path(version)
        data = self.io.read(path)
        try:
            msg = pb.RegionManifest.FromString(data)
            manifest = RegionManifest.from_proto(msg)
        except (DecodeError, ValueError) as e:
            raise ManifestCorruptError(path, f"corrupt region manifest: {e}") from e
        if manifest.version != version:
            raise ManifestCorruptError(
                path, f"manifest says version {manifest.version}, file name says {version}"
            )
        if manifest.region_id != self.region_id:
            raise ManifestCorruptError(
                path, f"manifest is for region {manifest.region_id}, not {self.region_id}"
            )
        return manifest

    def hint_problem(self) -> str | None:
        """What is wrong with ``version_hint.json`` (None when it is missing or usable).

        A corrupt hint is never fatal (the newest version is then found by listing),
        but :mod:`memwal_query.maintain.fsck` reports it.
        """
        try:
            raw = self.io.read(join(self.dir, HINT_FILE))
        except ObjectNotFoundError:
            return None
        try:
            value = json.loads(raw)["version"]
        except (ValueError, KeyError, TypeError) as e:
            return f"unreadable version hint: {type(e).__name__}: {e}"
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_COUNTER:
            return f"version hint {value!r} is not a version number"
        return None

    def _hint(self) -> int:
        try:
            data = json.loads(self.io.read(join(self.dir, HINT_FILE)))
            version = int(data["version"])
            return version if 0 < version <= MAX_COUNTER else 0
        except (ObjectNotFoundError, ValueError, KeyError, TypeError, OverflowError):
            # missing or corrupt hint (e.g. 1e400): fall back to listing (the spec allows
            # the hint to fail; fsck reports a corrupt one)
            return 0

    def _listed_versions(self) -> list[int]:
        return numbers_in(self.io.list(self.dir), MANIFEST_SUFFIX)

    def latest_version(self) -> int:
        """Newest committed version number, 0 when the region has no manifest."""
        start = self._hint()
        if start == 0 or not self.io.exists(self.path(start)):
            # No usable hint: version 1 as the spec says, but list when 1 is missing or
            # the hint pointed past the end (corrupt), so a bad hint can't hide versions.
            if start == 0 and self.io.exists(self.path(1)):
                start = 1
            else:
                listed = self._listed_versions()
                if not listed:
                    return 0
                start = max(listed)
        version = start
        while self.io.exists(self.path(version + 1)):
            version += 1
        return version

    def load_latest(self, known: RegionManifest | None = None) -> RegionManifest | None:
        """The newest manifest, or None when the region does not exist yet.

        ``known``: a version of this region read earlier. Versions are immutable and
        appear in order, so probing forward from it (one HEAD when nothing changed) finds
        the newest as surely as starting from the hint, and a new version is read only
        when there is one.
        """
        if known is not None:
            version = known.version
            while self.io.exists(self.path(version + 1)):
                version += 1
            return known if version == known.version else self.load(version)
        # Before the first read of a region (every writer claim, GC, status...): its
        # directories must be directories inside the table (InvalidPathError).
        paths.check_region_layout(self.io, self._table_uri, self.region_id)
        version = self.latest_version()
        if version == 0:
            return None
        # A version can only appear after the one before it, so it is safe to read.
        return self.load(version)

    # -- committing ------------------------------------------------------------------
    def try_commit(self, manifest: RegionManifest) -> bool:
        """Write ``manifest`` with put-if-not-exists; False if that version exists."""
        crashpoints.point("manifest.before_commit")
        try:
            self.io.put_if_not_exists(self.path(manifest.version), manifest.to_bytes())
        except AlreadyExistsError:
            return False
        crashpoints.point("manifest.after_commit")
        try:  # best effort
            self.io.write(
                join(self.dir, HINT_FILE), json.dumps({"version": manifest.version}).encode()
            )
        except Exception:  # noqa: BLE001 - hint failures are acceptable by spec
            pass
        return True

    def claim(
        self,
        region_spec_id: int = 0,
        max_retries: int = DEFAULT_MAX_RETRIES,
        region_field_entries: tuple[tuple[str, bytes], ...] = (),
        lineage: str = "",
    ) -> RegionManifest:
        """Claim the region: commit the next version with ``writer_epoch + 1``.

        Creates the region (version 1, epoch 1, with its spec id, field values and
        ``lineage``) when it has no manifest yet. Returns the committed manifest, whose
        ``writer_epoch`` is the new writer's fencing token. A SEALED region (pylance's
        drop protocol) is refused, and so is a region of another lineage
        (:class:`LeftoverRegionsError`: it belongs to an earlier life of the table).
        """
        for _ in range(max_retries):
            latest = self.load_latest()
            if latest is not None and foreign_lineage(latest, lineage):
                raise LeftoverRegionsError(
                    f"region {self.region_id} belongs to another lineage of the table "
                    f"({latest.lineage}, the table's is {lineage}): it was left over from "
                    "before the base table was initialized again; remove it with "
                    "MemWalTable.initialize(..., reset=True) or `memwal fsck`",
                    [self.region_id],
                )
            if latest is None:
                new = RegionManifest(
                    region_id=self.region_id,
                    version=1,
                    writer_epoch=1,
                    region_spec_id=region_spec_id,
                    current_generation=1,
                    region_field_entries=tuple(region_field_entries),
                    lineage=lineage,
                )
            elif latest.sealed:
                raise FencedError(self.region_id, 0, latest.writer_epoch)
            else:
                new = latest.replace(
                    version=latest.version + 1, writer_epoch=latest.writer_epoch + 1
                )
            if self.try_commit(new):
                return new
        raise CommitConflictError(
            f"could not claim region {self.region_id} after {max_retries} attempts"
        )

    def check_epoch(self, local_epoch: int) -> RegionManifest:
        """Newest manifest, or FencedError when a newer writer claimed the region."""
        latest = self.load_latest()
        if latest is None or latest.writer_epoch != local_epoch:
            stored = None if latest is None else latest.writer_epoch
            raise FencedError(self.region_id, local_epoch, stored)
        return latest

    def check_superseded(self, known_version: int, local_epoch: int) -> int:
        """Cheap fencing check between manifest updates; FencedError if claimed since.

        HEADs version ``known_version + 1`` (usually missing: one request). Versions
        found there are read: this writer's own (committed by its concurrent flush) are
        skipped, one with another epoch means a newer writer claimed the region. Returns
        the newest version known to be this writer's (or ``known_version``).
        """
        version = known_version
        while self.io.exists(self.path(version + 1)):
            newer = self.load(version + 1)
            if newer.writer_epoch != local_epoch:
                raise FencedError(self.region_id, local_epoch, newer.writer_epoch)
            version += 1
        return version

    def commit_update(
        self,
        local_epoch: int,
        update: Callable[[RegionManifest], RegionManifest],
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> RegionManifest:
        """Fenced read-modify-write of the manifest.

        ``update`` gets the newest manifest and returns the new content (its version is
        set here). Raises FencedError when a newer writer exists; retries lost races.
        """
        for _ in range(max_retries):
            latest = self.check_epoch(local_epoch)
            new = update(latest).replace(version=latest.version + 1, writer_epoch=local_epoch)
            if self.try_commit(new):
                return new
        raise CommitConflictError(
            f"region {self.region_id}: manifest update lost {max_retries} races"
        )

    def exists(self) -> bool:
        """Whether the region has at least one manifest version."""
        return self.latest_version() > 0
