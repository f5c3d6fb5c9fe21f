"""Source resolution of a search: the pinned view plus the indexed read plan (gap
generations when the base index is behind), the MemTables of a region, and filters on
in-memory rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    GenerationGoneError,
    MemWalError,
)
from memwal_query.format import baseindex
from memwal_query.format.schema import (
    GEN_COLUMN,
    TOMBSTONE,
    normalize_keys,
)
from memwal_query.read import sources, view
from memwal_query.read.dedup import KeySet
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.search.common import _IDX
from memwal_query.search.forget import forget_merged
from memwal_query.search.generations import _gen_info
from memwal_query.search.keys import _last_occurrence

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.memtable import MemTableSnapshot
    from memwal_query.write.writer import RegionWriter


class _MemRegion:
    """The unflushed MemTables of one region, merged (they are its newest data)."""

    def __init__(
        self, region_id: str, memtables: list[MemTableSnapshot], schema: pa.Schema, pk: list[str]
    ) -> None:
        self.region_id = region_id
        self.memtables = sorted(memtables, key=lambda m: m.generation)
        self.generation = self.memtables[-1].generation
        parts = [sources.conform(sources.memtable_rows(m), schema) for m in self.memtables]
        self.offsets = np.cumsum([0] + [p.num_rows for p in parts])
        self.rows = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        keys = self.rows.select(pk)
        last = _last_occurrence(keys)
        tomb = pc.fill_null(self.rows.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
        self.live_idx = last[~tomb[last]]
        self.keyset = KeySet(keys.take(pa.array(last)))
        self.live = np.zeros(self.rows.num_rows, bool)
        self.live[self.live_idx] = True
        self._pk = pk
        self._last = last

    def newest_gens(self, keys: pa.Table) -> np.ndarray:
        """``_gen`` of the newest row of each key here (-1 when absent)."""
        n = keys.num_rows
        out = np.full(n, -1, np.int64)
        if n == 0:
            return out
        newest = normalize_keys(self.rows.select(self._pk).take(pa.array(self._last)), self._pk)
        newest = newest.append_column(
            "__memwal_gen", self.rows.column(GEN_COLUMN).take(pa.array(self._last)).cast(pa.int64())
        )
        probe = normalize_keys(keys, self._pk).append_column(
            _IDX, pa.array(np.arange(n, dtype=np.int64))
        )
        joined = probe.join(newest, keys=self._pk, join_type="inner")
        out[joined.column(_IDX).to_numpy()] = joined.column("__memwal_gen").to_numpy()
        return out

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows


# ----------------------------------------------------------------------------------------
# Source resolution (with the indexed read plan)


@dataclass
class _Region:
    region_id: str
    merged_generation: int = 0
    caught_up: int | None = None
    gap: list[view.GenerationRef] = field(default_factory=list)
    generations: list[view.GenerationRef] = field(default_factory=list)
    memtables: list[MemTableSnapshot] = field(default_factory=list)


@dataclass
class SearchPlan:
    """The sources of one search and how the base table is read.

    Attributes
    ----------
    base : lance.LanceDataset
        Base table version read.
    read_plan : view.ReadPlan
        The regular LSM read plan (generations above the merged one, MemTables).
    regions : dict
        Per region: merged/caught-up generations, gap generations, generations,
        MemTables.
    index : baseindex.BaseIndexInfo or None
        Base index the search relies on.
    indexed_only : bool
        True when the base is searched over its indexed fragments only, the gap
        generations covering the rest.
    base_fragments : list[int]
        Fragment ids of the base version.
    notes : list[str]
        Decisions worth knowing (e.g. a gap generation that could not be opened).
    """

    base: lance.LanceDataset
    read_plan: view.ReadPlan
    regions: dict[str, _Region]
    index: baseindex.BaseIndexInfo | None
    indexed_only: bool
    base_fragments: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def indexed_fragments(self) -> list[int]:
        """Base fragments covered by the search index (none when there is no index)."""
        if self.index is None:
            return []
        return sorted(f for f in self.base_fragments if f in self.index.fragment_ids)

    @property
    def skipped_fragments(self) -> list[int]:
        """Unindexed base fragments not scanned (covered by gap generations)."""
        if not self.indexed_only or self.index is None:
            return []
        return sorted(f for f in self.base_fragments if f not in self.index.fragment_ids)

    def describe(self) -> str:
        """Human-readable plan (regions, gap generations, base fragments read)."""
        idx = "-" if self.index is None else f"{self.index.name}({self.index.index_type})"
        mode = "indexed-only" if self.indexed_only else "full"
        lines = [
            f"MemWalSearch: index={idx} base_version={self.base.version} "
            f"consistency={self.read_plan.consistency} base_mode={mode}",
            f"  base fragments={self.base_fragments} indexed={self.indexed_fragments} "
            f"skipped_unindexed={self.skipped_fragments}",
        ]
        for rid, r in sorted(self.regions.items()):
            lines.append(
                f"  region {rid} merged<={r.merged_generation} "
                f"index_caught_up<={'-' if r.caught_up is None else r.caught_up} "
                f"gap_generations=[{','.join(str(g.generation) for g in r.gap) or '-'}] "
                f"generations=[{','.join(str(g.generation) for g in r.generations) or '-'}] "
                f"memtables=[{','.join(str(m.generation) for m in r.memtables) or '-'}]"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def index_hint(
    uri: str, column: str, kind: str, dim: int | None = None, rows: int | None = None
) -> str:
    """How to create the base index a search of ``kind`` (``"vector"`` or ``"fts"``) on
    ``column`` uses: the Lance call, with this table's URI and column. For a vector
    column of ``dim`` dimensions and ``rows`` base rows, the IVF_PQ parameters are
    filled in (about sqrt(rows) partitions; sub-vectors of 8 dimensions)."""
    if kind == "fts":
        call = f"create_scalar_index({column!r}, 'INVERTED')"
    else:
        parts = max(1, min(256, int(math.sqrt(rows or 65536))))
        dim = dim or 128
        subs = max(d for d in range(1, max(1, dim // 8) + 1) if dim % d == 0)
        call = f"create_index({column!r}, 'IVF_PQ', num_partitions={parts}, num_sub_vectors={subs})"
    return f"create one with lance.dataset({uri!r}).{call}"


def resolve_search(
    table: Catalog,
    column: str | None = None,
    kind: str = "vector",
    consistency: str = DEFAULT_CONSISTENCY,
    writers: Sequence[RegionWriter] | None = None,
    predicates: list[tuple[str, str, Any]] | None = None,
) -> SearchPlan:
    """Sources of a search on ``column`` with its ``kind`` of index, and the read plan.

    Parameters
    ----------
    table : Catalog
    column : str, optional
        Searched column; its base index (``kind``: ``"vector"``, ``"fts"`` or
        ``"scalar"``) is looked up on the base version the plan reads.
    kind : str
    consistency, writers, predicates
        As for :func:`memwal_query.read.view.resolve`.

    Notes
    -----
    Like :func:`memwal_query.read.view.resolve`, plus, for each region whose
    ``index_catchup[index]`` is behind ``merged_generations``, the generations in
    ``(caught_up, merged]`` as *gap* generations; the base is then searched over its
    indexed fragments only. If a gap generation cannot be listed or opened, or the
    unindexed fragments hold rows the gap does not explain, the base is searched in
    full instead (correct, just not index-only).
    """
    plan = view.resolve(table, consistency, writers, predicates)
    base = plan.base
    with sources.reading_base(table, base):  # V cleaned up meanwhile: a typed error
        index = baseindex.find_index(base, column, kind) if column is not None else None
    merged = plan.index.merged_generations()
    forget_merged(table.uri, merged)  # the caches of generations no view reads again
    regions: dict[str, _Region] = {}
    for rv in plan.regions:
        regions[rv.region_id] = _Region(
            rv.region_id,
            merged_generation=rv.merged_generation,
            generations=list(rv.generations),
            memtables=list(rv.memtables),
        )
    notes: list[str] = []
    if index is None and column is not None and kind == "vector":
        dim = getattr(table.schema.field(column).type, "list_size", None)
        hint = index_hint(table.uri, column, kind, dim, base.count_rows())
        notes.append(f"no vector index on the base: exact search of every row; {hint}")
    indexed_only = False
    catchup = plan.index.index_catchup().get(index.name, {}) if index is not None else {}
    behind = {
        rid: gen
        for rid, gen in catchup.items()
        if gen < merged.get(rid, 0) and rid not in plan.pruned
    }
    if behind:
        ok = True
        for rid, caught in sorted(behind.items()):
            mg = merged[rid]
            region = regions.setdefault(rid, _Region(rid, merged_generation=mg))
            region.caught_up = caught
            manifest = table.region_manifest(rid)
            flushed = {
                g.generation: g.path for g in (manifest.flushed_generations if manifest else ())
            }
            wanted = range(caught + 1, mg + 1)
            missing = [g for g in wanted if g not in flushed]
            if missing:
                notes.append(f"region {rid}: gap generations {missing} are gone; full base scan")
                ok = False
                break
            from memwal_query.storage import paths

            for g in wanted:
                ref = view.GenerationRef(rid, g, paths.generation_path(table.uri, rid, flushed[g]))
                try:
                    _gen_info(table, ref)
                except GenerationGoneError as e:
                    notes.append(f"region {rid}: {e}; full base scan")
                    ok = False
                    break
                region.gap.append(ref)
            if not ok:
                break
        if ok and index is not None:
            with sources.reading_base(table, base):
                ok = _gap_covers_unindexed(table, base, index, regions, notes)
        if ok:
            indexed_only = True
        else:
            for r in regions.values():
                r.gap = []
    for rid, r in regions.items():
        if r.caught_up is None and rid in catchup:
            r.caught_up = catchup[rid]
    frags = [f.fragment_id for f in base.get_fragments()]
    return SearchPlan(base, plan, regions, index, indexed_only, frags, notes)


def _gap_covers_unindexed(
    table: Catalog,
    base: lance.LanceDataset,
    index: baseindex.BaseIndexInfo,
    regions: dict[str, _Region],
    notes: list[str],
) -> bool:
    """Whether the gap generations account for every row of the unindexed fragments.

    Merging a generation writes exactly its upserted rows (newest live row per key)
    into new fragments; a commit that merges several generations (or regions) at once
    writes the newest live row per key across them, fewer when a key repeats. So the
    unindexed fragments must hold at most as many rows as the gap generations upserted,
    and when they hold fewer, every live row must be the upsert of a gap generation's
    key. If they hold any other rows (a region with no catch-up record, a direct
    append, a compaction), skipping them would lose rows: then the base is searched in
    full.
    """
    unindexed = [f for f in base.get_fragments() if f.fragment_id not in index.fragment_ids]
    physical = sum(int(f.metadata.physical_rows) for f in unindexed)
    expected = 0
    upserted = []
    for r in regions.values():
        for ref in r.gap:
            keys = _gen_info(table, ref).keys
            live = ~keys.tombstone
            expected += int(live.sum())
            upserted.append(keys.keys.filter(pa.array(live)))
    if physical == expected:
        return True  # one commit per generation
    if physical < expected and unindexed:
        pk = list(table.primary_key)
        rows = base.scanner(columns=pk, fragments=unindexed).to_table()
        if KeySet(pa.concat_tables(upserted).rename_columns(pk)).contains(rows).all():
            return True  # generations merged together: rows of gap keys only
    notes.append(
        f"unindexed base fragments hold {physical} rows, gap generations upserted "
        f"{expected}, not only theirs: full base scan"
    )
    return False


def _filter_indices(rows: pa.Table, filter: Any) -> np.ndarray:
    """Indices of ``rows`` matching ``filter`` (SQL text or pyarrow Expression)."""
    n = rows.num_rows
    if filter is None or n == 0:
        return np.arange(n, dtype=np.int64)
    keyed = rows.append_column(_IDX, pa.array(np.arange(n, dtype=np.int64)))
    if isinstance(filter, pc.Expression):
        return keyed.filter(filter).column(_IDX).to_numpy()
    if not isinstance(filter, str):
        raise MemWalError(f"filter must be SQL text or a pyarrow Expression, got {filter!r}")
    # DataFusion evaluates the SQL text; in a worker thread, because the search may run
    # inside DataFusion's own runtime (the SQL table functions), which cannot nest.
    return _SQL_FILTER_POOL.submit(_sql_filter, keyed, filter).result()


def _sql_filter(keyed: pa.Table, filter: str) -> np.ndarray:
    import datafusion

    ctx = datafusion.SessionContext()
    ctx.register_record_batches("__memwal_rows", [keyed.to_batches()])
    got = ctx.sql(f"SELECT {_IDX} FROM __memwal_rows WHERE {filter}").to_arrow_table()
    return np.sort(got.column(0).to_numpy())


_SQL_FILTER_POOL = ThreadPoolExecutor(2, thread_name_prefix="memwal-sql-filter")
"""The threads that evaluate a search's SQL filter in their own DataFusion context."""


def _predicates(table: Catalog, filter: Any) -> list[tuple[str, str, Any]] | None:
    if isinstance(filter, pc.Expression):
        from memwal_query.read import pruning

        return pruning.predicates_from_expression(filter)
    return None
