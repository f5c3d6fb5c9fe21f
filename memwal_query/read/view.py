"""The pinned read view: what every reader of a MemWAL table reads, resolved once.

A **View** (:class:`ReadPlan`) is immutable: the base table at one version ``V``, the
MemWAL index read from that same version, per region the flushed generations above the
merged one, the MemTables of the writers handed in, and with ``consistency="latest"``
(:data:`DEFAULT_CONSISTENCY`, every reader's default) the durable WAL entries above each
region's last flushed generation, every acknowledged write of any process
(:mod:`memwal_query.read.waltail`). Every reader (the DataFusion provider, lookup,
vector and full-text search, the Spark reader) answers from one View with one
deduplication (:func:`memwal_query.read.dedup.newest_indices`).

:func:`resolve` reads the pieces in an order that makes every combination a state the
table had (no torn reads), re-resolving up to :data:`RESOLVE_ATTEMPTS` times when the
base version disappears meanwhile, or when it merged a generation flushed after a
manifest whose WAL tail was read (:func:`_check_tails`); :func:`resolve_as_of` resolves
a past moment. A piece found gone afterwards is a typed :class:`~memwal_query.exceptions.
BaseVersionGoneError` or :class:`~memwal_query.exceptions.GenerationGoneError`, never an
empty part. Why the order is consistent, and how long a View stays readable:
``docs/architecture.md``, "The pinned view".
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import (
    BaseVersionGoneError,
    MemWalError,
    ObjectNotFoundError,
)
from memwal_query.read import waltail
from memwal_query.storage import heap, paths
from memwal_query.storage.io import in_chunks
from memwal_query.write.memtable import MemTableSnapshot

if TYPE_CHECKING:
    import lance

    from memwal_query.catalog import Catalog
    from memwal_query.format.index import MemWalIndex
    from memwal_query.format.manifest import RegionManifest
    from memwal_query.write.writer import RegionWriter


@dataclass(frozen=True)
class GenerationRef:
    """A flushed generation to read.

    Attributes
    ----------
    region_id : str
    generation : int
    uri : str
        Directory of the generation's Lance table.
    rows : int or None
        Rows the region manifest records for it (``physical_rows``), when the view was
        resolved from manifests that record it; readers check the parts of optional
        files (region keys files) against it.
    """

    region_id: str
    generation: int
    uri: str
    rows: int | None = field(default=None, compare=False)


@dataclass
class RegionView:
    """What one region contributes to a read."""

    region_id: str
    values: dict[str, Any] | None
    merged_generation: int
    generations: list[GenerationRef] = field(default_factory=list)
    memtables: list[MemTableSnapshot] = field(default_factory=list)


@dataclass
class ReadPlan:
    """The sources of one LSM read.

    Attributes
    ----------
    base : lance.LanceDataset
        The base table version read.
    index : MemWalIndex
        The MemWAL index of that version.
    regions : list[RegionView]
        Regions read (after pruning).
    pruned : list[str]
        Region ids skipped by region pruning.
    consistency : str
        ``"latest"``, ``"strong"`` or ``"eventual"``.
    """

    base: lance.LanceDataset
    index: MemWalIndex
    regions: list[RegionView]
    pruned: list[str]
    consistency: str

    @property
    def generations(self) -> list[GenerationRef]:
        """All flushed generations read, region by region, oldest first."""
        return [g for r in self.regions for g in r.generations]

    def describe(self) -> str:
        """Human-readable summary (what EXPLAIN-style debugging shows)."""
        lines = [
            f"MemWalScan: consistency={self.consistency} base_version={self.base.version} "
            f"regions={len(self.regions)} pruned={len(self.pruned)}"
        ]
        for r in self.regions:
            gens = ",".join(str(g.generation) for g in r.generations) or "-"
            mems = ",".join(f"{m.generation}({m.num_rows} rows)" for m in r.memtables) or "-"
            lines.append(
                f"  region {r.region_id} values={r.values} merged<={r.merged_generation} "
                f"generations=[{gens}] memtables=[{mems}]"
            )
        for rid in self.pruned:
            lines.append(f"  pruned region {rid}")
        return "\n".join(lines)


DEFAULT_CONSISTENCY = "latest"
"""The consistency every reader uses unless told otherwise: every acknowledged write
(region manifests + the durable WAL entries not flushed yet, see
:mod:`memwal_query.read.waltail`)."""
CONSISTENCY_MODES = ("latest", "strong", "eventual")
RESOLVE_ATTEMPTS = 5
DEFAULT_MAX_STALENESS = 60.0
"""Seconds: an ``eventual`` snapshot older than this is not used (manifests instead)."""

View = ReadPlan
"""The pinned view of one read (an alias: the plan type every reader takes)."""

_State = tuple[Any, list[tuple[int, str]]]


def resolve(
    table: Catalog,
    consistency: str = DEFAULT_CONSISTENCY,
    writers: Sequence[RegionWriter] | None = None,
    predicates: list[tuple[str, str, Any]] | None = None,
    max_staleness: float | None = DEFAULT_MAX_STALENESS,
    as_of: Any = None,
) -> ReadPlan:
    """Resolve the :data:`View` to read now (see module docs), or with ``as_of`` the
    view of a past moment (:func:`resolve_as_of`; ``consistency`` and ``writers`` are
    then not used).

    Parameters
    ----------
    table : Catalog
    consistency : str
        ``"latest"`` (default: manifests + durable WAL entries not yet flushed, i.e.
        every acknowledged write of every process), ``"strong"`` (region manifests:
        flushed rows only) or ``"eventual"`` (index snapshots, at most
        ``max_staleness`` old).
    writers : list of RegionWriter, optional
        In-process writers whose MemTables are read too (read-your-writes).
    predicates : list, optional
        ``(column, op, value)`` predicates: regions whose region value cannot match are
        pruned.
    max_staleness : float or None
        ``eventual`` only: seconds after which a snapshot is too old (None: any age).
    as_of : int, datetime or str, optional
        Time travel: a base version or a moment (see :func:`resolve_as_of`).

    Raises
    ------
    MemWalError
        Unknown consistency mode, or a writer of another table.
    BaseVersionGoneError
        The base version kept disappearing while the view was resolved.
    """
    heap.note_read()
    if as_of is not None:
        return resolve_as_of(table, as_of, predicates)
    if consistency not in CONSISTENCY_MODES:
        raise MemWalError(f"consistency must be one of {CONSISTENCY_MODES}, got {consistency!r}")
    mem_by_region: dict[str, list[MemTableSnapshot]] = {}
    for w in writers or ():
        if w.table.uri != table.uri:
            raise MemWalError(f"writer of region {w.region_id} writes another table {w.table.uri}")
        mem_by_region.setdefault(w.region_id, []).extend(w.memtables())
    last: Exception | None = None
    for attempt in range(RESOLVE_ATTEMPTS):
        try:
            return _resolve_once(
                table, consistency, mem_by_region, predicates, max_staleness, writers, attempt > 0
            )
        except _Replan as e:
            last = e
        except (ObjectNotFoundError, OSError) as e:
            # The base version (or its index) vanished between opening and reading it.
            last = e
    raise BaseVersionGoneError(
        f"{table.uri}: could not resolve a consistent view in {RESOLVE_ATTEMPTS} attempts "
        f"(base versions cleaned up, or WAL tails flushed, merged and collected, "
        f"meanwhile): {last}"
    )


class _Replan(Exception):
    """Internal: the pieces read do not fit together; resolve again (reading every
    region manifest anew)."""


def _resolve_once(
    table: Catalog,
    consistency: str,
    mem_by_region: dict[str, list[MemTableSnapshot]],
    predicates: list[tuple[str, str, Any]] | None,
    max_staleness: float | None,
    writers: Sequence[RegionWriter] | None,
    fresh: bool = False,
) -> ReadPlan:
    writer_regions = {w.region_id for w in writers or ()}
    wal_tails: dict[str, list[MemTableSnapshot]] = {}
    pruned: list[str] = []
    rows: dict[tuple[str, int], int | None] | None = None  # per generation, from manifests
    if consistency == "eventual":
        # Step 2 for the writers' regions only, then step 3 and the snapshots of V.
        own = {r: s for r in writer_regions if (s := _manifest_state(table, r)) is not None}
        base = table.dataset()
        index = table.index(base)
        states = _snapshot_states(table, index, max_staleness)
        if states is None:  # no usable snapshot: strong, resolved in the safe order
            return _resolve_once(table, "strong", mem_by_region, predicates, None, writers, fresh)
        states.update(own)
    else:
        wanted, pruned = _wanted(table, predicates)
        if consistency == "latest":
            # Regions whose first unflushed position is missing keep the manifest read
            # last time (waltail: as good as the newest); the others are read as for
            # strong, then their WAL tails. A sealed region (spec change, drop) takes no
            # more WAL entries: one after its replay position was never acknowledged
            # (its writer was fenced by the seal), so it is not read. The writers'
            # regions are read from memory.
            probes = waltail.Probes(
                table, [] if fresh else [r for r in wanted if r not in writer_regions]
            )
            unchanged = probes.unchanged()
            manifests = _read_manifests(table, [r for r in wanted if r not in unchanged])
            unflushed = {
                r: m for r, m in manifests.items() if r not in writer_regions and not m.sealed
            }
            wal_tails = waltail.tails(table, unflushed, probes)
            manifests.update(unchanged)
        else:
            manifests = _read_manifests(table, wanted)
        states = {r: _state_of(table, r, m) for r, m in manifests.items()}
        base = table.dataset()
        index = table.index(base)  # progress of exactly the version we read
        if consistency == "latest":
            _check_tails(index, manifests, writer_regions)
        rows = {
            (r, g.generation): g.physical_rows
            for r, m in manifests.items()
            for g in m.flushed_generations
        }
    return _build(
        table,
        consistency,
        base,
        index,
        states,
        mem_by_region,
        wal_tails,
        predicates,
        pruned,
        rows,
    )


def _check_tails(
    index: MemWalIndex, manifests: dict[str, RegionManifest], writer_regions: set[str]
) -> None:
    """_Replan when the base version read merged a generation flushed after a region
    manifest whose WAL tail was read: GC may then have removed WAL entries of that tail
    (the first missing position the tail stopped at), with acknowledged entries after
    them (see :mod:`memwal_query.read.waltail`)."""
    merged = index.merged_generations()
    for region_id, m in manifests.items():
        if region_id in writer_regions or m.sealed:
            continue
        if merged.get(region_id, 0) >= m.current_generation:
            raise _Replan(
                f"region {region_id}: generation {merged[region_id]} was flushed and merged "
                f"after manifest version {m.version} was read"
            )


def _build(
    table: Catalog,
    consistency: str,
    base: lance.LanceDataset,
    index: MemWalIndex,
    states: dict[str, _State],
    mem_by_region: dict[str, list[MemTableSnapshot]],
    wal_tails: dict[str, list[MemTableSnapshot]],
    predicates: list[tuple[str, str, Any]] | None,
    pruned_unread: Sequence[str] = (),
    rows: dict[tuple[str, int], int | None] | None = None,
) -> ReadPlan:
    merged = index.merged_generations()
    for region_id in mem_by_region:
        if region_id not in states:
            states[region_id] = (table.region_values(region_id), [])
    regions: list[RegionView] = []
    pruned: list[str] = [r for r in pruned_unread if r not in states]
    may_match = _Pruner(table, predicates) if predicates else None
    for region_id, (values, flushed) in sorted(states.items()):
        if may_match is not None and values is not None and not may_match(values):
            pruned.append(region_id)
            continue
        merged_gen = merged.get(region_id, 0)
        view = RegionView(
            region_id=region_id,
            values=values[1] if values else None,
            merged_generation=merged_gen,
        )
        for gen, gen_dir in flushed:
            if gen <= merged_gen:
                continue
            view.generations.append(
                GenerationRef(
                    region_id,
                    gen,
                    _gen_uri(table.uri, region_id, gen_dir),
                    (rows or {}).get((region_id, gen)),
                )
            )
        view.generations.sort(key=lambda g: g.generation)
        max_flushed = view.generations[-1].generation if view.generations else merged_gen
        mems = mem_by_region.get(region_id, []) + wal_tails.get(region_id, [])
        for m in sorted(mems, key=lambda m: m.generation):
            # A MemTable sealed and flushed after the manifest was read is read from
            # memory (its generation is above every listed one); one already listed
            # as flushed, or merged into the base version, is not read twice.
            if m.generation > max_flushed and m.generation > merged_gen:
                view.memtables.append(m)
        if view.generations or view.memtables:
            regions.append(view)
    return ReadPlan(base, index, regions, sorted(pruned), consistency)


@functools.lru_cache(maxsize=1 << 16)
def _gen_uri(table_uri: str, region_id: str, gen_dir: str) -> str:
    """:func:`paths.generation_path`, validated once per generation (a query at 192
    generations built every path anew)."""
    return paths.generation_path(table_uri, region_id, gen_dir)


def _wanted(
    table: Catalog, predicates: list[tuple[str, str, Any]] | None = None
) -> tuple[list[str], list[str]]:
    """The regions whose manifests to read, and the regions pruned *before* reading theirs.

    A region whose values are known from an earlier read (they are fixed when the region
    is created) and cannot match ``predicates`` is not read at all (a lookup routed
    to one region of 64 reads one manifest); the same rule as :func:`_build`'s.
    """
    pruned = []
    wanted = []
    may_match = _Pruner(table, predicates) if predicates else None
    for region_id in table.region_ids():
        if may_match is not None:
            known = table.known_region_values(region_id)
            if known is not None and not may_match(known):
                pruned.append(region_id)
                continue
        wanted.append(region_id)
    return wanted, pruned


class _Pruner:
    """Whether a region with ``(spec_id, region values)`` may hold rows matching
    ``predicates``, judged by the region's OWN spec (a region of an older spec keeps
    the values, and so the pruning, of the spec it was created with): one
    :meth:`RegionSpec.pruner` per spec for all the regions of a query."""

    def __init__(self, table: Catalog, predicates: list[tuple[str, str, Any]]) -> None:
        self.table = table
        self.predicates = predicates
        self._by_spec: dict[int, Callable[[Any], bool] | None] = {}

    def __call__(self, values: tuple[int, dict[str, Any]]) -> bool:
        spec_id, region_values = values
        if spec_id not in self._by_spec:
            spec = self.table.spec_for(spec_id)
            self._by_spec[spec_id] = (
                None if spec is None else spec.pruner(self.predicates, self.table.lance_schema)
            )
        pruner = self._by_spec[spec_id]
        return pruner is None or pruner(region_values)


MANIFEST_READERS = 16
"""Region manifests read at once by a strong read (on an object store a manifest check
is a round trip; 64 regions one after the other would cost 64 of them)."""

_MANIFEST_READER_POOL = ThreadPoolExecutor(MANIFEST_READERS, thread_name_prefix="memwal-manifest")


def _read_manifests(table: Catalog, region_ids: list[str]) -> dict[str, RegionManifest]:
    """:meth:`Catalog.region_manifest` of each region that has one (the newest version:
    one HEAD of the next version when the cached one is still the newest), up to
    :data:`MANIFEST_READERS` regions at a time on an object store (one after the other
    on a local file system: :attr:`FileIO.parallel_requests`)."""
    if len(region_ids) <= 2 or not table.io.parallel_requests:
        read = [table.region_manifest(r) for r in region_ids]
    else:
        read = in_chunks(_MANIFEST_READER_POOL, table.region_manifest, region_ids, MANIFEST_READERS)
    return {r: m for r, m in zip(region_ids, read) if m is not None}


def _state_of(table: Catalog, region_id: str, manifest: RegionManifest) -> _State:
    return (
        table.region_values(region_id, manifest),
        [(g.generation, g.path) for g in manifest.flushed_generations],
    )


def _manifest_state(table: Catalog, region_id: str) -> _State | None:
    m = table.region_manifest(region_id)
    return None if m is None else _state_of(table, region_id, m)


def _snapshot_states(
    table: Catalog, index: MemWalIndex, max_staleness: float | None
) -> dict[str, _State] | None:
    """Region states from the snapshots of ``index``; None when there is none to use
    (never written, external file gone, or older than ``max_staleness`` seconds)."""
    from memwal_query.format.snapshots import read_snapshots

    if max_staleness is not None:
        ts = index.details.snapshot_ts_millis
        if ts and time.time() - ts / 1000.0 > max_staleness:
            return None
    spec = table.region_spec
    if spec is None:
        return read_snapshots(table.io, table.uri, index, None, [])
    return read_snapshots(
        table.io, table.uri, index, spec.spec_id, [f.field_id for f in spec.fields]
    )


# -- time travel -----------------------------------------------------------------------
def as_of_moment(table: Catalog, as_of: Any) -> tuple[int, float]:
    """``(base version, moment in epoch seconds)`` that ``as_of`` stands for.

    An int (or a string of digits) is a base version ``V``: the moment is ``V``'s
    commit time. A ``datetime`` (naive: local time) or an ISO-8601 string is a moment
    ``T``: the base version is the one that was the latest at ``T``.

    Raises
    ------
    VersionGoneError
        The version was cleaned up (or never existed).
    CursorError
        ``as_of`` is neither; no base version is that old.
    """
    import datetime as dt

    from memwal_query.exceptions import VersionGoneError
    from memwal_query.read.changes import parse_point, version_at

    point = parse_point(as_of, "as_of")
    if isinstance(point, dt.datetime):
        return version_at(table, point), point.timestamp()
    listed: dict[int, Any] = {v["version"]: v["timestamp"] for v in table.dataset().versions()}
    as_of = point
    if as_of not in listed:
        raise VersionGoneError(
            f"{table.uri}: base version {as_of} is not available (cleaned up, or never "
            f"written); versions kept: {sorted(listed)}"
        )
    return as_of, listed[as_of].timestamp()


def resolve_as_of(
    table: Catalog, as_of: Any, predicates: list[tuple[str, str, Any]] | None = None
) -> ReadPlan:
    """The :data:`View` of the table as it was at ``as_of`` (see :func:`as_of_moment`).

    The base version ``V`` of that moment, read with the MemWAL index of ``V``, plus per
    region the generations listed in the region manifest version that was the newest
    at the moment (found by the manifest files' modification times) and not merged
    into ``V``, deduplicated as usual. MemTables and WAL entries not flushed at that
    moment are not part of it (no writer's memory survives to be read later).

    Raises
    ------
    VersionGoneError
        ``V``, a manifest version or a generation of that moment is gone (cleaned up
        by GC or Lance); the message names it.
    """
    from memwal_query.exceptions import VersionGoneError
    from memwal_query.format.index import MemWalIndex, read_index

    version, moment = as_of_moment(table, as_of)
    try:
        base = table.dataset(version=version)
        index = read_index(table.io, base)
    except (ValueError, OSError, RuntimeError, ObjectNotFoundError) as e:
        raise VersionGoneError(f"{table.uri}: base version {version} is gone: {e}") from e
    if index is None:  # a version from before Catalog.initialize: the base alone
        empty = MemWalIndex("", version, table.index().details.__class__())
        return ReadPlan(base, empty, [], [], "strong")
    states: dict[str, _State] = {}
    for region_id in table.region_ids():
        manifest = manifest_at(table, region_id, moment)
        if manifest is not None:
            states[region_id] = _state_of(table, region_id, manifest)
    plan = _build(table, "strong", base, index, states, {}, {}, predicates)
    for region in plan.regions:
        for g in region.generations:
            if not table.io.is_dir(g.uri):
                raise VersionGoneError(
                    f"{g.uri}: generation {g.generation} of region {g.region_id}, live at "
                    f"base version {version}, was garbage collected (keep it with "
                    "gc(retain_versions_for=...))"
                )
    return plan


def manifest_at(table: Catalog, region_id: str, moment: float) -> RegionManifest | None:
    """The newest manifest version of a region written at or before ``moment`` (epoch
    seconds), by binary search over the versions' modification times; None when the
    region did not exist yet."""
    from memwal_query.exceptions import VersionGoneError
    from memwal_query.format.manifest import RegionManifestStore

    store = RegionManifestStore(table.io, table.uri, region_id)
    lo, hi = 1, store.latest_version()
    found = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            stamp = modified_at(table.io, store.path(mid))
        except (ObjectNotFoundError, FileNotFoundError) as e:
            raise VersionGoneError(
                f"{store.path(mid)}: region {region_id} manifest version {mid} is gone"
            ) from e
        if stamp <= moment:
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    return store.load(found) if found else None


def modified_at(io: Any, path: str) -> float:
    """Modification time (epoch seconds) of an object: ``stat`` on a local file
    system, the ``Last-Modified`` of a HEAD on an object store (a StorageError on
    storage that keeps none)."""
    return float(io.modified_at(path))
