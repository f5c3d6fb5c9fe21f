"""Reading the rows of a read's sources: flushed generations (cached), MemTables, and
the base table's errors.

A flushed generation is read from its rows sidecar (:mod:`memwal_query.format.rowfile`)
or its Lance table, conformed to the table's current schema, and its decoded columns
are kept in :data:`GENERATION_CACHE` (generations are immutable). Which generations and
MemTables a read sees is the pinned view's job (:func:`memwal_query.read.view.resolve`);
deduplicating them is :mod:`memwal_query.read.newer`'s.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import lance
import numpy as np
import pyarrow as pa

from memwal_query.exceptions import (
    BaseVersionGoneError,
    CorruptFileError,
    GenerationGoneError,
    MemWalError,
    ObjectNotFoundError,
    StorageError,
    without_source_locations,
)
from memwal_query.format.index import manifest_path
from memwal_query.format.schema import (
    GEN_COLUMN,
    ROWADDR_COLUMN,
    TOMBSTONE,
    cache_key,
    primary_key_columns,
)
from memwal_query.read.view import GenerationRef
from memwal_query.storage.cache import LRUCache
from memwal_query.storage.errors import store_error
from memwal_query.storage.io import FileIO, in_chunks, join
from memwal_query.write.memtable import MemTableSnapshot

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


def base_version_gone(table: Catalog, version: int) -> bool:
    """Whether version ``version`` of the base table was cleaned up (its manifest is gone)."""
    try:
        manifest_path(table.io, table.uri, version)
    except ObjectNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - cannot tell: report the original error
        return False
    return False


@contextlib.contextmanager
def reading_base(table: Catalog, base: lance.LanceDataset) -> Iterator[None]:
    """Turn an error reading ``base`` into a typed one.

    :class:`BaseVersionGoneError` when that version was cleaned up meanwhile (Lance
    reports the deleted data file as a plain OSError or ArrowInvalid "Not found");
    :class:`ObjectNotFoundError`, :class:`StorageError` or :class:`CorruptFileError`
    naming the file when a fragment's deletion file is missing, cannot be fetched from
    the store or cannot be decoded (:func:`deletion_file_error`); any other error
    propagates unchanged.

    Raises
    ------
    BaseVersionGoneError, ObjectNotFoundError, StorageError, CorruptFileError
    """
    try:
        yield
    except MemWalError:
        raise
    except Exception as e:
        if not base_version_gone(table, base.version):
            typed = deletion_file_error(base, e)
            if typed is None:
                raise
            raise typed from e
        raise BaseVersionGoneError(
            f"{table.uri}: base version {base.version} was cleaned up while it was read "
            f"(run the read again): {e}"
        ) from e


def deletion_file_error(base: lance.LanceDataset, error: Exception) -> MemWalError | None:
    """The typed error for ``error``, raised by Lance while reading ``base``, when a
    fragment's deletion file is at fault: :class:`ObjectNotFoundError` when it is
    missing, :class:`StorageError` when the store fails to serve it (5xx answers or
    dropped connections past the client's retries, denied credentials: the file may
    well be intact, the read can be run again), :class:`CorruptFileError` when it
    cannot be decoded, each naming the file and its fragment; None when no deletion
    file is at fault.

    Lance names a missing file and a damaged bitmap file in its message, not a damaged
    Arrow IPC one: when the message is about deletions but names no file, each
    fragment's deletion file is read again on its own (only on this error path) to
    find the one that fails."""
    text = str(error)
    if "_deletions/" not in text and "deletion" not in text:
        return None
    for fragment in base.get_fragments():
        path = fragment.deletion_file()
        if path is None:
            continue
        if path not in text:
            try:  # opening the fragment reads its deletion vector, no data
                fragment.scanner(columns=[], with_row_id=True, limit=1).to_table()
                continue
            except Exception as probe:  # noqa: BLE001 - the probe's failure is the answer
                text = str(probe)
        where = f"{base.uri.rstrip('/')}/{path}"
        what = f"deletion file of fragment {fragment.fragment_id} (base version {base.version})"
        if "Not found" in text or "not found" in text:
            return ObjectNotFoundError(f"{where}: {what} is missing")
        if "LanceError(IO)" in text and "corrupt" not in text:  # the store, not the file
            reason = store_error(without_source_locations(text).removeprefix("External error: "))
            return StorageError(f"{where}: {what} cannot be fetched: {reason}")
        return CorruptFileError(where, f"{what} cannot be read: {without_source_locations(text)}")
    return None


# -- reading flushed generations ---------------------------------------------------------
def _columns_nbytes(columns: dict[str, pa.ChunkedArray]) -> int:
    # the buffers' whole sizes (10x cheaper than ``nbytes``, which walks offsets; never
    # less than what is held)
    return sum(c.get_total_buffer_size() for c in columns.values())


class _GenerationCache(LRUCache[str, dict[str, pa.ChunkedArray]]):
    """Process-wide LRU of decoded generation columns (generations are immutable),
    bounded by bytes (default 1 GiB).

    Per generation directory: its ``_rowaddr`` and the columns read so far, each read
    from Lance at most once and only when a query needs it (projection pushdown: a query
    of ``id, val`` never reads a generation's other columns); an empty entry for a
    generation read without keeping its columns (an unfiltered read keeps only the
    newest rows it took of them).
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        super().__init__(
            1 << 20, max_bytes=max_bytes, sizeof=_columns_nbytes, name="generation_columns"
        )

    def columns(self, uri: str) -> dict[str, pa.ChunkedArray]:
        """The columns cached for ``uri`` (a copy; empty when none)."""
        return dict(self.get(uri) or {})

    def add(self, uri: str, columns: dict[str, pa.ChunkedArray]) -> dict[str, pa.ChunkedArray]:
        """Cache ``columns`` of ``uri`` too; return every column now cached for it."""
        merged = {**columns, **(self.get(uri) or {})}
        self.put(uri, merged)
        return dict(merged)


GENERATION_CACHE = _GenerationCache()


def read_generation(
    ref: GenerationRef,
    schema: pa.Schema,
    storage_options: dict[str, str] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """Rows of a flushed generation with ``_gen`` and ``_rowaddr``, in write order.

    Conformed to ``schema`` + ``_tombstone`` (columns added to the base table after the
    generation was written read as NULL; a missing ``_tombstone`` as false). With
    ``columns``, only those (names of that conformed schema) are returned, and only
    those are read from Lance. Raises GenerationGoneError when missing.
    """
    out = _read_generation(ref, schema, storage_options, columns, lance_ok=True)
    assert out is not None
    return out


def parallel_reads(uri: str, storage_options: dict[str, str] | None) -> bool:
    """Whether reading many generations at ``uri`` finishes sooner on several threads
    (:attr:`memwal_query.storage.io.FileIO.parallel_requests`: object stores yes, local
    file systems no; Lance reads, which release the GIL, always do)."""
    return bool(file_io(uri, storage_options).parallel_requests)


def _read_generation(
    ref: GenerationRef,
    schema: pa.Schema,
    storage_options: dict[str, str] | None,
    columns: Sequence[str] | None,
    lance_ok: bool,
    keep: bool = True,
    key_sidecar: bool = True,
) -> pa.Table | None:
    target = read_schema(schema)

    def add(uri: str, columns: dict[str, pa.ChunkedArray]) -> dict[str, pa.ChunkedArray]:
        if keep:
            return GENERATION_CACHE.add(uri, columns)
        return {**columns, **GENERATION_CACHE.columns(uri)}

    names = target.names if columns is None else [c for c in columns if c in target.names]
    cached = GENERATION_CACHE.columns(ref.uri)
    missing = [c for c in names if c not in cached and c not in (GEN_COLUMN, ROWADDR_COLUMN)]
    keys_only = key_sidecar and _keys_only(schema, names)
    if (missing or ROWADDR_COLUMN not in cached) and not cached and keys_only:
        # keys and tombstones only: the keys sidecar holds them (when there is one)
        keys = _keys_sidecar(ref, storage_options, target)
        if keys is not None and all(c in keys for c in missing):
            cached = add(ref.uri, keys)
            missing = []
    if missing or ROWADDR_COLUMN not in cached:
        side = _sidecar(ref, storage_options, target)
        if side is not None:
            cached = add(ref.uri, side)
            missing = [c for c in missing if c not in cached]
    if missing or ROWADDR_COLUMN not in cached:
        if not lance_ok:
            return None
        try:
            ds = lance.dataset(ref.uri, storage_options=storage_options or None)
            present = set(ds.schema.names)
            raw = ds.to_table(
                columns=[c for c in missing if c in present],
                with_row_address=ROWADDR_COLUMN not in cached,
            )
        except (ValueError, OSError, FileNotFoundError) as e:
            raise GenerationGoneError(
                f"generation {ref.generation} of region {ref.region_id} at {ref.uri} is "
                f"gone or unreadable: {e}"
            ) from e
        fresh = {c: raw.column(c) for c in raw.column_names}
        n = raw.num_rows if ROWADDR_COLUMN not in cached else len(cached[ROWADDR_COLUMN])
        for c in missing:
            if c not in present:  # written before the column existed
                t = target.field(c).type
                value = pa.scalar(False) if c == TOMBSTONE else pa.scalar(None, t)
                fresh[c] = pa.chunked_array([pa.repeat(value, n)], t)
        cached = add(ref.uri, fresh)
    n = len(cached[ROWADDR_COLUMN])
    arrays = []
    for name in names:
        f = target.field(name)
        if name == GEN_COLUMN:
            col = pa.chunked_array([pa.repeat(pa.scalar(ref.generation, pa.uint64()), n)])
        else:
            col = cached[name]
        arrays.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema([target.field(c) for c in names]))


READ_TASKS = 4
"""How many tasks read the generations of a query that are not cached yet."""
_GENERATION_READERS = ThreadPoolExecutor(READ_TASKS, thread_name_prefix="memwal-generations")
"""The threads that read generations (:func:`map_generations`, :func:`read_generations`)."""
T = TypeVar("T")


def map_generations(
    fn: Callable[[GenerationRef], T],
    refs: Sequence[GenerationRef],
    storage_options: dict[str, str] | None = None,
) -> list[T]:
    """``fn(ref)`` of each generation, in order: in this thread on a local file system,
    in a few concurrent tasks on an object store, where each read is mostly a round
    trip (:func:`parallel_reads`)."""
    if len(refs) < 2 or not parallel_reads(refs[0].uri, storage_options):
        return [fn(ref) for ref in refs]
    return in_chunks(_GENERATION_READERS, fn, refs, READ_TASKS)


def map_reads(fn: Callable[[Any], T], items: Sequence[Any], io: FileIO) -> list[T]:
    """``fn(item)`` of each item, in order, each reading from ``io``: as
    :func:`map_generations` (concurrent tasks on an object store only)."""
    if len(items) < 2 or not io.parallel_requests:
        return [fn(x) for x in items]
    return in_chunks(_GENERATION_READERS, fn, items, READ_TASKS)


def read_generations(
    refs: Sequence[GenerationRef],
    schema: pa.Schema,
    storage_options: dict[str, str] | None = None,
    columns: Sequence[str] | None = None,
    check: Callable[[pa.Table], object] | None = None,
    keep: bool = True,
    key_sidecar: bool = True,
) -> list[pa.Table]:
    """:func:`read_generation` of every generation of ``refs``, in that order.

    Generations not cached yet (a cold start: one rows sidecar each, or a Lance table
    when they have none) are read concurrently in a few tasks on an object store; on a
    local file system the cached columns and sidecars are read in this thread (threads
    would only contend for the GIL, and cost their own start on a cold start) and only
    the Lance tables, which release the GIL, in tasks. ``check`` sees each table as it
    is read (it may raise to stop the reading). An error of any generation
    (:class:`GenerationGoneError`) is raised. ``keep=False``: what is read is not added
    to :data:`GENERATION_CACHE` (a caller that takes a few rows of many generations
    and keeps those). ``key_sidecar=False``: key columns are never read from a keys
    sidecar (their rows sidecar or Lance table instead).
    """

    def read(g: GenerationRef, lance_ok: bool = True) -> pa.Table | None:
        t = _read_generation(g, schema, storage_options, columns, lance_ok, keep, key_sidecar)
        if t is not None and check is not None:
            check(t)
        return t

    local = bool(refs) and not parallel_reads(refs[0].uri, storage_options)
    got = [read(g, lance_ok=False) if local or GENERATION_CACHE.get(g.uri) else None for g in refs]
    todo = [i for i, t in enumerate(got) if t is None]
    cold = in_chunks(_GENERATION_READERS, read, [refs[i] for i in todo], READ_TASKS)
    for i, t in zip(todo, cold):
        got[i] = t
    out = [t for t in got if t is not None]
    if len(out) != len(refs):  # never: each read returns a table or raises
        raise AssertionError(f"{len(refs) - len(out)} generation(s) not read")
    return out


def generation_columns(
    refs: Sequence[GenerationRef],
    schema: pa.Schema,
    names: Sequence[str],
    storage_options: dict[str, str] | None = None,
    keep: bool = True,
    sidecars: bool = True,
) -> tuple[pa.Table, np.ndarray]:
    """Columns ``names`` (of :func:`read_schema`) of every generation of ``refs``,
    concatenated in that order (zero-copy), and each generation's row count.

    The same table as ``pa.concat_tables(read_generations(refs, schema, ..., names))``
    at a fraction of its per-generation cost (a cold first query reads generations by
    the thousand): a cached generation costs a dictionary lookup, and when ``names``
    are key and meta columns only, the generations not cached yet are read from their
    region's keys file (one read per region) or their own keys sidecar
    (:mod:`memwal_query.format.keyfile`). The others (and generations without a
    readable keys sidecar) are read by :func:`read_generations` (rows sidecar, then
    Lance table). Raises GenerationGoneError when a generation is missing.

    ``keep=False``: keys read from a region keys file or a keys sidecar are not added
    to :data:`GENERATION_CACHE` (a caller that keeps what it derives from them: each
    region's file is then released as soon as its region is done).

    ``sidecars=False``: no keys sidecar is read; the keys of generations that no region
    keys file covers are read from their rows, not cached with ``keep=False`` (a caller
    that reads those rows next: a keys sidecar is never the only source of a full
    read's keys, which its rows would contradict).
    """
    target = read_schema(schema)
    names = [c for c in names if c in target.names]  # as read_generation's columns
    wanted = list(dict.fromkeys([*(c for c in names if c != GEN_COLUMN), ROWADDR_COLUMN]))
    keys_only = _keys_only(schema, names)

    def from_keys(ref: GenerationRef) -> dict[str, pa.ChunkedArray] | None:
        keys = _keys_sidecar(ref, storage_options, target)
        if keys is None or not all(c in keys for c in wanted):
            return None  # none, damaged, or of other key columns: read the rows instead
        return GENERATION_CACHE.add(ref.uri, keys) if keep else keys

    found: list[dict[str, pa.ChunkedArray] | None] = []
    for ref in refs:
        cached = GENERATION_CACHE.get(ref.uri)
        found.append(cached if cached is not None and all(c in cached for c in wanted) else None)
    todo = [i for i, cols in enumerate(found) if cols is None]
    if keys_only and todo:  # region keys files, keys sidecars (concurrently on a store)
        unread = [refs[i] for i in todo if not GENERATION_CACHE.get(refs[i].uri)]
        parts = _region_keys(unread, storage_options, target, wanted, keep)
        for i in todo:
            cached = parts.get(refs[i].uri) or GENERATION_CACHE.get(refs[i].uri)
            if cached is not None and all(c in cached for c in wanted):
                found[i] = cached
        todo = [i for i, cols in enumerate(found) if cols is None]
        unread = [refs[i] for i in todo if not GENERATION_CACHE.get(refs[i].uri)]
        keys: list[dict[str, pa.ChunkedArray] | None]
        if not sidecars:
            keys = [None] * len(unread)
        elif len(unread) > 1 and parallel_reads(unread[0].uri, storage_options):
            keys = in_chunks(_GENERATION_READERS, from_keys, unread, READ_TASKS)
        else:
            keys = [from_keys(ref) for ref in unread]
        by_uri = {ref.uri: cols for ref, cols in zip(unread, keys)}
        found = [by_uri.get(ref.uri) if cols is None else cols for ref, cols in zip(refs, found)]
        todo = [i for i, cols in enumerate(found) if cols is None]
    if todo:
        slow = read_generations(
            [refs[i] for i in todo],
            schema,
            storage_options,
            wanted,
            keep=keep or sidecars,
            key_sidecar=sidecars,
        )
        for i, t in zip(todo, slow):
            found[i] = {c: t.column(c) for c in wanted}
    got = [cols for cols in found if cols is not None]
    sizes = np.array([len(cols[ROWADDR_COLUMN]) for cols in got], np.int64)
    fields = [target.field(c) for c in names]
    columns = []
    for f in fields:
        if f.name == GEN_COLUMN:
            gens = np.repeat(np.array([g.generation for g in refs], np.uint64), sizes)
            columns.append(pa.chunked_array([pa.array(gens)], f.type))
            continue
        chunks = []
        for cols in got:
            col = cols[f.name]
            chunks.extend((col if col.type == f.type else col.cast(f.type)).chunks)
        columns.append(pa.chunked_array(chunks, f.type))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields)), sizes


GENERATIONS_WITHOUT_SIDECAR: LRUCache[str, bool] = LRUCache(1 << 16)
"""Generation directories known to have no (readable) rows sidecar."""
_FILE_IOS: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}


def file_io(uri: str, storage_options: dict[str, str] | None) -> Any:
    """The FileIO of ``uri``'s store (one per scheme and storage options, kept)."""
    from memwal_query.storage.factory import file_io_for

    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    key = (scheme, tuple(sorted((storage_options or {}).items())))
    io = _FILE_IOS.get(key)
    if io is None:
        io = _FILE_IOS.setdefault(key, file_io_for(uri, storage_options))
    return io


GENERATIONS_WITHOUT_KEYS: LRUCache[str, bool] = LRUCache(1 << 16)
"""Generation directories known to have no (readable) keys sidecar."""


def _sidecar(
    ref: GenerationRef, storage_options: dict[str, str] | None, target: pa.Schema
) -> dict[str, pa.ChunkedArray] | None:
    """Every column of a generation from its rows sidecar (:mod:`memwal_query.format.
    rowfile`; columns added to the table after the generation was written as NULL), or
    None when it has none, a damaged one or one whose row count is not its region
    manifest's (then the Lance table is read)."""
    t = read_rows_sidecar(ref.uri, storage_options)
    if t is None:
        return None
    from memwal_query.format.rowfile import ROWS_FILE

    if not _rows_agree(ref, t.num_rows, join(ref.uri, ROWS_FILE)):
        return None
    return _conformed_columns(t, target, target.names)


def _keys_sidecar(
    ref: GenerationRef, storage_options: dict[str, str] | None, target: pa.Schema
) -> dict[str, pa.ChunkedArray] | None:
    """The key columns, ``_tombstone`` and ``_rowaddr`` of a generation from its keys
    sidecar (:mod:`memwal_query.format.keyfile`), or None when it has none, a damaged
    one or one whose row count is not its region manifest's (then the rows sidecar or
    the Lance table is read)."""
    t = read_keys_sidecar(ref.uri, storage_options)
    if t is None:
        return None
    from memwal_query.format.keyfile import KEYS_FILE

    if not _rows_agree(ref, t.num_rows, join(ref.uri, KEYS_FILE)):
        return None
    return _key_columns(t, target)


def _key_columns(t: pa.Table, target: pa.Schema) -> dict[str, pa.ChunkedArray]:
    """The columns of a keys sidecar's table ``t`` (``_tombstone`` false when absent)."""
    names = [c for c in t.column_names if c in target.names]
    return _conformed_columns(t, target, list(dict.fromkeys([*names, TOMBSTONE])))


REGION_FILES_WITHOUT_KEYS: LRUCache[str, bool] = LRUCache(1 << 16)
"""Generation directories known to have no (readable) region keys file."""


def _region_keys(
    refs: Sequence[GenerationRef],
    storage_options: dict[str, str] | None,
    target: pa.Schema,
    wanted: Sequence[str],
    keep: bool = True,
) -> dict[str, dict[str, pa.ChunkedArray]]:
    """The keys of the generations of ``refs`` that their region's keys file covers
    (:func:`region_keys_parts`), by generation URI, also cached
    (:data:`GENERATION_CACHE`) with ``keep``; the others are read from their own
    sidecars by the caller."""
    out: dict[str, dict[str, pa.ChunkedArray]] = {}
    for uri, (keys, _) in region_keys_parts(refs, storage_options).items():
        cols = _key_columns(keys, target)
        if all(c in cols for c in wanted):
            out[uri] = GENERATION_CACHE.add(uri, cols) if keep else cols
    return out


def region_keys_parts(
    refs: Sequence[GenerationRef], storage_options: dict[str, str] | None = None
) -> dict[str, tuple[pa.Table, str]]:
    """The keys of the generations of ``refs`` that their region's keys file covers
    (:func:`memwal_query.format.keyfile.read_region`), by generation URI: each as its
    keys sidecar would hold it (key columns, ``_tombstone``, ``_rowaddr``; not cached),
    with the path of the file it was read from.

    Per region, the file of its newest generation among ``refs``, one read for all of
    them (a region with one generation among ``refs``: none, its own sidecar is as
    small). Only parts whose generation number and directory both match a generation
    of ``refs`` are taken; a generation missing from the answer is read from its own
    keys sidecar (or rows) by the caller, as are all of a region whose file is missing
    or damaged (a warning, once per file).
    """
    from memwal_query.format import keyfile

    by_region: dict[str, list[GenerationRef]] = {}
    for ref in refs:
        by_region.setdefault(ref.region_id, []).append(ref)

    def read(group: list[GenerationRef]) -> dict[str, tuple[pa.Table, str]]:
        newest = max(group, key=lambda g: g.generation)
        if REGION_FILES_WITHOUT_KEYS.get(newest.uri):
            return {}
        parts = keyfile.read_region(file_io(newest.uri, storage_options), newest.uri)
        if parts is None:
            REGION_FILES_WITHOUT_KEYS.put(newest.uri, True)
            return {}
        path = join(newest.uri, keyfile.REGION_KEYS_FILE)
        by_flush = {(p.generation, p.path): p for p in parts}
        out = {}
        for ref in group:
            part = by_flush.get((ref.generation, ref.uri.rstrip("/").rsplit("/", 1)[-1]))
            if part is not None and _rows_agree(ref, part.keys.num_rows, path):
                out[ref.uri] = (part.keys, path)
        return out

    groups = [g for g in by_region.values() if len(g) > 1]  # one generation: its sidecar
    if len(groups) > 1 and parallel_reads(groups[0][0].uri, storage_options):
        found = in_chunks(_GENERATION_READERS, read, groups, READ_TASKS)
    else:
        found = [read(group) for group in groups]
    return {uri: part for parts in found for uri, part in parts.items()}


def _rows_agree(ref: GenerationRef, rows: int, path: str) -> bool:
    """Whether a sidecar (``path``: a region keys file's part, a keys or rows sidecar)
    holds as many rows for ``ref`` as its region manifest records (unknown: yes); a
    warning naming ``path`` when not (the file is not used for it; the generation's
    other files are read instead)."""
    if ref.rows is None or ref.rows == rows:
        return True
    warnings.warn(
        f"{path}: {rows} rows of generation {ref.generation} where its region manifest "
        f"records {ref.rows}; reading that generation's other files instead",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def region_key_columns(
    refs: Sequence[GenerationRef],
    schema: pa.Schema,
    names: Sequence[str],
    storage_options: dict[str, str] | None = None,
) -> tuple[pa.Table, np.ndarray, np.ndarray | None] | None:
    """:func:`generation_columns` of one region's generations ``refs`` (oldest first;
    ``names``: key columns and ``_tombstone``) from the region keys file of the newest
    one as one table, when that file holds exactly those generations (numbers and
    directories, in that order; nothing cached), with the file's flags of the newest
    row of each key (:data:`memwal_query.format.keyfile.NEWEST_COLUMN`, None when it
    has none); None otherwise (then :func:`generation_columns`)."""
    from memwal_query.format import keyfile

    newest = refs[-1]
    if REGION_FILES_WITHOUT_KEYS.get(newest.uri):
        return None
    got = keyfile.read_region_table(file_io(newest.uri, storage_options), newest.uri)
    if got is None:
        REGION_FILES_WITHOUT_KEYS.put(newest.uri, True)
        return None
    t, parts = got
    held = [(p.generation, p.path) for p in parts]
    if held != [(r.generation, r.uri.rstrip("/").rsplit("/", 1)[-1]) for r in refs]:
        return None
    path = join(newest.uri, keyfile.REGION_KEYS_FILE)
    if not all(_rows_agree(r, p.keys.num_rows, path) for r, p in zip(refs, parts)):
        return None
    target = read_schema(schema)
    cols = _key_columns(t, target)
    if not all(c in cols for c in names):
        return None
    fields = [target.field(c) for c in names]
    arrays = [
        cols[f.name] if cols[f.name].type == f.type else cols[f.name].cast(f.type) for f in fields
    ]
    sizes = np.array([p.keys.num_rows for p in parts], np.int64)
    last_of_key = None
    if keyfile.NEWEST_COLUMN in t.column_names:
        flags = t.column(keyfile.NEWEST_COLUMN)
        if flags.type == pa.bool_() and flags.null_count == 0:
            last_of_key = flags.to_numpy()
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields)), sizes, last_of_key


def read_keys_sidecar(uri: str, storage_options: dict[str, str] | None = None) -> pa.Table | None:
    """A generation's keys sidecar as stored (key columns, ``_tombstone`` when written,
    ``_rowaddr``; rows in write order), not cached; None when it has none or a damaged
    one (then the caller reads :func:`read_generation`)."""
    from memwal_query.format import keyfile

    return _read_sidecar(uri, storage_options, keyfile.read, GENERATIONS_WITHOUT_KEYS)


def read_rows_sidecar(uri: str, storage_options: dict[str, str] | None = None) -> pa.Table | None:
    """A generation's rows sidecar as stored (the columns of the schema it was written
    with, ``_tombstone``, ``_rowaddr``; rows in write order), not cached; None when it
    has none or a damaged one (then the caller reads :func:`read_generation`)."""
    from memwal_query.format import rowfile

    return _read_sidecar(uri, storage_options, rowfile.read, GENERATIONS_WITHOUT_SIDECAR)


def _keys_only(schema: pa.Schema, names: Sequence[str]) -> bool:
    """Whether ``names`` are primary-key columns of ``schema`` and meta columns only
    (what a keys sidecar holds)."""
    keyish = {TOMBSTONE, GEN_COLUMN, ROWADDR_COLUMN, *primary_key_columns(schema)}
    return all(name in keyish for name in names)


def _read_sidecar(
    uri: str,
    storage_options: dict[str, str] | None,
    read: Callable[[Any, str], pa.Table | None],
    absent: LRUCache[str, bool],
) -> pa.Table | None:
    """``read(io, uri)`` of a sidecar, remembering in ``absent`` the generations that
    have none (or a damaged one: read once, warned about once)."""
    if absent.get(uri):
        return None
    t = read(file_io(uri, storage_options), uri)
    if t is None:
        absent.put(uri, True)
    return t


def _conformed_columns(
    t: pa.Table, target: pa.Schema, names: Sequence[str]
) -> dict[str, pa.ChunkedArray]:
    """Columns ``names`` (of ``target``) of a sidecar's table ``t``; those it lacks
    (added to the table after the generation was written) as NULL, ``_tombstone`` as
    false."""
    out = {c: t.column(c) for c in t.column_names if c in set(names)}
    for name in names:
        if name not in out and name != GEN_COLUMN:
            f = target.field(name)
            value = pa.scalar(False) if name == TOMBSTONE else pa.scalar(None, f.type)
            out[name] = pa.chunked_array([pa.repeat(value, t.num_rows)], f.type)
    return out


def memtable_rows(m: MemTableSnapshot, at: np.ndarray | None = None) -> pa.Table:
    """Rows of a MemTable snapshot with ``_gen`` and ``_rowaddr`` (= row index): all of
    them, or those at the row indexes ``at`` (ascending)."""
    t = m.to_table()
    if at is None:
        at = np.arange(t.num_rows, dtype=np.uint64)
    else:
        t = t.take(pa.array(at))
    gen = pa.repeat(pa.scalar(m.generation, pa.uint64()), t.num_rows)
    addr = pa.array(np.asarray(at, dtype=np.uint64))
    return t.append_column(GEN_COLUMN, gen).append_column(ROWADDR_COLUMN, addr)


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select/cast ``t`` to ``schema`` + ``_tombstone``/``_gen``/``_rowaddr``; missing = NULL."""
    target = read_schema(schema)
    if t.schema.equals(target, check_metadata=False):
        return t
    cols = []
    for f in target:
        if f.name in t.column_names:
            c = t.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=target)


_READ_SCHEMAS: dict[pa.Schema | bytes, pa.Schema] = {}
_READ_SCHEMAS_BY_SCHEMA_ID: dict[int, tuple[pa.Schema, pa.Schema]] = {}


def read_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` (every field nullable) + ``_tombstone``, ``_gen``, ``_rowaddr``: the
    schema of the rows read from the sources (cached per schema)."""
    # by identity first: hashing a schema costs more than reading a small generation
    known = _READ_SCHEMAS_BY_SCHEMA_ID.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    out = _READ_SCHEMAS.get(cache_key(schema))
    if out is None:
        fields = [pa.field(f.name, f.type, nullable=True) for f in schema]
        fields += [
            pa.field(TOMBSTONE, pa.bool_()),
            pa.field(GEN_COLUMN, pa.uint64()),
            pa.field(ROWADDR_COLUMN, pa.uint64()),
        ]
        out = _READ_SCHEMAS[cache_key(schema)] = pa.schema(fields)
    if len(_READ_SCHEMAS_BY_SCHEMA_ID) > 64:
        _READ_SCHEMAS_BY_SCHEMA_ID.clear()
    _READ_SCHEMAS_BY_SCHEMA_ID[id(schema)] = (schema, out)
    return out
