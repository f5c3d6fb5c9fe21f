"""Vector search across the base, the flushed generations and the MemTables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    GenerationGoneError,
    MemWalError,
    SchemaError,
)
from memwal_query.format import baseindex
from memwal_query.read import sources
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.search import genblock
from memwal_query.search.caches import OPEN_GENERATIONS
from memwal_query.search.common import (
    DEFAULT_NPROBES,
    DEFAULT_REFINE_FACTOR,
    DISTANCE,
    POOL_ERROR_MARGIN,
    POOL_MAX_GROWTH,
    POOL_SCAN_FACTOR,
    ROWID,
)
from memwal_query.search.generations import _own, _reading, _retry_when_gone
from memwal_query.search.plan import _filter_indices, _MemRegion, _predicates, resolve_search
from memwal_query.search.topk import (
    SOURCE_SEARCH_POOL,
    _block_cached,
    _block_sources,
    _build_sources,
    _conform_output,
    _fill_debug,
    _first_fetch,
    _generation_count,
    _lance_columns,
    _materialize,
    _read_columns,
    _run_topk,
    _Source,
)
from memwal_query.search.vecmath import _distances, _vectors

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter


__all__ = ["DEFAULT_NPROBES", "DEFAULT_REFINE_FACTOR", "vector_search"]

BLOCK_MIN_GENERATIONS = 1
"""A refined search (``refine_factor`` given: the default of the table API) reads the
flushed generations as one in-memory block (exact distances) from this many of them; an
unrefined one from :data:`memwal_query.search.genblock.BLOCK_MIN_GENERATIONS` (the larger)."""


_EXACT = ("l2", "euclidean", "cosine", "dot", "hamming")
"""Metrics whose distances are recomputed exactly (and so searched in a block)."""


def not_a_vector(column: str, vtype: pa.DataType, dim: int) -> str:
    """Why ``column`` (of type ``vtype``) cannot be searched, and how to declare it."""
    return (
        f"column {column!r} is {vtype}, not a vector: vector search needs a fixed-size "
        f"list (pa.list_(pa.float32(), {dim}) for {dim} dimensions). A pandas column of "
        "arrays arrives as a variable-length list: declare the column when creating the "
        f"table, e.g. pa.field({column!r}, pa.list_(pa.float32(), {dim})) in the schema "
        "given to lance.write_dataset (pa.Table.from_pandas(df, schema=schema)); writes "
        "of pandas arrays into such a column are converted"
    )


def _query_vector(query: Any) -> np.ndarray:
    if isinstance(query, pa.ChunkedArray):
        query = query.combine_chunks()
    if isinstance(query, pa.FixedSizeListScalar | pa.ListScalar):
        query = query.values
    if isinstance(query, pa.Array):
        query = query.to_numpy(zero_copy_only=False)
    q = np.asarray(query, dtype=np.float32)
    if q.ndim != 1 or q.size == 0:
        raise MemWalError(f"query must be one non-empty vector, got shape {q.shape}")
    return q


@_retry_when_gone
def vector_search(
    table: Catalog,
    column: str,
    query: Any,
    k: int = 10,
    filter: str | pc.Expression | None = None,
    nprobes: int = DEFAULT_NPROBES,
    refine_factor: int | None = None,
    writers: Sequence[RegionWriter] | None = None,
    *,
    columns: Sequence[str] | None = None,
    consistency: str = DEFAULT_CONSISTENCY,
    debug: dict[str, Any] | None = None,
) -> pa.Table:
    """K nearest live rows of ``column`` to ``query`` across every source.

    Parameters
    ----------
    table : Catalog
    column : str
        A ``FixedSizeList<float>`` vector column.
    query : array-like
        The query vector.
    k : int
        Number of rows to return.
    filter : str or pyarrow.compute.Expression, optional
        Prefilter (Lance SQL); it applies to the newest version of each row.
    nprobes : int
        IVF partitions probed by each indexed source.
    refine_factor : int or None
        Each indexed source re-ranks at least ``refine_factor * k`` candidates of its
        quantized search by their exact distance, and more while its quantization
        error (measured on those candidates) says a nearer row may lie beyond them;
        the flushed generations are then searched exactly in memory. None: each source
        returns the rows its index ranks first (exact distances, but no wider pool),
        faster, lower recall. :meth:`MemWalTable.vector_search` and the SQL function
        default to :data:`DEFAULT_REFINE_FACTOR`.
    writers : list of RegionWriter, optional
        Writers whose MemTables are searched too (default: none;
        :meth:`MemWalTable.lookup` and the other methods pass the table's own writers).
    columns : list of str, optional
        Output columns (default: all table columns).
    consistency : str
        ``"latest"`` (default: region manifests + durable unflushed WAL entries),
        ``"strong"`` (region manifests) or ``"eventual"`` (MemWAL index snapshots); see
        :mod:`memwal_query.read.view`.
    debug : dict, optional
        Filled with ``plan`` (:class:`SearchPlan`), ``explain`` (text), ``sources``
        (per-source counters) and ``base_lance_plan`` (Lance's plan of the base query).

    Returns
    -------
    pa.Table
        Output columns plus ``_distance`` (exact, ascending), at most ``k`` rows.
    """
    if k <= 0:
        raise MemWalError(f"k must be positive, got {k}")
    if column not in table.schema.names:
        raise SchemaError(f"unknown vector column {column!r}")
    q = _query_vector(query)
    vtype = table.schema.field(column).type
    if not pa.types.is_fixed_size_list(vtype):
        raise SchemaError(not_a_vector(column, vtype, q.size))
    dim = getattr(vtype, "list_size", None)
    if dim is not None and dim != q.size:
        raise MemWalError(f"query has {q.size} dimensions, column {column!r} has {dim}")
    pk = table.primary_key
    out_schema, _ = _read_columns(table, columns, [*pk, column])
    plan = resolve_search(table, column, "vector", consistency, writers, _predicates(table, filter))
    info = plan.index
    narrow = list(dict.fromkeys([*pk, column]))
    # Generations as one in-memory block (exact search; cached per set of generations):
    # from the first one when refining (a Lance query of a small generation costs more
    # than the exact search of all its rows), else from a few.
    min_gens = BLOCK_MIN_GENERATIONS
    if refine_factor is None:
        min_gens = max(min_gens, genblock.BLOCK_MIN_GENERATIONS)
    # On a cold start three things take time: the index's metric (Lance index statistics),
    # the base's first query (Lance, off the GIL: it opens the index) and reading the
    # generations into their block. The first two run on other threads while
    # this one reads the block (a block already cached needs no such overlap). With a
    # block the base always has newer rows, so its first round asks for 2k + 8 rows
    # (``_run_topk``); a later round asks again as usual.
    prefetch = (
        plan.base is not None
        and _generation_count(plan) >= min_gens
        and not _block_cached(table, plan, column)
    )
    metric_known: Future[str] = Future()
    metric_of: Callable[[], str] = metric_known.result
    if info is None:
        metric_known.set_result("l2")
    elif not prefetch:
        metric_known.set_result(baseindex.vector_metric(plan.base, info))

    def nearest(kk: int) -> dict[str, Any]:
        spec: dict[str, Any] = {"column": column, "q": q, "k": kk, "nprobes": nprobes}
        if info is not None:
            spec["metric"] = metric_of()
        if refine_factor is not None:
            spec["refine_factor"] = refine_factor
        return spec

    def lance_knn(kind: str, gen: Any, stats: dict[str, Any], kk: int) -> pa.Table:
        """The ``kk`` nearest rows of the base (``kind == "base"``) or of generation
        ``gen``, by a Lance query (distances recomputed exactly for exact metrics)."""
        ds = _own(plan.base) if kind == "base" else gen.dataset()
        kwargs: dict[str, Any] = {}
        if filter is not None:
            kwargs.update(filter=filter, prefilter=True)
        if kind == "base":
            indexed = info is not None
            if plan.indexed_only:
                kwargs["fast_search"] = True
        else:
            indexed = info is not None and gen.has_index(info.name)
            stats["index"] = info.name if indexed and info is not None else "flat"
            if gen.blocklist is not None:
                kwargs["row_addr_blocklist"] = gen.blocklist
        m = metric_of()
        explain: Callable[[Any], None] | None = None
        if debug is not None and kind == "base" and "base_lance_plan" not in debug:

            def explain(scanner: Any) -> None:
                debug.setdefault("base_lance_plan", scanner.explain_plan(True))

        with sources.reading_base(table, plan.base), _reading(gen):
            if refine_factor is not None and indexed and info is not None and m in _EXACT:
                if _quantized(info.index_type):
                    spec = nearest(kk)
                    del spec["refine_factor"]
                    pool = max(refine_factor * k, kk)
                    return _pooled_knn(
                        ds, spec, kwargs, narrow, column, q, m, pool, k, stats, explain
                    )
            scanner = ds.scanner(
                nearest=nearest(kk),
                columns=[*_lance_columns(ds, narrow), DISTANCE],
                with_row_id=True,
                **kwargs,
            )
            if explain is not None:
                explain(scanner)
            got = scanner.to_table()
        if m in _EXACT and got.num_rows:
            mat, idx = _vectors(got.column(column), q.size)
            d = np.full(got.num_rows, np.inf, np.float32)
            d[idx] = _distances(mat, q, m)
            got = got.set_column(got.schema.get_field_index(DISTANCE), DISTANCE, pa.array(d))
        return got

    def metric_then_base(kk: int) -> pa.Table:
        # one task (a pool task waiting for another could deadlock a saturated pool)
        if not metric_known.done():
            try:
                metric_known.set_result(baseindex.vector_metric(plan.base, info))
            except BaseException as e:
                metric_known.set_exception(e)
                raise
        return lance_knn("base", None, early_stats, kk)

    early: dict[int, Future[pa.Table]] = {}
    early_stats: dict[str, Any] = {}
    if prefetch:
        first = _first_fetch(k, has_newer=True)
        early[first] = SOURCE_SEARCH_POOL.submit(metric_then_base, first)
    try:
        # the block assumes an exact metric (every metric Lance has is one)
        srcs = _block_sources(table, plan, column, min_gens)
        if _generation_count(plan) < genblock.BLOCK_MIN_GENERATIONS:
            _check_present(table, plan, srcs)
        metric = metric_of()
        if metric not in _EXACT:
            srcs = _build_sources(table, plan)
    except BaseException:
        for f in early.values():
            f.cancel()
        raise

    def fetch(s: _Source, kk: int) -> pa.Table:
        if s.block is not None:
            return s.block.knn(q, kk, metric, filter)
        if s.kind == "memtable":
            return _memtable_knn(s.mem_region, column, q, kk, metric, filter, narrow)
        if s.kind == "base" and kk in early:
            got = early.pop(kk).result()
            s.stats.update(early_stats)
            return got
        return lance_knn(s.kind, s.gen, s.stats, kk)

    merged = _run_topk(srcs, fetch, k, DISTANCE, False, pk)
    _fill_debug(debug, plan, srcs)
    dist_field = pa.field(DISTANCE, pa.float32())
    if merged is None:
        return out_schema.empty_table().append_column(dist_field, pa.array([], pa.float32()))
    merged = _materialize(merged, srcs, plan, out_schema, table)
    return _conform_output(merged, out_schema, [dist_field])


def _memtable_knn(
    mem: _MemRegion,
    column: str,
    q: np.ndarray,
    k: int,
    metric: str,
    filter: Any,
    cols: list[str],
) -> pa.Table:
    """Exact k nearest live MemTable rows (``_rowid`` = row index in ``mem.rows``)."""
    live = mem.live_idx
    keep = live
    if filter is not None:
        keep = live[_filter_indices(mem.rows.take(pa.array(live)), filter)]
    mat, idx = _vectors(mem.rows.column(column).take(pa.array(keep)), q.size)
    d = _distances(mat, q, metric)
    top = np.argsort(d, kind="stable")[:k]
    rows = keep[idx[top]]
    out = mem.rows.select(cols).take(pa.array(rows))
    out = out.append_column(DISTANCE, pa.array(d[top].astype(np.float32)))
    return out.append_column(ROWID, pa.array(rows.astype(np.uint64)))


def _quantized(index_type: str) -> bool:
    """Whether an index of Lance type ``index_type`` ranks by approximate distances
    (PQ, SQ, RQ codes) rather than the stored vectors (``*_FLAT``)."""
    return not index_type.upper().endswith("FLAT")


def _pooled_knn(
    ds: Any,
    spec: dict[str, Any],
    kwargs: dict[str, Any],
    cols: list[str],
    column: str,
    q: np.ndarray,
    metric: str,
    pool: int,
    rank: int,
    stats: dict[str, Any],
    explain: Callable[[Any], None] | None,
) -> pa.Table:
    """Nearest rows of a quantized index, re-ranked by exact distance.

    A scan of the index gives row ids and quantized distances (ascending) of
    :data:`POOL_SCAN_FACTOR` ``* pool`` rows; the first ``pool`` of them are read
    (``cols``, by row id) and re-scored exactly. The largest amount by which a quantized
    distance exceeded the exact one among the rows read, ``err``, estimates how much
    nearer than its quantized distance an unread row may be: the rows whose quantized
    distance is below the ``rank``-th exact distance plus :data:`POOL_ERROR_MARGIN`
    ``* err`` are read too, and again with the error of every row read, until no more
    qualify (a query whose quantization error is large reads more; the largest error of
    a few hundred rows understates that of the thousands beyond them); when they run
    past the scan's end, the index is scanned further
    (row ids and quantized distances only, :data:`POOL_SCAN_FACTOR` times as many rows)
    and those rows are read by row id, up to :data:`POOL_MAX_GROWTH` ``* pool`` rows.
    Returns every row read, ascending by exact ``_distance``, with ``_rowid``.
    """
    cap = POOL_MAX_GROWTH * pool
    present = _lance_columns(ds, cols)
    ids_read = np.zeros(0, np.uint64)
    exact = quantized = np.zeros(0, np.float32)
    parts: list[pa.Table] = []
    scan_k, scans = min(POOL_SCAN_FACTOR * pool, cap), 0
    while True:
        scanner = ds.scanner(
            nearest={**spec, "k": scan_k}, columns=[DISTANCE], with_row_id=True, **kwargs
        )
        if explain is not None:
            explain(scanner)
        got = scanner.to_table()
        scans += 1
        approx = got.column(DISTANCE).to_numpy()
        rowids = got.column(ROWID).to_numpy()
        n = len(rowids)
        want = min(max(pool, len(ids_read)), n)
        cut = n
        while True:  # read every scanned row that may beat the rank-th exact distance
            new = ~np.isin(rowids[:want], ids_read)
            if new.any():
                order = np.argsort(rowids[:want][new])  # Lance reads rows in id order faster
                take = rowids[:want][new][order]
                rows = ds._take_rows(take.tolist(), columns=present)
                parts.append(rows)
                ids_read = np.concatenate([ids_read, take])
                exact = np.concatenate([exact, _exact(rows, column, q, metric)])
                quantized = np.concatenate([quantized, approx[:want][new][order]])
            finite = np.isfinite(exact)
            r = min(rank, int(finite.sum()))
            if r == 0:
                break
            err = max(0.0, float(np.max(quantized[finite] - exact[finite])))
            kth = float(np.partition(exact[finite], r - 1)[r - 1])
            cut = int(np.searchsorted(approx, kth + POOL_ERROR_MARGIN * err, side="right"))
            if cut <= want or want >= min(n, cap):
                break
            want = min(cut, n, cap)
        if n < scan_k or cut < n or scan_k >= cap or len(ids_read) >= cap:
            break
        scan_k = min(scan_k * POOL_SCAN_FACTOR, cap)
    stats["pool"] = stats.get("pool", 0) + len(ids_read)
    stats["scans"] = stats.get("scans", 0) + scans
    out = pa.concat_tables(parts) if parts else ds.schema.empty_table().select(present)
    out = out.append_column(DISTANCE, pa.array(exact, pa.float32()))
    out = out.append_column(ROWID, pa.array(ids_read, pa.uint64()))
    return out.take(pa.array(np.argsort(exact, kind="stable")))


def _exact(rows: pa.Table, column: str, q: np.ndarray, metric: str) -> np.ndarray:
    """Exact distance of each row's ``column`` to ``q`` (inf for a null vector)."""
    d = np.full(rows.num_rows, np.inf, np.float32)
    if rows.num_rows:
        mat, idx = _vectors(rows.column(column), q.size)
        d[idx] = _distances(mat, q, metric)
    return d


def _check_present(table: Catalog, plan: Any, srcs: list[_Source]) -> None:
    """Raise :class:`GenerationGoneError` when a generation a block of ``srcs`` holds is
    gone from storage (one existence check per generation: only for a few of them).

    A block answers from memory; a plan made before its generations were merged and
    collected then re-plans as a per-generation search (which reads their files) would,
    instead of answering from a superseded view.
    """
    for s in srcs:
        if s.block is None:
            continue
        for _, ref in s.block.members:
            if not table.io.is_dir(ref.uri):
                OPEN_GENERATIONS.pop(ref.uri)
                raise GenerationGoneError(
                    f"generation {ref.generation} of region {ref.region_id} at {ref.uri} is gone"
                )
