"""DataFusion integration: SQL over base table + flushed generations + MemTables.

:class:`MemWalDataset` is a ``pyarrow.dataset.Dataset`` that DataFusion (and DuckDB,
Polars, pyarrow) scan: every query resolves the pinned view when it is planned
(:func:`memwal_query.read.view.resolve`), the base table is scanned by Lance with the
projection and the filter pushed down, minus the rows whose key a newer source holds,
and the newer sources contribute their newest row per key, tombstones removed, then
filtered. The pushed-down filter is exact (DataFusion does not re-apply it) and answers
as DataFusion would on every source. :meth:`MemWalDataset.explain` and ``last_plan``
describe the query resolved last by this provider object. Why this route and how the
filter keeps its semantics: ``docs/architecture.md``, "The DataFusion provider".
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from memwal_query.exceptions import SchemaError
from memwal_query.format.baseindex import version_key
from memwal_query.format.lancescan import batch_readahead
from memwal_query.format.rowaddrs import RowIdMask, row_address_treemap, run_starts
from memwal_query.format.schema import GEN_COLUMN, ROWADDR_COLUMN, as_int64
from memwal_query.read import (
    basecache,
    deletions,
    exprtree,
    newer,
    parallel,
    pointview,
    pruning,
    sources,
    view,
)
from memwal_query.read.dedup import KeySet, KeySetUnion, in_sorted
from memwal_query.read.filtersemantics import datafusion_semantics
from memwal_query.storage.cache import LRUCache
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.write.writer import RegionWriter

BASE_BATCH_ROWS = 65536  # fewer, larger batches: less per-batch Python overhead
# Bases up to this many rows drop rows overwritten by string/binary/composite keys by row
# address (their key columns are read once and cached, see KeySet.base_addresses).
ADDRESS_DEDUP_MAX_ROWS = 32_000_000
ROWID_COLUMN = deletions.ROWID_COLUMN  # what with_row_id adds (matched by the blocklist)
META_FIELDS = [pa.field(GEN_COLUMN, pa.uint64()), pa.field(ROWADDR_COLUMN, pa.uint64())]


def _as_expression(expr: Any) -> pc.Expression | None:
    """``expr`` as a pyarrow Expression: DataFusion hands a filter it simplified to a
    constant (``k IN (false, true)`` on a non-null ``k``) as a plain ``pa.Scalar``, which
    Lance's scanner rejects."""
    if expr is None or isinstance(expr, pc.Expression):
        return expr
    if isinstance(expr, str):
        raise SchemaError(
            f"filter {expr!r}: a table read takes a pyarrow.compute.Expression "
            "(pc.field('cat') == 7); SQL text: mq.register(ctx, name, uri) and ctx.sql(...)"
        )
    return pc.scalar(expr)


class _Filter:
    """A pushed-down filter, read once per query: what each source evaluates.

    Attributes
    ----------
    expr : pc.Expression or None
        The filter as DataFusion pushed it.
    columns : list of str
        Columns of the dataset schema it reads (meta columns included).
    local : pc.Expression or None
        What pyarrow evaluates (newer rows; base rows Lance cannot filter): ``expr`` with
        its float comparisons rewritten to DataFusion's order (NaN above everything,
        NaN = NaN), so that every source gives DataFusion's answer.
    base : pc.Expression or None
        What Lance evaluates on the base table: ``expr`` with ``_gen`` replaced by 0.
    lance : bool
        Whether to try ``base`` in Lance's scanner (fast path: late materialization,
        scalar indexes). False when it reads ``_rowaddr``, or when the expression cannot
        be read and compares floats (pyarrow then filters base rows too, so all sources
        agree); set to False when Lance refuses it (types its Substrait conversion
        does not support: unsigned integers, large strings/binaries, dictionaries,
        timestamp[ns] literals, any filter on a table with a time64 column...).
    pinned : tuple or None
        The keys it pins the primary key ``pk`` to (:func:`pointview.pinned_keys`), one
        tuple of values per key column: the newer rows are then read for those keys
        only.
    pinned_keys : pa.Table or None
        The same keys as a table of the key columns.
    """

    def __init__(
        self, expr: pc.Expression | None, schema: pa.Schema, pk: Sequence[str] = ()
    ) -> None:
        expr = _as_expression(expr)
        self.expr = expr
        self.columns: list[str] = []
        self.local = expr
        self.base = expr
        self.lance = expr is not None
        self.pinned: tuple[tuple[Any, ...], ...] | None = None
        self.pinned_keys: pa.Table | None = None
        if expr is None:
            return
        keys = pointview.pinned_keys_of(expr, schema, pk)
        if keys is not None:
            self.pinned_keys = keys
            self.pinned = tuple(tuple(keys.column(c).to_pylist()) for c in keys.column_names)
        node = exprtree.decode(expr)
        if node is None:  # not from DataFusion (whose filters always decode): be careful
            self.columns = pruning.referenced_columns(expr, schema.names)
            floats = [c for c in self.columns if pa.types.is_floating(schema.field(c).type)]
            if floats or GEN_COLUMN in self.columns or ROWADDR_COLUMN in self.columns:
                self.lance = False
            return
        used = exprtree.fields_of(node)
        self.columns = [n for n in schema.names if n in used]
        local = datafusion_semantics(node, schema)
        if not exprtree.same(local, node):
            self.local = exprtree.encode(local)
        if GEN_COLUMN in self.columns:
            self.base = exprtree.encode(
                exprtree.substitute(node, {GEN_COLUMN: pa.scalar(0, pa.uint64())})
            )
        if ROWADDR_COLUMN in self.columns:
            self.lance = False

    def data_columns(self) -> list[str]:
        """Referenced table columns (without the meta columns)."""
        return [c for c in self.columns if c not in (GEN_COLUMN, ROWADDR_COLUMN)]


def _staleness(max_staleness: float | None) -> float:
    """The snapshot age bound of an ``eventual`` read (None: the default)."""
    return view.DEFAULT_MAX_STALENESS if max_staleness is None else max_staleness


class _QueryState:
    """Sources and the deduplicated newer rows of one query (computed once, lazily)."""

    def __init__(self, dataset: MemWalDataset, filter: pc.Expression | None) -> None:
        self.dataset = dataset
        self.filter = _Filter(filter, dataset.schema, dataset.table.primary_key)
        table = dataset.table
        predicates = pruning.predicates_from_expression(filter)
        self.plan = view.resolve(
            table,
            dataset.consistency,
            dataset.writers,
            predicates,
            _staleness(dataset.max_staleness),
            dataset.as_of,
        )
        self._lock = threading.Lock()
        self._view: newer.NewerView | None = None
        self._point_views: dict[tuple[tuple[Any, ...], ...], newer.NewerView] = {}
        self._stale: np.ndarray | None = None
        self._stale_rows: _Stale | None = None
        self._base_rows: int | None = None
        self._kept_lock = threading.Lock()
        self._kept: tuple[int | None] | None = None
        self.rows_next = False  # set by a full read: it reads the generations' rows next

    def filter_for(self, expr: pc.Expression | None) -> _Filter:
        """The analysed filter of a scan (DataFusion passes the planned one again)."""
        known = self.filter
        expr = _as_expression(expr)
        if expr is known.expr or (
            expr is not None and known.expr is not None and expr.equals(known.expr)
        ):
            return known
        return _Filter(expr, self.dataset.schema, self.dataset.table.primary_key)

    @property
    def view(self) -> newer.NewerView:
        """Newest row per key of the newer sources (computed once per query)."""
        with self._lock:
            if self._view is None:
                table = self.dataset.table
                self._view = newer.newer_view(
                    self.plan,
                    table.schema,
                    table.primary_key,
                    table.storage_options,
                    self.rows_next,
                )
            return self._view

    def view_for(self, f: _Filter) -> newer.NewerView:
        """The newer rows a scan with filter ``f`` evaluates it on: when ``f`` pins the
        primary key to a few literals (:func:`pointview.pinned_keys`), only those keys'
        rows (:func:`pointview.point_view`, once per query and key set), else
        :attr:`view`."""
        keys = f.pinned
        if keys is None or f.pinned_keys is None:
            return self.view
        with self._lock:
            got = self._point_views.get(keys)
            if got is None:
                table = self.dataset.table
                got = pointview.point_view(
                    self.plan,
                    table.schema,
                    table.primary_key,
                    f.pinned_keys,
                    table.storage_options,
                )
                self._point_views[keys] = got
            return got

    @property
    def keys(self) -> KeySet | KeySetUnion:
        return self.view.keys

    def key_sets(self, f: _Filter | None = None) -> tuple[list[KeySet], list[KeySet]]:
        """The newer sources' key sets: (integer sets, hashed sets); with ``f``, those of
        :meth:`view_for` (the keys a base scan with that filter drops rows of)."""
        keys = self.keys if f is None else self.view_for(f).keys
        sets = keys.sets if isinstance(keys, KeySetUnion) else [keys]
        sets = [s for s in sets if len(s)]
        return [s for s in sets if not s.hashed], [s for s in sets if s.hashed]

    def stale_addresses(self, hashed: list[KeySet]) -> np.ndarray:
        """Sorted addresses of the base rows whose key is in a hashed set (once per query;
        each set caches its own across queries)."""
        with self._lock:
            if self._stale is None:
                parts = [s.base_addresses(self.plan.base) for s in hashed]
                # each part is sorted; duplicates do no harm to a binary search
                self._stale = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
            return self._stale

    def blocklist(self) -> bytes | None:
        """The base rows overwritten by a newer source as Lance's serialized
        ``RowAddrTreeMap``, for an unfiltered base scan (``row_addr_blocklist``: Lance
        skips those rows inside its scan; no key columns read, no copy of the kept rows
        in Python), or None to test keys per batch.

        Built once per query from every newer key set's :meth:`KeySet.base_addresses`
        (their row ids, which Lance matches the list against: equal to the addresses
        unless the base has stable row ids; one scan of the base table's key columns per
        set and base version, cached on the set). Only for hashed key sets (string,
        binary, composite keys), whose per-batch membership test rebuilds a hash set:
        integer key sets are tested per batch on the key column the scan reads (a
        gather in a dense table or a binary search, cheaper than that extra scan of
        the base's keys and row ids and than Lance's blocklist, measured on a 10M-row
        base: ``docs/architecture.md``). None when there is nothing to drop, the newer keys
        are integers, or the base table is over ``ADDRESS_DEDUP_MAX_ROWS`` rows.
        Filtered scans do not use it: Lance then plans the filter differently (a point
        query measured 2-3x slower), and a filter leaves few rows to copy anyway.
        """
        int_sets, hashed = self.key_sets()
        sets = int_sets + hashed
        if not hashed:
            return None  # integer keys: tested per batch (see stale_by_key)
        base = self.plan.base
        with self._lock:
            if self._stale_rows is None:
                if self.base_rows() > ADDRESS_DEDUP_MAX_ROWS:
                    return None
                self._stale_rows = _stale(base, sets)
            return self._stale_rows.blocklist

    def stale_rows_mask(self) -> RowIdMask:
        """After :meth:`blocklist` returned a list: the overwritten base rows as a
        :class:`RowIdMask` whatever their share (rows Lance does not scan, taken from
        memory, are tested on it)."""
        assert self._stale_rows is not None
        return self._stale_rows.mask

    def stale_mask(self) -> RowIdMask | None:
        """After :meth:`blocklist`: the overwritten base rows as a :class:`RowIdMask` when
        they are over ``MASK_SHARE`` of the base (an unfiltered scan then reads every
        row with its row id and drops those: cheaper than Lance's blocklist), else None."""
        stale, rows = self._stale_rows, self._base_rows
        if stale is None or rows is None or len(stale.ids) <= rows * MASK_SHARE:
            return None
        return stale.mask

    def base_rows(self) -> int:
        """Rows of the pinned base version (counted once per query)."""
        if self._base_rows is None:
            self._base_rows = self.plan.base.count_rows()
        return self._base_rows

    def kept_base_rows(self) -> int | None:
        """How many base rows no newer source overwrites, without reading a row: the
        base's live rows less those whose key is in a newer key set, counted on the
        base version's key flags (:func:`_base_keys`: one scan of its keys, kept for
        every later query of that version). None when they do not apply (keys other
        than one integer column, a key range too wide, a key in two live base rows):
        the rows are then scanned. Computed once per query."""
        with self._kept_lock:
            if self._kept is None:
                self._kept = (self._kept_from_flags(),)
            return self._kept[0]

    def _kept_from_flags(self) -> int | None:
        int_sets, hashed = self.key_sets()
        if hashed:
            return None
        if not int_sets:
            return self.base_rows()
        flags = _base_keys(self.plan.base, self.dataset.table.primary_key)
        if flags is None:
            return None
        return self.base_rows() - flags.overwritten(int_sets)

    def by_address(self, hashed: list[KeySet]) -> bool:
        """Whether base rows are dropped by row address (see ``_BaseFragment``)."""
        if not hashed:
            return False
        return self.base_rows() <= ADDRESS_DEDUP_MAX_ROWS

    def count(self) -> int:
        """Live rows of the view without reading a row: the base's row count minus its
        rows whose key a newer source holds, plus the newer sources' live newest rows
        (the same rows an unfiltered scan returns). The overwritten base rows are
        counted with one scan of the base's key columns (cached per base version and
        key sets, :data:`_OVERWRITTEN_BASE_COUNTS`), or taken from the overwritten rows
        already found by an earlier scan."""
        newer_live = self.view.live_count()
        int_sets, hashed = self.key_sets()
        sets = int_sets + hashed
        if not sets:
            return self.base_rows() + newer_live
        overwritten = _overwritten_count(self.dataset.table, self.plan.base, sets)
        return self.base_rows() - overwritten + newer_live


# Above this share of the base's rows overwritten, an unfiltered scan reads every base
# row with its row id and drops the overwritten ones with a RowIdMask: Lance's blocklist
# costs per blocked row (measured, 100k-row base: 63% blocked 2.6x a plain scan, against
# 1.6x read-then-mask; 0.5% blocked: the same as a plain scan, against 1.4x).
MASK_SHARE = 1 / 16


class _Stale:
    """The base rows overwritten by newer keys, for one base version and key sets: as
    Lance's serialized blocklist and as a :class:`RowIdMask` (built when first needed)."""

    def __init__(self, sets: list[KeySet], ids: np.ndarray) -> None:
        self.sets = sets
        self.ids = ids
        self.blocklist = row_address_treemap(ids)
        self._mask: RowIdMask | None = None
        self._lock = threading.Lock()

    @property
    def mask(self) -> RowIdMask:
        with self._lock:
            if self._mask is None:
                self._mask = RowIdMask(self.ids)
            return self._mask


def _stale_size(stale: _Stale) -> int:
    # the mask (built later, when used) holds a byte per base row up to the last
    # overwritten one of each fragment: at most ADDRESS_DEDUP_MAX_ROWS bytes
    return stale.ids.nbytes + len(stale.blocklist) + stale.ids.size


_OVERWRITTEN_BASE_ROWS: LRUCache[tuple[Any, ...], _Stale] = LRUCache(
    8, max_bytes=256 << 20, sizeof=_stale_size, name="overwritten_base_rows"
)
"""The base rows overwritten by newer sources, per (base URI, version, key sets)."""


def _stale(base: Any, sets: list[KeySet]) -> _Stale:
    """The rows of ``base`` whose key is in one of ``sets`` (their row ids: see
    :meth:`KeySet.base_addresses`), cached per base version and key sets (the sets of
    flushed generations are cached across queries: an unchanged table does not build
    it again)."""
    key = (base.uri, base.version, tuple(id(s) for s in sets))
    hit = _OVERWRITTEN_BASE_ROWS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit.sets, sets)):
        return hit
    found = np.concatenate([s.base_addresses(base, row_ids=True) for s in sets])
    if len(sets) > 1:
        found = np.unique(found)
    return _OVERWRITTEN_BASE_ROWS.put(key, _Stale(list(sets), found))


_OVERWRITTEN_BASE_COUNTS: LRUCache[tuple[Any, ...], tuple[list[KeySet], int]] = LRUCache(8)
"""How many base rows newer sources overwrite, per (base URI, version, key sets)."""


def _overwritten_count(table: Any, base: Any, sets: list[KeySet]) -> int:
    """How many rows of ``base`` have a key in one of ``sets`` (cached, see
    :data:`_OVERWRITTEN_BASE_COUNTS`; from :data:`_OVERWRITTEN_BASE_ROWS` when an
    earlier scan found those rows). Fragments whose data file has a key-runs summary
    (:mod:`memwal_query.format.basekeys`) are counted from it; the others' key
    column is scanned."""
    key = (base.uri, base.version, tuple(id(s) for s in sets))
    rows = _OVERWRITTEN_BASE_ROWS.get(key)
    if rows is not None and all(a is b for a, b in zip(rows.sets, sets)):
        return len(rows.ids)
    hit = _OVERWRITTEN_BASE_COUNTS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], sets)):
        return hit[1]
    pk = sets[0].pk
    covered, found = _summarized_count(table, base, sets)
    flags = None if covered or any(s.hashed for s in sets) else _base_keys(base, pk)
    if flags is not None:
        found = flags.overwritten(sets)
        _OVERWRITTEN_BASE_COUNTS.put(key, (list(sets), found))
        return found
    rest = None
    if covered:
        rest = [f for f in base.get_fragments() if f.fragment_id not in covered]
    if rest is None or rest:
        # hashed sets build their hash set per test: few large batches; integer sets
        # gather: small batches (less memory in flight)
        size = 1 << 20 if any(s.hashed for s in sets) else BASE_BATCH_ROWS
        # one fragment at a time: ~15 MB less at the peak of a cold count, no slower
        scan = deletions.scan(base, pk, batch_size=size, fragment_readahead=1, fragments=rest)
        for batch, gone in scan:
            mask = np.zeros(batch.num_rows, dtype=bool)  # a row counts once, whatever its sets
            keys = batch.select(pk)
            for s in sets:
                mask |= s.contains(keys)
            if gone is not None:
                mask &= ~gone
            found += int(mask.sum())
    _OVERWRITTEN_BASE_COUNTS.put(key, (list(sets), found))
    return found


class _BaseKeys:
    """The keys of one base version's live rows as flags over their range
    (``flags[k - lo]``; one integer key column, each key in one live row), with what
    derives the next version's flags from them (:func:`_derived_base_keys`): the version's
    dataset and the signature of each of its fragments (:func:`_fragment_signatures`).
    ``flags`` is never changed in place (versions with the same fragments share it)."""

    __slots__ = ("lo", "flags", "base", "fragments")

    def __init__(
        self,
        lo: int,
        flags: np.ndarray,
        base: Any = None,
        fragments: dict[int, tuple[Any, ...]] | None = None,
    ) -> None:
        self.lo = lo
        self.flags = flags
        self.base = base
        self.fragments = fragments

    def overwritten(self, sets: list[KeySet]) -> int:
        """How many live base rows have a key in one of ``sets`` (integer key sets):
        the flags of their keys over the base's range, and-ed with the base's."""
        newer = np.zeros(len(self.flags), dtype=bool)
        for s in sets:
            s.mark(newer, self.lo)
        newer &= self.flags
        return int(np.count_nonzero(newer))


_NO_BASE_KEYS = _BaseKeys(0, np.zeros(0, dtype=bool))
"""A base version the flags do not apply to (remembered: not scanned again)."""

BASE_KEYS_MAX_FLAGS = 1 << 26
"""Widest key range of a base version's key flags (a byte per key of the range), and at
most :data:`BASE_KEYS_FLAGS_PER_ROW` per live row (the flags then take at most what its
int64 keys would)."""
BASE_KEYS_FLAGS_PER_ROW = 8

BASE_KEYS_DERIVE_MAX_SHARE = 0.5
"""A base version's key flags are derived from an earlier version's when the rows of the
fragments that differ between the two (read from both) are at most this share of its
rows; otherwise its key column is scanned whole."""

_BASE_KEYS: LRUCache[tuple[str, int, int], _BaseKeys] = LRUCache(
    2, max_bytes=128 << 20, sizeof=lambda k: k.flags.nbytes, name="base_key_flags"
)
"""The key flags of a base version (:func:`_base_keys`), per (base URI, version): a
stream's reader counts many queries on each version a maintenance pass leaves (the
newest version and the one before it, for queries pinned to it meanwhile), keyed by
:func:`memwal_query.format.baseindex.version_key` (a table created again at a URI
has versions of the same numbers)."""


def _base_keys(base: Any, pk: list[str]) -> _BaseKeys | None:
    """The key flags of the live rows of ``base`` (a pinned Lance version; cached, see
    :data:`_BASE_KEYS`), or None when they do not apply: keys other than one integer
    column (uint64 aside), a range wider than :data:`BASE_KEYS_MAX_FLAGS` or than
    :data:`BASE_KEYS_FLAGS_PER_ROW` per row, or a key in two live rows (the count must
    be of rows, not of keys). Derived from the flags of a version cached before when
    few of its fragments differ (:func:`_derived_base_keys`), else one scan."""
    key = version_key(base)
    hit = _BASE_KEYS.get(key)
    if hit is None:
        got = _derived_base_keys(base, pk) or _scan_base_keys(base, pk)
        hit = _BASE_KEYS.put(key, got)
    return None if hit is _NO_BASE_KEYS else hit


def _fragment_signatures(base: Any) -> dict[int, tuple[Any, ...]]:
    """Per fragment id of ``base``: its data files, physical rows and deletion file. Two
    versions' fragments with equal signatures hold the same live rows (data files and
    deletion files are immutable)."""
    out: dict[int, tuple[Any, ...]] = {}
    for f in base.get_fragments():
        m = f.metadata
        d = m.deletion_file
        gone = None if d is None else (d.file_type, d.read_version, d.id, d.num_deleted_rows)
        out[m.id] = (tuple(x.path for x in m.files), m.physical_rows, gone)
    return out


def _flag_limit(rows: int) -> int:
    return min(BASE_KEYS_MAX_FLAGS, max(1 << 20, BASE_KEYS_FLAGS_PER_ROW * rows))


def _widened(
    lo: int, flags: np.ndarray, first: int, last: int, most: int
) -> tuple[int, np.ndarray] | None:
    """``(lo, flags)`` covering keys ``first .. last`` too, or None when the keys set so
    far and these would span more than ``most``. A new array has the spare room of half
    the keys' span, split between both ends (or keeps its length when that is already
    half again the span), so it never holds more than about 1.5 flags per key of the
    span and is copied few times however the keys widen the range."""
    if len(flags) and first >= lo and last < lo + len(flags):
        return lo, flags
    a = int(np.argmax(flags)) if len(flags) else 0  # the first flag set, if any
    used = bool(len(flags)) and bool(flags[a])
    b = len(flags) - int(np.argmax(flags[::-1])) if used else 0  # after the last set
    start = min(lo + a, first) if used else first
    end = max(lo + b - 1, last) if used else last
    span = end - start + 1
    if span > most:
        return None
    size = len(flags) if span * 3 // 2 <= len(flags) else min(most, span * 3 // 2 + 1)
    start -= (size - span) // 2
    grown = np.zeros(size, dtype=bool)
    if used:
        grown[lo + a - start : lo + b - start] = flags[a:b]
    return start, grown


def _live_keys(
    base: Any, pk: list[str], fragments: list[Any] | None = None
) -> Iterator[np.ndarray]:
    """The int64 keys of the live rows of ``base`` (of ``fragments`` only, when given),
    a batch at a time."""
    if fragments is not None and not fragments:
        return
    scan = deletions.scan(
        base, pk, batch_size=BASE_BATCH_ROWS, fragment_readahead=1, fragments=fragments
    )
    for batch, gone in scan:
        keys = as_int64(batch.column(pk[0])).to_numpy(zero_copy_only=False)
        if gone is not None:
            keys = keys[~gone]
        if len(keys):
            yield keys


def _derived_base_keys(base: Any, pk: list[str]) -> _BaseKeys | None:
    """The key flags of ``base`` from those of another version of the same table cached
    in :data:`_BASE_KEYS` (the newest one): the same array when every fragment is the
    same (an index or metadata commit); otherwise the live keys of the fragments the
    earlier version has and this one does not (read from the earlier version) cleared,
    then those of the fragments this one has and the earlier does not set. Each cleared
    flag must have been set and each set flag clear, and the flags set must be as many
    as the version's live rows: the same flags a scan finds. None when there is no such
    version, more than :data:`BASE_KEYS_DERIVE_MAX_SHARE` of the rows differ, a check
    fails or the earlier version's fragments cannot be read (its files removed): the
    caller scans. (A table created again at the URI shares no data file with the first:
    every fragment differs, and it is scanned.)"""
    here = version_key(base)
    prior = [
        v
        for key, v in _BASE_KEYS.items()
        if key[0] == here[0] and key != here and v.fragments is not None
    ]
    if not prior:
        return None
    prev = max(prior, key=lambda v: v.base.version)
    assert prev.fragments is not None
    now = _fragment_signatures(base)
    gone = [i for i, s in prev.fragments.items() if now.get(i) != s]
    new = [i for i, s in now.items() if prev.fragments.get(i) != s]
    if not gone and not new:
        return _BaseKeys(prev.lo, prev.flags, base, now)
    rows = base.count_rows()
    touched = sum(prev.fragments[i][1] for i in gone) + sum(now[i][1] for i in new)
    if touched > rows * BASE_KEYS_DERIVE_MAX_SHARE:
        return None
    lo, flags = prev.lo, prev.flags.copy()
    most = _flag_limit(rows)
    try:
        gone_ids, new_ids = set(gone), set(new)
        old = [f for f in prev.base.get_fragments() if f.fragment_id in gone_ids]
        for keys in _live_keys(prev.base, pk, old):
            at = keys - np.int64(lo)
            if at.min() < 0 or at.max() >= len(flags) or not flags[at].all():
                return None
            flags[at] = False
        added = [f for f in base.get_fragments() if f.fragment_id in new_ids]
        for keys in _live_keys(base, pk, added):
            grown = _widened(lo, flags, int(keys.min()), int(keys.max()), most)
            if grown is None:
                return None
            lo, flags = grown
            at = keys - np.int64(lo)
            if flags[at].any():
                return None
            flags[at] = True
    except (OSError, ValueError, RuntimeError):
        return None  # the earlier version's files removed meanwhile: scan this one
    if int(np.count_nonzero(flags)) != rows:
        return None  # a key in two of the new live rows
    return _BaseKeys(lo, flags, base, now)


def _scan_base_keys(base: Any, pk: list[str]) -> _BaseKeys:
    """One scan of the base's key column into flags (:func:`_base_keys`), widened as the
    keys widen the range (:func:`_widened`: few copies, at most about 1.5 flags per key
    of the span)."""
    if len(pk) != 1:
        return _NO_BASE_KEYS
    t = base.schema.field(pk[0]).type
    if not pa.types.is_integer(t) or t == pa.uint64():
        return _NO_BASE_KEYS
    fragments = _fragment_signatures(base)
    rows = base.count_rows()
    most = _flag_limit(rows)
    lo, flags, seen = 0, np.zeros(0, dtype=bool), 0
    for keys in _live_keys(base, pk):
        grown = _widened(lo, flags, int(keys.min()), int(keys.max()), most)
        if grown is None:
            return _NO_BASE_KEYS
        lo, flags = grown
        flags[keys - np.int64(lo)] = True
        seen += len(keys)
    if seen != rows or int(np.count_nonzero(flags)) != rows:
        return _NO_BASE_KEYS  # a key in two live rows
    return _BaseKeys(lo, flags, base, fragments)


def _summarized_count(table: Any, base: Any, sets: list[KeySet]) -> tuple[set[int], int]:
    """(ids of the fragments counted, how many of their rows have a key in one of
    ``sets``) from the fragments' key-runs summaries: a run of keys ``start ..
    start + length - 1`` holds as many overwritten rows as distinct newer keys in that
    range (one listing of the summaries, then a read of each one listed). Nothing for
    hashed sets or keys other than one integer column."""
    from memwal_query.format import basekeys

    pk = sets[0].pk
    if len(pk) != 1 or any(s.hashed for s in sets):
        return set(), 0
    field = base.lance_schema.field(pk[0])
    t = base.schema.field(pk[0]).type
    if field is None or not pa.types.is_integer(t) or t == pa.uint64():
        return set(), 0
    covered: set[int] = set()
    starts, lengths = [], []
    present = basekeys.listed(table.io, table.uri)
    if not present:
        return covered, 0
    fragments = base.get_fragments()

    def read(fragment: Any) -> tuple[np.ndarray, np.ndarray] | None:
        return basekeys.read(table.io, table.uri, fragment, pk[0], field.id(), present)

    summaries = sources.map_reads(read, fragments, table.io)
    for fragment, got in zip(fragments, summaries):
        if got is not None:
            covered.add(fragment.fragment_id)
            starts.append(got[0])
            lengths.append(got[1])
    if not covered:
        return covered, 0
    first = np.concatenate(starts)
    last = first + (np.concatenate(lengths) - 1)  # never past the int64 range
    if len(sets) == 1:
        found = sets[0].count_in_ranges(first, last)
        assert found is not None  # an integer set
        return covered, found
    newer = _distinct_ints(sets)
    inside = np.searchsorted(newer, last, side="right") - np.searchsorted(newer, first)
    return covered, int(inside.sum())


def _distinct_ints(sets: list[KeySet]) -> np.ndarray:
    """The distinct keys of integer key sets, ascending."""
    parts = [s.sorted_ints() for s in sets]
    ints = [p for p in parts if p is not None and len(p)]
    if len(ints) == 1:
        return ints[0]
    merged = np.sort(np.concatenate(ints)) if ints else np.zeros(0, np.int64)
    return merged[run_starts(merged)]


# What Lance raises when its Substrait conversion refuses a filter expression (at
# scanner creation or on the first batch). Anything else is a real error.
_LANCE_REFUSALS = (ValueError, TypeError, NotImplementedError, pa.ArrowException)


def _output_schema(schema: pa.Schema, columns: Sequence[str] | None) -> pa.Schema:
    if columns is None:
        return schema
    return pa.schema([schema.field(c) for c in columns])


class _Scanner:
    """What DataFusion calls ``scanner``: a projected schema and batches (``whole``:
    the same batches produced anew for a consumer that keeps them all, for
    ``to_table``, which therefore reads the sources again even after ``to_batches``)."""

    def __init__(
        self,
        schema: pa.Schema,
        batches: Iterator[pa.RecordBatch] | None,
        whole: Callable[[], Iterator[pa.RecordBatch]] | None = None,
    ) -> None:
        self.projected_schema = schema
        self._batches = batches
        self._whole = whole

    def to_batches(self) -> Iterator[pa.RecordBatch]:
        return self._batches if self._batches is not None else iter(())

    def to_table(self) -> pa.Table:
        batches = self._whole() if self._whole is not None else self.to_batches()
        return pa.Table.from_batches(list(batches), schema=self.projected_schema)

    def to_reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(self.projected_schema, self.to_batches())

    def count_rows(self) -> int:
        return sum(b.num_rows for b in self.to_batches())


class _BaseFragment:
    """Base-table rows (a share of its Lance fragments) whose key is not newer.

    A scan of no column without a filter (``count(*)``) returns only a number of rows:
    the part with ``counts`` returns every base part's (:meth:`_QueryState.kept_base_rows`),
    the others none, when that number is known without reading a row."""

    def __init__(
        self, state: _QueryState, lance_fragments: list[Any] | None, counts: bool = True
    ) -> None:
        self.state = state
        self.lance_fragments = lance_fragments
        self.counts = counts

    def _read_table_file(self, path: str) -> bytes:
        """A file of the base table (``path`` relative to its directory)."""
        table = self.state.dataset.table
        return table.io.read(join(table.uri, path))

    def _reads_deleted(self) -> bool:
        """Whether this part's scan reads the deleted rows of its fragments and drops
        them itself (:func:`deletions.reads_deleted`, the deletion files it needs read
        concurrently on an object store)."""
        table = self.state.dataset.table
        return deletions.reads_deleted(
            self.fragments(),
            self._read_table_file,
            table.uri,
            lambda fn, paths: sources.map_reads(fn, paths, table.io),
        )

    def _indexed(self) -> list[str]:
        """Columns with a point index (:data:`deletions.POINT_INDEXES`) covering every
        fragment of this part that has a deletion file (index metadata only)."""
        deleted = {f.fragment_id for f in self.fragments() if f.num_deletions}
        if not deleted:
            return []
        found: list[str] = []
        for d in self.state.plan.base.describe_indices():
            if d.index_type not in deletions.POINT_INDEXES or len(d.field_names) != 1:
                continue
            covered = {i for seg in d.segments for i in seg.fragment_ids}
            if deleted <= covered:
                found.append(d.field_names[0])
        return found

    def _twin_candidates(self) -> list[tuple[Any, Any]]:
        """This part's fragments with deletion files that have a clean twin
        (:class:`deletions.CleanFragments`), each with its twin (no file read)."""
        uri = self.state.dataset.table.uri
        found = []
        for fragment in self.fragments():
            if fragment.num_deletions:
                twin = deletions.TWINS.twin(uri, fragment)
                if twin is not None:
                    found.append((fragment, twin))
        return found

    def _twins(self, candidates: list[tuple[Any, Any]]) -> tuple[dict[int, Any], RowIdMask] | None:
        """The twins of ``candidates`` (:meth:`_twin_candidates`) whose deletion files
        could be read (concurrently on an object store), by fragment id, and their
        deleted rows by address, or None when there is none."""
        table = self.state.dataset.table
        deleted = sources.map_reads(
            lambda pair: deletions.deleted_flags(table.uri, pair[0], self._read_table_file),
            candidates,
            table.io,
        )
        twins = {f.fragment_id: twin for (f, twin), d in zip(candidates, deleted) if d is not None}
        flags = {f.fragment_id: d for (f, _), d in zip(candidates, deleted) if d is not None}
        return (twins, RowIdMask.from_flags(flags)) if twins else None

    def _from_cache(
        self, f: _Filter, data_cols: list[str]
    ) -> tuple[list[pa.Table], list[Any]] | None:
        """The live rows of this part's fragments the cache holds, filtered by ``f`` (as
        the newer rows are: ``f.local``), and the fragments left to scan (also those
        whose rows pyarrow cannot filter: Lance evaluates some filters another way); or
        None when the cache holds none. An unfiltered scan of every column decodes the
        new fragments it may keep first (:func:`basecache.new_fragments`)."""
        state = self.state
        uri = state.dataset.table.uri
        schema = state.dataset.table.schema
        fragments = self.fragments()
        new: set[int] = set()
        if f.expr is None and set(schema.names) <= set(data_cols):
            every = state.plan.base.get_fragments()  # counted over the version, not the part
            new = {x.fragment_id for x in basecache.new_fragments(uri, every)}
        known = basecache.cached_ids(uri)
        if not known and not new:
            return None
        tables: list[pa.Table] = []
        rest: list[Any] = []
        for fragment in fragments:
            rows = None
            if fragment.fragment_id in known:
                rows = basecache.cached(uri, fragment, schema)
            if rows is None and fragment.fragment_id in new:
                scanner = state.plan.base.scanner(
                    columns=schema.names,
                    fragments=[fragment],
                    with_row_address=True,
                    batch_size=BASE_BATCH_ROWS,
                    batch_readahead=batch_readahead() if _narrow(schema, schema.names) else None,
                )
                rows = basecache.keep(uri, fragment, schema, scanner.to_table())
            if rows is not None:
                rows = basecache.live(uri, fragment, rows, self._read_table_file)
            if rows is not None and f.expr is not None:
                try:  # as on the newer rows; what pyarrow cannot evaluate, Lance may
                    rows = rows.filter(f.local)
                except (pa.ArrowException, TypeError, ValueError):
                    rows = None
            if rows is None:
                rest.append(fragment)
            else:
                tables.append(rows)
        return (tables, rest) if tables else None

    @staticmethod
    def _given(
        tables: list[pa.Table],
        columns: list[str],
        addresses: bool,
        overwritten: RowIdMask | None,
        size: int,
    ) -> Iterator[pa.RecordBatch]:
        """Batches of ``tables`` (:meth:`_from_cache`: filtered already) as a scan would
        give them: ``columns``, ``_rowaddr`` when ``addresses``, and ``_rowid`` (the
        same values: no stable row ids) when ``overwritten`` is tested on it."""
        names = list(dict.fromkeys(columns))
        for rows in tables:
            out = rows.select(names)
            if addresses:
                out = out.append_column(ROWADDR_COLUMN, rows.column(ROWADDR_COLUMN))
            if overwritten is not None:
                out = out.append_column(ROWID_COLUMN, rows.column(ROWADDR_COLUMN))
            yield from out.to_batches(max_chunksize=size)

    def fragments(self) -> list[Any]:
        """The Lance fragments this part scans."""
        if self.lance_fragments is not None:
            return self.lance_fragments
        fragments: list[Any] = self.state.plan.base.get_fragments()
        return fragments

    def scanner(
        self,
        schema: pa.Schema | None = None,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        batch_size: int | None = None,
        **_: Any,
    ) -> _Scanner:
        ds = self.state.dataset
        out_schema = _output_schema(ds.schema, columns)
        return _Scanner(out_schema, self._guarded(out_schema, filter, batch_size))

    def _guarded(
        self,
        out_schema: pa.Schema,
        filter: pc.Expression | None,
        batch_size: int | None,
        whole: bool = False,
    ) -> Iterator[pa.RecordBatch]:
        # A base version cleaned up mid-query: a typed BaseVersionGoneError, not Lance's
        # bare "Not found" (the next query plans on the current version).
        with sources.reading_base(self.state.dataset.table, self.state.plan.base):
            yield from self._batches(out_schema, filter, batch_size, whole)

    def whole(self, out_schema: pa.Schema) -> pa.Table | None:
        """The kept rows of an unfiltered scan as one table, or None when that does not
        apply (the base is over ``ADDRESS_DEDUP_MAX_ROWS`` rows while newer keys exist,
        or no column is read: the partitions then share the work).

        The overwritten rows are dropped batch by batch as Lance decodes them (by key,
        by Lance's blocklist, or by row id: :meth:`_batches`), never by a filter over
        the whole base read first: the peak memory is the answer plus a batch."""
        if not self.can_be_whole(out_schema):
            return None
        batches = list(self._guarded(out_schema, None, BASE_BATCH_ROWS, whole=True))
        return pa.Table.from_batches(batches, schema=out_schema)

    def can_be_whole(self, out_schema: pa.Schema) -> bool:
        """Whether :meth:`whole` applies (computes the newer sources' view)."""
        state = self.state
        if not [c for c in out_schema.names if c not in (GEN_COLUMN, ROWADDR_COLUMN)]:
            return False
        return not (any(state.key_sets()) and state.base_rows() > ADDRESS_DEDUP_MAX_ROWS)

    def _batches(
        self,
        out_schema: pa.Schema,
        filter: pc.Expression | None,
        batch_size: int | None,
        whole: bool = False,
        given: list[pa.Table] | None = None,
        cache: bool = True,
    ) -> Iterator[pa.RecordBatch]:
        """The kept base rows of this part, batch by batch; ``whole``: every batch is
        kept in one answer (:meth:`whole`); ``given``: the rows of this part's fragments
        taken from memory (:mod:`memwal_query.read.basecache`: deleted rows dropped,
        filtered, every column and ``_rowaddr``) instead of a scan; ``cache=False``: a
        scan of every fragment of the part, none taken from memory."""
        state = self.state
        pk = state.dataset.table.primary_key
        base = state.plan.base
        uri = state.dataset.table.uri
        if given is None:
            basecache.note_first(uri, base)
        wanted = list(out_schema.names)
        data_cols = [c for c in wanted if c not in (GEN_COLUMN, ROWADDR_COLUMN)]
        f = state.filter_for(filter)
        if not wanted and f.expr is None:
            # no column and no filter (count(*)): rows that differ only in number
            kept_rows = state.kept_base_rows()
            if kept_rows is not None:
                if self.counts:
                    yield from _no_columns(kept_rows)
                return
        if given is None:  # (a scan that reads rows: what a filtered scan may use later)
            deletions.TWINS.note(uri, base.version, base.get_fragments)
        if (
            given is None
            and cache
            and data_cols
            and (f.expr is None or f.lance)
            and GEN_COLUMN not in f.columns
            and (f.expr is None or deletions.total_filter(f.base))
            and basecache.usable(base)
        ):
            split = self._from_cache(f, data_cols)
            if split is not None:  # some fragments from memory, the others scanned
                tables, rest = split
                if rest:
                    part = _BaseFragment(state, rest, counts=False)
                    yield from part._batches(out_schema, filter, batch_size, whole, cache=False)
                yield from self._batches(out_schema, filter, batch_size, whole, tables)
                return
        blocklist = state.blocklist() if f.expr is None else None
        overwritten = state.stale_mask() if blocklist is not None else None
        int_sets, hashed = ([], []) if blocklist is not None else state.key_sets(f)
        # Hashed key sets (strings, binary, composite keys) rebuild a hash set on every
        # membership test: after the first batch (a selective scan may have only one),
        # or from the start when the addresses are cached, overwritten base rows are
        # dropped by row address instead (and then need no key columns).
        # (a key-pinned view's few keys are hashed per batch: no scan of the base's keys)
        by_address = f.pinned is None and state.by_address(hashed)
        cached = by_address and all(s.has_addresses(state.plan.base) for s in hashed)
        key_cols = pk if int_sets or (hashed and not cached) else []
        want_addr = ROWADDR_COLUMN in wanted
        size = max(batch_size or 0, BASE_BATCH_ROWS)
        batches: Iterator[pa.RecordBatch] | None = None
        if given is not None:  # rows taken from memory (basecache)
            if blocklist is not None and overwritten is None:  # Lance does not drop them
                overwritten = state.stale_rows_mask()
            batches = self._given(
                given, data_cols + key_cols, want_addr or by_address, overwritten, size
            )
            with_deleted, twin_deleted, local = False, None, None
        else:
            # Fragments with deletion files: read their deleted rows too and drop them with
            # the mask below (Lance's own scan of them decodes range by range, see
            # memwal_query.read.deletions). A filtered scan then reads its columns whole
            # (no late materialization, which Lance refuses with deleted rows), so only
            # when they are narrow, and only with a filter that cannot fail on a value a
            # deleted row holds.
            # The deletion files are read (concurrently on an object store) only when the
            # scan may take that path and their metadata does not decide.
            # A key lookup through a scalar index stays on Lance's path (it decodes the
            # matching rows only).
            # A scan reads the fragments with deletion files that have a clean twin (the
            # same data files seen without one) as those twins, with Lance's own plan (late
            # materialization for a filter; a plain scan, cheaper than one of the deleted
            # rows too, without one), and drops their deleted rows by address
            # (:class:`deletions.CleanFragments`).
            narrow = f.expr is None or _narrow(state.dataset.schema, data_cols + f.data_columns())
            candidates: list[tuple[Any, Any]] = []
            may = f.expr is None or (
                deletions.total_filter(f.base)  # never evaluated on deleted rows
                and not deletions.point_filter(f.base, self._indexed())
            )
            if may and (f.expr is None or f.lance):
                candidates = self._twin_candidates()
            worth = may and (narrow or bool(candidates)) and self._reads_deleted()
            twins = self._twins(candidates) if worth and candidates else None
            twin_deleted = twins[1] if twins is not None else None
            with_deleted = worth and narrow
            # several batches decoded at once (Lance's default is one on a small machine),
            # unless they are wide: then as many as Lance's default holds in memory
            readahead = (
                batch_readahead()
                if _narrow(state.dataset.schema, data_cols + key_cols + f.data_columns())
                else None
            )
            if f.expr is None or f.lance:
                # Fast path: Lance filters (late materialization, scalar indexes).
                def lance_scan(
                    deleted: bool, fragments: list[Any] | None = self.lance_fragments
                ) -> Iterator[pa.RecordBatch]:
                    scanner = state.plan.base.scanner(
                        columns=list(dict.fromkeys(data_cols + key_cols)),
                        filter=f.base,
                        fragments=fragments,
                        with_row_address=want_addr or by_address or twin_deleted is not None,
                        with_row_id=overwritten is not None or deleted,
                        batch_size=size,
                        batch_readahead=readahead,
                        row_addr_blocklist=None if overwritten is not None else blocklist,
                        include_deleted_rows=deleted or None,
                        late_materialization=False if deleted and f.expr is not None else None,
                    )
                    it = iter(scanner.to_batches())
                    first = next(it, None)
                    return it if first is None else itertools.chain([first], it)

                try:
                    try:
                        if twins is not None or (with_deleted and f.expr is not None):
                            batches = _split_scans(
                                lance_scan,
                                self.fragments(),
                                with_deleted,
                                twins[0] if twins else {},
                            )
                        else:
                            batches = lance_scan(with_deleted)
                    except _LANCE_REFUSALS:
                        if not ((with_deleted or twins is not None) and f.expr is not None):
                            raise
                        # a plan Lance does not run with deleted rows or twins: its own way
                        with_deleted, twin_deleted = False, None
                        batches = lance_scan(with_deleted)
                except _LANCE_REFUSALS:
                    if f.expr is None:
                        raise
                    f.lance = False  # the other partitions need not ask again
            local = None
            if batches is None:
                # Lance refused the filter (or it reads _rowaddr): read its columns too, and
                # filter with pyarrow after the key check (same result: a base row is kept
                # only if its key is in no newer source, whatever the filter).
                local = f.local
                with_deleted = self._reads_deleted()  # no filter in Lance: read whole anyway
                # (another partition may have found Lance refusing the filter after this
                # one chose its twins: this scan reads the fragments themselves)
                twin_deleted = None
                scanner = state.plan.base.scanner(
                    columns=list(dict.fromkeys(data_cols + key_cols + f.data_columns())),
                    fragments=self.lance_fragments,
                    with_row_address=want_addr or by_address or ROWADDR_COLUMN in f.columns,
                    with_row_id=with_deleted,
                    batch_size=size,
                    batch_readahead=readahead,
                    row_addr_blocklist=blocklist,
                    include_deleted_rows=with_deleted or None,
                )
                batches = scanner.to_batches()

        needed = set(out_schema.names) | (set(f.columns) if local is not None else set())
        # An unfiltered read of the whole table into one answer copies its batches even
        # when it drops no row: the answer then holds copies in memory the scan's freed
        # batches leave warm, not Lance's own batches, for which Lance's decoding threads
        # take fresh pages (a clean 10M-row base of narrow columns: 0.29-0.30 s against
        # 0.41-0.53 s, and less CPU). Not for a stream of batches (a consumer that
        # frees them, or stops early) nor wide columns (vectors: copies cost more).
        copy_all = (
            whole
            and given is None  # rows from memory: not Lance's fresh pages, no copy needed
            and f.expr is None
            and bool(data_cols)
            and _narrow(state.dataset.schema, data_cols)
        )

        def kept(i: int, batch: pa.RecordBatch) -> pa.RecordBatch:
            # one mask of the rows to drop (deleted, overwritten), one copy of the rest
            deleted = with_deleted and ROWID_COLUMN in batch.schema.names
            mask = deletions.deleted_rows(batch) if deleted else None
            if twin_deleted is not None:  # a clean twin's rows deleted since
                addr = deletions.live_values(batch, ROWADDR_COLUMN)
                mask = _either(mask, twin_deleted.contains(addr))
            if overwritten is not None:
                ids = deletions.live_values(batch, ROWID_COLUMN)
                mask = _either(mask, overwritten.contains(ids))
            for s in int_sets:
                mask = _either(mask, s.contains(batch.select(pk)))
            if by_address and (i or cached):
                addr = deletions.live_values(batch, ROWADDR_COLUMN)
                mask = _either(mask, in_sorted(addr, state.stale_addresses(hashed)))
            else:
                for s in hashed:
                    mask = _either(mask, s.contains(batch.select(pk)))
            if mask is None and copy_all:
                mask = np.zeros(batch.num_rows, dtype=bool)
            if mask is not None and (copy_all or mask.any()):
                # copy only what is returned or filtered on (not _rowid, unread keys)
                names = batch.schema.names
                if len(names) > len(needed) or any(n not in needed for n in names):
                    batch = batch.select([n for n in names if n in needed])
                batch = _drop(batch, mask)
            if local is not None:
                if GEN_COLUMN in f.columns:
                    gen = pa.repeat(pa.scalar(0, pa.uint64()), batch.num_rows)
                    batch = batch.append_column(GEN_COLUMN, gen)
                batch = batch.filter(local)
            return _project(batch, out_schema, generation=0)

        if not (
            copy_all
            or overwritten is not None
            or int_sets
            or hashed
            or with_deleted
            or twin_deleted is not None
            or local is not None
        ):
            yield from (kept(i, b) for i, b in enumerate(batches))  # nothing to drop or copy
            return
        yield from _ahead(kept, batches)


def _split_scans(
    scan: Callable[[bool, list[Any]], Iterator[pa.RecordBatch]],
    fragments: list[Any],
    with_deleted: bool,
    twins: dict[int, Any],
) -> Iterator[pa.RecordBatch]:
    """A scan of ``fragments`` with those that have a clean twin read as that twin
    (``twins``, by fragment id; the caller drops their deleted rows by address), in one
    scan of Lance's own plan (``scan(False, ...)``: for a filter, its columns first and
    the other columns of the matching rows only), in order; unless ``with_deleted`` and
    some fragment with a deletion file has no twin: those are scanned first with their
    deleted rows (``scan(True, those)``: no late materialization, which Lance refuses
    with deleted rows), the others when that scan is done."""
    dirty = [f for f in fragments if f.num_deletions and f.fragment_id not in twins]
    apart = {f.fragment_id for f in dirty} if with_deleted else set()
    rest = [twins.get(f.fragment_id, f) for f in fragments if f.fragment_id not in apart]
    if not (with_deleted and dirty):
        return scan(False, rest)
    first = scan(True, dirty)  # started here: a refusal surfaces to the caller

    def both() -> Iterator[pa.RecordBatch]:
        yield from first
        if rest:
            yield from scan(False, rest)

    return both()


KEEP_AHEAD = 2
"""Base batches whose overwritten rows are dropped while the consumer takes the one
before them (:func:`_ahead`)."""
_KEEPERS = ThreadPoolExecutor(KEEP_AHEAD, thread_name_prefix="memwal-base-batches")
_NEWER_ROWS = ThreadPoolExecutor(1, thread_name_prefix="memwal-newer-rows")
"""Takes the newer sources' rows of a full read while its base is scanned."""


def _ahead(
    fn: Callable[[int, pa.RecordBatch], pa.RecordBatch], batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``fn(i, batch)`` of every batch, in order, computed on :data:`_KEEPERS` up to
    :data:`KEEP_AHEAD` batches ahead of the consumer (the copy of the kept rows and the
    membership tests release the GIL: they overlap with Lance decoding the next batches
    and with the consumer). Bounded memory: that many batches in flight."""
    pending: collections.deque[Future[pa.RecordBatch]] = collections.deque()
    try:
        for i, batch in enumerate(batches):
            pending.append(_KEEPERS.submit(fn, i, batch))
            if len(pending) > KEEP_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for left in pending:  # the consumer stopped early or a batch failed
            left.cancel()


_KEPT_ROWS_POOL = pa.system_memory_pool()
"""Where the kept base rows are copied: the system allocator, the one Lance's batches
come from, so each copy reuses the memory of the batches already dropped (Arrow's
default pool would take fresh pages for every one: measured on a 10M-row base in a new
process, 2.5-2.8 s against 3.6-5.7 s and 60 MB less at the peak). An unfiltered read
of the whole table of narrow columns (:meth:`_BaseFragment.whole`) copies every batch
there, dropped rows or not."""


def _either(mask: np.ndarray | None, more: np.ndarray) -> np.ndarray:
    """``mask | more`` (``more`` when there is no mask yet)."""
    if mask is None:
        return more
    mask |= more
    return mask


def _narrow(schema: pa.Schema, columns: Sequence[str]) -> bool:
    """Whether ``columns`` are all cheap to decode for every row (no lists, vectors,
    structs or binary values: what late materialization saves a selective filter)."""
    for name in columns:
        t = schema.field(name).type
        while isinstance(t, pa.BaseExtensionType):  # a tensor, a bfloat16: as stored
            t = t.storage_type
        if pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return False
    return True


def _no_columns(rows: int, chunk: int = 1 << 20) -> Iterator[pa.RecordBatch]:
    """``rows`` rows of no column, in batches of at most ``chunk`` rows."""
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        yield pa.RecordBatch.from_pydict({"_": pa.nulls(n)}).select([])


def _drop(batch: pa.RecordBatch, mask: np.ndarray) -> pa.RecordBatch:
    """``batch`` without the rows where ``mask`` is true."""
    kept: pa.RecordBatch = pc.filter(batch, pa.array(~mask), memory_pool=_KEPT_ROWS_POOL)
    return kept


class _NewerFragment:
    """Newest live rows of the flushed generations and MemTables."""

    def __init__(self, state: _QueryState) -> None:
        self.state = state

    def scanner(
        self,
        schema: pa.Schema | None = None,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        batch_size: int | None = None,
        **_: Any,
    ) -> _Scanner:
        out_schema = _output_schema(self.state.dataset.schema, columns)
        return _Scanner(out_schema, self._batches(out_schema, filter, batch_size))

    def _batches(
        self, out_schema: pa.Schema, filter: pc.Expression | None, batch_size: int | None
    ) -> Iterator[pa.RecordBatch]:
        f = self.state.filter_for(filter)
        view = self.state.view_for(f)
        if len(view.winners) == 0:
            return
        live = view.live(list(out_schema.names), f.local, f.columns)
        if live.num_rows == 0:
            return
        for batch in live.to_batches(max_chunksize=batch_size or 8192):
            yield _project(batch, out_schema)


def _project(
    batch: pa.RecordBatch, out_schema: pa.Schema, generation: int | None = None
) -> pa.RecordBatch:
    arrays = []
    for f in out_schema:
        if f.name == GEN_COLUMN and generation is not None:
            arrays.append(pa.repeat(pa.scalar(generation, pa.uint64()), batch.num_rows))
            continue
        col = batch.column(f.name)
        arrays.append(col if col.type == f.type else col.cast(f.type))
    if not arrays:
        return pa.RecordBatch.from_pydict({"_": pa.nulls(batch.num_rows)}).select([])
    return pa.RecordBatch.from_arrays(arrays, schema=out_schema)


class MemWalDataset(pads.Dataset):
    """A MemWAL table as a ``pyarrow.dataset.Dataset`` DataFusion can register.

    Obtain one from :meth:`MemWalTable.provider`. Every DataFusion query re-resolves the
    sources, so a registered table always shows the newest data its consistency mode
    allows. See the module docstring for how filters stay correct.

    Parameters
    ----------
    table : Catalog
    consistency : str
        ``"latest"`` (default: region manifests + writers' MemTables + every region's
        durable unflushed WAL entries), ``"strong"`` (without the WAL entries) or
        ``"eventual"`` (region snapshots in the MemWAL index).
    writers : list of RegionWriter, optional
        In-process writers whose unflushed MemTables are read too.
    meta_columns : bool
        Add ``_gen`` (0 for the base table) and ``_rowaddr`` columns.
    base_partitions : int
        How many DataFusion partitions share the base table's fragments.
    max_staleness : float, optional
        ``eventual``: seconds after which a region snapshot is too old and the region
        manifests are read instead (default
        :data:`memwal_query.read.view.DEFAULT_MAX_STALENESS`).
    as_of : int, datetime or str, optional
        Time travel: the table as it was at that base version or moment
        (:func:`memwal_query.read.view.resolve_as_of`).
    """

    def __init__(
        self,
        table: Catalog,
        consistency: str = view.DEFAULT_CONSISTENCY,
        writers: Sequence[RegionWriter] | None = None,
        meta_columns: bool = False,
        base_partitions: int = 2,
        max_staleness: float | None = None,
        as_of: Any = None,
    ) -> None:
        if consistency not in view.CONSISTENCY_MODES:
            from memwal_query.exceptions import MemWalError

            raise MemWalError(
                f"consistency must be one of {view.CONSISTENCY_MODES}, got {consistency!r}"
            )
        self.table = table
        self.consistency = consistency
        self.max_staleness = max_staleness
        self.as_of = as_of
        self.writers = list(writers or [])
        self.meta_columns = meta_columns
        self.base_partitions = max(1, base_partitions)
        self._schema = pa.schema(
            [pa.field(f.name, f.type, f.nullable) for f in table.schema]
            + (META_FIELDS if meta_columns else [])
        )
        self.last_plan: view.ReadPlan | None = None

    @property
    def schema(self) -> pa.Schema:
        """Table columns (plus ``_gen``/``_rowaddr`` with ``meta_columns``)."""
        return self._schema

    def scanner(
        self, columns: Sequence[str] | None = None, filter: pc.Expression | None = None, **_: Any
    ) -> _Scanner:
        """A scanner over the deduplicated view (also usable without DataFusion: DuckDB
        and Polars call it).

        Sources are resolved when batches are first requested (DataFusion calls this
        method only for the projected schema). The partitions are read concurrently, as
        DataFusion would (:func:`memwal_query.read.parallel.concurrent_streams`: a thread
        each, a few batches ahead, or as far ahead as they go for the scanner's
        ``to_table()``), and returned one after the other.

        Parameters
        ----------
        columns : list of str, optional
            Output columns (default: all).
        filter : pyarrow.compute.Expression, optional
            Evaluated on the newest version of each key.
        **_
            Other ``pyarrow.dataset`` scanner options, accepted and ignored.

        Returns
        -------
        Scanner
            Has ``projected_schema``, ``to_reader()``, ``to_batches()``,
            ``to_table()`` and ``count_rows()``, as a ``pyarrow.dataset.Scanner``.
        """
        out_schema = _output_schema(self._schema, columns)

        def stream(frag: _BaseFragment | _NewerFragment) -> Callable[[], Iterator[pa.RecordBatch]]:
            return lambda: frag.scanner(self._schema, columns=columns, filter=filter).to_batches()

        def batches(depth: int | None = 2) -> Iterator[pa.RecordBatch]:
            frags = self.get_fragments(filter)
            yield from parallel.concurrent_streams([stream(f) for f in frags], depth)

        # to_table keeps every batch: no partition waits for the ones before it
        return _Scanner(out_schema, batches(), whole=lambda: batches(None))

    def check(self) -> view.ReadPlan:
        """Resolve the sources now and return the plan.

        Returns
        -------
        ReadPlan
            The regions, generations and base version a query would read.

        Raises
        ------
        MemWalError
            The typed error (e.g. ``ManifestCorruptError``) that a query would
            otherwise surface wrapped by DataFusion.
        """
        plan = view.resolve(
            self.table,
            self.consistency,
            self.writers,
            max_staleness=_staleness(self.max_staleness),
            as_of=self.as_of,
        )
        self.last_plan = plan
        return plan

    def get_fragments(self, filter: pc.Expression | None = None) -> list[Any]:
        """Resolve the sources now and split the work into partitions.

        Parameters
        ----------
        filter : pyarrow.compute.Expression, optional
            Evaluated on the newest version of each key.

        Returns
        -------
        list
            Partitions, each scannable on its own; together they hold each live row
            once.
        """
        state = _QueryState(self, filter)
        self.last_plan = state.plan
        lance_frags = state.plan.base.get_fragments()
        n = min(self.base_partitions, max(1, len(lance_frags)))
        shares: list[list[Any]] = [lance_frags[i::n] for i in range(n)]
        # a scan of no column takes the whole base's count from the first part
        parts: list[Any] = [
            _BaseFragment(state, share, counts=i == 0) for i, share in enumerate(shares) if share
        ]
        if not parts:
            parts.append(_BaseFragment(state, None))
        parts.append(_NewerFragment(state))
        return parts

    def to_table(
        self, columns: Sequence[str] | None = None, filter: pc.Expression | None = None, **_: Any
    ) -> pa.Table:
        """The deduplicated view as one table.

        Without a filter, the base rows are read by one Lance scan whose batches lose
        their overwritten rows as they come (:meth:`_BaseFragment.whole`) while the
        newer rows are taken from their deduplicated view; otherwise the partitions are
        scanned as DataFusion would (:meth:`scanner`). Base rows come first, then the
        newer ones (the order of base fragments may differ between the two routes).

        Parameters
        ----------
        columns : list of str, optional
            Output columns (default: all).
        filter : pyarrow.compute.Expression, optional
            Evaluated on the newest version of each key.
        **_
            Other ``pyarrow.dataset`` options, accepted and ignored.

        Returns
        -------
        pa.Table
        """
        out_schema = _output_schema(self._schema, columns)
        if _as_expression(filter) is None and set(out_schema.names) - {GEN_COLUMN, ROWADDR_COLUMN}:
            got = self._whole(out_schema)
            if got is not None:
                return got
        return self.scanner(columns=columns, filter=filter).to_table()

    def _whole(self, out_schema: pa.Schema) -> pa.Table | None:
        """The unfiltered view as one table: one Lance scan of the base (overwritten
        rows dropped per batch) and the newer rows, or None when the base scan cannot
        be whole."""
        state = _QueryState(self, None)
        self.last_plan = state.plan
        state.rows_next = any(c not in self.table.primary_key for c in out_schema.names)
        base_part = _BaseFragment(state, None)
        if not base_part.can_be_whole(out_schema):
            return None
        # the newer rows are taken on another thread while the base is scanned
        newer_part = _NewerFragment(state).scanner(columns=out_schema.names)
        newer_rows = _NEWER_ROWS.submit(newer_part.to_table)
        base = base_part.whole(out_schema)
        newer = newer_rows.result()
        assert base is not None  # can_be_whole
        return pa.concat_tables([base, newer]) if newer.num_rows else base

    def count_rows(self, filter: pc.Expression | None = None, **_: Any) -> int:
        """Number of live rows (without a filter: no row read, see
        :meth:`_QueryState.count`).

        Parameters
        ----------
        filter : pyarrow.compute.Expression, optional
            Count only the live rows it keeps.
        **_
            Other ``pyarrow.dataset`` options, accepted and ignored.

        Returns
        -------
        int
        """
        if _as_expression(filter) is not None:
            return self.to_table(columns=[], filter=filter).num_rows
        state = _QueryState(self, None)
        self.last_plan = state.plan
        with sources.reading_base(self.table, state.plan.base):
            return state.count()

    def explain(self) -> str:
        """Sources of the last resolved query (regions, generations, pruned regions)."""
        if self.last_plan is None:
            self.get_fragments(None)
        assert self.last_plan is not None
        return self.last_plan.describe()

    def __repr__(self) -> str:
        return f"MemWalDataset({self.table.uri!r}, consistency={self.consistency!r})"
