"""The shared top-k machinery of vector and full-text search: sources with the newer
sources their candidates must beat (staleness), fetch/merge/re-fetch rounds, and
materialization of the final rows."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa

from memwal_query.exceptions import (
    SchemaError,
)
from memwal_query.format.bloom import hash_keys
from memwal_query.read import sources, view
from memwal_query.search.common import _IDX, _MAX_ROUNDS, _SRC, ROWID
from memwal_query.search.genblock import GenBlock, cached_block, gen_block
from memwal_query.search.generations import _gen_info, _GenInfo, _own, _reading
from memwal_query.search.keys import _mask_to_indices
from memwal_query.search.plan import SearchPlan, _MemRegion

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


@dataclass
class _Source:
    kind: str  # "base" | "generation" | "memtable" | "block"
    region_id: str | None
    generation: int
    gap: bool = False
    gen: _GenInfo | None = None
    mem: _MemRegion | None = None
    block: GenBlock | None = None  # every generation at once (see genblock)
    newer_gens: list[_GenInfo] = field(default_factory=list)
    # blocks holding newer versions when their (_gen, region rank) beats ``rank_gen``
    newer_blocks: list[GenBlock] = field(default_factory=list)
    newer_mems: list[_MemRegion] = field(default_factory=list)
    # MemTables of other regions: newer for a key when its _gen there beats ``rank_gen``
    cross_mems: list[tuple[_MemRegion, int]] = field(default_factory=list)
    rank_gen: tuple[int, int] = (0, -1)  # (_gen, region rank) of this source's rows
    k_fetch: int = 0
    exhausted: bool = False
    candidates: pa.Table | None = None
    live: pa.Table | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def gen_info(self) -> _GenInfo:
        """The generation of a ``"generation"`` source."""
        assert self.gen is not None, self.kind
        return self.gen

    @property
    def mem_region(self) -> _MemRegion:
        """The MemTables of a ``"memtable"`` source."""
        assert self.mem is not None, self.kind
        return self.mem

    def label(self) -> str:
        if self.kind == "base":
            return "base"
        if self.kind == "block" and self.block is not None:
            return f"block of {len(self.block.members)} generations"
        gap = " (gap)" if self.gap else ""
        return f"{self.kind} {self.generation}{gap} of region {self.region_id}"


def _build_sources(
    table: Catalog, plan: SearchPlan, with_generations: bool = True
) -> list[_Source]:
    """Sources, base first; each knows the newer sources its candidates must beat.

    With ``with_generations`` False the generations are left out (not even opened): for
    :func:`_block_sources`, which reads them as one block.
    """
    pk = table.primary_key
    out: list[_Source] = []
    all_gens: list[_GenInfo] = []
    all_mems: list[_MemRegion] = []
    per_region: list[_Source] = []
    # (rank, generation ref, info) of every generation; (rank, MemTables) of every region
    every_gen: list[tuple[int, view.GenerationRef, _GenInfo]] = []
    every_mem: list[tuple[int, _MemRegion]] = []
    for rank, (rid, region) in enumerate(sorted(plan.regions.items())):
        refs = [(g, True) for g in region.gap] + [(g, False) for g in region.generations]
        refs.sort(key=lambda x: x[0].generation)
        gens = [(ref, gap, _gen_info(table, ref)) for ref, gap in refs if with_generations]
        mem = _MemRegion(rid, region.memtables, table.schema, pk) if region.memtables else None
        for i, (ref, gap, info) in enumerate(gens):
            per_region.append(
                _Source(
                    "generation",
                    rid,
                    ref.generation,
                    gap=gap,
                    gen=info,
                    newer_gens=[g for _, _, g in gens[i + 1 :]],
                    newer_mems=[mem] if mem is not None else [],
                    rank_gen=(ref.generation, rank),
                )
            )
            every_gen.append((rank, ref, info))
        if mem is not None:
            per_region.append(
                _Source("memtable", rid, mem.generation, mem=mem, rank_gen=(mem.generation, rank))
            )
            all_mems.append(mem)
            every_mem.append((rank, mem))
        all_gens.extend(info for _, _, info in gens)
    # A key written to two regions: the other region's version is newer when its _gen,
    # then its region rank, is higher (dedup.newest_indices's rule).
    for src in per_region:
        g, rank = src.rank_gen
        for r2, ref, info in every_gen:
            if r2 != rank and (ref.generation, r2) > (g, rank):
                src.newer_gens.append(info)
        src.cross_mems = [(m, r2) for r2, m in every_mem if r2 != rank]
    out.append(_Source("base", None, 0, newer_gens=all_gens, newer_mems=all_mems))
    out.extend(per_region)
    return out


def _drop_stale(src: _Source, cands: pa.Table, pk: list[str]) -> pa.Table:
    """Remove candidates whose key exists in a newer source (bloom first, then exact)."""
    n = cands.num_rows
    st = src.stats
    if n == 0 or not _has_newer(src):
        return cands
    keys = cands.select(pk)
    stale = np.zeros(n, bool)
    hashes = hash_keys(keys) if src.newer_gens else np.zeros(0, np.uint64)
    for g in src.newer_gens:
        todo = ~stale
        maybe = np.zeros(n, bool)
        maybe[todo] = g.might_contain(hashes[todo])
        st["bloom_checks"] = st.get("bloom_checks", 0) + int(todo.sum())
        st["bloom_hits"] = st.get("bloom_hits", 0) + int(maybe.sum())
        if maybe.any():
            idx = _mask_to_indices(maybe)
            exact = g.keys.contains(keys.take(pa.array(idx)))
            stale[idx[exact]] = True
    for m in src.newer_mems:
        stale |= m.keyset.contains(keys)
    # (_gen, region rank) of each candidate: the source's, or per row for a block
    own_gen: int | np.ndarray
    rank: int | np.ndarray
    own_gen, rank = src.rank_gen
    if src.block is not None:
        rows = cands.column(ROWID).to_numpy().astype(np.int64)
        own_gen, rank = src.block.gens[rows], src.block.ranks[rows]
    for m, r2 in src.cross_mems:
        theirs = m.newest_gens(keys)
        stale |= (theirs > own_gen) | ((theirs == own_gen) & (r2 > rank))
    for b in src.newer_blocks:
        their_gen, their_rank = b.newest(keys)
        stale |= (their_gen > own_gen) | ((their_gen == own_gen) & (their_rank > rank))
    st["stale"] = st.get("stale", 0) + int(stale.sum())
    if not stale.any():
        return cands
    return cands.filter(pa.array(~stale))


def _first_fetch(k: int, has_newer: bool) -> int:
    """Rows a source is asked for in the first round of :func:`_run_topk`: ``k``, or
    ``2k + 8`` when newer sources may make some of them stale."""
    return 2 * k + 8 if has_newer else k


def _generation_count(plan: SearchPlan) -> int:
    """Flushed generations of ``plan`` (each region's gap and listed generations)."""
    return sum(len(r.gap) + len(r.generations) for r in plan.regions.values())


def _has_newer(s: _Source) -> bool:
    return bool(s.newer_gens or s.newer_mems or s.cross_mems or s.newer_blocks)


def _block_sources(
    table: Catalog, plan: SearchPlan, column: str, min_generations: int
) -> list[_Source]:
    """The sources of ``plan`` with every generation replaced by one :class:`GenBlock`
    source, when there are at least ``min_generations`` of them and they are small enough
    in all (:data:`~memwal_query.search.genblock.BLOCK_MAX_ROWS`); else one source per
    generation (:func:`_build_sources`)."""
    members = _block_members(plan)
    if len(members) < max(min_generations, 1):
        return _build_sources(table, plan)
    block = gen_block(
        [(rank, ref) for rank, _, ref in members],
        table.schema,
        list(table.primary_key),
        column,
        table.storage_options or None,
    )
    if block is None:  # too many rows for one block
        return _build_sources(table, plan)
    srcs = _build_sources(table, plan, with_generations=False)
    mems = [s for s in srcs if s.kind == "memtable"]
    out: list[_Source] = []
    for s in srcs:
        s.newer_blocks = [block]
        out.append(s)
    every_mem = [(s.mem_region, s.rank_gen[1]) for s in mems]
    out.append(_Source("block", None, 0, block=block, cross_mems=every_mem))
    return out


def _block_members(plan: SearchPlan) -> list[tuple[int, int, view.GenerationRef]]:
    """``(region rank, generation, ref)`` of every flushed generation of ``plan``, in
    block order."""
    return sorted(
        (rank, ref.generation, ref)
        for rank, (_, region) in enumerate(sorted(plan.regions.items()))
        for ref in [*region.gap, *region.generations]
    )


def _block_cached(table: Catalog, plan: SearchPlan, column: str) -> bool:
    """Whether the block :func:`_block_sources` would read for ``plan`` is cached."""
    members = [(rank, ref) for rank, _, ref in _block_members(plan)]
    return cached_block(members, table.schema, list(table.primary_key), column) is not None


def _in_memory(s: _Source) -> bool:
    """Whether ``s`` answers from memory (a block or MemTables: no Lance query)."""
    return s.block is not None or s.kind == "memtable"


def _run_topk(
    sources_: list[_Source],
    fetch: Callable[[_Source, int], pa.Table],
    k: int,
    score_col: str,
    descending: bool,
    pk: list[str],
    bound: Callable[[_Source], float | None] | None = None,
) -> pa.Table | None:
    """Fetch, drop stale, merge; re-fetch sources that may still hold better live rows.

    A source that is not exhausted is asked again (for 4x as many rows) when the rows it
    has not returned yet could still enter the top ``k``:

    - by default (a source returning its rows in the merge order), when it has fewer
      than ``k`` live candidates and all of them made the top ``k`` (including the case
      where every candidate was stale);
    - when ``bound(source)`` gives a number (a source ranking by its own score, which
      the merge re-scores), when that upper bound on the merge score of its unreturned
      rows beats the current ``k``-th score (or fewer than ``k`` rows were found).

    The sources are queried concurrently (Lance releases the GIL; a query costs a few
    milliseconds of fixed overhead however small the generation).
    """
    for s in sources_:
        s.k_fetch = _first_fetch(k, _has_newer(s))

    def run(s: _Source) -> None:
        cands = fetch(s, s.k_fetch)
        s.stats["fetched"] = cands.num_rows
        s.stats["rounds"] = s.stats.get("rounds", 0) + 1
        s.exhausted = cands.num_rows < s.k_fetch
        s.candidates = cands
        s.stats["stale"] = 0
        s.live = _drop_stale(s, cands, pk)
        s.stats["live"] = s.live.num_rows

    pending = list(sources_)
    merged = None
    order = "descending" if descending else "ascending"
    for _round in range(_MAX_ROUNDS):
        # Lance queries run concurrently (they release the GIL), on this thread when
        # there is one; in-memory sources on this thread meanwhile (a hand-off to a
        # pool thread costs more than they do on a busy machine)
        lance_ = [s for s in pending if not _in_memory(s)]
        futures = [SOURCE_SEARCH_POOL.submit(run, s) for s in lance_[1:]]
        for s in [*lance_[:1], *(s for s in pending if _in_memory(s))]:
            run(s)
        for f in futures:
            f.result()
        parts = []
        for i, s in enumerate(sources_):
            if s.live is not None and s.live.num_rows:
                src = pa.repeat(pa.scalar(i, pa.int32()), s.live.num_rows)
                parts.append(s.live.append_column(_SRC, src))
        counts: collections.Counter[int] = collections.Counter()
        kth: float | None = None
        if parts:
            merged = pa.concat_tables(parts, promote_options="permissive")
            merged = merged.sort_by([(score_col, order)]).slice(0, k)
            counts.update(merged.column(_SRC).to_pylist())
            if merged.num_rows >= k:
                kth = float(merged.column(score_col)[k - 1].as_py())
        else:  # nothing live yet (e.g. every candidate was stale): ask again
            merged = None
        pending = []
        for i, s in enumerate(sources_):
            if s.exhausted:
                continue
            b = bound(s) if bound is not None else None
            if b is not None:
                beats = kth is None or (b > kth if descending else b < kth)
                if beats:
                    s.k_fetch = s.k_fetch * 4
                    pending.append(s)
                continue
            live = s.live.num_rows if s.live is not None else 0
            if live >= k:
                continue
            if counts.get(i, 0) == live:  # every live candidate made the top-k: want more
                s.k_fetch = s.k_fetch * 4
                pending.append(s)
        if not pending:
            break
    return merged


SOURCE_SEARCH_POOL = ThreadPoolExecutor(8, thread_name_prefix="memwal-search")
"""The threads that search a query's sources (base, generations, blocks) concurrently."""


def _conform_output(t: pa.Table, schema: pa.Schema, extra: list[pa.Field]) -> pa.Table:
    cols = []
    have = set(t.column_names)
    for f in list(schema) + extra:
        if f.name in have:
            c = t.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=pa.schema(list(schema) + extra) if extra else schema)


def _read_columns(
    table: Catalog, columns: Sequence[str] | None, need: list[str]
) -> tuple[pa.Schema, list[str]]:
    names = list(table.schema.names) if columns is None else list(columns)
    unknown = [c for c in names if c not in table.schema.names]
    if unknown:
        raise SchemaError(f"unknown column(s) {unknown}; table columns: {table.schema.names}")
    out_schema = pa.schema([table.schema.field(c) for c in names])
    read = list(dict.fromkeys(names + need))
    return out_schema, read


def _lance_columns(ds: lance.LanceDataset, wanted: list[str]) -> list[str]:
    present = set(ds.schema.names)
    return [c for c in wanted if c in present]


def _materialize(
    merged: pa.Table,
    srcs: list[_Source],
    plan: SearchPlan,
    out_schema: pa.Schema,
    table: Catalog,
) -> pa.Table:
    """Fetch the output columns the candidates lack, for the final rows only.

    Sources answered with the key, the searched column and their row id; the other
    columns are read by row id from the sources that contributed to the result.
    """
    need = [c for c in out_schema.names if c not in merged.column_names]
    if not need or merged.num_rows == 0:
        return merged
    src = merged.column(_SRC).to_numpy()
    rowid = merged.column(ROWID).to_numpy()

    def take(i: int) -> tuple[np.ndarray, pa.Table]:
        s = srcs[i]
        pos = np.flatnonzero(src == i)
        ids = rowid[pos]
        if s.kind == "memtable":
            part = s.mem_region.rows.select(need).take(pa.array(ids.astype(np.int64)))
        elif s.block is not None:
            part = s.block.take(ids.astype(np.int64), need)
        else:
            ds = _own(plan.base) if s.kind == "base" else s.gen_info.dataset()
            cols = _lance_columns(ds, need)
            if cols:
                with sources.reading_base(table, plan.base), _reading(s.gen):
                    part = ds._take_rows(ids.tolist(), columns=cols)
            else:  # columns the source predates: NULL
                part = pa.table({_IDX: np.zeros(len(ids), np.int64)})
        return pos, part

    groups = [int(i) for i in np.unique(src)]
    if len(groups) == 1:
        results = [take(groups[0])]
    else:
        results = [f.result() for f in [SOURCE_SEARCH_POOL.submit(take, i) for i in groups]]
    fields = [out_schema.field(c) for c in need]
    order = np.concatenate([pos for pos, _ in results])
    parts = [_conform_output(part, pa.schema(fields), []) for _, part in results]
    cols = pa.concat_tables(parts).take(pa.array(np.argsort(order, kind="stable")))
    for f in fields:
        merged = merged.append_column(f, cols.column(f.name))
    return merged


def _fill_debug(debug: dict[str, Any] | None, plan: SearchPlan, srcs: list[_Source]) -> None:
    if debug is None:
        return
    debug["plan"] = plan
    debug["explain"] = plan.describe()
    debug["sources"] = [
        {
            "source": s.label(),
            "kind": s.kind,
            "region_id": s.region_id,
            "generation": s.generation,
            "gap": s.gap,
            **s.stats,
        }
        for s in srcs
    ]
