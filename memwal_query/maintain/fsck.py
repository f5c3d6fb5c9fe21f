"""Check a table for damaged storage (``memwal fsck``) and repair what can be repaired.

:func:`check` reads everything a reader, writer, merger or garbage collector depends
on and reports each problem as a :class:`Finding` (severity, file, what is wrong, the
command that repairs it), changing nothing:

- the layout: ``_mem_wal`` and every region's ``manifest``/``wal`` directories are
  directories inside the table (not files, not links out of it);
- the MemWAL index of every retained base version, and the index catch-up progress;
- every region manifest version, and the version hint;
- every WAL entry (framing, checksum, metadata), and holes: a missing position with
  entries after it (acknowledged writes a writer would refuse to replay);
- every flushed generation not merged yet (the Lance table opens) and its bloom
  filter (size, checksum, and that every key of the generation hits it).

:func:`repair` fixes what can be fixed without losing anything (a corrupt version hint,
a bad bloom filter: rebuilt from the generation's keys) and, only with
``accept_loss=True``, moves a region's WAL past holes and corrupt unflushed entries:
the region is claimed (fencing its writer), each such position gets an empty entry
marked ``memwal_repair`` (so replay goes on; pylance reads it too), and the positions
dropped are returned. Corrupt manifests and a damaged index have no automatic repair.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import lance

from memwal_query.exceptions import (
    AlreadyExistsError,
    BloomCorruptError,
    InvalidPathError,
    MemWalError,
    ObjectNotFoundError,
    WalCorruptError,
)
from memwal_query.format import bloom
from memwal_query.format.index import read_index
from memwal_query.format.manifest import HINT_FILE, RegionManifest, RegionManifestStore
from memwal_query.format.naming import MANIFEST_SUFFIX, from_bit_reversed
from memwal_query.format.schema import storage_schema
from memwal_query.format.wal import REPAIR_KEY, Wal, encode_entry
from memwal_query.storage import paths
from memwal_query.storage.io import join

if TYPE_CHECKING:
    import pyarrow as pa

    from memwal_query.catalog import Catalog

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One problem found by :func:`check`.

    Attributes
    ----------
    severity : str
        ``"error"`` (corrupt: an operation would refuse, or data is at risk) or
        ``"warning"`` (harmless for answers, e.g. a corrupt version hint).
    kind : str
        ``layout``, ``index``, ``catch-up``, ``manifest``, ``hint``, ``wal-gap``,
        ``wal-entry``, ``generation`` or ``bloom``.
    path : str
        The file or directory concerned.
    message : str
        What is wrong.
    repair : str or None
        The command that repairs it, None when there is none (restore from a backup).
    """

    severity: str
    kind: str
    path: str
    message: str
    repair: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The finding as a dict (for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        fix = f"  (repair: {self.repair})" if self.repair else ""
        return f"{self.severity.upper():7} {self.kind:10} {self.path}: {self.message}{fix}"


@dataclass(frozen=True)
class FsckReport:
    """What :func:`check` found (``t.maintenance.fsck()``, ``memwal fsck``).

    Attributes
    ----------
    findings : list of Finding
        Every problem, empty for a healthy table.
    """

    findings: list[Finding]

    @property
    def ok(self) -> bool:
        """No finding of severity ``"error"``."""
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        """The findings of severity ``"error"``."""
        return [f for f in self.findings if f.severity == ERROR]

    def to_dict(self) -> dict[str, Any]:
        """The report as a dict (for JSON)."""
        return {"ok": self.ok, "findings": [f.to_dict() for f in self.findings]}

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)


def _repair_cmd(table: Catalog, region_id: str, accept_loss: bool = False) -> str:
    loss = " --accept-loss" if accept_loss else ""
    return f"memwal repair {table.uri} --region {region_id}{loss}"


def _message(e: BaseException) -> str:
    reason = getattr(e, "reason", None)
    return reason if reason is not None else f"{type(e).__name__}: {e}"


def check(table: Catalog, progress: Callable[[str], None] | None = None) -> list[Finding]:
    """Every problem of ``table``'s storage (empty for a healthy table); changes nothing.

    ``progress`` is called with each region id before it is checked.
    """
    out: list[Finding] = []
    try:
        paths.check_mem_wal_root(table.io, table.uri)
    except InvalidPathError as e:
        return [Finding(ERROR, "layout", paths.mem_wal_root(table.uri), str(e))]
    ds = table.dataset()
    merged: dict[str, int] = {}
    for v in ds.versions():
        version = v["version"]
        try:
            idx = read_index(table.io, table.dataset(version=version))
        except Exception as e:  # noqa: BLE001 - reported
            out.append(
                Finding(ERROR, "index", f"{table.uri} version {version}", f"MemWAL index: {e}")
            )
            continue
        if version == ds.version and idx is not None:
            merged = idx.merged_generations()
    out.extend(_check_catchup(table))
    for region_id in table.region_ids():
        if progress is not None:
            progress(region_id)
        out.extend(_check_region(table, region_id, merged.get(region_id, 0)))
    return out


def _check_catchup(table: Catalog) -> list[Finding]:
    """Index catch-up progress versions that do not decode (readers use the version
    before: less progress, so GC keeps more; harmless, hence warnings)."""
    from memwal_query.format._proto import memwal_pb2 as pb
    from memwal_query.format.progress import _dir

    out = []
    for name in table.io.list(_dir(table.uri)):
        if not name.endswith(MANIFEST_SUFFIX):
            continue
        path = join(_dir(table.uri), name)
        try:
            pb.MemWalIndexDetails.FromString(table.io.read(path))
        except Exception as e:  # noqa: BLE001 - reported
            out.append(
                Finding(
                    WARNING,
                    "catch-up",
                    path,
                    f"index catch-up progress does not decode ({e}); the version before it is used",
                    f"memwal catch-up {table.uri}",
                )
            )
    return out


def _check_region(table: Catalog, region_id: str, merged: int) -> list[Finding]:
    out: list[Finding] = []
    try:
        paths.check_region_layout(table.io, table.uri, region_id)
        store = RegionManifestStore(table.io, table.uri, region_id)
    except InvalidPathError as e:
        return [Finding(ERROR, "layout", paths.region_dir(table.uri, region_id), str(e))]
    latest: RegionManifest | None = None
    versions = sorted(store._listed_versions())
    for version in versions:
        try:
            m = store.load(version)
        except MemWalError as e:
            out.append(
                Finding(ERROR, "manifest", store.path(version), _message(e), None),
            )
            continue
        if version == versions[-1]:
            latest = m
    problem = store.hint_problem()
    if problem is not None:
        out.append(
            Finding(
                WARNING, "hint", join(store.dir, HINT_FILE), problem, _repair_cmd(table, region_id)
            )
        )
    if latest is None:
        return out  # nothing more can be checked without the newest manifest
    out.extend(
        Finding(ERROR, kind, path, msg, _repair_cmd(table, region_id, accept_loss=True))
        if kind != "wal-flushed"
        else Finding(WARNING, "wal-entry", path, msg, f"memwal gc {table.uri}")
        for kind, path, msg in _wal_problems(table, region_id, latest)
    )
    for g in latest.flushed_generations:
        if g.generation <= merged:
            continue  # merged: readers no longer need it (GC may have removed it)
        uri = paths.generation_path(table.uri, region_id, g.path)
        try:
            keys = lance.dataset(uri, storage_options=table.storage_options or None).to_table(
                columns=list(table.primary_key)
            )
        except Exception as e:  # noqa: BLE001 - reported
            out.append(Finding(ERROR, "generation", uri, f"generation {g.generation}: {e}", None))
            continue
        try:
            _check_bloom(table, uri, keys)
        except (BloomCorruptError, ObjectNotFoundError) as e:
            path = getattr(e, "path", join(uri, bloom.BLOOM_FILE))
            out.append(Finding(ERROR, "bloom", path, _message(e), _repair_cmd(table, region_id)))
    return out


def _check_bloom(table: Catalog, uri: str, keys: pa.Table) -> None:
    """BloomCorruptError unless the filter passes its checks and every key hits it."""
    bf = bloom.validate(table.io, uri, keys.num_rows)
    hits = bf.might_contain(keys)
    if not hits.all():
        raise BloomCorruptError(
            join(uri, bloom.BLOOM_FILE),
            f"{int((~hits).sum())} of the generation's {keys.num_rows} keys are not in it",
        )


def _wal_problems(
    table: Catalog, region_id: str, manifest: RegionManifest
) -> list[tuple[str, str, str]]:
    """``(kind, path, message)`` of holes and unreadable entries of a region's WAL.

    Kinds: ``wal-gap`` (a missing position before the last entry), ``wal-entry`` (an
    unflushed entry that does not decode), ``wal-flushed`` (one already flushed).
    """
    wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
    after = manifest.replay_after_wal_entry_position
    positions = wal.positions()
    out = []
    present = set(positions)
    last = max(positions, default=0)
    for p in range(after + 1, last):
        if p not in present:
            out.append(
                ("wal-gap", wal.path(p), f"WAL entry {p} is missing but entries up to {last} exist")
            )
    for p in positions:
        try:
            wal.read(p)
        except WalCorruptError as e:
            kind = "wal-entry" if p > after else "wal-flushed"
            note = "" if p > after else " (already flushed into a generation)"
            out.append((kind, wal.path(p), f"{e.reason}{note}"))
        except ObjectNotFoundError:
            continue  # deleted meanwhile (GC)
    return sorted(out, key=lambda x: x[1])


def repair(
    table: Catalog, region_id: str, accept_loss: bool = False, dry_run: bool = False
) -> list[str]:
    """Repair one region; return what was done (or would be, with ``dry_run``).

    Without ``accept_loss`` only lossless repairs are made (version hint, bloom
    filters); WAL holes and corrupt unflushed entries are then listed and a
    WalCorruptError raised after the lossless repairs. With it, the region is claimed
    and each such position is filled with an empty entry: the writes it held are lost,
    the writes after it are kept.
    """
    region_id = paths.validate_region_id(region_id)
    store = RegionManifestStore(table.io, table.uri, region_id)
    actions: list[str] = []
    latest = store.load_latest()
    if latest is None:
        raise ObjectNotFoundError(f"{store.dir}: region {region_id} has no manifest")
    if store.hint_problem() is not None:
        actions.append(f"rewrite {join(store.dir, HINT_FILE)} (version {latest.version})")
        if not dry_run:
            table.io.write(
                join(store.dir, HINT_FILE), json.dumps({"version": latest.version}).encode()
            )
    merged = table.index().merged_generations().get(region_id, 0)
    for g in latest.flushed_generations:
        if g.generation <= merged:
            continue
        uri = paths.generation_path(table.uri, region_id, g.path)
        keys = lance.dataset(uri, storage_options=table.storage_options or None).to_table(
            columns=list(table.primary_key)
        )
        try:
            _check_bloom(table, uri, keys)
        except (BloomCorruptError, ObjectNotFoundError):
            actions.append(f"rebuild {join(uri, bloom.BLOOM_FILE)} from {keys.num_rows} keys")
            if not dry_run:
                bloom.write(table.io, uri, keys)
            continue
        if not table.io.exists(join(uri, bloom.BLOOM_META_FILE)):  # pylance's: sound
            actions.append(f"record the checksum of {join(uri, bloom.BLOOM_FILE)}")
            if not dry_run:
                data = table.io.read(join(uri, bloom.BLOOM_FILE))
                bloom.write_meta(table.io, uri, data, keys.num_rows)
    lossy = [
        (path, msg)
        for kind, path, msg in _wal_problems(table, region_id, latest)
        if kind != "wal-flushed"
    ]
    if not lossy:
        return actions
    drops = [f"drop WAL entry {path}: {msg}" for path, msg in lossy]
    if not accept_loss:
        raise WalCorruptError(
            lossy[0][0],
            f"{len(lossy)} WAL position(s) of region {region_id} are missing or corrupt "
            f"({'; '.join(drops)}); the writes they held are lost. Run "
            f"`{_repair_cmd(table, region_id, accept_loss=True)}` to move past them "
            "(the writes after them are kept)",
        )
    actions.extend(drops)
    if dry_run:
        return actions
    claimed = store.claim(latest.region_spec_id, region_field_entries=latest.region_field_entries)
    wal = Wal(table.io, paths.wal_dir(table.uri, region_id), region_id)
    empty = storage_schema(table.schema).empty_table()
    for path, msg in lossy:
        position = from_bit_reversed(path)
        filler = empty.replace_schema_metadata({REPAIR_KEY: f"dropped: {msg}"[:1000]})
        table.io.delete(path)
        try:
            wal.write_encoded(
                position, encode_entry(filler, claimed.writer_epoch, claimed.current_generation)
            )
        except AlreadyExistsError:
            pass  # a (fenced) writer wrote it meanwhile: replay reads that entry
    return actions
