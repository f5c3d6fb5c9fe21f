"""Full-text (BM25) search across the base, the flushed generations and the MemTables,
re-scored with global statistics."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    MemWalError,
    SchemaError,
)
from memwal_query.format import baseindex
from memwal_query.format.postings import tokenize_many
from memwal_query.format.schema import (
    ROWADDR_COLUMN,
)
from memwal_query.read import sources
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.search.caches import BASE_FTS_STATS
from memwal_query.search.common import _BOUND_MAX_FETCH, _BOUND_SLACK, K1, ROWID, SCORE, B
from memwal_query.search.genblock import BLOCK_MIN_GENERATIONS
from memwal_query.search.generations import _own, _reading, _retry_when_gone
from memwal_query.search.plan import _predicates, index_hint, resolve_search
from memwal_query.search.textindex import (
    _block_mem_fts,
    _FtsStats,
    _gen_mem_fts,
    _MemFts,
    _memtable_token_index,
    _texts,
)
from memwal_query.search.topk import (
    SOURCE_SEARCH_POOL,
    _block_sources,
    _conform_output,
    _fill_debug,
    _generation_count,
    _lance_columns,
    _materialize,
    _read_columns,
    _run_topk,
    _Source,
)
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter


@dataclass
class _IndexFtsStats:
    """N, total tokens and cached per-token df of one Lance INVERTED index version."""

    num_docs: int
    total_tokens: int
    df: dict[str, int] = field(default_factory=dict)


def _index_total_tokens(
    ds: lance.LanceDataset, info_segments: list[str], storage: dict[str, str] | None
) -> int | None:
    import json

    from lance.file import LanceFileReader

    total = 0
    try:
        for seg in info_segments:
            d = join(ds.uri, "_indices", seg)
            meta = LanceFileReader(join(d, "metadata.lance"), storage_options=storage)
            parts = json.loads(meta.metadata().schema.metadata[b"partitions"])
            for p in parts:
                r = LanceFileReader(join(d, f"part_{p}_docs.lance"), storage_options=storage)
                total += int(r.metadata().schema.metadata[b"total_tokens"])
    except Exception:  # noqa: BLE001 - unknown layout: estimate instead
        return None
    return total


def _fts_index_stats(
    ds: lance.LanceDataset,
    index_name: str,
    column: str,
    tok_kwargs: dict[str, Any],
    storage: dict[str, str] | None,
) -> _IndexFtsStats:
    key = (ds.uri, ds.version, index_name)
    cached = BASE_FTS_STATS.get(key)
    if cached is not None:
        return cached
    stats = ds.stats.index_stats(index_name)
    n = int(sum(int(i.get("num_docs", 0)) for i in stats.get("indices", [])))
    segs = [str(s.uuid) for d in ds.describe_indices() if d.name == index_name for s in d.segments]
    total = _index_total_tokens(ds, segs, storage or None)
    if total is None:  # estimate the average document length from a sample
        sample = ds.to_table(columns=[column], limit=2000).column(column)
        tokens, doc, valid = tokenize_many(sample, tok_kwargs)
        total = int(round((len(tokens) / max(int(valid.sum()), 1)) * n))
    out = _IndexFtsStats(n, total)
    BASE_FTS_STATS.put(key, out)
    return out


def _doc_weight(tf: np.ndarray, dl: np.ndarray, avgdl: float) -> np.ndarray:
    norm = K1 * (1.0 - B + B * dl / avgdl)
    return (K1 + 1.0) * tf / (tf + norm)


def _idf(df: np.ndarray | float, n: float) -> np.ndarray:
    return np.log((n - df + 0.5) / (df + 0.5) + 1.0)


def _index_df(
    ds: lance.LanceDataset,
    st: _IndexFtsStats,
    column: str,
    token: str,
    word: str,
    tok_kwargs: dict[str, Any],
) -> int:
    """df of ``token`` in a Lance INVERTED index, inverted from Lance's own BM25 score."""
    from lance.query import MatchQuery

    if token in st.df:
        return st.df[token]
    df: int | None = None
    if st.num_docs > 0 and st.total_tokens > 0:
        top = ds.to_table(
            full_text_query=MatchQuery(word, column),
            columns=[column, SCORE],
            limit=1,
            fast_search=True,
        )
        if top.num_rows == 0:
            df = 0
        else:
            text = _texts(top.column(column))[0] or ""
            toks = [t.text for t in lance.tokenize(text, **tok_kwargs)]
            tf = toks.count(token)
            score = float(top.column(SCORE)[0].as_py())
            if tf > 0 and score > 0:
                avgdl = st.total_tokens / st.num_docs
                w = float(_doc_weight(np.array([tf]), np.array([len(toks)]), avgdl)[0])
                r = math.exp(score / w) - 1.0
                est = (st.num_docs + 0.5 - 0.5 * r) / (1.0 + r)
                df = int(min(max(round(est), 1), st.num_docs))
    if df is None:  # fall back to counting the matches
        df = ds.scanner(
            full_text_query=MatchQuery(word, column),
            columns=[],
            with_row_id=True,
            fast_search=True,
        ).count_rows()
    st.df[token] = df
    return df


def _score_ratio(st: _FtsStats, uniq: list[str], idf: np.ndarray, avgdl: float) -> float:
    """Upper bound of global BM25 / local BM25 for any document of one indexed source.

    ``st`` holds the source's own statistics (those its index scores with), ``uniq`` the
    query tokens, ``idf`` their global idf and ``avgdl`` the global average length.
    Per token, the global idf over the local one; for the document-length part,
    ``(tf + k1 (1 - b) + k1 b dl / A_l) / (tf + k1 (1 - b) + k1 b dl / A_g)`` is at most
    ``max(1, A_g / A_l)``. Tokens absent from the source contribute to no document.
    """
    if st.num_docs <= 0 or st.total_tokens <= 0:
        return 0.0
    length = max(1.0, avgdl / (st.total_tokens / st.num_docs))
    best = 0.0
    for j, tok in enumerate(uniq):
        df = st.df.get(tok, 0)
        if df <= 0 or idf[j] <= 0:
            continue
        local = float(_idf(min(df, st.num_docs), st.num_docs))
        best = max(best, float(idf[j]) / local if local > 0 else math.inf)
    return length * best


def _query_tokens(query: str, tok_kwargs: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Query tokens (with repeats, as Lance scores them) and a word producing each."""
    tokens = [t.text for t in lance.tokenize(query, **tok_kwargs)]
    words: dict[str, str] = {}
    for word in query.split():
        got = [t.text for t in lance.tokenize(word, **tok_kwargs)]
        if len(got) == 1 and got[0] not in words:
            words[got[0]] = word
    for t in tokens:
        words.setdefault(t, t)
    return tokens, words


@_retry_when_gone
def fts_search(
    table: Catalog,
    column: str,
    query: str,
    k: int = 10,
    filter: str | pc.Expression | None = None,
    writers: Sequence[RegionWriter] | None = None,
    *,
    columns: Sequence[str] | None = None,
    consistency: str = DEFAULT_CONSISTENCY,
    debug: dict[str, Any] | None = None,
) -> pa.Table:
    """Top-``k`` live rows of a BM25 full-text match on ``column`` across every source.

    Parameters
    ----------
    table : Catalog
    column : str
        A text column with an INVERTED index on the base table.
    query : str
        Query text (tokens are OR-ed, as Lance's ``MatchQuery``).
    k : int
        Number of rows to return.
    filter : str or pyarrow.compute.Expression, optional
        Prefilter; it applies to the newest version of each row.
    writers : list of RegionWriter, optional
        Writers whose MemTables are searched too (default: none;
        :meth:`MemWalTable.lookup` and the other methods pass the table's own writers).
    columns : list of str, optional
        Output columns (default: all table columns).
    consistency : str
        ``"latest"`` (default: every acknowledged write), ``"strong"`` or ``"eventual"``
        (see :mod:`memwal_query.read.view`).
    debug : dict, optional
        As for :func:`vector_search`, plus ``stats`` (global N, avgdl, df).

    Returns
    -------
    pa.Table
        Output columns plus ``_score`` (global BM25, descending), at most ``k`` rows.
    """
    if k <= 0:
        raise MemWalError(f"k must be positive, got {k}")
    if column not in table.schema.names:
        raise SchemaError(f"unknown text column {column!r}")
    pk = table.primary_key
    out_schema, _ = _read_columns(table, columns, [*pk, column])
    score_field = pa.field(SCORE, pa.float32())
    empty = out_schema.empty_table().append_column(score_field, pa.array([], pa.float32()))
    plan = resolve_search(table, column, "fts", consistency, writers, _predicates(table, filter))
    info = plan.index
    if info is None:
        raise MemWalError(
            f"{table.uri}: column {column!r} has no INVERTED index on the base table; "
            + index_hint(table.uri, column, "fts")
        )
    tok_kwargs = baseindex.tokenize_kwargs(baseindex.fts_params(plan.base, info.name))
    tokens, words = _query_tokens(query, tok_kwargs)
    if not tokens:
        return empty
    storage = table.storage_options or None

    def index_stats(ds: Any, gen: Any) -> _FtsStats:
        """N, token total and document frequencies of the Lance index of ``ds``."""
        with sources.reading_base(table, plan.base), _reading(gen):
            ist = _fts_index_stats(ds, info.name, column, tok_kwargs, storage)
            df = {t: _index_df(ds, ist, column, t, words[t], tok_kwargs) for t in set(tokens)}
        return _FtsStats(ist.num_docs, ist.total_tokens, df)

    # The base's statistics (Lance; on a cold start they open its index) are gathered
    # while this thread reads the generations into their block.
    base_early: Future[_FtsStats] | None = None
    if plan.base is not None and _generation_count(plan) >= BLOCK_MIN_GENERATIONS:
        base_early = SOURCE_SEARCH_POOL.submit(index_stats, _own(plan.base), None)
    try:
        srcs = _block_sources(table, plan, column, BLOCK_MIN_GENERATIONS)
    except BaseException:
        if base_early is not None:
            base_early.cancel()
        raise

    # -- per-source matchers and global statistics ------------------------------------
    mem_fts: dict[int, _MemFts] = {}

    def source_stats(i: int, s: _Source) -> _FtsStats:
        if s.kind == "memtable":
            parts = [
                (int(off), _memtable_token_index(table, m, column, tok_kwargs))
                for off, m in zip(s.mem_region.offsets, s.mem_region.memtables)
            ]
            mem_fts[i] = _MemFts(s.mem_region.rows, parts, s.mem_region.live)
            s.stats["index"] = "memory"
            return mem_fts[i].stats(tokens)
        if s.block is not None:
            mem_fts[i] = _block_mem_fts(s.block, table, column, tok_kwargs)
            s.stats["index"] = "memory"
            return mem_fts[i].stats(tokens)
        if s.kind == "generation" and not s.gen_info.has_index(info.name):
            mem_fts[i] = _gen_mem_fts(s.gen_info, table, column, tok_kwargs)
            s.stats["index"] = "memory"
            return mem_fts[i].stats(tokens)
        s.stats["index"] = info.name
        ds = _own(plan.base) if s.kind == "base" else s.gen_info.dataset()
        return index_stats(ds, s.gen)

    # Sources' statistics are independent (and cached per immutable index version):
    # gather them concurrently (the base's already asked for), then sum.
    futures = [
        base_early
        if s.kind == "base" and base_early is not None
        else SOURCE_SEARCH_POOL.submit(source_stats, i, s)
        for i, s in enumerate(srcs)
    ]
    for s in srcs:
        if s.kind == "base" and base_early is not None:
            s.stats["index"] = info.name
    per_source = [f.result() for f in futures]
    n_total = sum(st.num_docs for st in per_source)
    t_total = sum(st.total_tokens for st in per_source)
    df_total: collections.Counter[str] = collections.Counter()
    for st in per_source:
        df_total.update(st.df)
    avgdl = t_total / n_total if n_total else 1.0
    uniq = list(dict.fromkeys(tokens))
    mult = np.array([tokens.count(t) for t in uniq], np.float64)
    idf = np.array(
        [_idf(df_total[t], n_total) if df_total[t] > 0 else 0.0 for t in uniq], np.float64
    )
    if debug is not None:
        debug["stats"] = {
            "num_docs": n_total,
            "avgdl": avgdl,
            "df": dict(df_total),
            "idf": dict(zip(uniq, idf.tolist())),
        }

    # A Lance-indexed source ranks by its *own* BM25 (its N, avgdl, df), which can
    # order documents differently from the global score. Its unreturned documents have
    # a local score <= the lowest local score it returned (``floors``), hence a global
    # score <= ratio * that floor, where per query token
    # ``idf_global / idf_local <= max_t(...)`` and
    # ``weight_global / weight_local <= max(1, avgdl_global / avgdl_local)``.
    # _run_topk asks such a source for more while this bound beats the k-th score.
    ratios = {
        i: _score_ratio(st, uniq, idf, avgdl) for i, st in enumerate(per_source) if i not in mem_fts
    }
    floors: dict[int, float] = {}

    def bound(s: _Source) -> float | None:
        i = srcs.index(s)
        if i not in ratios:
            return None  # exact global scores, in order: the default rule applies
        floor = floors.get(i)
        if floor is None or s.k_fetch >= max(_BOUND_MAX_FETCH, 16 * k):
            return 0.0  # nothing returned; or enough (only fills the result to k now)
        return ratios[i] * floor * (1.0 + _BOUND_SLACK)

    def score(tf: np.ndarray, dl: np.ndarray) -> np.ndarray:
        if len(dl) == 0:
            return np.zeros(0, np.float32)
        w = _doc_weight(tf, dl[:, None], avgdl)
        return (w * (idf * mult)[None, :]).sum(1).astype(np.float32)

    def rescore_lance(got: pa.Table) -> pa.Table:
        tokens, doc, _ = tokenize_many(got.column(column), tok_kwargs)
        dl = np.bincount(doc, minlength=got.num_rows).astype(np.float64)
        pos = pc.index_in(tokens, value_set=pa.array(uniq, pa.string()))
        j = np.asarray(pc.fill_null(pos, -1).to_numpy(zero_copy_only=False), np.int64)
        hit = j >= 0
        tf = np.zeros((got.num_rows, len(uniq)))
        np.add.at(tf, (doc[hit], j[hit]), 1.0)
        got = got.set_column(got.schema.get_field_index(SCORE), SCORE, pa.array(score(tf, dl)))
        return got.sort_by([(SCORE, "descending")])

    from lance.query import MatchQuery

    narrow = list(dict.fromkeys([*pk, column]))

    def fetch(s: _Source, kk: int) -> pa.Table:
        i = srcs.index(s)
        if i in mem_fts:
            mf = mem_fts[i]
            rows_idx, tf = mf.match(tokens, filter)
            sc = score(tf, mf.doc_len[rows_idx])
            best = np.argsort(-sc, kind="stable")[:kk]
            top = rows_idx[best]
            out = mf.rows.select(narrow).take(pa.array(top))
            out = out.append_column(SCORE, pa.array(sc[best].astype(np.float32)))
            if s.kind == "generation":  # row ids of the generation's Lance table
                rowid = mf.rows.column(ROWADDR_COLUMN).take(pa.array(top))
            else:
                rowid = pa.array(top.astype(np.uint64))
            return out.append_column(ROWID, rowid.cast(pa.uint64()))
        ds = _own(plan.base) if s.kind == "base" else s.gen_info.dataset()
        kwargs: dict[str, Any] = dict(
            full_text_query=MatchQuery(query, column),
            columns=[*_lance_columns(ds, narrow), SCORE],
            limit=kk,
            with_row_id=True,
        )
        if filter is not None:
            kwargs.update(filter=filter, prefilter=True)
        if s.kind == "base":
            if plan.indexed_only:
                kwargs["fast_search"] = True
        elif s.gen_info.blocklist is not None:
            kwargs["row_addr_blocklist"] = s.gen_info.blocklist
        with sources.reading_base(table, plan.base), _reading(s.gen):
            scanner = ds.scanner(**kwargs)
            if debug is not None and s.kind == "base" and "base_lance_plan" not in debug:
                debug["base_lance_plan"] = scanner.explain_plan(True)
            got = scanner.to_table()
        if got.num_rows:
            floors[i] = float(pc.min(got.column(SCORE)).as_py())
        else:
            floors.pop(i, None)
        return rescore_lance(got)

    merged = _run_topk(srcs, fetch, k, SCORE, True, pk, bound)
    _fill_debug(debug, plan, srcs)
    if merged is None:
        return empty
    merged = _materialize(merged, srcs, plan, out_schema, table)
    return _conform_output(merged, out_schema, [score_field])
