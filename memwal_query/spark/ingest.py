"""Batch ingest of a Spark DataFrame into the regions of a MemWAL table.

One Spark job, two stages, no per-row Python:

1. **Route** (``mapInArrow``, narrow): each Arrow batch is coerced to the table schema
   and :meth:`RegionSpec.evaluate` computes the region values of its rows - the very
   function :meth:`MemWalTable.write` and :class:`RegionWriter` use, so the values are
   identical - then the derived region id (:func:`memwal_query.table.region_id_for`,
   hashed once per distinct value). The batch's rows of each region leave the stage as
   one Arrow IPC blob: ``(__memwal_region, payload)``. (:func:`route` gives the same
   region ids row by row, to inspect them.)
2. **Write** (``repartition(n, "__memwal_region")`` then ``mapInArrow``): hash
   partitioning sends all blobs of a region to one partition, so each task owns whole
   regions (a task may own several). The task opens one :class:`RegionWriter` per region
   it sees (claiming it: ``writer_epoch + 1``), buffers each region's rows up to
   ``buffer_rows`` and puts them as one durable WAL entry, and at the end flushes the
   MemTable as a generation (``flush=True``) or leaves it in the WAL (``flush=False``).
   Only then does it yield its small result batch (region, rows, generation, epoch).

Shuffling blobs rather than rows spares Spark the conversion of every row from Arrow to
its row format and back; the shuffle moves a few records per input batch.

Task retries and speculative attempts
-------------------------------------
A second attempt of a task opens the same regions again, which *claims* them with a
higher epoch: from then on the earlier attempt is fenced (its next WAL entry or manifest
commit raises :class:`~memwal_query.exceptions.FencedError`). The new writer replays the
earlier attempt's durable WAL entries (or adopts one written concurrently, spec
Appendix 1) and then writes the whole partition again. The rows written twice are the
same rows in the same order, and the view keeps the newest row per key, so nothing is
lost and nothing is doubled in reads.

Ordering
--------
Within one call, rows of one key are applied in the order they reach the write task,
which after a shuffle is not the input order (the rows of one input batch do keep their
order): give ``order_by`` (e.g. an event time or a sequence number) and each task sorts
every region's rows by it (ascending, stable, NULLs last) before writing them - it then
holds the region's rows until the end of the task - or write unique keys. Across calls
(and streaming micro-batches) order is the call order.

Spark does not stop the losing attempt of a speculative pair at once: it may still be
running - and could open a region it has not opened yet - after the job ended and a
later job (the next micro-batch...) wrote newer rows. To keep such a late claim from
writing old rows over newer ones, every call is a *write job* with an id, and the driver
marks the job ended (``{table}/_mem_wal/_spark/jobs/{job}.done``, put-if-not-exists)
as soon as Spark returns, whether the job succeeded or failed. A task attempt checks the
marker before claiming each region (so as not to fence a later job's writer) and again
right after: if the job has ended it writes nothing and fails with
:class:`~memwal_query.spark.JobEndedError` (a ``FencedError``). A claim made before the
marker exists is safe: any later job claims the region afterwards, which orders the late
attempt's durable entries before its own rows and fences the rest. Markers are pruned
after :data:`JOB_MARKER_TTL` seconds.

A job that fails for good (retries exhausted) may leave part of its rows written, as
any non-transactional sink does; running the same write again converges to the same
view (upserts and deletes by key are idempotent).
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    AlreadyExistsError,
    FencedError,
    JobEndedError,
    MemWalError,
    PrimaryKeyError,
    SchemaError,
)
from memwal_query.format.schema import coerce_keys, coerce_partial_rows
from memwal_query.regions.spec import check_partial_sources
from memwal_query.spark._common import (
    REGION_COLUMN,
    SPARK_DIR,
    armed,
    fault,
    open_table,
    region_id_array,
    require_spec,
    split_by_value,
)
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import join
from memwal_query.storage.paths import mem_wal_root
from memwal_query.table import concurrently

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from memwal_query.table import MemWalTable
    from memwal_query.write.writer import RegionWriter

MODES = ("upsert", "delete")
DEFAULT_BUFFER_ROWS = 200_000
DEFAULT_FENCE_RETRIES = 5
JOB_MARKER_TTL = 7 * 24 * 3600
"""Seconds a write job's ended-marker is kept (a task attempt outliving it is unguarded)."""

RESULT_SCHEMA = pa.schema(
    [
        pa.field("region_id", pa.string()),
        pa.field("upserted", pa.int64()),
        pa.field("deleted", pa.int64()),
        pa.field("generation", pa.int64()),
        pa.field("epoch", pa.int64()),
        pa.field("partition", pa.int32()),
        pa.field("attempt", pa.int32()),
    ]
)
PAYLOAD_COLUMN = "__memwal_payload"
PACKED_SCHEMA = pa.schema(
    [
        pa.field(REGION_COLUMN, pa.string(), nullable=False),
        pa.field(PAYLOAD_COLUMN, pa.binary(), nullable=False),
    ]
)
PACKED_DDL = f"{REGION_COLUMN} string not null, {PAYLOAD_COLUMN} binary not null"
RESULT_DDL = (
    "region_id string, upserted long, deleted long, generation long, epoch long, "
    "partition int, attempt int"
)


@dataclass(frozen=True)
class RegionWriteResult:
    """What one Spark task wrote into one region.

    Attributes
    ----------
    region_id : str
    upserted, deleted : int
        Rows put and keys deleted.
    generation : int or None
        Newest generation flushed by the task (None with ``flush=False``).
    epoch : int
        Writer epoch the task claimed the region with.
    partition, attempt : int
        Spark partition id and attempt number of the task.
    """

    region_id: str
    upserted: int
    deleted: int
    generation: int | None
    epoch: int
    partition: int
    attempt: int


@dataclass
class WriteResult:
    """Summary of :func:`write`.

    Attributes
    ----------
    regions : list of RegionWriteResult
        One entry per region written (by the successful task attempt).
    seconds : float
        Wall-clock time of the Spark job.
    """

    regions: list[RegionWriteResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def upserted(self) -> int:
        """Rows put."""
        return sum(r.upserted for r in self.regions)

    @property
    def deleted(self) -> int:
        """Keys deleted."""
        return sum(r.deleted for r in self.regions)

    @property
    def rows(self) -> int:
        """Rows put plus keys deleted."""
        return self.upserted + self.deleted

    def by_region(self) -> dict[str, int]:
        """``{region_id: rows written}``."""
        return {r.region_id: r.upserted + r.deleted for r in self.regions}


# -- driver side -----------------------------------------------------------------------
def write(
    df: DataFrame,
    uri: str,
    mode: str = "upsert",
    *,
    delete_column: str | None = None,
    order_by: str | list[str] | None = None,
    num_partitions: int | None = None,
    flush: bool = True,
    buffer_rows: int = DEFAULT_BUFFER_ROWS,
    writer_options: dict[str, Any] | None = None,
    storage_options: dict[str, str] | None = None,
    partial: bool = False,
    fence_retries: int = DEFAULT_FENCE_RETRIES,
) -> WriteResult:
    """Write a batch DataFrame into the table's regions (see the module docs).

    Parameters
    ----------
    df : pyspark.sql.DataFrame
        Rows to write. Columns must be table columns, all of them (an upsert replaces
        whole rows) unless ``partial``; with ``mode="delete"`` only the primary-key
        columns are used.
    uri : str
        Table URI; the table must be initialized with a region spec.
    mode : {"upsert", "delete"}
        Put the rows, or delete their keys.
    delete_column : str, optional
        A boolean column: rows where it is true are deletes of their key, the others
        upserts (CDC input). Overrides ``mode``; the column is not written.
    order_by : str or list of str, optional
        Each task sorts every region's rows by these columns (ascending, stable, NULLs
        last) before writing them, so that among rows of one key the last in this
        order wins; the task then holds each region's rows until its end. Columns that
        are not table columns (a sequence number...) are used for sorting only.
    num_partitions : int, optional
        Write tasks (each owns whole regions). Default: the session's default
        parallelism.
    flush : bool
        ``True`` (default): each task flushes its MemTables as generations before it
        reports success, so the rows are visible to every reader. ``False``: the rows
        are only durable in the WAL; the next writer of the region replays them, and
        readers see them once that writer flushes.
    buffer_rows : int
        Rows of one region buffered in a task before a durable put (one WAL entry).
    writer_options : dict, optional
        :class:`RegionWriter` options (``max_memtable_rows``, ``max_memtable_bytes``...).
    storage_options : dict, optional
        Object-store options of the table.
    partial : bool
        Partial update: columns the DataFrame lacks keep each key's current value
        (see :meth:`RegionWriter.put`).
    fence_retries : int
        Another writer of a region (a concurrent job, a streaming sink, a Python
        process) fences a task's writer; the fenced put was never acknowledged, so the
        task claims the region again and writes it again, up to this many times with
        exponential backoff. Then the driver raises :class:`FencedError`.

    Returns
    -------
    WriteResult

    Raises
    ------
    SchemaError
        When a column is not in the table, or a primary-key column is missing.
    MemWalError
        When the table has no region spec, or a task failed for good.
    """
    if num_partitions is None:
        num_partitions = max(1, df.sparkSession.sparkContext.defaultParallelism)
    order = [order_by] if isinstance(order_by, str) else list(order_by or [])
    options = _options(
        df, uri, mode, delete_column, order, storage_options, flush, buffer_rows, writer_options
    )
    options["partial"] = bool(partial)
    options["fence_retries"] = max(0, int(fence_retries))
    if mode == "upsert" or delete_column is not None:
        data = [c for c in df.columns if c not in options["ignore"]]
        table = open_table(uri, storage_options)
        missing = [c for c in table.schema.names if c not in data]
        if partial:
            check_partial_sources(require_spec(table), missing, table.lance_schema)
        elif missing:
            raise SchemaError(
                f"the DataFrame lacks column(s) {missing}: an upsert replaces whole rows; "
                "add them (NULL explicitly if meant) or write with partial=True"
            )
    options["job"] = new_job()

    def pack_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return pack_batches(batches, options)

    def write_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return write_partition(batches, options)

    started = time.perf_counter()
    try:
        rows = (
            df.mapInArrow(pack_task, PACKED_DDL)
            .repartition(num_partitions, REGION_COLUMN)
            .mapInArrow(write_task, RESULT_DDL)
            .collect()
        )
    except BaseException as e:
        try:
            end_job(options)
        except MemWalError:  # keep the job's own error
            pass
        typed = _typed_task_error(e) if not isinstance(e, MemWalError) else None
        if typed is not None:  # bad input values, found while routing: nothing written
            raise typed from e
        raise
    end_job(options)  # attempts still running (speculative losers) claim no more
    seconds = time.perf_counter() - started
    regions = sorted(
        (RegionWriteResult(**r.asDict()) for r in rows), key=lambda r: (r.region_id, r.partition)
    )
    return WriteResult(regions, seconds)


def route(
    df: DataFrame,
    uri: str,
    mode: str = "upsert",
    *,
    delete_column: str | None = None,
    storage_options: dict[str, str] | None = None,
) -> DataFrame:
    """``df`` plus the derived region id of every row (column ``__memwal_region``).

    The routing of :func:`write`, row by row, to inspect it: the region values come
    from :meth:`RegionSpec.evaluate` on Arrow batches, as in the writer.
    """
    from pyspark.sql.types import StringType, StructField, StructType

    options = _options(df, uri, mode, delete_column, [], storage_options)
    schema = StructType(
        [*df.schema.fields, StructField(REGION_COLUMN, StringType(), nullable=False)]
    )

    def route_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return route_batches(batches, options)

    return df.mapInArrow(route_task, schema)


def _options(
    df: DataFrame,
    uri: str,
    mode: str,
    delete_column: str | None,
    order: list[str],
    storage_options: dict[str, str] | None,
    flush: bool = True,
    buffer_rows: int = DEFAULT_BUFFER_ROWS,
    writer_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate the request in the driver; the options the executor functions get."""
    if mode not in MODES:
        raise MemWalError(f"mode must be one of {MODES}, got {mode!r}")
    table = open_table(uri, storage_options)
    require_spec(table)
    return {
        "uri": table.uri,
        "storage_options": dict(storage_options or {}),
        "mode": mode,
        "delete_column": delete_column,
        "order": order,
        "ignore": _check_columns(df, table, mode, delete_column, order),
        "flush": flush,
        "buffer_rows": max(1, int(buffer_rows)),
        "writer_options": dict(writer_options or {}),
    }


def _check_columns(
    df: DataFrame, table: MemWalTable, mode: str, delete_column: str | None, order: list[str]
) -> list[str]:
    """Validate the DataFrame's columns; return those not to write (delete flag, sort)."""
    names = list(df.columns)
    if REGION_COLUMN in names:
        raise SchemaError(f"column name {REGION_COLUMN!r} is reserved")
    if delete_column is not None and delete_column not in names:
        raise SchemaError(f"delete_column {delete_column!r} is not a column of the DataFrame")
    unknown = [c for c in order if c not in names]
    if unknown:
        raise SchemaError(f"order_by column(s) {unknown} are not columns of the DataFrame")
    ignore = [
        c for c in names if c == delete_column or (c in order and c not in table.schema.names)
    ]
    data = [c for c in names if c not in ignore]
    missing_pk = [k for k in table.primary_key if k not in data]
    if missing_pk:
        raise SchemaError(f"the DataFrame lacks primary-key column(s) {missing_pk}")
    if mode == "upsert" or delete_column is not None:
        extra = [c for c in data if table.schema.get_field_index(c) < 0]
        if extra:
            raise SchemaError(f"column(s) {extra} are not in the table schema {table.schema.names}")
        _check_types(df, table, data)
    else:
        _check_types(df, table, table.primary_key)
    if delete_column is not None:
        flag = _arrow_type(df.schema[delete_column].dataType)
        if flag is not None and not (pa.types.is_boolean(flag) or pa.types.is_integer(flag)):
            raise SchemaError(f"delete_column {delete_column!r} must be boolean, not {flag}")
    return ignore


def _arrow_type(spark_type: Any) -> pa.DataType | None:
    """The Arrow type Spark hands ``mapInArrow`` for ``spark_type`` (None: unknown)."""
    from pyspark.sql.pandas.types import to_arrow_type

    try:
        return to_arrow_type(spark_type, timezone="UTC")
    except Exception:  # noqa: BLE001 - a type PySpark cannot convert: the task reports it
        return None


def _check_types(df: DataFrame, table: MemWalTable, columns: list[str]) -> None:
    """SchemaError, before any task runs, for a column of another kind of type than the
    table's (the conversions :func:`memwal_query.format.schema.coerce_rows` refuses)."""
    from memwal_query.format.schema import _type_family

    for name in columns:
        t = _arrow_type(df.schema[name].dataType)
        want = table.schema.field(name).type
        if t is not None and _type_family(t) not in ("null", _type_family(want)):
            raise SchemaError(
                f"column {name!r}: cannot convert {df.schema[name].dataType.simpleString()} "
                f"({t}) to the table's {want}; convert the values explicitly first"
            )


_TASK_ERROR = re.compile(r"memwal_query\.exceptions\.(SchemaError|PrimaryKeyError): (.*)")
_FENCED = re.compile(
    r"memwal_query\.exceptions\.FencedError: writer of region (\S+) was fenced: "
    r"local epoch (\d+), stored epoch (\w+)"
)
_JOB_ENDED = re.compile(
    r"memwal_query\.exceptions\.JobEndedError: region (\S+): write job (\S+) already ended"
)


def _typed_task_error(error: BaseException) -> MemWalError | None:
    """The typed error a task raised (SchemaError, PrimaryKeyError, FencedError,
    JobEndedError), rebuilt from Spark's wrapped Python worker exception."""
    text = str(error)
    found = _TASK_ERROR.findall(text)
    if found:
        name, message = found[-1]
        return (PrimaryKeyError if name == "PrimaryKeyError" else SchemaError)(message.strip())
    ended = _JOB_ENDED.findall(text)
    if ended:
        region, job = ended[-1]
        return JobEndedError(region, job)
    fenced = _FENCED.findall(text)
    if fenced:
        region, local, stored = fenced[-1]
        return FencedError(region, int(local), int(stored) if stored.isdigit() else None)
    return None


# -- write jobs ------------------------------------------------------------------------
def new_job() -> str:
    """A fresh write job id: ``{start time in ms:013d}-{uuid hex}`` (sortable by age)."""
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex}"


def jobs_dir(uri: str) -> str:
    """``{table}/_mem_wal/_spark/jobs``: the ended-markers of write jobs."""
    return join(mem_wal_root(uri), SPARK_DIR, "jobs")


def end_job(options: dict[str, Any]) -> None:
    """Driver: mark the write job ``options["job"]`` ended, then prune expired markers.

    From then on a task attempt of the job refuses to claim a region (see the module
    docs). Idempotent; pruning is best effort.
    """
    io = file_io_for(options["uri"], options["storage_options"])
    directory = jobs_dir(options["uri"])
    try:
        io.put_if_not_exists(join(directory, f"{options['job']}.done"), b"")
    except AlreadyExistsError:
        pass
    cutoff = (time.time() - JOB_MARKER_TTL) * 1000
    try:
        for name in io.list(directory):
            stamp = name.split("-", 1)[0]
            if name.endswith(".done") and stamp.isdigit() and int(stamp) < cutoff:
                io.delete(join(directory, name))
    except MemWalError:  # pragma: no cover - pruning again on the next write
        pass


def job_ended(options: dict[str, Any]) -> bool:
    """Executor: whether the driver marked this task's write job ended (one HEAD)."""
    job = options.get("job")
    if job is None:
        return False
    io = file_io_for(options["uri"], options["storage_options"])
    return io.exists(join(jobs_dir(options["uri"]), f"{job}.done"))


# -- executor side: routing ------------------------------------------------------------
def _delete_mask(batch: pa.RecordBatch | pa.Table, options: dict[str, Any]) -> np.ndarray:
    """Which rows are deletes (``delete_column`` true, or every row in delete mode)."""
    column = options["delete_column"]
    if column is None:
        return np.full(batch.num_rows, options["mode"] == "delete")
    col = batch.column(column)
    if col.type != pa.bool_():
        col = pc.cast(col, pa.bool_())
    return pc.fill_null(col, False).to_numpy(zero_copy_only=False)


def _data(batch: pa.RecordBatch | pa.Table, options: dict[str, Any]) -> pa.Table:
    """The columns to write (without the delete flag, sort-only columns, region id)."""
    drop = {REGION_COLUMN, *options["ignore"]}
    keep = [n for n in batch.schema.names if n not in drop]
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch.select(keep)])
    return batch.select(keep)


def region_values(table: MemWalTable, data: pa.Table, is_delete: bool) -> pa.RecordBatch:
    """Region values of upsert rows (full rows) or delete keys, as the writer computes them.

    :meth:`RegionWriter.put` checks ``spec.evaluate`` on the coerced rows, and
    :meth:`RegionWriter.delete` on the key table, so routing does exactly the same.
    """
    spec = require_spec(table)
    if is_delete:
        rows = coerce_keys(data, table.schema, table.primary_key)
    else:
        # partial updates (checked on the driver) may lack columns the spec does not read
        rows, missing = coerce_partial_rows(data, table.schema, table.primary_key)
        check_partial_sources(spec, missing, table.lance_schema)
    return spec.evaluate(rows, table.lance_schema)


def batch_region_ids(
    table: MemWalTable, batch: pa.RecordBatch, options: dict[str, Any]
) -> pa.Array:
    """Derived region id of every row of an input batch."""
    spec = require_spec(table)
    data = _data(batch, options)
    deletes = _delete_mask(batch, options)
    parts: list[tuple[np.ndarray, pa.Array]] = []
    for is_delete in (False, True):
        idx = np.flatnonzero(deletes == is_delete)
        if not len(idx):
            continue
        part = data if len(idx) == batch.num_rows else data.take(pa.array(idx))
        parts.append((idx, region_id_array(spec, region_values(table, part, is_delete))))
    if len(parts) == 1:
        return parts[0][1]
    # upserts and deletes: put each row's id back in its place
    where = np.empty(batch.num_rows, dtype=np.int64)
    where[np.concatenate([idx for idx, _ in parts])] = np.arange(batch.num_rows)
    return pa.concat_arrays([a for _, a in parts]).take(pa.array(where))


def route_batches(
    batches: Iterator[pa.RecordBatch], options: dict[str, Any]
) -> Iterator[pa.RecordBatch]:
    """:func:`route`: append the derived region id of every row (``__memwal_region``)."""
    table = open_table(options["uri"], options["storage_options"])
    for batch in batches:
        if batch.num_rows:
            ids = batch_region_ids(table, batch, options)
            yield batch.append_column(pa.field(REGION_COLUMN, pa.string(), nullable=False), ids)


def pack_batches(
    batches: Iterator[pa.RecordBatch], options: dict[str, Any]
) -> Iterator[pa.RecordBatch]:
    """Stage 1 of :func:`write`: each batch's rows of one region as one Arrow IPC blob.

    Yields ``(__memwal_region, payload)`` rows: the shuffle then moves a few blobs per
    input batch instead of converting every row to Spark's row format and back.
    """
    table = open_table(options["uri"], options["storage_options"])
    for batch in batches:
        if batch.num_rows == 0:
            continue
        ids = batch_region_ids(table, batch, options)
        regions: list[str] = []
        offsets = [0]
        out = pa.BufferOutputStream()  # every region's IPC stream, back to back
        for region_id, idx in split_by_value(ids):
            part = batch if len(idx) == batch.num_rows else batch.take(pa.array(idx))
            with pa.ipc.new_stream(out, part.schema) as w:
                w.write_batch(part)
            regions.append(region_id)
            offsets.append(out.tell())
        payload = pa.Array.from_buffers(
            pa.large_binary(),
            len(regions),
            [None, pa.py_buffer(np.asarray(offsets, dtype=np.int64)), out.getvalue()],
        )
        yield pa.RecordBatch.from_arrays(
            [pa.array(regions, pa.string()), payload.cast(pa.binary())], schema=PACKED_SCHEMA
        )


def unpack(payload: pa.Array) -> Iterator[pa.Table]:
    """The tables of a ``payload`` column (see :func:`pack_batches`)."""
    for i in range(len(payload)):
        yield pa.ipc.open_stream(payload[i].as_buffer()).read_all()


# -- executor side: writing ------------------------------------------------------------
class _RegionSink:
    """One region's writer inside a write task, with its row buffer."""

    def __init__(self, table: MemWalTable, region_id: str, options: dict[str, Any]) -> None:
        self.table = table
        self.region_id = region_id
        self.options = options
        self.writer: RegionWriter | None = None
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.upserted = 0
        self.deleted = 0
        self.generation: int | None = None
        # A row of the region and whether it was a delete (to claim the region again).
        self._first: tuple[pa.Table, bool] | None = None

    def _open(self, first: pa.Table, is_delete: bool) -> RegionWriter:
        if job_ended(self.options):  # do not even claim (it would fence a later job)
            raise JobEndedError(self.region_id, self.options["job"])
        values = region_values(self.table, first, is_delete)
        region = {name: values.column(name)[0].as_py() for name in values.schema.names}
        writer = self.table.writer(region_values=region, **self.options["writer_options"])
        if writer.region_id != self.region_id:  # routing and writer disagree: a bug
            writer.close(flush=False)
            raise MemWalError(
                f"routed region {self.region_id} but the writer derived {writer.region_id}"
            )
        # Checked again after claiming: no marker now means we claimed before the job
        # ended, so before any later job's claim, which then fences us.
        if job_ended(self.options):
            try:
                writer.close(flush=False)
            except MemWalError:  # fenced meanwhile: nothing of ours to keep
                pass
            raise JobEndedError(self.region_id, self.options["job"], writer.epoch)
        return writer

    def add(self, rows: pa.Table) -> None:
        """Buffer ``rows`` (input columns); write when ``buffer_rows`` are buffered.

        With ``order_by`` everything is kept until :meth:`finish`, which sorts it.
        """
        self.buffer.append(rows)
        self.buffered += rows.num_rows
        if not self.options["order"] and self.buffered >= self.options["buffer_rows"]:
            self.drain()

    def drain(self) -> None:
        """Write the buffer: one durable put/delete per run of upserts or deletes."""
        if not self.buffer:
            return
        rows = pa.concat_tables(self.buffer, promote_options="default")
        self.buffer, self.buffered = [], 0
        if self.options["order"]:
            rows = rows.sort_by([(c, "ascending") for c in self.options["order"]])
        deletes = _delete_mask(rows, self.options)
        data = _data(rows, self.options)
        bounds = np.flatnonzero(np.diff(deletes.astype(np.int8))) + 1
        schema, pk = self.table.schema, self.table.primary_key
        for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), rows.num_rows]):
            run = data.slice(start, end - start)
            is_delete = bool(deletes[start])
            if is_delete:
                keys = coerce_keys(run, schema, pk)
                self._retrying(run, is_delete, lambda w, k=keys: w.delete(k))
                self.deleted += keys.num_rows
            else:
                # Routed with spec.evaluate on these coerced rows: put without re-checking.
                full, missing = coerce_partial_rows(run, schema, pk)
                if missing and not self.options.get("partial"):
                    raise SchemaError(f"column(s) {missing} are missing from the input")
                self._retrying(run, is_delete, lambda w, f=full, m=missing: w._put_routed(f, m))
                self.upserted += run.num_rows
            fault("ingest.after_put")
            if armed("ingest.fence_after_put"):  # tests: another writer claims the region
                assert self.writer is not None
                self.table.writer(region_values=self.writer.region_values).close(flush=False)

    def _retrying(self, run: pa.Table, is_delete: bool, put: Any) -> Any:
        """``put(writer)``, claiming the region again when another writer fenced ours
        (the fenced put was not acknowledged; the new claim replays what was)."""
        if self._first is None:
            self._first = (run.slice(0, 1), is_delete)
        retries = self.options.get("fence_retries", DEFAULT_FENCE_RETRIES)
        for attempt in range(retries + 1):
            if self.writer is None:
                self.writer = self._open(run.slice(0, 1), is_delete)
            try:
                return put(self.writer)
            except JobEndedError:
                raise
            except FencedError:
                self.abort()
                self.writer = None
                if attempt == retries:
                    raise
                time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def finish(self) -> None:
        """Write what is buffered, then flush (or sync the WAL) and close the writer."""
        self.drain()
        if self.writer is None:
            return
        if self.options["flush"]:
            # Fenced here, the rows are still durable (acknowledged): flush them through
            # a new claim, which replays them.
            assert self._first is not None
            self.generation = self._retrying(*self._first, lambda w: w.flush())
        assert self.writer is not None
        self.writer.close(flush=False)  # without flush: syncs the WAL, replayed later

    def abort(self) -> None:
        """Close without flushing (the WAL keeps what was acknowledged)."""
        if self.writer is not None:
            try:
                self.writer.close(flush=False)
            except Exception:  # noqa: BLE001 - the task is failing anyway
                pass


def _task_info() -> tuple[int, int]:
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover
        return 0, 0
    ctx = TaskContext.get()
    if ctx is None:
        return 0, 0
    return ctx.partitionId(), ctx.attemptNumber()


def write_partition(
    batches: Iterator[pa.RecordBatch], options: dict[str, Any]
) -> Iterator[pa.RecordBatch]:
    """Stage 2: write a partition's packed rows through one RegionWriter per region.

    Input: :func:`pack_batches` output. Yields one small result batch
    (:data:`RESULT_SCHEMA`) once every region's rows are durable (flushed or in the
    WAL), so Spark sees success only after durability.
    """
    partition, attempt = _task_info()
    table = open_table(options["uri"], options["storage_options"])
    sinks: dict[str, _RegionSink] = {}
    try:
        for batch in batches:
            regions = batch.column(REGION_COLUMN).to_pylist()
            for region_id, rows in zip(regions, unpack(batch.column(PAYLOAD_COLUMN))):
                sink = sinks.get(region_id)
                if sink is None:
                    sink = sinks[region_id] = _RegionSink(table, region_id, options)
                sink.add(rows)
        concurrently(lambda sink: sink.finish(), sinks.values())
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    out: dict[str, list] = {name: [] for name in RESULT_SCHEMA.names}
    for region_id, sink in sorted(sinks.items()):
        out["region_id"].append(region_id)
        out["upserted"].append(sink.upserted)
        out["deleted"].append(sink.deleted)
        out["generation"].append(sink.generation)
        out["epoch"].append(sink.writer.epoch if sink.writer is not None else None)
        out["partition"].append(partition)
        out["attempt"].append(attempt)
    if sinks:
        yield pa.RecordBatch.from_pydict(out, schema=RESULT_SCHEMA)
