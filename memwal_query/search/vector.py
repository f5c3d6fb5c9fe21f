"""Vector search across the base, the flushed generations and the MemTables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    MemWalError,
    SchemaError,
)
from memwal_query.format import baseindex
from memwal_query.read import sources
from memwal_query.search.common import DISTANCE, ROWID
from memwal_query.search.genblock import BLOCK_MIN_GENERATIONS
from memwal_query.search.generations import _own, _reading, _retry_when_gone
from memwal_query.search.plan import _filter_indices, _MemRegion, _predicates, resolve_search
from memwal_query.search.topk import (
    SOURCE_SEARCH_POOL,
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


DEFAULT_REFINE_FACTOR = 20
"""Default ``refine_factor`` of :meth:`MemWalTable.vector_search` and the SQL function
(chosen for recall@10 >= 0.95 against exact search: IVF_PQ index, ``nprobes=20``)."""


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
    nprobes: int = 20,
    refine_factor: int | None = DEFAULT_REFINE_FACTOR,
    writers: Sequence[RegionWriter] | None = None,
    *,
    columns: Sequence[str] | None = None,
    consistency: str = "strong",
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
        Passed to Lance for each indexed source: each re-ranks ``refine_factor * k``
        candidates by their full vectors (None: ranked by the quantized distances only,
        faster, lower recall). Default :data:`DEFAULT_REFINE_FACTOR`, as everywhere
        (:meth:`MemWalTable.vector_search`, the SQL function).
    writers : list of RegionWriter, optional
        Writers whose MemTables are searched too (default: none;
        :meth:`MemWalTable.lookup` and the other methods pass the table's own writers).
    columns : list of str, optional
        Output columns (default: all table columns).
    consistency : str
        ``"strong"`` (region manifests), ``"eventual"`` (MemWAL index snapshots) or
        ``"latest"`` (+ durable unflushed WAL entries; see :mod:`memwal_query.read.view`).
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
    # On a cold start three things take time: the index's metric (Lance index statistics),
    # the base's first query (Lance, off the GIL: it opens the index) and reading the
    # generations into their block. The first two run on other threads while
    # this one reads the block. With a block the base always has newer rows, so its first
    # round asks for 2k + 8 rows (``_run_topk``); a later round asks again as usual.
    prefetch = plan.base is not None and _generation_count(plan) >= BLOCK_MIN_GENERATIONS
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
        kwargs: dict[str, Any] = dict(
            nearest=nearest(kk),
            columns=[*_lance_columns(ds, narrow), DISTANCE],
            with_row_id=True,
        )
        if filter is not None:
            kwargs.update(filter=filter, prefilter=True)
        if kind == "base":
            if plan.indexed_only:
                kwargs["fast_search"] = True
        else:
            indexed = info is not None and gen.has_index(info.name)
            stats["index"] = info.name if indexed and info is not None else "flat"
            if gen.blocklist is not None:
                kwargs["row_addr_blocklist"] = gen.blocklist
        with sources.reading_base(table, plan.base), _reading(gen):
            scanner = ds.scanner(**kwargs)
            if debug is not None and kind == "base" and "base_lance_plan" not in debug:
                debug["base_lance_plan"] = scanner.explain_plan(True)
            got = scanner.to_table()
        m = metric_of()
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
        return lance_knn("base", None, {}, kk)

    early: dict[int, Future[pa.Table]] = {}
    if prefetch:
        first = _first_fetch(k, has_newer=True)
        early[first] = SOURCE_SEARCH_POOL.submit(metric_then_base, first)
    try:
        # the block assumes an exact metric (every metric Lance has is one)
        srcs = _block_sources(table, plan, column, BLOCK_MIN_GENERATIONS)
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
            return early.pop(kk).result()
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
