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
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    BaseVersionGoneError,
    GenerationGoneError,
    MemWalError,
    SchemaError,
)
from memwal_query.format.bloom import BloomFilter, hash_keys
from memwal_query.format.bloom import load as load_bloom
from memwal_query.format.schema import (
    GEN_COLUMN,
    ROWADDR_COLUMN,
    TOMBSTONE,
    coerce_keys,
    normalize_keys,
)
from memwal_query.read import sources
from memwal_query.read.dedup import KeySet, newest_indices
from memwal_query.storage.io import join
from memwal_query.write import genindex

if TYPE_CHECKING:
    import datafusion

    from memwal_query.table import MemWalTable
    from memwal_query.write.memtable import MemTableSnapshot
    from memwal_query.write.writer import RegionWriter

DISTANCE = "_distance"
ROWID = "_rowid"
SCORE = "_score"
K1 = 1.2
B = 0.75
BLOOM_FILE = "bloom_filter.bin"
_PROBE = "__memwal_probe"
_IDX = "__memwal_idx"
_SRC = "__memwal_src"
_GEN_CACHE_SIZE = 256
_MEM_FTS_CACHE_SIZE = 64
_PRUNE_MAX_KEYS = 64
_SMALL_MATCH = 64  # key pairs compared as Python values (see _match_keys)
_BASE_LOOKUP_CHUNK = 20_000
# Lookups of many keys scan the base's key columns instead (see _use_base_key_scan).
_BASE_KEY_SCAN_MIN_KEYS = 20_000
_BASE_KEY_SCAN_ROWS_PER_KEY = 50
_BASE_KEY_SCAN_MAX_ROWS = 32_000_000
_MAX_ROUNDS = 12
_BOUND_SLACK = 1e-5  # relative: float32 scores, and df recovered from a rounded score
_BOUND_MAX_FETCH = 256  # rows (or 16 k) a full-text source is re-asked for at most

__all__ = [
    "SearchPlan",
    "clear_caches",
    "fts_search",
    "lookup",
    "register_search_functions",
    "resolve_search",
    "vector_search",
]


# ----------------------------------------------------------------------------------------
# Key indexes and per-generation caches
# ----------------------------------------------------------------------------------------
def _last_occurrence(keys: pa.Table) -> np.ndarray:
    """Sorted row indices of the last occurrence of each key (rows in write order):
    the readers' one deduplication, :func:`memwal_query.read.dedup.newest_indices`."""
    return newest_indices(keys, keys.column_names)


def _mask_to_indices(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask).astype(np.int64)


def _normalized_keys(keys: pa.Table) -> pa.Table:
    """Key columns as values that are equal exactly when the keys are (see
    :func:`_hashable_column`; ``hash_keys`` of the result is :func:`_index_hashes`)."""
    cols = [_hashable_column(c) for c in keys.columns]
    return pa.Table.from_arrays(cols, names=keys.column_names)


class _KeyIndex:
    """Newest row of each key of an immutable source, probed by sorted key hashes.

    Parameters
    ----------
    keys : pa.Table
        Primary-key columns of every row, in write order.
    tombstone : np.ndarray
        Tombstone flag of every row.
    row_index : np.ndarray
        Dataset row index of every row (what ``take`` accepts).
    """

    def __init__(self, keys: pa.Table, tombstone: np.ndarray, row_index: np.ndarray) -> None:
        # Normalized keys (-0.0 == 0.0, NaN == NaN) hashed by value: the bloom hash of
        # most key types (floats, timestamps, decimals...) is their null flag only, which
        # put every key in one run and made each probe a Python scan of the generation.
        norm = _normalized_keys(keys)
        last = _last_occurrence(norm)
        newest = norm.take(pa.array(last))
        hashes = hash_keys(newest)  # == _index_hashes of the original keys
        order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[order]
        self.keys = newest.take(pa.array(order)).combine_chunks()
        self.rows = row_index[last][order]
        self.tombstone = tombstone[last][order]
        self.num_keys = len(order)

    def probe(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Position in this index of each probe key, -1 when absent.

        ``hashes`` are the probe keys' :func:`_index_hashes` (not their bloom hashes).
        Every index entry of equal hash is compared exactly (vectorised), with floats
        compared as keys (``-0.0 == 0.0``, ``NaN == NaN``).
        """
        n = keys.num_rows
        out = np.full(n, -1, np.int64)
        if n == 0 or self.num_keys == 0:
            return out
        norm = _normalized_keys(keys)
        h = hash_keys(norm) if hashes is None else hashes
        lo = np.searchsorted(self.hashes, h, "left")
        counts = np.searchsorted(self.hashes, h, "right") - lo
        total = int(counts.sum())
        if total == 0:
            return out
        probe_idx = np.repeat(np.arange(n, dtype=np.int64), counts)
        pos = np.repeat(lo, counts) + (
            np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        ok = np.ones(total, bool)
        for i in range(norm.num_columns):
            mine = self.keys.column(i).take(pa.array(pos))
            theirs = norm.column(i).take(pa.array(probe_idx))
            ok &= pc.fill_null(pc.equal(mine, theirs), False).to_numpy(zero_copy_only=False)
        out[probe_idx[ok]] = pos[ok]
        return out

    def contains(self, keys: pa.Table, hashes: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask: which probe keys exist (as a row or a tombstone)."""
        return self.probe(keys, hashes) >= 0


_CHECKOUT_LOCK = threading.Lock()


def _own(ds: lance.LanceDataset) -> lance.LanceDataset:
    """A private handle on the same version (a LanceDataset object must not be used by
    two threads at once; checking out is cheap and shares Lance's caches)."""
    with _CHECKOUT_LOCK:
        return ds.checkout_version(ds.version)


class _GenInfo:
    """What searches need from one flushed generation (cached: generations are immutable)."""

    def __init__(self, table: MemWalTable, ref: sources.GenerationRef) -> None:
        self.ref = ref
        self.uri = ref.uri
        self.io = table.io
        self.pk = list(table.primary_key)
        try:
            self.ds = lance.dataset(ref.uri, storage_options=table.storage_options or None)
            self.num_rows = self.ds.count_rows()
        except (ValueError, OSError, FileNotFoundError) as e:
            raise GenerationGoneError(
                f"generation {ref.generation} of region {ref.region_id} at {ref.uri} is "
                f"gone or unreadable: {e}"
            ) from e
        # A missing or corrupt filter (size, checksum) is not used: a warning, and
        # every key is checked exactly (bloom_trusted False), so answers stay the same.
        loaded = load_bloom(table.io, ref.uri, self.num_rows)
        self.bloom: BloomFilter | None = loaded.filter
        self.bloom_trusted = loaded.trusted
        self.bloom_corrupt = not loaded.trusted
        self.indexes = {d.name: d for d in self.ds.describe_indices()}
        self._lock = threading.Lock()
        self._keys: _KeyIndex | None = None
        self._blocklist: bytes | None = None
        self._token_index: dict[tuple, _TokenIndex] = {}

    def _load_keys(self) -> None:
        with self._lock:
            if self._keys is not None:
                return
            cols = [*self.pk, TOMBSTONE]
            with _reading(self):
                raw = self.dataset().to_table(columns=cols, with_row_address=True)
            tomb = pc.fill_null(raw.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
            index = np.arange(raw.num_rows, dtype=np.int64)
            keys = raw.select(self.pk)
            self._keys = _KeyIndex(keys, tomb, index)
            if (
                self.bloom is not None
                and not self.bloom.might_contain_hashes(hash_keys(keys)).all()
            ):
                # A bloom filter that denies a key the generation holds (a flipped bit,
                # a truncated file) would hide that key's newer version: ignore it and
                # check every key exactly, as the scan's deduplication does.
                self.bloom = None
                self.bloom_corrupt = True
            live = np.zeros(raw.num_rows, bool)
            live[self._keys.rows[~self._keys.tombstone]] = True
            dead = raw.column(ROWADDR_COLUMN).to_numpy()[~live]
            if len(dead):
                from lance.dataset import serialize_row_addrs

                self._blocklist = serialize_row_addrs(dead.tolist())

    def exists(self) -> bool:
        """Whether the generation's directory is still there (False when unsure)."""
        try:
            return self.io.is_dir(self.uri)
        except Exception:  # noqa: BLE001 - cannot tell: treat as gone
            return False

    def dataset(self) -> lance.LanceDataset:
        """A private handle on the generation's Lance table (see :func:`_own`)."""
        return _own(self.ds)

    @property
    def keys(self) -> _KeyIndex:
        """Key index of the generation (loaded on first use)."""
        self._load_keys()
        assert self._keys is not None
        return self._keys

    @property
    def blocklist(self) -> bytes | None:
        """Row addresses of superseded rows and tombstones (Lance prefilter), or None."""
        self._load_keys()
        return self._blocklist

    def live_mask(self) -> np.ndarray:
        """Which dataset rows are the newest version of a live key."""
        keys = self.keys
        live = np.zeros(self.num_rows, bool)
        live[keys.rows[~keys.tombstone]] = True
        return live

    def has_index(self, name: str | None) -> bool:
        return name is not None and name in self.indexes

    def might_contain(self, hashes: np.ndarray) -> np.ndarray:
        """Which keys (bloom hashes) may be in the generation. The filter is first
        checked against the generation's keys (once; they are loaded for the key index
        anyway), so a negative is trustworthy: a corrupt filter is ignored."""
        self._load_keys()
        if self.bloom is None:
            return np.ones(len(hashes), bool)
        return self.bloom.might_contain_hashes(hashes)


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def discard(self, key: Any) -> None:
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_GENERATIONS = _LRU(_GEN_CACHE_SIZE)
_MEM_FTS = _LRU(_MEM_FTS_CACHE_SIZE)
_INDEX_STATS = _LRU(1024)


def _gen_info(table: MemWalTable, ref: sources.GenerationRef) -> _GenInfo:
    info = _GENERATIONS.get(ref.uri)
    if info is None:
        info = _GenInfo(table, ref)
        _GENERATIONS.put(ref.uri, info)
    return info


@contextlib.contextmanager
def _reading(gen: _GenInfo | None) -> Iterator[None]:
    """Turn an I/O error reading generation ``gen`` into GenerationGoneError.

    A plan (or a cached generation handle) made before the generation was merged and
    garbage collected reads files that are gone; Lance reports that as a plain OSError.
    The handle is dropped from the cache, so a retry reopens (or skips) it.
    """
    if gen is None:
        yield
        return
    try:
        yield
    except GenerationGoneError:
        _GENERATIONS.discard(gen.uri)
        raise
    except Exception as e:
        # Lance reports a missing file as OSError, or (through an Arrow stream) as
        # ArrowInvalid "LanceError(IO) ... Not found": any error while the generation's
        # directory is gone means the generation is gone, others propagate unchanged.
        if not isinstance(e, OSError) and gen.exists():
            raise
        _GENERATIONS.discard(gen.uri)
        raise GenerationGoneError(
            f"generation {gen.ref.generation} of region {gen.ref.region_id} at {gen.uri} "
            f"is gone or unreadable: {e}"
        ) from e


def _retry_when_gone(fn: Callable) -> Callable:
    """Run a search once more, with a fresh read plan, if a generation it read is gone
    or the base version it read was cleaned up.

    A generation disappears only after it was merged (and the index caught up), so a
    fresh plan reads its rows from the base table; a cleaned-up base version has a newer
    one. A second failure propagates as :class:`GenerationGoneError` /
    :class:`BaseVersionGoneError`.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (GenerationGoneError, BaseVersionGoneError):
            return fn(*args, **kwargs)

    return run


def clear_caches() -> None:
    """Forget cached key indexes (generations, MemTables), token indexes and BM25 stats."""
    _GENERATIONS.clear()
    _MEM_FTS.clear()
    _MEM_KEYS.clear()
    _INDEX_STATS.clear()


# ----------------------------------------------------------------------------------------
# MemTables of a region
# ----------------------------------------------------------------------------------------
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
# ----------------------------------------------------------------------------------------
@dataclass
class _Region:
    region_id: str
    merged_generation: int = 0
    caught_up: int | None = None
    gap: list[sources.GenerationRef] = field(default_factory=list)
    generations: list[sources.GenerationRef] = field(default_factory=list)
    memtables: list[MemTableSnapshot] = field(default_factory=list)


@dataclass
class SearchPlan:
    """The sources of one search and how the base table is read.

    Attributes
    ----------
    base : lance.LanceDataset
        Base table version read.
    read_plan : sources.ReadPlan
        The regular LSM read plan (generations above the merged one, MemTables).
    regions : dict
        Per region: merged/caught-up generations, gap generations, generations,
        MemTables.
    index : genindex.BaseIndexInfo or None
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
    read_plan: sources.ReadPlan
    regions: dict[str, _Region]
    index: genindex.BaseIndexInfo | None
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


def resolve_search(
    table: MemWalTable,
    column: str | None = None,
    kind: str = "vector",
    consistency: str = "strong",
    writers: Sequence[RegionWriter] | None = None,
    predicates: list[tuple[str, str, Any]] | None = None,
) -> SearchPlan:
    """Sources of a search on ``column`` with its ``kind`` of index, and the read plan.

    Parameters
    ----------
    table : MemWalTable
    column : str, optional
        Searched column; its base index (``kind``: ``"vector"``, ``"fts"`` or
        ``"scalar"``) is looked up on the base version the plan reads.
    kind : str
    consistency, writers, predicates
        As for :func:`memwal_query.read.sources.resolve`.

    Notes
    -----
    Like :func:`memwal_query.read.sources.resolve`, plus, for each region whose
    ``index_catchup[index]`` is behind ``merged_generations``, the generations in
    ``(caught_up, merged]`` as *gap* generations; the base is then searched over its
    indexed fragments only. If a gap generation cannot be listed or opened, or the
    unindexed fragments hold rows the gap does not explain, the base is searched in
    full instead (correct, just not index-only).
    """
    plan = sources.resolve(table, consistency, writers, predicates)
    base = plan.base
    with sources.reading_base(table, base):  # V cleaned up meanwhile: a typed error
        index = genindex.find_index(base, column, kind) if column is not None else None
    merged = plan.index.merged_generations()
    regions: dict[str, _Region] = {}
    for view in plan.regions:
        regions[view.region_id] = _Region(
            view.region_id,
            merged_generation=view.merged_generation,
            generations=list(view.generations),
            memtables=list(view.memtables),
        )
    notes: list[str] = []
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
                ref = sources.GenerationRef(
                    rid, g, paths.generation_path(table.uri, rid, flushed[g])
                )
                try:
                    _gen_info(table, ref)
                except GenerationGoneError as e:
                    notes.append(f"region {rid}: {e}; full base scan")
                    ok = False
                    break
                region.gap.append(ref)
            if not ok:
                break
        if ok:
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
    table: MemWalTable,
    base: lance.LanceDataset,
    index: genindex.BaseIndexInfo,
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


# ----------------------------------------------------------------------------------------
# Filters on in-memory rows
# ----------------------------------------------------------------------------------------
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
    return _SQL_POOL.submit(_sql_filter, keyed, filter).result()


def _sql_filter(keyed: pa.Table, filter: str) -> np.ndarray:
    import datafusion

    ctx = datafusion.SessionContext()
    ctx.register_record_batches("__memwal_rows", [keyed.to_batches()])
    got = ctx.sql(f"SELECT {_IDX} FROM __memwal_rows WHERE {filter}").to_arrow_table()
    return np.sort(got.column(0).to_numpy())


_SQL_POOL = ThreadPoolExecutor(2, thread_name_prefix="memwal-sql-filter")


def _predicates(table: MemWalTable, filter: Any) -> list[tuple[str, str, Any]] | None:
    if isinstance(filter, pc.Expression):
        from memwal_query.read import pruning

        return pruning.predicates_from_expression(filter)
    return None


# ----------------------------------------------------------------------------------------
# Shared top-k machinery
# ----------------------------------------------------------------------------------------
@dataclass
class _Source:
    kind: str  # "base" | "generation" | "memtable"
    region_id: str | None
    generation: int
    gap: bool = False
    gen: _GenInfo | None = None
    mem: _MemRegion | None = None
    newer_gens: list[_GenInfo] = field(default_factory=list)
    newer_mems: list[_MemRegion] = field(default_factory=list)
    # MemTables of other regions: newer for a key when its _gen there beats ``rank_gen``
    cross_mems: list[tuple[_MemRegion, int]] = field(default_factory=list)
    rank_gen: tuple[int, int] = (0, -1)  # (_gen, region rank) of this source's rows
    k_fetch: int = 0
    exhausted: bool = False
    candidates: pa.Table | None = None
    live: pa.Table | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        if self.kind == "base":
            return "base"
        gap = " (gap)" if self.gap else ""
        return f"{self.kind} {self.generation}{gap} of region {self.region_id}"


def _build_sources(table: MemWalTable, plan: SearchPlan) -> list[_Source]:
    """Sources, base first; each knows the newer sources its candidates must beat."""
    pk = table.primary_key
    out: list[_Source] = []
    all_gens: list[_GenInfo] = []
    all_mems: list[_MemRegion] = []
    per_region: list[_Source] = []
    # (rank, generation ref, info) of every generation; (rank, MemTables) of every region
    every_gen: list[tuple[int, sources.GenerationRef, _GenInfo]] = []
    every_mem: list[tuple[int, _MemRegion]] = []
    for rank, (rid, region) in enumerate(sorted(plan.regions.items())):
        refs = [(g, True) for g in region.gap] + [(g, False) for g in region.generations]
        refs.sort(key=lambda x: x[0].generation)
        gens = [(ref, gap, _gen_info(table, ref)) for ref, gap in refs]
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
    if n == 0 or (not src.newer_gens and not src.newer_mems and not src.cross_mems):
        return cands
    keys = cands.select(pk)
    stale = np.zeros(n, bool)
    hashes = hash_keys(keys) if src.newer_gens else None
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
    g, rank = src.rank_gen
    for m, r2 in src.cross_mems:
        theirs = m.newest_gens(keys)
        stale |= (theirs > g) | ((theirs == g) & (r2 > rank))
    st["stale"] = st.get("stale", 0) + int(stale.sum())
    if not stale.any():
        return cands
    return cands.filter(pa.array(~stale))


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
        has_newer = bool(s.newer_gens or s.newer_mems or s.cross_mems)
        s.k_fetch = 2 * k + 8 if has_newer else k

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
        if len(pending) == 1:
            run(pending[0])
        else:
            for f in [_SEARCH_POOL.submit(run, s) for s in pending]:
                f.result()
        parts = []
        for i, s in enumerate(sources_):
            if s.live is not None and s.live.num_rows:
                src = pa.repeat(pa.scalar(i, pa.int32()), s.live.num_rows)
                parts.append(s.live.append_column(_SRC, src))
        counts: collections.Counter = collections.Counter()
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


_SEARCH_POOL = ThreadPoolExecutor(8, thread_name_prefix="memwal-search")


# ----------------------------------------------------------------------------------------
# Vector search
# ----------------------------------------------------------------------------------------
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


def _vectors(col: pa.ChunkedArray | pa.Array, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 matrix of the non-null vectors, their row indices)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    valid = (
        np.ones(n, bool) if col.null_count == 0 else col.is_valid().to_numpy(zero_copy_only=False)
    )
    idx = _mask_to_indices(valid)
    if len(idx) == 0:
        return np.zeros((0, dim), np.float32), idx
    if col.null_count:
        col = col.filter(pa.array(valid))
    flat = col.flatten() if isinstance(col, pa.FixedSizeListArray) else pc.list_flatten(col)
    mat = flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)
    return mat, idx


def _distances(mat: np.ndarray, q: np.ndarray, metric: str) -> np.ndarray:
    if metric in ("l2", "euclidean"):
        diff = mat - q
        return np.einsum("ij,ij->i", diff, diff)
    if metric == "cosine":
        denom = np.linalg.norm(mat, axis=1) * float(np.linalg.norm(q))
        with np.errstate(divide="ignore", invalid="ignore"):
            d = 1.0 - (mat @ q) / denom
        return np.where(np.isfinite(d), d, np.inf)
    if metric == "dot":
        return 1.0 - mat @ q
    if metric == "hamming":  # uint8 vectors: differing bits
        diff = np.bitwise_xor(mat.astype(np.uint8), q.astype(np.uint8))
        return np.unpackbits(diff, axis=1).sum(1).astype(np.float32)
    raise MemWalError(f"exact re-scoring does not support metric {metric!r}")


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


def _read_columns(table: MemWalTable, columns: Sequence[str] | None, need: list[str]) -> tuple:
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


@_retry_when_gone
def vector_search(
    table: MemWalTable,
    column: str,
    query: Any,
    k: int = 10,
    filter: str | pc.Expression | None = None,
    nprobes: int = 20,
    refine_factor: int | None = None,
    writers: Sequence[RegionWriter] | None = None,
    *,
    columns: Sequence[str] | None = None,
    consistency: str = "strong",
    debug: dict | None = None,
) -> pa.Table:
    """K nearest live rows of ``column`` to ``query`` across every source.

    Parameters
    ----------
    table : MemWalTable
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
    refine_factor : int, optional
        Passed to Lance for each indexed source.
    writers : list of RegionWriter, optional
        Writers whose MemTables are searched too (default: the table's own writers).
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
    dim = getattr(vtype, "list_size", None)
    if dim is not None and dim != q.size:
        raise MemWalError(f"query has {q.size} dimensions, column {column!r} has {dim}")
    pk = table.primary_key
    out_schema, _ = _read_columns(table, columns, [*pk, column])
    if writers is None:
        writers = table.writers()
    plan = resolve_search(table, column, "vector", consistency, writers, _predicates(table, filter))
    info = plan.index
    metric = genindex.vector_metric(plan.base, info) if info is not None else "l2"
    exact = metric in ("l2", "euclidean", "cosine", "dot", "hamming")
    srcs = _build_sources(table, plan)

    def nearest(kk: int) -> dict[str, Any]:
        spec: dict[str, Any] = {"column": column, "q": q, "k": kk, "nprobes": nprobes}
        if info is not None:
            spec["metric"] = metric
        if refine_factor is not None:
            spec["refine_factor"] = refine_factor
        return spec

    narrow = list(dict.fromkeys([*pk, column]))

    def fetch(s: _Source, kk: int) -> pa.Table:
        if s.kind == "memtable":
            return _memtable_knn(s.mem, column, q, kk, metric, filter, narrow)
        ds = _own(plan.base) if s.kind == "base" else s.gen.dataset()
        kwargs: dict[str, Any] = dict(
            nearest=nearest(kk),
            columns=[*_lance_columns(ds, narrow), DISTANCE],
            with_row_id=True,
        )
        if filter is not None:
            kwargs.update(filter=filter, prefilter=True)
        if s.kind == "base":
            if plan.indexed_only:
                kwargs["fast_search"] = True
        else:
            s.stats["index"] = info.name if s.gen.has_index(info and info.name) else "flat"
            if s.gen.blocklist is not None:
                kwargs["row_addr_blocklist"] = s.gen.blocklist
        with sources.reading_base(table, plan.base), _reading(s.gen):
            scanner = ds.scanner(**kwargs)
            if debug is not None and s.kind == "base" and "base_lance_plan" not in debug:
                debug["base_lance_plan"] = scanner.explain_plan(True)
            got = scanner.to_table()
        if exact and got.num_rows:
            mat, idx = _vectors(got.column(column), q.size)
            d = np.full(got.num_rows, np.inf, np.float32)
            d[idx] = _distances(mat, q, metric)
            got = got.set_column(got.schema.get_field_index(DISTANCE), DISTANCE, pa.array(d))
        return got

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


def _materialize(
    merged: pa.Table,
    srcs: list[_Source],
    plan: SearchPlan,
    out_schema: pa.Schema,
    table: MemWalTable,
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
            part = s.mem.rows.select(need).take(pa.array(ids.astype(np.int64)))
        else:
            ds = _own(plan.base) if s.kind == "base" else s.gen.dataset()
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
        results = [f.result() for f in [_SEARCH_POOL.submit(take, i) for i in groups]]
    fields = [out_schema.field(c) for c in need]
    order = np.concatenate([pos for pos, _ in results])
    parts = [_conform_output(part, pa.schema(fields), []) for _, part in results]
    cols = pa.concat_tables(parts).take(pa.array(np.argsort(order, kind="stable")))
    for f in fields:
        merged = merged.append_column(f, cols.column(f.name))
    return merged


def _fill_debug(debug: dict | None, plan: SearchPlan, srcs: list[_Source]) -> None:
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


# ----------------------------------------------------------------------------------------
# Full-text search
# ----------------------------------------------------------------------------------------
def _texts(col: pa.ChunkedArray | pa.Array) -> list[str | None]:
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [None if v is None else " ".join(x for x in v if x) for v in col.to_pylist()]
    return col.to_pylist()


class _TokenIndex:
    """In-memory token postings of a growing list of documents (MemTables, fallbacks)."""

    def __init__(self, tok_kwargs: dict[str, Any]) -> None:
        self.tok_kwargs = tok_kwargs
        self.postings: dict[str, tuple[list[int], list[int]]] = {}
        self.doc_len: list[int] = []
        self.num_docs = 0  # non-null documents
        self.total_tokens = 0
        self.source: tuple = ()

    def extend(self, texts: list[str | None]) -> None:
        start = len(self.doc_len)
        for i, text in enumerate(texts):
            if text is None:
                self.doc_len.append(0)
                continue
            toks = [t.text for t in lance.tokenize(text, **self.tok_kwargs)]
            self.doc_len.append(len(toks))
            self.num_docs += 1
            self.total_tokens += len(toks)
            for tok, c in collections.Counter(toks).items():
                rows, tfs = self.postings.setdefault(tok, ([], []))
                rows.append(start + i)
                tfs.append(c)

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        rows, tfs = self.postings.get(token, ((), ()))
        return np.asarray(rows, np.int64), np.asarray(tfs, np.float64)


def _memtable_token_index(
    table: MemWalTable, m: MemTableSnapshot, column: str, tok_kwargs: dict[str, Any]
) -> _TokenIndex:
    """Token index of one MemTable, extended incrementally as it grows (batch identity)."""
    key = (table.uri, m.region_id, m.generation, column, repr(sorted(tok_kwargs.items())))
    idx: _TokenIndex | None = _MEM_FTS.get(key)
    batches = m.batches
    if idx is not None:
        done = len(idx.source)
        if done > len(batches) or any(a is not b for a, b in zip(idx.source, batches[:done])):
            idx = None
    if idx is None:
        idx = _TokenIndex(tok_kwargs)
    for b in batches[len(idx.source) :]:
        idx.extend(_texts(b.column(column)))
    idx.source = tuple(batches)
    _MEM_FTS.put(key, idx)
    return idx


@dataclass
class _FtsStats:
    num_docs: int
    total_tokens: int
    df: dict[str, int]


class _MemFts:
    """Full-text matching over in-memory rows: a MemTable region or an unindexed gen."""

    def __init__(
        self, rows: pa.Table, parts: list[tuple[int, _TokenIndex]], live: np.ndarray
    ) -> None:
        self.rows = rows
        self.parts = parts
        self.live = live
        self.doc_len = np.zeros(rows.num_rows, np.float64)
        for off, ti in parts:
            dl = np.asarray(ti.doc_len, np.float64)
            self.doc_len[off : off + len(dl)] = dl[: rows.num_rows - off]

    def posting(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        rows, tfs = [], []
        for off, ti in self.parts:
            r, t = ti.posting(token)
            rows.append(r + off)
            tfs.append(t)
        r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        t = np.concatenate(tfs) if tfs else np.zeros(0)
        keep = r < len(self.live)
        r, t = r[keep], t[keep]
        keep = self.live[r]
        return r[keep], t[keep]

    def stats(self, tokens: list[str]) -> _FtsStats:
        valid = self.live & (self.doc_len > 0)
        return _FtsStats(
            num_docs=int(valid.sum()),
            total_tokens=int(self.doc_len[self.live].sum()),
            df={t: len(self.posting(t)[0]) for t in set(tokens)},
        )

    def match(self, tokens: list[str], filter: Any) -> tuple[np.ndarray, np.ndarray]:
        """(matching live row indices, tf matrix [rows x unique tokens]) after filter."""
        uniq = list(dict.fromkeys(tokens))
        posts = [self.posting(t) for t in uniq]
        allrows = np.unique(np.concatenate([p[0] for p in posts])) if posts else np.zeros(0)
        allrows = allrows.astype(np.int64)
        if len(allrows) and filter is not None:
            keep = _filter_indices(self.rows.take(pa.array(allrows)), filter)
            allrows = allrows[keep]
        tf = np.zeros((len(allrows), len(uniq)), np.float64)
        if len(allrows) == 0:
            return allrows, tf
        for j, (r, t) in enumerate(posts):
            pos = np.searchsorted(allrows, r)
            ok = (pos < len(allrows)) & (allrows[np.minimum(pos, len(allrows) - 1)] == r)
            tf[pos[ok], j] = t[ok]
        return allrows, tf


@dataclass
class _IndexFtsStats:
    """N, total tokens and cached per-token df of one Lance INVERTED index version."""

    num_docs: int
    total_tokens: int
    df: dict[str, int] = field(default_factory=dict)


def _index_total_tokens(ds: lance.LanceDataset, info_segments: list[str], storage) -> int | None:
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
    cached = _INDEX_STATS.get(key)
    if cached is not None:
        return cached
    stats = ds.stats.index_stats(index_name)
    n = int(sum(int(i.get("num_docs", 0)) for i in stats.get("indices", [])))
    segs = [str(s.uuid) for d in ds.describe_indices() if d.name == index_name for s in d.segments]
    total = _index_total_tokens(ds, segs, storage or None)
    if total is None:  # estimate the average document length from a sample
        sample = ds.to_table(columns=[column], limit=2000).column(column)
        lens = [len(lance.tokenize(t, **tok_kwargs)) for t in _texts(sample) if t is not None]
        total = int(round((sum(lens) / max(len(lens), 1)) * n))
    out = _IndexFtsStats(n, total)
    _INDEX_STATS.put(key, out)
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
    table: MemWalTable,
    column: str,
    query: str,
    k: int = 10,
    filter: str | pc.Expression | None = None,
    writers: Sequence[RegionWriter] | None = None,
    *,
    columns: Sequence[str] | None = None,
    consistency: str = "strong",
    debug: dict | None = None,
) -> pa.Table:
    """Top-``k`` live rows of a BM25 full-text match on ``column`` across every source.

    Parameters
    ----------
    table : MemWalTable
    column : str
        A text column with an INVERTED index on the base table.
    query : str
        Query text (tokens are OR-ed, as Lance's ``MatchQuery``).
    k : int
        Number of rows to return.
    filter : str or pyarrow.compute.Expression, optional
        Prefilter; it applies to the newest version of each row.
    writers : list of RegionWriter, optional
        Writers whose MemTables are searched too (default: the table's own writers).
    columns : list of str, optional
        Output columns (default: all table columns).
    consistency : str
        ``"strong"``, ``"eventual"`` or ``"latest"`` (see :mod:`memwal_query.read.view`).
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
    if writers is None:
        writers = table.writers()
    plan = resolve_search(table, column, "fts", consistency, writers, _predicates(table, filter))
    info = plan.index
    if info is None:
        raise MemWalError(f"{table.uri}: column {column!r} has no INVERTED index on the base")
    tok_kwargs = genindex.tokenize_kwargs(genindex.fts_params(plan.base, info.name))
    tokens, words = _query_tokens(query, tok_kwargs)
    if not tokens:
        return empty
    srcs = _build_sources(table, plan)
    storage = table.storage_options or None

    # -- per-source matchers and global statistics ------------------------------------
    mem_fts: dict[int, _MemFts] = {}

    def source_stats(i: int, s: _Source) -> _FtsStats:
        if s.kind == "memtable":
            parts = [
                (int(off), _memtable_token_index(table, m, column, tok_kwargs))
                for off, m in zip(s.mem.offsets, s.mem.memtables)
            ]
            mem_fts[i] = _MemFts(s.mem.rows, parts, s.mem.live)
            s.stats["index"] = "memory"
            return mem_fts[i].stats(tokens)
        if s.kind == "generation" and not s.gen.has_index(info.name):
            mem_fts[i] = _gen_mem_fts(s.gen, table, column, tok_kwargs)
            s.stats["index"] = "memory"
            return mem_fts[i].stats(tokens)
        ds = _own(plan.base) if s.kind == "base" else s.gen.dataset()
        with sources.reading_base(table, plan.base), _reading(s.gen):
            ist = _fts_index_stats(ds, info.name, column, tok_kwargs, storage)
            s.stats["index"] = info.name
            df = {t: _index_df(ds, ist, column, t, words[t], tok_kwargs) for t in set(tokens)}
        return _FtsStats(ist.num_docs, ist.total_tokens, df)

    # Sources' statistics are independent (and cached per immutable index version):
    # gather them concurrently, then sum.
    futures = [_SEARCH_POOL.submit(source_stats, i, s) for i, s in enumerate(srcs)]
    per_source = [f.result() for f in futures]
    n_total = sum(st.num_docs for st in per_source)
    t_total = sum(st.total_tokens for st in per_source)
    df_total: collections.Counter = collections.Counter()
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
        texts = _texts(got.column(column))
        tf = np.zeros((len(texts), len(uniq)))
        dl = np.zeros(len(texts))
        pos = {t: j for j, t in enumerate(uniq)}
        for r, text in enumerate(texts):
            if text is None:
                continue
            toks = [t.text for t in lance.tokenize(text, **tok_kwargs)]
            dl[r] = len(toks)
            for tok, c in collections.Counter(toks).items():
                j = pos.get(tok)
                if j is not None:
                    tf[r, j] = c
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
        ds = _own(plan.base) if s.kind == "base" else s.gen.dataset()
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
        elif s.gen.blocklist is not None:
            kwargs["row_addr_blocklist"] = s.gen.blocklist
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


def _gen_mem_fts(
    gen: _GenInfo, table: MemWalTable, column: str, tok_kwargs: dict[str, Any]
) -> _MemFts:
    """In-memory full-text matching for a generation without an INVERTED index."""
    key = (column, repr(sorted(tok_kwargs.items())))
    ti = gen._token_index.get(key)
    rows = sources.read_generation(gen.ref, table.schema, table.storage_options)
    if ti is None:
        ti = _TokenIndex(tok_kwargs)
        ti.extend(_texts(rows.column(column)))
        gen._token_index[key] = ti
    return _MemFts(rows, [(0, ti)], gen.live_mask())


# ----------------------------------------------------------------------------------------
# Point lookup
# ----------------------------------------------------------------------------------------
def _key_table(table: MemWalTable, keys: Any) -> pa.Table:
    pk = table.primary_key
    is_frame = hasattr(keys, "columns") and hasattr(keys, "to_numpy")
    if isinstance(keys, pa.Table | pa.RecordBatch | pa.RecordBatchReader | dict) or is_frame:
        return coerce_keys(keys, table.schema, pk, "lookup keys")
    if len(pk) != 1:
        raise SchemaError(f"composite primary key {pk}: pass the keys as a table")
    if keys is None:
        raise SchemaError(f"lookup keys: expected values of primary-key column {pk[0]!r}, got None")
    if isinstance(keys, pa.ChunkedArray | pa.Array):
        arr = keys
    elif isinstance(keys, pa.Scalar):
        arr = pa.array([keys.as_py()], keys.type)
    else:
        if np.isscalar(keys) or isinstance(keys, str | bytes):
            keys = [keys]
        try:
            arr = pa.array(keys)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            raise SchemaError(
                f"lookup keys: cannot convert to values of primary-key column {pk[0]!r}: {e}"
            ) from e
    field = table.schema.field(pk[0])
    if arr.type == field.type and not arr.null_count and not pa.types.is_floating(arr.type):
        # already what coerce_keys returns (cast, normalized, non-null): skip its copies
        return pa.Table.from_arrays([arr], schema=pa.schema([field]))
    return coerce_keys(pa.table({pk[0]: arr}), table.schema, pk)


@_retry_when_gone
def lookup(
    table: MemWalTable,
    keys: Any,
    columns: Sequence[str] | None = None,
    writers: Sequence[RegionWriter] | None = None,
    *,
    consistency: str = "strong",
    debug: dict | None = None,
    as_of: Any = None,
) -> pa.Table:
    """The newest live row of each primary key (vectorised over many keys).

    Parameters
    ----------
    table : MemWalTable
    keys : array-like, pa.Array, pa.Table or dict
        Primary-key values: an array (or list, or scalar) for a single-column key, a
        table/dict with the key columns otherwise.
    columns : list of str, optional
        Output columns (default: all table columns).
    writers : list of RegionWriter, optional
        Writers whose MemTables are read too (default: the table's own writers).
    consistency : str
        ``"strong"``, ``"eventual"`` or ``"latest"`` (see :mod:`memwal_query.read.view`).
    debug : dict, optional
        Filled with per-source counters (``sources``) and the read plan.
    as_of : int, datetime or str, optional
        Time travel: the rows as they were at that base version or moment
        (:func:`memwal_query.read.view.resolve_as_of`; ``writers`` are not read).

    Returns
    -------
    pa.Table
        One row per key found (deleted and unknown keys are absent), in the order of
        the keys' first occurrence in ``keys``.
    """
    pk = table.primary_key
    out_schema, read_cols = _read_columns(table, columns, list(pk))
    probe = _key_table(table, keys)
    if probe.num_rows:
        first = _first_occurrence(probe)
        if len(first) != probe.num_rows:
            probe = probe.take(pa.array(first))
    n = probe.num_rows
    if n == 0:
        return out_schema.empty_table()
    if writers is None:
        writers = table.writers()
    predicates = None
    if len(pk) == 1 and n <= _PRUNE_MAX_KEYS and table.region_spec is not None:
        predicates = [(pk[0], "in", probe.column(0).to_pylist())]
    plan = sources.resolve(table, consistency, writers, predicates, as_of=as_of)
    resolved = np.zeros(n, bool)
    parts: list[tuple[pa.Table, np.ndarray, int, int]] = []
    counters: list[dict[str, Any]] = []
    hashes = hash_keys(probe)
    mem_hashes = hashes if _native_hash(probe.schema) else None

    def keys_at(idx: np.ndarray) -> pa.Table:
        return probe if len(idx) == n else probe.take(pa.array(idx))

    def add(rows: pa.Table, probe_idx: np.ndarray, gen: int = 0, rank: int = -1) -> None:
        if rows.num_rows:
            parts.append((_conform_output(rows, out_schema, []), probe_idx, gen, rank))

    # Per region, newest source first (the first hit answers the key within its
    # region); across regions the one rule of dedup.newest_indices: highest _gen, then
    # region rank. Every region is probed (a key may have been written to two).
    hits: list[tuple[np.ndarray, np.ndarray, int]] = []  # (probe idx, _gen, region rank)
    for rank, region in enumerate(sorted(plan.regions, key=lambda r: r.region_id)):
        found_r = np.zeros(n, bool)
        # MemTables, newest first: the last write of a key in write order wins.
        for m in sorted(region.memtables, key=lambda m: m.generation, reverse=True):
            todo = _mask_to_indices(~found_r)
            if len(todo) == 0:
                break
            if mem_hashes is None:
                mem_hashes = _index_hashes(probe)
            found = _memtable_lookup(table, m, keys_at(todo), mem_hashes[todo], read_cols)
            c = {"source": f"memtable {m.generation} of region {region.region_id}"}
            c["probed"] = len(todo)
            counters.append(c)
            if found is None:
                continue
            rows, local = found
            hit = todo[local]
            found_r[hit] = True
            hits.append((hit, np.full(len(hit), m.generation, np.int64), rank))
            tomb = rows.column(TOMBSTONE)
            if tomb.null_count or pc.any(tomb).as_py():
                live = ~pc.fill_null(tomb, False).to_numpy(zero_copy_only=False)
                rows, hit_live = rows.filter(pa.array(live)), hit[live]
            else:
                hit_live = hit
            add(rows, hit_live, m.generation, rank)
            c["hits"] = len(hit)
        for ref in reversed(region.generations):
            if found_r.all():
                break
            gen = _gen_info(table, ref)
            todo = _mask_to_indices(~found_r)
            # The bloom filter is checked against the generation's keys before a
            # negative is trusted (_GenInfo.might_contain): a corrupt filter is ignored.
            maybe = gen.might_contain(hashes[todo])
            c = {"source": f"generation {ref.generation} of region {ref.region_id}"}
            c.update(probed=len(todo), bloom_hits=int(maybe.sum()))
            counters.append(c)
            if not maybe.any():
                continue
            cand = todo[maybe]
            if mem_hashes is None:
                mem_hashes = _index_hashes(probe)
            pos = gen.keys.probe(keys_at(cand), mem_hashes[cand])
            hit = pos >= 0
            c["hits"] = int(hit.sum())
            if not hit.any():
                continue
            cand, pos = cand[hit], pos[hit]
            found_r[cand] = True
            hits.append((cand, np.full(len(cand), ref.generation, np.int64), rank))
            live = ~gen.keys.tombstone[pos]
            if live.any():
                gds = gen.dataset()
                cols = _lance_columns(gds, read_cols)
                with _reading(gen):
                    rows = gds.take(gen.keys.rows[pos[live]].tolist(), columns=cols)
                add(rows, cand[live], ref.generation, rank)
        resolved |= found_r
    if len(hits) > 1:
        parts = _newest_across_regions(parts, hits, n)
    todo = _mask_to_indices(~resolved)
    if len(todo):
        with sources.reading_base(table, plan.base):
            got = _base_lookup(plan.base, keys_at(todo), pk, read_cols)
        counters.append({"source": "base", "probed": len(todo), "hits": got[0].num_rows})
        add(got[0], todo[got[1]])
    if debug is not None:
        debug["read_plan"] = plan
        debug["explain"] = plan.describe()
        debug["sources"] = counters
    if not parts:
        return out_schema.empty_table()
    if len(parts) == 1:
        out, order = parts[0][0], parts[0][1]
    else:
        out = pa.concat_tables([p[0] for p in parts])
        order = np.concatenate([p[1] for p in parts])
    if len(order) > 1 and (order[1:] < order[:-1]).any():
        out = out.take(pa.array(np.argsort(order, kind="stable")))
    return out


def _newest_across_regions(
    parts: list[tuple[pa.Table, np.ndarray, int, int]],
    hits: list[tuple[np.ndarray, np.ndarray, int]],
    n: int,
) -> list[tuple[pa.Table, np.ndarray, int, int]]:
    """Drop the rows of keys found in several regions that are not the newest (highest
    ``_gen``, then region rank: :func:`memwal_query.read.dedup.newest_indices`'s rule)."""
    best_gen = np.full(n, -1, np.int64)
    best_rank = np.full(n, -1, np.int64)
    for idx, gens, rank in hits:
        better = (gens > best_gen[idx]) | ((gens == best_gen[idx]) & (rank > best_rank[idx]))
        best_gen[idx[better]] = gens[better]
        best_rank[idx[better]] = rank
    out = []
    for rows, idx, gen, rank in parts:
        keep = (best_gen[idx] == gen) & (best_rank[idx] == rank)
        if keep.all():
            out.append((rows, idx, gen, rank))
        elif keep.any():
            out.append((rows.filter(pa.array(keep)), idx[keep], gen, rank))
    return out


def _first_occurrence(keys: pa.Table) -> np.ndarray:
    n = keys.num_rows
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    if keys.num_columns == 1:
        ints = _ints(keys.column(0))
        if ints is not None:
            return np.sort(np.unique(ints, return_index=True)[1]).astype(np.int64)
    idx = pa.array(np.arange(n, dtype=np.int64))
    first = keys.append_column(_IDX, idx).group_by(keys.column_names).aggregate([(_IDX, "min")])
    return np.sort(first.column(f"{_IDX}_min").to_numpy())


def _ints(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """The values as int64, or None (not integers, NULLs, or uint64 beyond int64)."""
    if not pa.types.is_integer(col.type) or col.null_count:
        return None
    if col.type == pa.uint64() and len(col) and pc.max(col).as_py() > np.iinfo(np.int64).max:
        return None
    return pc.cast(col, pa.int64()).to_numpy()


def _py_comparable(t: pa.DataType) -> bool:
    """Types whose Python values are equal exactly when Arrow's are."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    )


def _match_keys(rows_keys: pa.Table, probe: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (row index, probe index) with equal keys (probe keys are distinct).

    Float keys compare as keys: a base row written with ``-0.0`` is the row of ``0.0``
    (Arrow's ``index_in`` and joins tell them apart).
    """
    rows_keys = normalize_keys(rows_keys, rows_keys.column_names)
    probe = normalize_keys(probe, probe.column_names)
    if (
        rows_keys.num_rows * probe.num_rows <= _SMALL_MATCH
        and rows_keys.schema.types == probe.schema.types
        and all(_py_comparable(t) for t in probe.schema.types)
        and not any(c.null_count for c in rows_keys.columns)
        and not any(c.null_count for c in probe.columns)
    ):  # a few keys (a point lookup): Python values, no kernel overhead
        where = {k: i for i, k in enumerate(zip(*(c.to_pylist() for c in probe.columns)))}
        pairs = [
            (i, where[k])
            for i, k in enumerate(zip(*(c.to_pylist() for c in rows_keys.columns)))
            if k in where
        ]
        return np.array([i for i, _ in pairs], np.int64), np.array([j for _, j in pairs], np.int64)
    if rows_keys.num_columns == 1:
        pos = pc.index_in(rows_keys.column(0), value_set=probe.column(0).combine_chunks())
        found = pc.is_valid(pos).to_numpy(zero_copy_only=False)
        r = _mask_to_indices(found)
        return r, pos.to_numpy(zero_copy_only=False)[found].astype(np.int64)
    left = rows_keys.append_column(_IDX, pa.array(np.arange(rows_keys.num_rows, dtype=np.int64)))
    right = probe.append_column(_PROBE, pa.array(np.arange(probe.num_rows, dtype=np.int64)))
    joined = left.join(right, keys=rows_keys.column_names, join_type="inner")
    return joined.column(_IDX).to_numpy(), joined.column(_PROBE).to_numpy()


# MemTable key index: sorted key hashes per MemTable, extended as it grows ----------------
_NATIVE_HASH_TYPES = (pa.int32(), pa.int64(), pa.string(), pa.binary())
_MEM_KEYS = _LRU(_MEM_FTS_CACHE_SIZE)
_MEM_KEYS_GATHER = 32  # up to this many rows are sliced out of their batches, else take


def _hashable_column(col: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """``col`` as a type :func:`hash_keys` hashes by value (it hashes other types by their
    null flag only, which would put every key in one bucket).

    Equal keys get equal values (floats: ``-0.0`` and every NaN are made one value), so
    the hashes only pre-select candidates, which are then compared exactly. Types with
    no such conversion are returned unchanged (one bucket: still exact, just a scan).
    """
    t = col.type
    if t in _NATIVE_HASH_TYPES:
        return col
    try:
        if pa.types.is_boolean(t) or pa.types.is_integer(t):
            return pc.cast(col, pa.int64(), safe=False)  # bit-preserving, so injective
        if pa.types.is_floating(t):
            x = pc.add(pc.cast(col, pa.float64()), pa.scalar(0.0, pa.float64()))
            x = pc.if_else(pc.is_nan(x), pa.scalar(math.nan, pa.float64()), x)
            x = x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x
            return x.view(pa.int64())
        if pa.types.is_fixed_size_binary(t) or pa.types.is_large_binary(t):
            return pc.cast(col, pa.binary())
        if pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return pc.cast(col, pa.string())
        if pa.types.is_binary_view(t):
            return pc.cast(col, pa.binary())
        width = t.bit_width  # ValueError: not fixed width
        if width % 8 == 0:  # temporal, decimal...: the value's bytes
            arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            return pc.cast(arr.view(pa.binary(width // 8)), pa.binary())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError):
        pass
    return col


def _native_hash(schema: pa.Schema) -> bool:
    """Whether :func:`_index_hashes` of such keys equals :func:`hash_keys`."""
    return all(f.type in _NATIVE_HASH_TYPES for f in schema)


def _index_hashes(keys: pa.Table) -> np.ndarray:
    """Key hashes for the MemTable key index (bloom hashes of :func:`_hashable_column`)."""
    if _native_hash(keys.schema):
        return hash_keys(keys)
    cols = [_hashable_column(c) for c in keys.columns]
    return hash_keys(pa.Table.from_arrays(cols, names=keys.column_names))


def _conform_keys(keys: pa.Table, key_schema: pa.Schema) -> pa.Table:
    """Key columns cast to the table's key types (what lookup keys are coerced to)."""
    if all(a.type == b.type for a, b in zip(keys.schema, key_schema)):
        return keys
    cols = [c if c.type == f.type else c.cast(f.type) for c, f in zip(keys.columns, key_schema)]
    return pa.Table.from_arrays(cols, schema=key_schema)


class _MemKeyRun:
    """Sorted key hashes of the MemTable rows ``[start, end)`` and those rows' keys."""

    __slots__ = ("start", "end", "hashes", "local", "keys")

    def __init__(self, start: int, hashes: np.ndarray, local: np.ndarray, keys: pa.Table):
        self.start = start
        self.end = start + keys.num_rows
        self.hashes = hashes  # sorted
        self.local = local  # row - start of each hash
        self.keys = keys  # key columns of rows start..end, in row order (one chunk)


def _merge_runs(a: _MemKeyRun, b: _MemKeyRun) -> _MemKeyRun:
    """One run of two adjacent runs (``a.end == b.start``), by a linear merge."""
    na, nb = len(a.hashes), len(b.hashes)
    at_b = np.searchsorted(a.hashes, b.hashes, side="right") + np.arange(nb)
    from_a = np.ones(na + nb, bool)
    from_a[at_b] = False
    hashes = np.empty(na + nb, np.uint64)
    local = np.empty(na + nb, np.int64)
    hashes[at_b] = b.hashes
    hashes[from_a] = a.hashes
    local[at_b] = b.local + (b.start - a.start)
    local[from_a] = a.local
    keys = pa.concat_tables([a.keys, b.keys]).combine_chunks()
    return _MemKeyRun(a.start, hashes, local, keys)


class _MemKeyIndex:
    """Key hashes of one MemTable's rows, for point lookups in O(log n).

    Built incrementally as batches are appended (tracked by batch identity): every new
    group of batches becomes a sorted run of ``(hash, row)``, and adjacent runs are
    merged while the older one is at most twice the newer one, so there are O(log n)
    runs and each row is merged O(log n) times. A lookup binary-searches every run;
    the candidate rows (equal hash: every version of the key, and any 64-bit hash
    collision) are compared with the probe keys exactly and the newest wins.

    The index holds weak references to the batches only: once one is garbage collected
    (the MemTable is gone), ids may be reused and the index is never used again.
    """

    def __init__(self, pk: list[str], batch_keys: pa.Schema, key_schema: pa.Schema) -> None:
        self.lock = threading.Lock()
        self.pk = pk
        self.batch_keys = batch_keys  # key fields as stored in the batches
        self.key_schema = key_schema  # key fields of the table (= lookup keys)
        self.ids: tuple[int, ...] = ()
        self._refs: list[weakref.ref] = []
        self._dead = [False]
        self.offsets = np.zeros(1, np.int64)  # first row of each batch, then the total
        self.runs: list[_MemKeyRun] = []

    @property
    def dead(self) -> bool:
        return self._dead[0]

    def extend(self, batches: Sequence[pa.RecordBatch]) -> None:
        """Index ``batches[len(self.ids):]`` (the earlier ones are indexed already)."""
        new = batches[len(self.ids) :]
        if not new:
            return
        dead = self._dead

        def died(_ref: weakref.ref, dead: list[bool] = dead) -> None:
            dead[0] = True

        self._refs.extend(weakref.ref(b, died) for b in new)
        self.ids = self.ids + tuple(map(id, new))
        start = int(self.offsets[-1])
        sizes = np.array([b.num_rows for b in new], np.int64)
        self.offsets = np.concatenate([self.offsets, start + np.cumsum(sizes)])
        if not sizes.sum():
            return
        keys = pa.Table.from_batches([b.select(self.pk) for b in new], schema=self.batch_keys)
        keys = _conform_keys(keys, self.key_schema).combine_chunks()
        hashes = _index_hashes(keys)
        order = np.argsort(hashes, kind="stable")
        self.runs.append(_MemKeyRun(start, hashes[order], order.astype(np.int64), keys))
        while len(self.runs) > 1 and len(self.runs[-2].hashes) <= 2 * len(self.runs[-1].hashes):
            b = self.runs.pop()
            self.runs.append(_merge_runs(self.runs.pop(), b))

    def find(
        self, probe: pa.Table, hashes: np.ndarray, limit: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(probe index, row) of the newest row below ``limit`` of each probe key found.

        ``probe`` holds distinct keys, ``hashes`` their :func:`_index_hashes`.
        """
        cand_keys: list[pa.Table] = []
        cand_rows: list[np.ndarray] = []
        for run in self.runs:
            if run.start >= limit:
                break
            lo = np.searchsorted(run.hashes, hashes, "left")
            hi = np.searchsorted(run.hashes, hashes, "right")
            cnt = hi - lo
            total = int(cnt.sum())
            if total == 0:
                continue
            if total == len(cnt) and int(cnt.max()) == 1:  # one candidate per probe key
                pos = lo
            else:
                ends = np.cumsum(cnt)
                pos = np.arange(total) + np.repeat(lo - (ends - cnt), cnt)
            local = run.local[pos]
            if run.end > limit:
                local = local[local < limit - run.start]
                if len(local) == 0:
                    continue
            cand_keys.append(run.keys.take(local))
            cand_rows.append(local + run.start)
        if not cand_rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        keys = cand_keys[0] if len(cand_keys) == 1 else pa.concat_tables(cand_keys)
        rows = cand_rows[0] if len(cand_rows) == 1 else np.concatenate(cand_rows)
        r, p = _match_keys(keys, probe)
        rows = rows[r]
        if len(p) > 1:  # the newest row of each probe key
            order = np.lexsort((rows, p))
            p, rows = p[order], rows[order]
            last = np.ones(len(p), bool)
            last[:-1] = p[1:] != p[:-1]
            p, rows = p[last], rows[last]
        return p, rows


def _memtable_find(
    table: MemWalTable, m: MemTableSnapshot, probe: pa.Table, hashes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probe index, row) of the newest row of each probe key in ``m``, and the row
    offsets of its batches.

    The MemTable's key index is cached per (table, region, generation) and extended
    with the batches appended since. A snapshot older than the index (a prefix of its
    batches) uses it with a row limit; a different batch sequence (a WAL entry adopted
    before unsynced rows, or another MemTable) rebuilds it.
    """
    pk = list(probe.column_names)
    key = (table.uri, m.region_id, m.generation, tuple(pk))
    batches = m.batches
    ids = tuple(map(id, batches))
    idx: _MemKeyIndex | None = _MEM_KEYS.get(key)
    if idx is not None:
        with idx.lock:
            done = len(idx.ids)
            if not idx.dead and (ids[:done] == idx.ids or idx.ids[: len(ids)] == ids):
                idx.extend(batches)
                limit = int(idx.offsets[len(ids)])
                p, r = idx.find(probe, hashes, limit)
                return p, r, idx.offsets
    batch_keys = pa.schema([m.schema.field(k) for k in pk])
    idx = _MemKeyIndex(pk, batch_keys, probe.schema)
    with idx.lock:
        idx.extend(batches)
        _MEM_KEYS.put(key, idx)
        p, r = idx.find(probe, hashes, int(idx.offsets[-1]))
    return p, r, idx.offsets


def _memtable_rows_at(
    m: MemTableSnapshot, offsets: np.ndarray, rows: np.ndarray, cols: list[str]
) -> pa.Table:
    """Rows ``rows`` of a MemTable snapshot (columns ``cols``), in that order."""
    if len(rows) <= _MEM_KEYS_GATHER:
        which = (np.searchsorted(offsets, rows, "right") - 1).tolist()
        starts = offsets[which].tolist()
        parts = [m.batches[b].slice(r - s, 1) for b, s, r in zip(which, starts, rows.tolist())]
        return pa.Table.from_batches(parts, schema=m.schema).select(cols)
    return m.to_table().select(cols).take(pa.array(rows))


def _memtable_lookup(
    table: MemWalTable,
    m: MemTableSnapshot,
    probe: pa.Table,
    hashes: np.ndarray,
    read_cols: list[str],
) -> tuple[pa.Table, np.ndarray] | None:
    """Newest row (maybe a tombstone) of each probe key in one MemTable, and its probe
    index (``hashes``: the probe keys' :func:`_index_hashes`)."""
    p, r, offsets = _memtable_find(table, m, probe, hashes)
    if len(p) == 0:
        return None
    names = set(m.schema.names)
    cols = [c for c in read_cols if c in names and c != TOMBSTONE] + [TOMBSTONE]
    return _memtable_rows_at(m, offsets, r, cols), p


def _base_lookup(
    base: lance.LanceDataset, probe: pa.Table, pk: list[str], read_cols: list[str]
) -> tuple[pa.Table, np.ndarray]:
    """Base rows of the probe keys, and their probe index.

    Keys never go through SQL text (which cannot express every value exactly: a
    nanosecond timestamp, a decimal, NaN...). Rows are pre-selected with a filter Lance
    can serve from the key's BTREE: an ``IN`` list of integers for an integer key, else
    a ``pyarrow.compute`` ``is_in`` expression (typed values; for a composite key one
    per column, a superset); then matched to the probe keys exactly with an Arrow join.
    Key types Lance cannot filter that way, and many keys at once (see
    :func:`_use_base_key_scan`), are matched by a scan of the key columns.
    """
    cols = _lance_columns(base, read_cols)
    if _use_base_key_scan(base, probe.num_rows):
        parts = [_base_rows_by_key_scan(base, probe, pk, cols)]
    else:
        parts = [
            _base_rows_filtered(base, probe.slice(start, _BASE_LOOKUP_CHUNK), pk, cols)
            for start in range(0, probe.num_rows, _BASE_LOOKUP_CHUNK)
        ]
    got = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if got.num_rows == 0:
        return got, np.zeros(0, np.int64)
    r, p = _match_keys(got.select(pk), probe)
    if len(r) == got.num_rows and (len(r) == 0 or (r == np.arange(len(r))).all()):
        return got, p
    return got.take(pa.array(r)), p


def _base_rows_filtered(
    base: lance.LanceDataset, chunk: pa.Table, pk: list[str], cols: list[str]
) -> pa.Table:
    """Base rows (a superset) of ``chunk``'s keys through a key filter, else a key scan."""
    flt = _base_key_filter(chunk, pk)
    if flt is not None:
        try:
            return base.scanner(columns=cols, filter=flt, scan_in_order=False).to_table()
        except (pa.ArrowNotImplementedError, ValueError):
            pass  # a key type Lance cannot filter on: scan the keys instead
    return _base_rows_by_key_scan(base, chunk, pk, cols)


def _use_base_key_scan(base: lance.LanceDataset, num_keys: int) -> bool:
    """Whether base rows of ``num_keys`` keys are found by one scan of the key columns.

    A filtered scan costs ~8 us per key (an ``IN`` list or ``is_in`` over the BTREE, in
    chunks of :data:`_BASE_LOOKUP_CHUNK`); a scan of the key columns ~50 ns per base row
    plus a join. Measured on a 2M-row base (pylance 14): 50k keys 0.6 s against 0.3 s,
    1M keys 10.5 s against 1.1 s; 10k keys are faster filtered. The key scan holds the
    base's key columns in memory, so bases above :data:`_BASE_KEY_SCAN_MAX_ROWS` rows are
    always filtered.
    """
    if num_keys < _BASE_KEY_SCAN_MIN_KEYS:
        return False
    rows = base.count_rows()
    return rows <= _BASE_KEY_SCAN_MAX_ROWS and num_keys * _BASE_KEY_SCAN_ROWS_PER_KEY >= rows


# Arrow types a pyarrow ``is_in`` filter reaches Lance with (pylance 14's Substrait
# conversion); the others are matched by a key scan.
def _isin_filterable(t: pa.DataType) -> bool:
    if pa.types.is_timestamp(t):
        return t.unit != "ns"
    return (
        (pa.types.is_integer(t) and pa.types.is_signed_integer(t))
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
    )


def _base_key_filter(chunk: pa.Table, pk: list[str]) -> str | pc.Expression | None:
    """A filter selecting (a superset of) the base rows of ``chunk``'s keys, or None."""
    if len(pk) == 1:
        col = chunk.column(0)
        ints: Any = None
        small = 0 < len(col) <= _SMALL_MATCH
        if small and pa.types.is_integer(col.type) and not col.null_count:
            ints = col.to_pylist()  # a few keys: no numpy round trip
            if max(ints) > np.iinfo(np.int64).max:
                ints = None
        else:
            ints = _ints(col)
            ints = None if ints is None else ints.tolist()
        if ints is not None:  # integers are exact as SQL text, and the IN list is fast
            name = "`" + pk[0].replace("`", "``") + "`"
            return f"{name} IN ({','.join(map(str, ints))})"
    expr = None
    for name in pk:
        col = chunk.column(name)
        if not _isin_filterable(col.type):
            continue
        values = pc.unique(col.combine_chunks())
        term = pc.field(name).isin(values)
        expr = term if expr is None else expr & term
    return expr


def _base_rows_by_key_scan(
    base: lance.LanceDataset, chunk: pa.Table, pk: list[str], cols: list[str]
) -> pa.Table:
    """Base rows of ``chunk``'s keys: scan the key columns, join, take the matches."""
    keys = base.to_table(columns=pk, with_row_id=True)
    r, _ = _match_keys(keys.select(pk), chunk)
    if len(r) == 0:
        return base.scanner(columns=cols, limit=0).to_table()
    ids = keys.column(ROWID).take(pa.array(np.sort(r))).to_pylist()
    return base._take_rows(ids, columns=cols)


# ----------------------------------------------------------------------------------------
# SQL table functions
# ----------------------------------------------------------------------------------------
def _literal(expr: Any) -> Any:
    """The Python value of a literal DataFusion expression argument."""
    fn = getattr(expr, "python_value", None)
    if fn is None:
        raise MemWalError(f"search table functions take literal arguments, got {expr}")
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - not a literal
        raise MemWalError(f"search table functions take literal arguments, got {expr}") from e
    return value.as_py() if isinstance(value, pa.Scalar) else value


def register_search_functions(
    ctx: datafusion.SessionContext,
    tables: dict[str, MemWalTable] | None = None,
    writers: dict[str, Sequence[RegionWriter]] | None = None,
) -> None:
    """Register the SQL table functions ``vector_search``, ``fts_search`` and ``lookup``.

    Parameters
    ----------
    ctx : datafusion.SessionContext
    tables : dict, optional
        ``{name: MemWalTable}`` the functions can search. Default: the tables
        registered on ``ctx`` with :func:`memwal_query.register` (looked up at call
        time, so tables registered later are found too).
    writers : dict, optional
        ``{name: [RegionWriter, ...]}``: writers whose MemTables the functions read
        for that table (default: the writers opened by ``MemWalTable.write``).

    Notes
    -----
    Arguments are literals; optional trailing ones may be omitted::

        SELECT * FROM vector_search('events', 'vec', [0.1, 0.2, ...], 10)
        SELECT * FROM vector_search('events', 'vec', [...], 10, 'x > 5', 40)  -- filter, nprobes
        SELECT id, _score FROM fts_search('events', 'text', 'hello world', 5)
        SELECT * FROM fts_search('events', 'text', 'hello', 5, 'x > 5')       -- filter
        SELECT * FROM lookup('events', 42)
        SELECT * FROM lookup('events', [1, 2, 3])

    The search runs when DataFusion plans the query (the function's result is a
    table), with strong consistency and the MemTables of ``writers`` (by default the
    writers opened by ``MemWalTable.write`` on that table object). An empty filter
    string means none.
    """
    from datafusion import Table, udtf

    if tables is None:
        from memwal_query.session import _registered

        tables = _registered(ctx)
    registry = tables
    table_writers = writers if writers is not None else {}

    def table_of(name: Any) -> MemWalTable:
        t = registry.get(str(name))
        if t is None:
            raise MemWalError(f"no MemWAL table named {name!r} (known: {sorted(registry)})")
        return t

    def writers_of(name: Any) -> Sequence[RegionWriter] | None:
        return table_writers.get(str(name))

    def as_table(result: pa.Table) -> Any:
        import pyarrow.dataset as pads

        return Table(pads.dataset(result))

    def sql_vector_search(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) < 3:
            raise MemWalError("vector_search(table, column, query [, k [, filter [, nprobes]]])")
        name, column, query = vals[:3]
        k = int(vals[3]) if len(vals) > 3 else 10
        flt = vals[4] if len(vals) > 4 and vals[4] else None
        nprobes = int(vals[5]) if len(vals) > 5 else 20
        t = table_of(name)
        return as_table(vector_search(t, column, query, k, flt, nprobes, writers=writers_of(name)))

    def sql_fts_search(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) < 3:
            raise MemWalError("fts_search(table, column, query [, k [, filter]])")
        name, column, query = vals[:3]
        k = int(vals[3]) if len(vals) > 3 else 10
        flt = vals[4] if len(vals) > 4 and vals[4] else None
        t = table_of(name)
        return as_table(fts_search(t, column, str(query), k, flt, writers=writers_of(name)))

    def sql_lookup(*args: Any) -> Any:
        vals = [_literal(a) for a in args]
        if len(vals) != 2:
            raise MemWalError("lookup(table, key_or_list_of_keys)")
        return as_table(lookup(table_of(vals[0]), vals[1], writers=writers_of(vals[0])))

    ctx.register_udtf(udtf(sql_vector_search, "vector_search"))
    ctx.register_udtf(udtf(sql_fts_search, "fts_search"))
    ctx.register_udtf(udtf(sql_lookup, "lookup"))
