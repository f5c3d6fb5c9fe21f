"""Indexed reads of a MemWAL table: point lookup, vector search, full-text search.

Every search reads the same sources as a scan (spec, "MemTable Collection"): the base
table (generation 0), the flushed generations of each region, and optionally the
MemTables of in-process writers. A key lives in one region, so "newer" always means a
higher generation of the same region (or any generation/MemTable, for the base).

Point lookup (:func:`lookup`)
-----------------------------
Per region, newest source first: the MemTables, then the flushed generations. Each
MemTable has a key index (sorted 64-bit key hashes in a few runs, extended as batches
are appended, rebuilt when its batch sequence changes, e.g. by an adopted WAL entry),
so a lookup costs O(log n) in its size: candidates of equal hash are compared exactly
and the newest wins. A generation whose bloom filter says "absent" is skipped,
otherwise the keys are probed in the generation's key index (sorted 64-bit key hashes,
cached per generation; generations are immutable) and the rows fetched with ``take``.
The first hit answers the key (a tombstone answers "not found"). Keys found nowhere
are read from the base table with one ``pk IN (...)`` filter (integers as SQL text,
other types as a typed ``pyarrow.compute`` ``is_in``; never a value as SQL text),
which Lance serves from the primary key's BTREE index when there is one, then matched
exactly by an Arrow join. All steps work on arrays of keys: a batch of many keys costs
a few vectorised operations per source, and a handful of keys (a point lookup) takes
Python-level fast paths for hashing, bloom probes and key matching instead of paying
numpy's and Arrow's per-call overhead many times.

A search whose plan names a generation that was merged and garbage collected meanwhile
(its files are gone) runs once more with a fresh plan, which reads those rows from the
base; if that fails too it raises :class:`~memwal_query.exceptions.GenerationGoneError`.

Vector search (:func:`vector_search`) and full-text search (:func:`fts_search`)
-------------------------------------------------------------------------------
Each source answers a top-k query with its own index: the base table's index, each
generation's index built at flush time (:mod:`memwal_query.write.genindex`; IVF-PQ with the
base's centroids and codebook), and the MemTables by exact search. Then:

- **Within a generation**, rows superseded by a later write of the same key and
  tombstones are excluded *before* ranking, with Lance's ``row_addr_blocklist``
  prefilter (computed once per generation).
- **Across sources**, a candidate from generation ``g`` is *stale* when its key exists
  in a newer source of its region (any generation or MemTable, for the base). Newer
  generations are checked with their bloom filter first and exactly (key index) only
  on a bloom hit; MemTables exactly. Stale candidates are dropped - so a deleted or
  updated row never comes back with its old vector or old words.
- **Over-fetch**: a source whose candidates lost some rows to staleness is asked again
  for more (4x) while it still has rows and all its surviving candidates made the
  global top-k (also when *every* candidate was stale), so the result is filled up to
  ``k`` whenever enough live rows match.
- **filter** is a prefilter evaluated by each source on its own rows. Because
  staleness is decided on *unfiltered* keys, a row whose newest version fails the
  filter is never returned through an older version that passed it (base ``id=1,
  x=10``, generation 1 ``id=1, x=0``, filter ``x > 5``: id 1 is not returned).
- Vector results are merged by **exact distance**: the candidates' stored vectors are
  re-scored with the index metric (``l2`` = squared L2, ``cosine`` = 1 - cos, ``dot``
  = 1 - dot, as Lance reports them), which makes distances of all sources compare
  exactly whatever their quantization (``refine_factor`` is still passed to Lance,
  to widen each source's re-ranked candidate pool).
- **BM25 across sources** (full-text): each source ranks its candidates with its own
  index statistics, which differ between a 1M-row base and a 1k-row generation. The
  merged candidates are therefore **re-scored with global statistics**: ``N`` and
  total tokens summed over all sources, and the document frequency ``df(t)`` of each
  query token summed over all sources, using Lance's BM25 (``k1=1.2, b=0.75``,
  ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, score ``sum_t idf(t) * (k1 + 1) * tf
  / (tf + k1 * (1 - b + b * dl / avgdl))``). Per indexed source, ``N`` comes from the
  index statistics, total tokens from the index's document file metadata, and
  ``df(t)`` from Lance itself: the BM25 score of the best document of the one-token
  query, whose ``tf`` and length are known (it is re-tokenized with
  ``lance.tokenize`` and the index's tokenizer parameters), gives back ``idf`` and thus
  ``df`` (cached per index version and token; a count query is the fallback). MemTables
  (and generations without a full-text index) keep an in-memory token index and give
  exact statistics over their live rows. With the base table alone, the global score
  equals Lance's own ``_score``. Superseded rows still counted by an index (a base row
  updated in a generation) stay in its statistics, as Lance keeps deleted rows in its
  own until the index is rebuilt. Queries are Lance ``MatchQuery`` (OR of the tokens).
  An indexed source ranks by its *own* statistics, which may order documents unlike
  the global score (a small generation's short average length favours short
  documents), so its top rows are not necessarily its globally best: it is asked for
  more while ``ratio * floor`` beats the current k-th global score, where ``floor``
  is the lowest local score it returned and ``ratio`` bounds global/local score for
  any of its documents (``max_t idf_global(t) / idf_local(t)`` times
  ``max(1, avgdl_global / avgdl_local)``), up to ``max(256, 16 k)`` rows per source
  (the bound is loose on many equal scores, and every candidate is re-tokenized);
  beyond that the order is approximate. In-memory sources score globally already.
  (Lance scores rows of *unindexed* base fragments, searched only when there is no
  catch-up record, with slightly different statistics; the bound is approximate there.)
- **Cost**: the sources are queried concurrently (a Lance query has a few milliseconds
  of fixed cost however small the generation). They answer with the key, the searched
  column and their row id only; the other output columns are read by row id for the
  final ``k`` rows. SQL-text filters are evaluated on MemTable rows by DataFusion
  (a ``pyarrow.compute.Expression`` works everywhere and also prunes regions).

Indexed read plan
-----------------
For the index used by a search, ``index_catchup`` of the MemWAL index says up to which
merged generation the base index covers each region. When it is behind
``merged_generations``, the generations in ``(index_gen, merged_gen]`` (still on disk:
garbage collection waits for index catch-up) are searched with their own indexes and
the base only over its *indexed* fragments (Lance ``fast_search``), so nothing falls
back to a flat scan of unindexed base data. As a safety net, the unindexed fragments
must hold exactly the rows the gap generations upserted (merging writes those rows, and
only those, to new fragments); anything else there (a direct append, a compaction, a
region without a catch-up record) makes the base be searched in full - still correct,
just not index-only. Without a catch-up record the index counts as caught up (spec)
and Lance searches the base's unindexed fragments itself. Pass ``debug={}`` to any
search to get the plan (:meth:`SearchPlan.describe`), per-source counters, and Lance's
plan of the base query.

Measuring recall
----------------
recall@k of a search against exact brute force over the *deduplicated* data::

    rows = table.to_table(columns=["id", "vec"])                 # newest row per key
    mat = np.stack(rows["vec"].to_numpy(zero_copy_only=False))
    truth = set(rows["id"].to_numpy()[np.argsort(((mat - q) ** 2).sum(1))[:k]])
    got = set(table.vector_search("vec", q, k=k)["id"].to_pylist())
    recall = len(truth & got) / k

averaged over queries; the native baseline is ``lance.mem_wal.LsmVectorSearchPlanner``
on the same sources (region snapshots built from the region manifests) with the same
``nprobes`` and index.

SQL
---
:func:`register_search_functions` registers the table functions ``vector_search``,
``fts_search`` and ``lookup`` in a DataFusion context (see there).

Modules
-------
:mod:`~memwal_query.search.pointlookup` (lookup), :mod:`~memwal_query.search.vector`,
:mod:`~memwal_query.search.fulltext` (BM25), :mod:`~memwal_query.search.textindex` (the
in-memory token indexes), :mod:`~memwal_query.search.memkeys` (the MemTable key index),
:mod:`~memwal_query.search.plan` (sources and the indexed read plan),
:mod:`~memwal_query.search.topk` (staleness and the fetch/merge rounds),
:mod:`~memwal_query.search.generations` (cached generation handles),
:mod:`~memwal_query.search.keys` (key matching and hashing),
:mod:`~memwal_query.search.sqlfunctions` (the SQL table functions) and
:mod:`~memwal_query.search.common` (names, constants, caches).
"""

from __future__ import annotations

from memwal_query.search.caches import clear_caches
from memwal_query.search.common import BLOOM_FILE, DISTANCE, ROWID, SCORE
from memwal_query.search.fulltext import fts_search
from memwal_query.search.plan import SearchPlan, resolve_search
from memwal_query.search.pointlookup import lookup
from memwal_query.search.sqlfunctions import register_search_functions
from memwal_query.search.vector import vector_search

__all__ = [
    "BLOOM_FILE",
    "DISTANCE",
    "ROWID",
    "SCORE",
    "SearchPlan",
    "clear_caches",
    "fts_search",
    "lookup",
    "register_search_functions",
    "resolve_search",
    "vector_search",
]
