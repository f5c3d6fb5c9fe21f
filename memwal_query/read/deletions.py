"""Scanning base fragments that carry deletion files: read the deleted rows too and drop
them with the reader's own mask.

Lance turns a fragment's deletion vector into the list of row ranges between deleted
rows and decodes each range on its own: a fragment with rows deleted at random (what a
merge of random-key upserts leaves on every fragment) becomes tens of thousands of
ranges of a few rows each, and its scan costs 2-4x a clean fragment's. Asked for the
deleted rows as well (``include_deleted_rows``), Lance decodes every fragment as one
range and marks the deleted rows with a null ``_rowid``; the reader drops them with
the same boolean mask (and the same copy) that drops the base rows newer sources
overwrote. Range deletes, which leave few runs of deleted rows, stay on Lance's path
(:func:`reads_deleted`). Lance still reads every deletion file to mark the rows, so a
missing or damaged one is an error, never a longer answer. A fragment the process saw
before it had a deletion file is scanned as that clean twin instead, and its deleted
rows dropped by address (:class:`CleanFragments`, :func:`deleted_flags`). Measurements:
``docs/architecture.md`` (the DataFusion provider, deletion files, clean twins).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_query.format.rowaddrs import roaring32_runs, roaring32_values
from memwal_query.read import exprtree
from memwal_query.storage.cache import LRUCache

ROWID_COLUMN = "_rowid"
"""The row-id column Lance adds (``with_row_id``); null on a deleted row when the scan
includes deleted rows."""

READ_DELETED_ROWS = True
"""False: every scan leaves fragments with deletion files to Lance's own path (what the
benchmarks compare against)."""

READ_DELETED_MAX_SHARE = 0.5
"""Without the deletion files' contents (:func:`reads_deleted` given no reader): a scan
reads the deleted rows of its fragments when they are at most this share of the
physical rows of the fragments with deletion files."""

RANGE_ROWS = 32
"""What one range of Lance's deletion path costs, in rows decoded (measured on a
1M-row fragment: ~1.3 us per range against ~0.04 us per row)."""

_RUNS: LRUCache[str, int] = LRUCache(4096)
"""Runs of deleted rows per deletion file read (deletion files are immutable: keyed by
table URI and path)."""


def reads_deleted(
    fragments: Iterable[Any],
    read: Callable[[str], bytes] | None = None,
    table: str = "",
    map_reads: Callable[[Callable[[str], int | None], list[str]], list[int | None]] | None = None,
) -> bool:
    """Whether a scan of ``fragments`` (Lance fragments) should include their deleted rows
    and drop them itself.

    Parameters
    ----------
    fragments : iterable of lance.LanceFragment
        The fragments the scan reads.
    read : callable, optional
        Reads a deletion file (its path relative to the table). With it, the deleted
        rows are read when Lance's ranges would cost more than decoding them and
        copying the kept rows: ``runs * RANGE_ROWS > deleted + live / 2``, ``runs``
        the runs of consecutive deleted rows in the deletion files (cached per file).
        A file is read only when the metadata does not decide: a fragment's runs are
        at least 1 and at most ``min(deleted, live + 1)``, so sparse deletes stay on
        Lance's path and tiny fragments read their deleted rows without any file read.
        A range delete leaves few runs and stays on Lance's path; deletes at random
        keys leave about one run per deleted row. A deletion file it cannot read or
        decode leaves the scan to Lance (which reports it). Without ``read``, only the
        metadata: the deleted rows are at most :data:`READ_DELETED_MAX_SHARE` of the
        fragments with deletion files.
    table : str
        The table's URI (with ``read``: what the runs read are cached under, with the
        file's path).
    map_reads : callable, optional
        ``map_reads(fn, paths)``: ``fn`` of each path, in order (an object store's
        reads run concurrently this way); default in this thread, one after another.

    Returns
    -------
    bool
        False when no fragment has a deletion file.
    """
    if not READ_DELETED_ROWS:
        return False
    deleted = physical = least = most = 0
    unread: list[str] = []
    for fragment in fragments:
        n = fragment.num_deletions
        if not n:
            continue
        rows = fragment.physical_rows
        deleted += n
        physical += rows
        if read is None:
            continue
        path = fragment.deletion_file()
        if path is None:
            return False
        hit = _RUNS.get(_key(table, path))
        if hit is not None:
            least += hit
            most += hit
        else:  # runs of deleted rows are separated by live ones
            least += 1
            most += max(1, min(n, rows - n + 1))
            unread.append(path)
    if not deleted:
        return False
    if read is None:
        return deleted <= physical * READ_DELETED_MAX_SHARE
    worth = deleted + (physical - deleted) // 2
    if most * RANGE_ROWS <= worth or least * RANGE_ROWS > worth:
        return least * RANGE_ROWS > worth  # decided without reading a file
    found = (map_reads or _one_by_one)(lambda p: _runs(table, p, read), unread)
    if any(r is None for r in found):
        return False
    runs = least - len(unread) + sum(r for r in found if r is not None)
    return runs * RANGE_ROWS > worth


def _one_by_one(fn: Callable[[str], int | None], paths: list[str]) -> list[int | None]:
    return [fn(p) for p in paths]


def _key(table: str, path: str) -> str:
    return f"{table}\x00{path}"


def _runs(table: str, path: str, read: Callable[[str], bytes]) -> int | None:
    """Runs of consecutive deleted rows in the deletion file ``path`` of ``table`` (a
    Roaring bitmap or an Arrow IPC file of row offsets), or None when it cannot be read
    or decoded."""
    key = _key(table, path)
    hit = _RUNS.get(key)
    if hit is None:
        try:
            data = read(path)
            if path.endswith(".arrow"):
                rows = pa.ipc.open_file(pa.BufferReader(data)).read_all()
                offsets = np.sort(rows.column(0).to_numpy().astype(np.int64))
                hit = int(len(offsets) > 0) + int(np.count_nonzero(np.diff(offsets) != 1))
            else:
                hit = roaring32_runs(data)[1]
        except Exception:  # noqa: BLE001 - Lance's own read reports a bad file, typed
            return None  # not cached: the next scan asks again
        _RUNS.put(key, hit)
    return hit


MAX_TWIN_SOURCES = 4
"""Most base versions whose clean fragments :data:`TWINS` keeps (each holds its
dataset's manifest in memory); the least recently used goes first."""

Signature = tuple[int, tuple[tuple[Any, ...], ...]]
"""A fragment's physical rows and data files (path, fields, columns, format version)."""


def signature(fragment: Any) -> Signature:
    """What makes two Lance fragments the same rows whatever their deletion files: the
    physical rows and every data file (its path, field ids, columns and file version).
    Data file names are unique, so equal signatures mean the same files."""
    md = fragment.metadata
    files = tuple(
        (
            d.path,
            tuple(d.fields),
            tuple(d.column_indices),
            d.file_major_version,
            d.file_minor_version,
            d.base_id,
        )
        for d in md.files
    )
    return int(md.physical_rows), files


class CleanFragments:
    """The fragments a process has seen without a deletion file, per table URI and
    fragment id, from at most ``max_sources`` base versions: a fragment that has since
    been given a deletion file (a merge replaced some of its rows) is scanned as its
    clean *twin*, the same data files with no deletion file, and its deleted rows are
    dropped by the reader (:func:`deleted_flags`). Lance then plans a scan of it as of
    a clean fragment (a plain scan; with a filter, the filter's columns first and the
    other columns of the matching rows only), where its own scan of a fragment with
    rows deleted at random decodes it range by range, and a scan of its deleted rows
    too costs more and, filtered, decodes every column of every row. Only the twin's
    metadata is used: its data files are the current
    fragment's, checked by :func:`signature` on every use. A twin keeps the Lance
    dataset object of the version it was seen in alive (its manifest, not its data),
    hence the bound on versions."""

    def __init__(self, max_sources: int = MAX_TWIN_SOURCES) -> None:
        self.max_sources = max_sources
        self._lock = threading.Lock()
        # (table, version) -> {fragment id: fragment}, least recently used first
        self._sources: OrderedDict[tuple[str, int], dict[int, Any]] = OrderedDict()
        self._where: dict[tuple[str, int], tuple[str, int]] = {}  # (table, id) -> source
        self._noted: LRUCache[tuple[str, int], bool] = LRUCache(256)

    def note(self, table: str, version: int, fragments: Callable[[], Iterable[Any]]) -> None:
        """Remember the fragments of version ``version`` of ``table`` that have no deletion
        file and are not known yet (``fragments()`` is called once per version)."""
        if self._noted.get((table, version)):
            return
        self._noted.put((table, version), True)  # two threads may both note: the same
        clean = [f for f in fragments() if not f.num_deletions]
        with self._lock:
            source = (table, version)
            kept = self._sources.get(source, {})
            for f in clean:
                if (table, f.fragment_id) not in self._where:
                    kept[f.fragment_id] = f
                    self._where[(table, f.fragment_id)] = source
            if not kept:
                return
            self._sources[source] = kept
            self._sources.move_to_end(source)
            while len(self._sources) > self.max_sources:
                (uri, _), gone = self._sources.popitem(last=False)
                for fragment_id in gone:
                    self._where.pop((uri, fragment_id), None)

    def twin(self, table: str, fragment: Any) -> Any | None:
        """The clean fragment seen with the same data files as ``fragment`` (a fragment of
        ``table``), or None."""
        key = (table, fragment.fragment_id)
        with self._lock:
            source = self._where.get(key)
            if source is None:
                return None
            twin = self._sources[source][fragment.fragment_id]
            self._sources.move_to_end(source)
        if signature(fragment) == signature(twin):
            return twin
        with self._lock:  # other data files now (new columns, a table made anew)
            if self._where.get(key) == source:
                del self._where[key]
                kept = self._sources[source]
                kept.pop(fragment.fragment_id, None)
                if not kept:
                    del self._sources[source]
        return None

    def clear(self) -> None:
        """Forget every fragment."""
        with self._lock:
            self._sources.clear()
            self._where.clear()
            self._noted.clear()


TWINS = CleanFragments()
"""The process's clean fragments (:class:`CleanFragments`)."""

_DELETED: LRUCache[str, np.ndarray] = LRUCache(
    4096,
    1 << 30,
    sizeof=lambda flags: flags.nbytes,
    name="deleted_base_rows",
    keep_newest=False,
)
"""The deleted rows of each deletion file decoded (a flag per physical row of its
fragment; deletion files are immutable: keyed by table URI and path)."""


def deleted_flags(table: str, fragment: Any, read: Callable[[str], bytes]) -> np.ndarray | None:
    """The deleted rows of ``fragment`` (a Lance fragment of ``table`` with a deletion
    file): a boolean per physical row, true where deleted, read from its deletion file (a
    Roaring bitmap or an Arrow IPC file of row offsets) with ``read`` (a path relative to
    the table) and cached; None when the file cannot be read or decoded or disagrees with
    the fragment's metadata (its scan is then left to Lance, which reports the file)."""
    path = fragment.deletion_file()
    if path is None:
        return None
    key = _key(table, path)
    hit = _DELETED.get(key)
    if hit is not None:
        return hit
    rows = fragment.physical_rows
    try:
        data = read(path)
        if path.endswith(".arrow"):
            column = pa.ipc.open_file(pa.BufferReader(data)).read_all().column(0)
            offsets = column.to_numpy().astype(np.int64)
        else:
            offsets = roaring32_values(data).astype(np.int64)
    except Exception:  # noqa: BLE001 - Lance's own read reports a bad file, typed
        return None
    if len(offsets) and (offsets.min() < 0 or offsets.max() >= rows):
        return None
    flags = np.zeros(rows, dtype=bool)
    flags[offsets] = True
    if int(np.count_nonzero(flags)) != fragment.num_deletions:
        return None
    return _DELETED.put(key, flags)


# Calls that evaluate without error whatever the values of their arguments (comparisons,
# boolean logic, set and pattern tests); any other call (arithmetic, casts of columns,
# functions) may fail on a value only a deleted row holds.
_TOTAL_CALLS = frozenset(
    {
        "equal",
        "not_equal",
        "less",
        "less_equal",
        "greater",
        "greater_equal",
        "and",
        "and_kleene",
        "and_not",
        "and_not_kleene",
        "or",
        "or_kleene",
        "xor",
        "invert",
        "is_in",
        "is_null",
        "is_valid",
        "is_nan",
        "is_finite",
        "is_inf",
        "true_unless_null",
        "match_like",
        "match_substring",
        "match_substring_regex",
        "starts_with",
        "ends_with",
    }
)


def total_filter(expr: Any) -> bool:
    """Whether the filter ``expr`` (a ``pyarrow.compute.Expression``) evaluates without
    error on any row: only comparisons, boolean logic, set and pattern tests of columns
    and literals (casts of literals too). A scan evaluating another filter never reads
    the deleted rows, which may hold values it fails on (a division by zero, a cast out
    of range) while the live rows do not.

    Parameters
    ----------
    expr : pyarrow.compute.Expression

    Returns
    -------
    bool
        False for an expression whose tree cannot be read.
    """
    node = exprtree.decode(expr)
    return node is not None and _total(node)


def _total(node: exprtree.Node) -> bool:
    if node[0] != "call":
        return True  # a field or a literal
    _, name, args, _ = node
    if name == "cast":
        return not exprtree.fields_of(node)
    return name in _TOTAL_CALLS and all(_total(a) for a in args)


POINT_INDEXES = frozenset({"BTree", "Bitmap"})
"""Scalar index types that answer an equality or ``IN`` filter with the matching rows
only (:func:`point_filter`)."""


def point_filter(expr: Any, indexed: Iterable[str]) -> bool:
    """Whether the filter ``expr`` selects rows by equality or ``IN`` on ``indexed``
    columns (a key lookup): a comparison ``column == literal`` or ``column.isin(...)``,
    a conjunction holding one, or a disjunction of them. Lance answers it through the
    index and decodes only the matching rows, so its deletion ranges cost nothing more
    and the scan need not read the deleted rows (nor the deletion files to decide).

    Parameters
    ----------
    expr : pyarrow.compute.Expression or None
    indexed : iterable of str
        Columns with a scalar index (:data:`POINT_INDEXES`) covering the scanned
        fragments.

    Returns
    -------
    bool
        False without a filter or when its tree cannot be read.
    """
    names = set(indexed)
    if expr is None or not names:
        return False
    node = exprtree.decode(expr)
    return node is not None and _point(node, names)


def _point(node: exprtree.Node, indexed: set[str]) -> bool:
    if node[0] != "call":
        return False
    _, name, args, _ = node
    if name in ("and", "and_kleene"):
        return any(_point(a, indexed) for a in args)
    if name in ("or", "or_kleene"):
        return all(_point(a, indexed) for a in args)
    if name == "is_in":
        return args[0][0] == "field" and args[0][1] in indexed
    if name == "equal":
        kinds = sorted(a[0] for a in args)
        return kinds == ["field", "lit"] and any(a[0] == "field" and a[1] in indexed for a in args)
    return False


def deleted_rows(batch: pa.RecordBatch) -> np.ndarray | None:
    """The deleted rows of a batch read with ``include_deleted_rows`` (a boolean mask, true
    where ``_rowid`` is null), or None when the batch holds none."""
    ids = batch.column(ROWID_COLUMN)
    if not ids.null_count:
        return None
    return np.asarray(ids.is_null())


def live_values(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """``column`` (``_rowid`` or ``_rowaddr``) of ``batch`` as uint64, the deleted rows'
    nulls read as 0 (the caller drops those rows whatever the value)."""
    values = batch.column(column)
    if values.null_count:
        values = values.fill_null(0)
    return values.to_numpy().astype(np.uint64, copy=False)


def scan(
    base: Any, columns: list[str], **options: Any
) -> Iterator[tuple[pa.RecordBatch, np.ndarray | None]]:
    """The batches of a scan of ``base`` (a Lance dataset) reading ``columns`` with
    Lance scanner ``options``, each with the mask of its deleted rows (None when it
    holds none): when :func:`reads_deleted` says so, the deleted rows are read and
    the caller drops them (by the mask), else Lance leaves them out itself."""
    fragments = options.get("fragments")
    with_deleted = reads_deleted(base.get_fragments() if fragments is None else fragments)
    if with_deleted:
        options = {**options, "with_row_id": True, "include_deleted_rows": True}
    for batch in base.scanner(columns=columns, **options).to_batches():
        yield batch, deleted_rows(batch) if with_deleted else None
