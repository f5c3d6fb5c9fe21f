"""The merger: flushed generations into the base table, in order, exactly once.

:func:`merge_region` merges one region's generations above its
``merged_generations`` entry in ascending order; :func:`merge_regions` and
:func:`merge` merge several regions, packing consecutive generations into as few
batches as :data:`DEFAULT_BATCH_ROWS` and :data:`DEFAULT_BATCH_BYTES` allow. A batch is
one Lance ``merge_insert`` commit carrying the upserts and the progress marker
(``merged_generations``) together, or on a large base with an integer key one
``Update`` commit of the merger's own followed by the marker's commit; each batch is
reduced to the last write per key first, so a deleted key is removed and a live key
holds its newest row.

Contract: a generation is merged once and never skipped, whichever other mergers run;
lost commit races are retried (at most ``max_retries`` per generation) on the latest
version; a region that fails does not stop the others, and :func:`merge` then raises
:class:`~memwal_query.exceptions.MergeFailedError` naming the failed regions.

How a batch is committed and why that is safe: docs/maintenance.md, "How a merge
commits".
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.commit import CommitConflictError as LanceCommitConflictError
from lance.mem_wal import CompactedSsTable

from memwal_query.exceptions import CommitConflictError, CorruptFileError, MergeFailedError
from memwal_query.format.keyfile import KEYS_FILE
from memwal_query.format.lancescan import batch_readahead
from memwal_query.format.manifest import FlushedGeneration
from memwal_query.format.schema import TOMBSTONE
from memwal_query.maintain import mergeintent
from memwal_query.read import sources, view
from memwal_query.read.dedup import newest_indices
from memwal_query.read.keypredicate import key_predicate
from memwal_query.storage import crashpoints
from memwal_query.storage.io import in_chunks, join
from memwal_query.storage.locking import index_lock

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

DEFAULT_MAX_RETRIES = 20
# What one merge commit holds. A merge_insert commit pays a fixed part (a scan of the
# base table's key column: ~0.1 s at 10M rows) and a part per source row (~0.3 s per
# million narrow rows), so the fewest commits are the fastest: generations of every
# due region go into one commit while they fit both budgets. The bytes (the
# generations' ``in_memory_bytes`` statistic) bound the merger's memory, which holds a
# batch's rows while Lance joins them; the rows bound Lance's join (measured with
# pylance 14 on a 10M-row base: 8M narrow source rows join in 2.9 s, 2M rows of 130
# bytes in 1.6 s, neither near its memory pool's limit).
DEFAULT_BATCH_ROWS = 4_000_000
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024
# A batch with upserts and deletes: on a base of this many rows or more, its deletes
# are a commit of their own just before the progress-carrying upsert commit (see
# :func:`_commit_generation`). Lance's only one-commit form,
# ``when_not_matched_by_source_delete``, joins every base row and evaluates the key
# predicate on each: +0.4 to +1.0 s per commit at 10M rows, where a
# ``when_matched_delete`` commit of 50k keys takes 0.08 s (measured, pylance 14). On a
# smaller base the one-commit form costs a few ms and keeps one version per batch.
SEPARATE_DELETE_MIN_BASE_ROWS = 1_000_000
# A batch with upserts, on a base of this many rows or more and a single integer key:
# the merger joins its keys with the base itself and commits one Lance ``Update`` of its
# own (the winning rows as new fragments, the rows they replace and the deleted keys'
# rows marked in deletion files), then the progress marker in a commit of no rows (see
# :func:`_commit_rewrite`). Measured with pylance 14 on a 10M-row base, 1M upserts and
# 50k deletes: 0.33 CPU s, where ``merge_insert`` plus a ``when_matched_delete`` of the
# deleted keys take 1.16 (``merge_insert`` alone 0.79). Below it, one ``merge_insert``.
REWRITE_MIN_BASE_ROWS = 1_000_000
# The key span (largest minus smallest key of a batch, plus one) the join's bitmap may
# cover: one byte per key of the span. A batch spanning more goes through merge_insert.
REWRITE_MAX_KEY_SPAN = 64 * 1024 * 1024
REWRITE_SCAN_BATCH_ROWS = 1 << 18  # four decoded at once on a small machine (lancescan)
# Lance's merge_insert can join through a scalar index on the key (index lookups per
# source row) or by scanning the base table's key column (a hash join). The index path
# pays ~20 us per source row and keeps the whole source in a hash table inside a fixed
# 300 MB memory pool: a generation of 150k rows with a 32-d vector column fails there
# with "Resources exhausted" (measured, pylance 14). The scan path costs a read of the
# key column (~15 ns per base row) and streams. So the index is used only for small
# generations on large tables (see ``_use_key_index``).
INDEX_JOIN_MAX_SOURCE_ROWS = 10_000
INDEX_JOIN_BASE_ROWS_PER_SOURCE_ROW = 2_000
# Regions sharing a commit are read and reduced in a few concurrent tasks (Arrow's
# group-by, take and cast release the GIL).
PREPARE_TASKS = 2
_PREPARERS = ThreadPoolExecutor(PREPARE_TASKS, thread_name_prefix="memwal-merge-prepare")
# The winning rows of prepared batches are read by one task, region after region in the
# order they were prepared, while the keys of the next regions are reduced and the
# deletes commit (see :class:`_Prepared`).
_ROW_READERS = ThreadPoolExecutor(1, thread_name_prefix="memwal-merge-rows")
# How often the merger's upsert stream, waiting for a part, checks whether the merge
# failed beside its fragment writer.
STREAM_STOP_POLL_SECONDS = 0.05
BACKOFF_BASE_SECONDS = 0.01
BACKOFF_MAX_SECONDS = 0.5


@dataclass(frozen=True)
class MergeResult:
    """One merged generation."""

    region_id: str
    generation: int
    upserted: int
    deleted: int
    seconds: float


@dataclass(frozen=True)
class _Prepared:
    """Generations reduced to the last write per key.

    The deleted keys are known when it is made (from the generations' keys); the upsert
    rows are built in the background (``parts``, one per region, in region order) while
    the deletes commit, and the upsert commit takes them as one table
    (:meth:`upsert_source`), or the merger's own ``Update`` as a stream
    (:meth:`upsert_stream`). ``deletes`` holds the deleted keys plus their other-signed
    float zeros, and ``unmatched_deletes`` adds the other-signed zeros of upserted keys
    (see :func:`_zero_twins`).
    """

    generation: int
    schema: pa.Schema
    parts: tuple[Future[pa.Table], ...]
    upsert_rows: int  # rows of all ``parts``
    deletes: pa.Table
    unmatched_deletes: pa.Table
    deleted: int  # keys the generations delete
    # The key columns of the upsert rows, known before the rows are read.
    upsert_keys: pa.Table
    # Base versions this batch's own delete commits made (see :func:`_commit_split`):
    # not "another merger moved the table" when a later step of the batch fails.
    own_versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def upserts(self) -> pa.Table:
        """Every upsert row (waits for the parts)."""
        tables = [f.result() for f in self.parts]
        return pa.concat_tables(tables) if tables else self.schema.empty_table()

    def upsert_source(self) -> pa.Table:
        """The upsert rows for a ``merge_insert``: one table, once every part is built.

        Lance plans the join of a table from its statistics; the same rows as a stream
        cost its upsert ~0.25 s more CPU per million rows on a 10M-row base (measured,
        pylance 14, the source arriving before and while the join runs alike), more
        than the rows take to read."""
        return self.upserts

    def upsert_stream(self, stop: _StreamStop | None = None) -> pa.RecordBatchReader:
        """The upsert rows as a stream of ``schema``: each part's batches as soon as it
        is built, in part order (a file writer starts on the first region's rows while
        the next ones are read). A part that failed to build ends the stream with an
        error (which Lance passes on as an ``OSError`` of its text: :meth:`failure`
        names the part's own); so does ``stop`` once set, even while a part is still
        being built."""

        def batches() -> Iterable[pa.RecordBatch]:
            for f in self.parts:
                while stop is not None and not f.done() and not stop.is_set():
                    wait([f], timeout=STREAM_STOP_POLL_SECONDS)
                if stop is not None and stop.is_set():
                    stop.honoured = True
                    raise OSError("the merge failed beside its fragment writer")
                yield from f.result().to_batches()

        return pa.RecordBatchReader.from_batches(self.schema, batches())

    def failure(self) -> BaseException | None:
        """The error of a part that failed to build (None: none failed so far)."""
        for f in self.parts:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None


# Text of the errors a lost commit race produces when pylance raises a plain OSError
# (``merge_insert(...).conflict_retries(0)``: "Too many concurrent writers. Attempted 0
# retries."); typed ``lance.commit.CommitConflictError`` is recognised first.
_CONFLICT_TEXT = ("concurrent", "conflict", "stale sstable", "retryable", "preempted")


def _is_conflict(err: BaseException) -> bool:
    """Whether ``err`` is a lost commit race (worth re-reading and retrying)."""
    if isinstance(err, LanceCommitConflictError):
        return bool(getattr(err, "retryable", True))
    if not isinstance(err, OSError):
        return False
    text = str(err).lower()
    return any(s in text for s in _CONFLICT_TEXT)


def _backoff(attempt: int) -> float:
    """Sleep a jittered, exponentially growing pause before retry ``attempt`` (1, 2...)."""
    cap = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * (2 ** min(attempt - 1, 16)))
    pause = random.uniform(cap / 2, cap)  # noqa: S311 - jitter, not cryptography
    time.sleep(pause)
    return pause


def prepare_generation(
    table: Catalog,
    region_id: str,
    gen: FlushedGeneration | Sequence[FlushedGeneration],
    schema: pa.Schema | None = None,
) -> _Prepared:
    """Read flushed generation(s) and split their newest rows into upserts and deletes.

    Several generations (consecutive, ascending) are reduced together: rows are read in
    generation order, so the last write of a key across them wins, exactly as merging
    them one after another would leave the base table. The result carries the last
    generation's number (the progress marker).

    The keys decide which rows win and which keys are deleted: from the region keys
    file of the newest generation where its parts match the generations by number and
    directory (:func:`~memwal_query.read.sources.region_keys_parts`), else from each
    generation's keys sidecar, else from its rows. The winning rows' columns are then
    read in the background (:func:`_upsert_rows`; in key order for a single integer
    key), so the caller may commit the deletes meanwhile.

    ``schema`` is the schema of the base version the rows will be merged into (default:
    ``table.schema``, the schema when ``table`` was opened). The merger passes the
    current one: columns added since ``table`` was opened must reach the base table
    (merging with the older schema would set them to NULL), and dropped ones must not.

    Raises
    ------
    GenerationGoneError
        A generation is missing or unreadable (from the keys here; from the rows when
        the upserts are used).
    CorruptFileError
        The keys of a generation (from whichever file) are not as many as its manifest
        records (here); its rows disagree with its keys (when the upserts are used).
    """
    schema = table.schema if schema is None else schema
    gens = [gen] if isinstance(gen, FlushedGeneration) else list(gen)
    refs = [
        view.GenerationRef(region_id, g.generation, table_generation_uri(table, region_id, g.path))
        for g in gens
    ]
    pk = list(table.primary_key)
    key_schema = pa.schema([schema.field(k) for k in pk])
    key_fields = [*key_schema, pa.field(TOMBSTONE, pa.bool_())]
    so = table.storage_options

    # One region keys file per region where it covers the generations (generation
    # number and directory checked), each generation's own keys sidecar otherwise.
    covered = sources.region_keys_parts(refs, so)

    def keys_of(ref: view.GenerationRef) -> pa.Table:
        t = sources.read_keys_sidecar(ref.uri, so)
        if t is None:
            t = sources.read_generation(ref, schema, so, [*pk, TOMBSTONE])
        return t

    todo = [ref for ref in refs if ref.uri not in covered]
    read = dict(zip([ref.uri for ref in todo], sources.map_generations(keys_of, todo, so)))
    parts = [covered[ref.uri][0] if ref.uri in covered else read[ref.uri] for ref in refs]
    for g, ref, part in zip(gens, refs, parts, strict=True):
        if g.physical_rows is not None and part.num_rows != g.physical_rows:
            path = covered[ref.uri][1] if ref.uri in covered else join(ref.uri, KEYS_FILE)
            raise CorruptFileError(
                path,
                f"{part.num_rows} keys of generation {g.generation} of region {region_id}, "
                f"whose manifest records {g.physical_rows} rows",
            )
    keys = _concat_conformed(parts, key_fields)
    counts = [p.num_rows for p in parts]
    newest = newest_indices(keys, pk, key_order=True)  # upserts in key order: see there
    tomb = keys.column(TOMBSTONE).combine_chunks().to_numpy(zero_copy_only=False)[newest]
    live = newest[~tomb]
    key_cols = keys.select(pk)
    deletes = key_cols.take(pa.array(newest[tomb])).cast(key_schema).combine_chunks()
    deleted = deletes.num_rows
    deletes = pa.concat_tables([deletes, _zero_twins(deletes)]).combine_chunks()
    upsert_keys = key_cols.take(pa.array(live)).cast(key_schema)
    if any(pa.types.is_floating(f.type) for f in key_schema):
        unmatched = pa.concat_tables([deletes, _zero_twins(upsert_keys)]).combine_chunks()
    else:
        unmatched = deletes
    built: tuple[Future[pa.Table], ...] = ()
    if len(live):
        built = (_ROW_READERS.submit(_upsert_rows, table, refs, schema, counts, live, key_cols),)
    return _Prepared(
        gens[-1].generation, schema, built, len(live), deletes, unmatched, deleted, upsert_keys
    )


def _concat_conformed(parts: Sequence[pa.Table], fields: Sequence[pa.Field]) -> pa.Table:
    """``parts`` (generations' columns as stored, oldest first) as one table of
    ``fields``: columns a generation lacks (added to the table after it was written)
    NULL, a missing ``_tombstone`` false, other columns dropped."""
    names = [f.name for f in fields]
    if parts and all(p.schema.equals(parts[0].schema) for p in parts):
        parts = [pa.concat_tables(parts)]  # as usual: one schema, conformed once
    out = []
    for t in parts:
        arrays = []
        for f in fields:
            if f.name in t.column_names:
                c = t.column(f.name)
                if f.name == TOMBSTONE and c.null_count:
                    c = pc.fill_null(c, False)
            else:
                value = pa.scalar(False) if f.name == TOMBSTONE else pa.scalar(None, f.type)
                c = pa.chunked_array([pa.repeat(value, t.num_rows)], f.type)
            arrays.append(c if c.type == f.type else c.cast(f.type))
        out.append(pa.Table.from_arrays(arrays, names=names))
    return pa.concat_tables(out) if out else pa.schema(fields).empty_table()


def _upsert_rows(
    table: Catalog,
    refs: Sequence[view.GenerationRef],
    schema: pa.Schema,
    counts: Sequence[int],
    live: np.ndarray,
    keys: pa.Table,
) -> pa.Table:
    """The winning rows ``live`` (indices into the generations' rows, in order) of the
    generations ``refs``, in ``schema``. ``counts`` and ``keys`` are the generations' row
    counts and key columns as the keys were read: the rows must agree with them."""
    so = table.storage_options

    def rows_of(ref: view.GenerationRef) -> pa.Table:
        t = sources.read_rows_sidecar(ref.uri, so)
        if t is None:
            t = sources.read_generation(ref, schema, so)
        return t

    parts = sources.map_generations(rows_of, refs, so)
    for ref, part, n in zip(refs, parts, counts, strict=True):
        if part.num_rows != n:
            raise CorruptFileError(
                ref.uri,
                f"generation {ref.generation} of region {ref.region_id} has "
                f"{part.num_rows} rows, but its keys list {n}",
            )
    rows = _concat_conformed(parts, list(sources.read_schema(schema))[: len(schema)])
    # every row's keys, not only the winners': a compare in place instead of a take
    for name in keys.column_names:
        if not _same_keys(rows.column(name), keys.column(name).cast(rows.schema.field(name).type)):
            raise CorruptFileError(
                refs[0].uri,
                f"generations {refs[0].generation}-{refs[-1].generation} of region "
                f"{refs[0].region_id}: their rows and keys disagree on {name!r}",
            )
    if len(live) != rows.num_rows:
        rows = _take(rows, pa.array(live))
    return rows.cast(schema)


def _take(rows: pa.Table, indices: pa.Array) -> pa.Table:
    """``rows.take(indices)``, the chunks combined first: a take across a generation's
    many chunks costs ~3x one over a contiguous table (measured, pyarrow 26: 32,898 rows
    of 40 generations, 7.8 ms against 2.5 ms with the combining)."""
    try:
        return rows.combine_chunks().take(indices)
    except pa.ArrowInvalid:  # a column too large for one array (offsets): chunk by chunk
        return rows.take(indices)


def _same_keys(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """Whether two key columns of one type hold the same keys in the same order (float
    keys: NaN equals NaN, and ``-0.0`` equals ``0.0``, as the deduplication has it)."""
    if not pa.types.is_floating(a.type):
        return a.equals(b)
    if len(a) != len(b):
        return False
    if not len(a):
        return True
    same = pc.or_kleene(pc.equal(a, b), pc.and_(pc.is_nan(a), pc.is_nan(b)))
    return bool(pc.all(pc.fill_null(same, False)).as_py())


def _zero_twins(keys: pa.Table) -> pa.Table:
    """The keys of ``keys`` with a float zero, with that zero's sign flipped.

    memwal_query treats ``-0.0`` and ``0.0`` as one key (as the reader's deduplication
    does), but Lance's merge-insert joins float keys by their bits: a delete of ``0.0``
    would not remove a base row keyed ``-0.0``, and an upsert of ``0.0`` would insert a
    second row beside it. The merger therefore also deletes these twins. Every
    combination of signs is produced for keys with several float columns.
    """
    variants = keys
    for i, field in enumerate(keys.schema):
        if pa.types.is_floating(field.type):
            col = variants.column(i)
            zero = pc.fill_null(pc.equal(col, pa.scalar(0, field.type)), False)
            if pc.any(zero).as_py():
                flipped = variants.filter(zero)
                flipped = flipped.set_column(i, field, pc.negate(flipped.column(i)))
                variants = pa.concat_tables([variants, flipped])
    return variants.slice(keys.num_rows).combine_chunks()


def _use_key_index(ds: lance.LanceDataset, source_rows: int) -> bool:
    """Whether merge-insert should join through the key index (small source, big base).

    Measured on a 1M-row base: 100 source rows take the same time both ways, 1k rows
    2x, 10k rows 4x and 50k rows 5x longer through the index, and 150k rows (with a
    vector column) exhaust Lance's join memory pool. The scan reads the base table's
    key column, so on a large base a small generation still goes through the index.
    """
    if source_rows > INDEX_JOIN_MAX_SOURCE_ROWS:
        return False
    return ds.count_rows() > source_rows * INDEX_JOIN_BASE_ROWS_PER_SOURCE_ROW


class _StreamStop(threading.Event):
    """Set when the merge fails beside its fragment writer: the upsert stream ends with
    an error (Lance then drops the files it was writing); ``honoured`` once it did."""

    honoured = False


class _BatchMoved(OSError):
    """A batch's regions were merged further while it waited for the index lock (a
    lost race: the merger re-reads and re-plans)."""


def _commit_generation(
    table: Catalog,
    ds: lance.LanceDataset,
    region_id: str | list[CompactedSsTable],
    prep: _Prepared,
) -> None:
    """Apply prepared rows on top of ``ds`` with their progress marker(s):
    ``merged_generations[region_id] = prep.generation``, or the given markers (one per
    region when several regions' generations share the commit).

    On a base of at least :data:`REWRITE_MIN_BASE_ROWS` rows with a single integer key,
    a batch with upserts is two commits: the rows (upserts and deletes) in one ``Update``
    of the merger's own, then the marker (:func:`_commit_rewrite`). Otherwise one commit,
    except for a batch with upserts and deletes on a base of at least
    :data:`SEPARATE_DELETE_MIN_BASE_ROWS` rows: its deletes are committed first, without
    a marker, then the upserts with the marker (:func:`_commit_split`). Called under the
    table's index lock. Raises the commit error on a lost race (see :func:`_is_conflict`).
    """
    pk = list(table.primary_key)
    if isinstance(region_id, str):
        marker = [CompactedSsTable(region_id, prep.generation)]
    else:
        marker = list(region_id)
    if prep.deletes.num_rows and not prep.upsert_rows:
        _delete_keys(ds, pk, prep.deletes, marker)
        return
    if _rewrite_applies(ds, pk) and _commit_rewrite(table, ds, pk, prep, marker):
        return
    predicate = None
    if prep.unmatched_deletes.num_rows:
        if ds.count_rows() >= SEPARATE_DELETE_MIN_BASE_ROWS:
            ds = _commit_split(table, ds, pk, prep, marker)
        else:
            # A deleted key is not among the upserts, so it is "not matched by source".
            predicate = key_predicate(prep.unmatched_deletes)
    builder = (
        ds.merge_insert(pk)
        .use_index(_use_key_index(ds, prep.upsert_rows))
        .when_matched_update_all()
        .when_not_matched_insert_all()
    )
    if predicate is not None:
        builder = builder.when_not_matched_by_source_delete(predicate)
    builder = builder.mark_sstables_as_compacted(marker).conflict_retries(0)
    source = prep.upsert_source()  # a part that failed to build raises its error here
    builder.execute(source)


def _delete_keys(
    ds: lance.LanceDataset,
    pk: list[str],
    keys: pa.Table,
    marker: list[CompactedSsTable] | None,
) -> None:
    """Delete the base rows with these keys (a join on the key, no predicate), in one
    commit carrying ``marker`` (None: no progress marker)."""
    # No keys: no join to plan through the key index, whose unindexed rows Lance would
    # scan (the rows a merger's own Update just added: ~50 ms per million).
    use_index = bool(keys.num_rows) and _use_key_index(ds, keys.num_rows)
    builder = ds.merge_insert(pk).use_index(use_index).when_matched_delete()
    if marker is not None:
        builder = builder.mark_sstables_as_compacted(marker)
    builder.conflict_retries(0).execute(keys)


def _commit_split(
    table: Catalog,
    ds: lance.LanceDataset,
    pk: list[str],
    prep: _Prepared,
    marker: list[CompactedSsTable],
) -> lance.LanceDataset:
    """Commit a batch's deletes on their own (no progress marker); return the version
    the progress-carrying upsert commit goes on.

    Why two commits are as safe as one:

    - the caller holds the index lock, which every commit of merge progress takes, and
      the batch is checked to be still unmerged on the latest version first (else a
      lost race, :class:`_BatchMoved`), so no other merger commits these regions'
      progress until the marker commit below is made or abandoned;
    - a crash (or a lost race) after the delete commit leaves the markers where they
      were: the batch is merged again, and its deletes then find no row (a key deleted
      by the batch can only come back through a later generation of its region, merged
      after this batch's marker). Each delete takes effect once, and the upserts and
      the marker still land in one commit;
    - the base version between the two commits is a state readers may pin, and its
      answer is the same as before and after: every key it lacks is deleted by a
      generation still above its ``merged_generations``, which every reader applies.
    """
    latest = _latest_unmoved(table, ds, marker)
    _delete_keys(latest, pk, prep.unmatched_deletes, None)
    prep.own_versions.append(latest.version)  # the commit's version (updated in place)
    crashpoints.point("merge.between_commits")
    return table.dataset()


def _latest_unmoved(
    table: Catalog, ds: lance.LanceDataset, marker: list[CompactedSsTable]
) -> lance.LanceDataset:
    """The latest base version, when the batch planned on ``ds`` may still go on it: its
    regions' ``merged_generations`` and the schema as on ``ds`` (else
    :class:`_BatchMoved`, a lost race)."""
    latest = table.dataset()
    if latest.version != ds.version:
        planned = table.index(ds).merged_generations()
        now = table.index(latest).merged_generations()
        if any(now.get(m.shard_id, 0) != planned.get(m.shard_id, 0) for m in marker):
            raise _BatchMoved(f"{table.uri}: conflict: merged meanwhile up to {now}")
        if not latest.schema.equals(ds.schema):
            raise _BatchMoved(f"{table.uri}: conflict: the schema changed meanwhile")
    return latest


def _rewrite_applies(ds: lance.LanceDataset, pk: list[str]) -> bool:
    """Whether a batch may go through :func:`_commit_rewrite` on ``ds``: a single
    integer key of at most 63 bits' values, a base of at least
    :data:`REWRITE_MIN_BASE_ROWS` rows, no stable row ids (new fragments would give the
    upserted rows new ids, where Lance's own upsert may keep them)."""
    if len(pk) != 1:
        return False
    t = ds.schema.field(pk[0]).type
    if not pa.types.is_integer(t) or t == pa.uint64():
        return False
    if ds.has_stable_row_ids:
        return False
    return ds.count_rows() >= REWRITE_MIN_BASE_ROWS


def _int_keys(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """An integer key column as int64 values (nulls dropped: no base row matches one)."""
    if col.null_count:
        col = pc.drop_null(col)
    return np.asarray(col.cast(pa.int64()).to_numpy(), dtype=np.int64)


def _key_span(keys: np.ndarray) -> tuple[int, int]:
    """The smallest of ``keys`` (not empty) and their span (largest minus smallest,
    plus one), as Python ints (no int64 overflow)."""
    lo = int(keys.min())
    return lo, int(keys.max()) - lo + 1


def _base_addresses(ds: lance.LanceDataset, key: str, keys: np.ndarray) -> np.ndarray | None:
    """The row addresses (fragment id << 32 | offset) of the live rows of ``ds`` whose
    ``key`` is one of ``keys``, ascending; None when the keys span more than
    :data:`REWRITE_MAX_KEY_SPAN` values.

    One scan of the key column with row addresses, each batch looked up in a bitmap
    over the keys' span (vectorised; memory: the span in bytes and one scan batch).
    """
    if not len(keys):
        return np.empty(0, np.uint64)
    lo, span = _key_span(keys)
    if span > REWRITE_MAX_KEY_SPAN:
        return None
    # wanted[k - lo] for a key k of the span; the last entry (False) stands for every
    # value outside it
    wanted = np.zeros(span + 1, dtype=bool)
    wanted[keys - lo] = True
    hits = []
    scan = ds.scanner(
        columns=[key],
        with_row_address=True,
        batch_size=REWRITE_SCAN_BATCH_ROWS,
        batch_readahead=batch_readahead(),
    ).to_batches()
    for batch in scan:
        col, addr = batch.column(0), batch.column(1)
        if col.null_count:
            valid = col.is_valid()
            col, addr = col.filter(valid), addr.filter(valid)
        ids = np.asarray(col.cast(pa.int64()).to_numpy(), dtype=np.int64)
        # value - lo modulo 2**64, as unsigned: a value v below lo gives
        # 2**64 - (lo - v) >= 2**64 - (lo - int64 min) = 2**63 - lo >= span (as
        # lo + span - 1 = hi <= int64 max), past the span like a value above hi, so
        # one bound suffices
        offsets = np.subtract(ids, lo, dtype=np.int64).view(np.uint64)
        np.minimum(offsets, np.uint64(span), out=offsets)
        found = wanted.take(offsets.view(np.int64))
        hits.append(np.asarray(addr.to_numpy(), dtype=np.uint64)[found])
    return np.sort(np.concatenate(hits), kind="stable") if hits else np.empty(0, np.uint64)


def _delete_rows(ds: lance.LanceDataset, addresses: np.ndarray) -> tuple[list[Any], list[int]]:
    """Mark rows (ascending addresses) deleted in new deletion files of their fragments
    of ``ds``; return the fragments' new metadata and the ids of fragments left empty
    (nothing is committed)."""
    frags = (addresses >> np.uint64(32)).astype(np.int64)
    offsets = (addresses & np.uint64(0xFFFFFFFF)).astype(np.int64)
    cuts = np.flatnonzero(np.diff(frags)) + 1
    starts = np.concatenate([[0], cuts]) if len(frags) else np.empty(0, np.int64)
    ends = np.concatenate([cuts, [len(frags)]]) if len(frags) else np.empty(0, np.int64)
    updated, removed = [], []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        fid = int(frags[start])
        fragment = ds.get_fragment(fid)
        if fragment is None:  # scanned on this very version: not expected; re-plan
            raise _BatchMoved(f"{ds.uri}: conflict: fragment {fid} is gone")
        raw = getattr(fragment, "_fragment", None)
        if raw is not None:  # the offsets as one list (the public method converts each)
            out = raw.delete_rows(offsets[start:end].tolist())
            meta = None if out is None else out.metadata()
        else:
            meta = fragment.delete_rows(offsets[start:end].tolist())
        if meta is None:
            removed.append(fid)
        else:
            updated.append(meta)
    return updated, removed


def _commit_rewrite(
    table: Catalog,
    ds: lance.LanceDataset,
    pk: list[str],
    prep: _Prepared,
    marker: list[CompactedSsTable],
) -> bool:
    """Commit a batch as one Lance ``Update`` of the merger's own, then its progress
    marker in a commit of no rows; False (nothing written) when the batch's keys span
    more than :data:`REWRITE_MAX_KEY_SPAN` (the caller merges it through
    ``merge_insert``).

    The ``Update`` (on the latest version, the batch still unmerged there:
    :func:`_latest_unmoved`) adds the winning rows as new fragments and marks deleted,
    in new deletion files, every live base row whose key the batch upserts or deletes
    (found by :func:`_base_addresses`); no index loses a fragment (no column of an old
    row changes), and the new fragments are outside the indexes until they are
    extended, as after Lance's own upsert. The marker then goes in a ``merge_insert``
    of no keys carrying ``mark_sstables_as_compacted``.

    Why two commits are as safe as one (as in :func:`_commit_split`): both are made
    under the index lock; a crash or lost race between them leaves the marker where it
    was, so the batch is merged again, and merging it again is idempotent (its upserted
    keys' rows, the ones the first commit added, are replaced by equal rows, and its
    deleted keys find no row); and a reader pinning the version between them applies
    the batch's generations over it (still above ``merged_generations``), whose rows
    are newer than every base row of their keys, so its answer is the same. The
    ``Update`` is never applied over another merger's merge of the same batch, even
    by a merger whose lock was lost and that is killed right after it commits
    (:func:`memwal_query.maintain.mergeintent.commit_update`).
    """
    key = pk[0]
    # The keys are known before the rows are read: the new fragments are written as the
    # regions' rows are read, while the base's rows of the batch's keys are found and
    # their deletion files written.
    keys = np.concatenate(
        [_int_keys(prep.upsert_keys.column(key)), _int_keys(prep.unmatched_deletes.column(key))]
    )
    if len(keys) and _key_span(keys)[1] > REWRITE_MAX_KEY_SPAN:
        return False  # as _base_addresses would find, before any row is written
    latest = _latest_unmoved(table, ds, marker)
    failed = prep.failure()  # a part that failed to build: its error, nothing written
    if failed is not None:
        raise failed
    so = table.storage_options or None
    # a thread of its own per batch (a shared one would make a merge started while
    # another one writes wait for it); the rows are written as their regions are read
    writer = ThreadPoolExecutor(1, thread_name_prefix="memwal-merge-write")
    stop = _StreamStop()
    writing = writer.submit(
        lance.fragment.write_fragments,
        prep.upsert_stream(stop),
        latest,
        schema=latest.schema,
        storage_options=so,
    )
    writer.shutdown(wait=False)
    try:
        addresses = _base_addresses(latest, key, keys)
        if addresses is None:  # not expected: the span is checked above
            raise RuntimeError(f"{table.uri}: the batch's keys span over the rewrite's bound")
        updated, removed = _delete_rows(latest, addresses)
    except BaseException as e:
        stop.set()  # the writer stops at once, not once every region's rows are read
        try:
            _written(writing, prep)
        except Exception:
            if isinstance(e, Exception) and not stop.honoured:
                raise  # the writer failed by itself: its error first, as after success
        raise
    new = _written(writing, prep)
    # never applied twice, crash or lost lock: see mergeintent
    committed = mergeintent.commit_update(
        table, latest, new, updated, removed, marker, prep.own_versions
    )
    crashpoints.point("merge.between_commits")
    _delete_keys(committed, pk, prep.deletes.schema.empty_table(), marker)
    return True


def _written(writing: Future[Any], prep: _Prepared) -> Any:
    """The fragments ``writing`` wrote from ``prep``'s upsert stream; when a part of the
    stream failed to build, that part's own (typed) error."""
    try:
        return writing.result()
    except Exception:
        failed = prep.failure()
        if failed is not None:
            raise failed from None
        raise


def _commit_once(
    table: Catalog,
    ds: lance.LanceDataset,
    index: Any,
    marker: str | list[CompactedSsTable],
    prepared: _Prepared,
    attempts: int,
    max_retries: int,
    what: str,
) -> bool:
    """One progress-carrying commit under the index lock (between the merge crash
    points). True when committed; False after a lost race (after a backoff: re-read
    and try again); CommitConflictError once ``max_retries`` races are lost."""
    from memwal_query.maintain.snapshots import carry_forward

    crashpoints.point("merge.before_commit")
    try:
        with index_lock(table.uri, table.io):
            _commit_generation(table, ds, marker, prepared)
            try:
                carry_forward(table, index)
            except Exception:  # noqa: BLE001 - best effort: readers find it anyway
                pass
    except OSError as e:
        if not _is_conflict(e) or prepared.failure() is not None:
            raise  # a failed read of the rows is not a lost race, whatever its text
        if attempts + 1 > max_retries:
            raise CommitConflictError(
                f"{table.uri}: merging {what} lost {attempts + 1} commit races"
            ) from e
        _backoff(attempts + 1)
        return False
    crashpoints.point("merge.after_commit")
    return True


def merge_region(
    table: Catalog,
    region_id: str,
    max_generations: int | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> list[MergeResult]:
    """Merge the region's unmerged generations in order; return what this call merged.

    Consecutive generations of up to ``batch_rows`` rows and ``batch_bytes`` bytes in
    all go into one commit (``batch_rows=0``: one commit per generation).
    """
    done: list[MergeResult] = []
    mergeintent.repair(table)
    _merge_region_into(
        table, region_id, max_generations, max_retries, done, batch_rows, batch_bytes
    )
    return done


def _next_batch(
    pending: list[FlushedGeneration],
    room: int | None,
    batch_rows: int,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> list[FlushedGeneration]:
    """The oldest pending generations to merge in one commit: at most ``room`` of them
    and, after the first, no more than ``batch_rows`` rows and ``batch_bytes`` bytes in
    all (by the manifest's ``physical_rows`` and ``in_memory_bytes``; a generation
    without the row statistic counts as ``batch_rows``, one without the byte statistic
    by its rows only)."""
    batch = [pending[0]]
    if batch_rows <= 0:
        return batch
    rows, size = _size(pending[0], batch_rows)
    for g in pending[1:]:
        if room is not None and len(batch) >= room:
            break
        if g.generation != batch[-1].generation + 1:
            break  # only a contiguous run (the manifest lists them so anyway)
        more_rows, more_bytes = _size(g, batch_rows)
        rows, size = rows + more_rows, size + more_bytes
        if rows > batch_rows or size > batch_bytes:
            break
        batch.append(g)
    return batch


def _size(g: FlushedGeneration, batch_rows: int) -> tuple[int, int]:
    """A generation's rows and bytes as the batch budgets count them."""
    return g.physical_rows or batch_rows, g.in_memory_bytes or 0


def _merge_region_into(
    table: Catalog,
    region_id: str,
    max_generations: int | None,
    max_retries: int,
    done: list[MergeResult],
    batch_rows: int = 0,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> None:
    """:func:`merge_region`, appending each merged generation to ``done`` as it commits."""

    attempts = 0  # lost races for the batch being merged (the bound is per batch)
    current: tuple[int, ...] | None = None
    prepared: _Prepared | None = None
    prepared_schema = pa.schema([])
    merged_here = 0
    while max_generations is None or merged_here < max_generations:
        ds = table.dataset()
        index = table.index(ds)
        merged = index.merged_generations().get(region_id, 0)
        manifest = table.region_manifest(region_id)
        if manifest is None:
            return
        pending = sorted(
            (g for g in manifest.flushed_generations if g.generation > merged),
            key=lambda g: g.generation,
        )
        if not pending:
            return
        room = None if max_generations is None else max_generations - merged_here
        batch = _next_batch(pending, room, batch_rows, batch_bytes)
        gen = batch[-1]
        if tuple(g.generation for g in batch) != current:
            current, attempts, prepared = tuple(g.generation for g in batch), 0, None
        started = time.perf_counter()
        what = f"generation(s) {list(current or ())} of region {region_id}"
        try:
            if prepared is None or not prepared_schema.equals(ds.schema):
                # Rows in the schema of the version committed to (columns may have been
                # added or dropped since ``table`` was opened, or since the last attempt).
                prepared_schema = ds.schema
                prepared = prepare_generation(table, region_id, batch, prepared_schema)
            committed = _commit_once(
                table, ds, index, region_id, prepared, attempts, max_retries, what
            )
        except Exception:
            own = prepared.own_versions if prepared is not None else []
            if attempts >= max_retries or not _table_moved(table, ds, own):
                raise
            # Another merger committed (and GC may have collected what we were reading):
            # re-plan from the new ``merged_generations``.
            attempts, prepared = attempts + 1, None
            continue
        if not committed:
            attempts += 1
            continue  # re-read: maybe another merger merged it (Appendix 2)
        merged_here += len(batch)
        seconds = time.perf_counter() - started
        for g in batch[:-1]:  # merged by the same commit: its figures are on the last
            done.append(MergeResult(region_id, g.generation, 0, 0, 0.0))
        done.append(
            MergeResult(region_id, gen.generation, prepared.upsert_rows, prepared.deleted, seconds)
        )


def _table_moved(table: Catalog, ds: lance.LanceDataset, own: Sequence[int] = ()) -> bool:
    """Whether the base table has a newer version than ``ds`` (the merge was planned on)
    that is not one of ``own`` (versions the failed batch committed itself: its deletes).

    A merge that fails (a generation "Not found", a data file gone) while another
    merger committed and the garbage collector ran is re-planned from the newer
    ``merged_generations``, not reported: the work it was doing may be done. A failure
    with no newer version is a real one and propagates.
    """
    try:
        return table.dataset().version not in (ds.version, *own)
    except Exception:  # noqa: BLE001 - cannot tell: report the original failure
        return False


def table_generation_uri(table: Catalog, region_id: str, gen_dir: str) -> str:
    """Absolute URI of a generation directory (validated)."""
    from memwal_query.storage import paths

    return paths.generation_path(table.uri, region_id, gen_dir)


def merge(
    table: Catalog,
    region_id: str | None = None,
    max_generations: int | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> list[MergeResult]:
    """Merge one region (or all regions: :func:`merge_regions`).

    Consecutive generations totalling up to ``batch_rows`` rows and ``batch_bytes``
    bytes are merged by one commit (``batch_rows=0``: one commit per generation); each
    is still reported.

    With ``region_id``, that region's error propagates unchanged. For all regions, a
    failing region does not stop the others: every region is attempted, then
    :class:`MergeFailedError` names the failed regions (``.errors``) and carries what
    was merged (``.results``).
    """
    if region_id is not None:
        done = merge_region(table, region_id, max_generations, max_retries, batch_rows, batch_bytes)
        _forget_merged(table, done)
        return done
    rooms = {rid: max_generations for rid in table.region_ids()}
    return merge_regions(table, rooms, max_retries, batch_rows, batch_bytes)


def merge_regions(
    table: Catalog,
    rooms: dict[str, int | None],
    max_retries: int = DEFAULT_MAX_RETRIES,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> list[MergeResult]:
    """Merge the given regions, each at most ``rooms[region]`` generations (None: all
    of its unmerged ones), in as few commits as the budgets allow.

    Several regions' generations share a commit while they fit ``batch_rows`` rows and
    ``batch_bytes`` bytes (:func:`_merge_across_regions`); what is left (one region, or a
    region whose shared commit failed) is merged region by region. A failing region
    does not stop the others: every region is attempted, then :class:`MergeFailedError`
    names the failed regions (``.errors``) and carries what was merged (``.results``).

    Returns
    -------
    list of MergeResult
        Every generation merged, per region in ascending order.

    Raises
    ------
    MergeFailedError
        Some region failed (the others were merged).
    """
    out: list[MergeResult] = []
    errors: dict[str, BaseException] = {}
    mergeintent.repair(table)
    if batch_rows > 0:
        try:
            _merge_across_regions(table, rooms, max_retries, batch_rows, batch_bytes, out)
        except Exception:  # noqa: BLE001 - isolated region by region just below
            pass
    counts = Counter(r.region_id for r in out)
    for rid, limit in rooms.items():
        room = _room(limit, rid, counts)
        if room is not None and room <= 0:
            continue
        try:
            _merge_region_into(table, rid, room, max_retries, out, batch_rows, batch_bytes)
        except Exception as e:  # noqa: BLE001 - reported below, after the other regions
            errors[rid] = e
    _forget_merged(table, out)
    if errors:
        raise MergeFailedError(table.uri, errors, out)
    return out


def _forget_merged(table: Catalog, done: list[MergeResult]) -> None:
    """Drop this process's search blocks holding the generations just merged: a view
    resolved from now on reads them from the base (their per-generation caches go at the
    next search or maintenance pass, :func:`memwal_query.search.forget.forget_merged`)."""
    if not done:
        return
    from memwal_query.search.forget import forget_merged_blocks

    with contextlib.suppress(Exception):  # only a cache: never fails a merge
        forget_merged_blocks(table.uri, table.index().merged_generations())


def _room(limit: int | None, region_id: str, merged: Mapping[str, int]) -> int | None:
    """How many more generations of the region may be merged (None: no limit), given
    how many of each region's were ``merged`` so far."""
    if limit is None:
        return None
    return limit - merged.get(region_id, 0)


def _merge_across_regions(
    table: Catalog,
    rooms: dict[str, int | None],
    max_retries: int,
    batch_rows: int,
    batch_bytes: int,
    done: list[MergeResult],
) -> None:
    """Merge several regions' pending generations per commit, up to ``batch_rows`` rows
    and ``batch_bytes`` bytes.

    A key lives in one region, so the regions' newest rows never overlap: their
    upserts and deletes are applied by one ``merge_insert`` whose commit carries every
    region's progress marker. Stops when at most one region has pending work (the
    per-region path finishes it); raises on anything but a lost race, which
    :func:`merge_regions` then isolates region by region.
    """

    attempts = 0
    while True:
        counts = Counter(r.region_id for r in done)
        if all(limit is not None and limit <= counts[rid] for rid, limit in rooms.items()):
            return  # every region merged as far as asked: nothing to read again
        ds = table.dataset()
        index = table.index(ds)
        merged = index.merged_generations()
        groups: list[tuple[str, list[FlushedGeneration]]] = []
        rows_left, bytes_left = batch_rows, batch_bytes
        for rid, limit in rooms.items():
            room = _room(limit, rid, counts)
            if room is not None and room <= 0:
                continue
            manifest = table.region_manifest(rid)
            if manifest is None:
                continue
            pending = sorted(
                (g for g in manifest.flushed_generations if g.generation > merged.get(rid, 0)),
                key=lambda g: g.generation,
            )
            if not pending:
                continue
            batch = _next_batch(pending, room, rows_left, bytes_left)
            sizes = [_size(g, batch_rows) for g in batch]
            rows, size = sum(r for r, _ in sizes), sum(b for _, b in sizes)
            if groups and (rows > rows_left or size > bytes_left):
                break
            groups.append((rid, batch))
            rows_left, bytes_left = rows_left - rows, bytes_left - size
            if rows_left <= 0 or bytes_left <= 0:
                break
        if len(groups) < 2:
            return
        started = time.perf_counter()
        schema = ds.schema

        def prepare(group: tuple[str, list[FlushedGeneration]], schema: Any = schema) -> _Prepared:
            return prepare_generation(table, group[0], group[1], schema)

        preps = in_chunks(_PREPARERS, prepare, groups, PREPARE_TASKS)
        parts = [(rid, b, p) for (rid, b), p in zip(groups, preps, strict=True)]
        combined = _Prepared(
            0,
            schema,
            tuple(f for _, _, p in parts for f in p.parts),
            sum(p.upsert_rows for _, _, p in parts),
            pa.concat_tables([p.deletes for _, _, p in parts]).combine_chunks(),
            pa.concat_tables([p.unmatched_deletes for _, _, p in parts]).combine_chunks(),
            sum(p.deleted for _, _, p in parts),
            pa.concat_tables([p.upsert_keys for _, _, p in parts]),
        )
        markers = [CompactedSsTable(rid, batch[-1].generation) for rid, batch in groups]
        what = f"{len(groups)} regions"
        if not _commit_once(table, ds, index, markers, combined, attempts, max_retries, what):
            attempts += 1
            continue  # re-read: another merger may have merged some of them
        attempts = 0
        seconds = time.perf_counter() - started
        for rid, batch, prep in parts:
            for g in batch[:-1]:
                done.append(MergeResult(rid, g.generation, 0, 0, 0.0))
            last = batch[-1].generation
            done.append(MergeResult(rid, last, prep.upsert_rows, prep.deleted, seconds))


def generations_by_region(merged: Iterable[MergeResult | Any]) -> dict[str, list[int]]:
    """``{region_id: [generations, ascending]}`` of merged generations (anything with
    ``region_id`` and ``generation``), regions in id order."""
    out: dict[str, list[int]] = {}
    for m in merged:
        out.setdefault(m.region_id, []).append(m.generation)
    return {k: sorted(v) for k, v in sorted(out.items())}


@dataclass(frozen=True)
class MergeReport:
    """What a merge did: :meth:`memwal_query.table.Maintenance.merge`.

    Attributes
    ----------
    merged : list of MergeResult
        Each merged generation, per region in ascending order.
    """

    merged: list[MergeResult]

    def by_region(self) -> dict[str, list[int]]:
        """``{region_id: [generations merged, ascending]}``."""
        return generations_by_region(self.merged)

    @property
    def upserted(self) -> int:
        """Rows upserted into the base table."""
        return sum(m.upserted for m in self.merged)

    @property
    def deleted(self) -> int:
        """Keys deleted from the base table."""
        return sum(m.deleted for m in self.merged)

    def __len__(self) -> int:
        return len(self.merged)
