"""Batch ingest of a Spark DataFrame into the regions of a MemWAL table.

:func:`write` routes every row to its region with the region spec (the same
:meth:`RegionSpec.evaluate` as :meth:`MemWalTable.write`, in a ``mapInArrow`` stage),
shuffles each region's rows to one task, and writes them there through one
:class:`RegionWriter` per region as durable WAL entries, flushing them as generations
per ``flush``. It returns a :class:`WriteResult` once every row is durable.
:func:`route` gives the region id of every row, to inspect the routing.

Contract: a retried or speculative task attempt fences the earlier one and writes the
same rows again, so the deduplicated view neither loses nor doubles rows; an attempt
that outlives its job (the job's end marker under ``_mem_wal/_spark/jobs/``) writes
nothing and fails with :class:`~memwal_query.spark.JobEndedError`. Rows of one key
within one call are applied in ``order_by`` order when given (otherwise in the order
they reach the task); across calls, in call order. A job that fails for good may
leave part of its rows written; running it again converges to the same view.

Stages, retries, markers and ordering: docs/spark.md ("Ingest: one job, two stages").
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.exceptions import (
    FencedError,
    JobEndedError,
    MemWalError,
    PrimaryKeyError,
    SchemaError,
)
from memwal_query.regions.spec import check_partial_sources
from memwal_query.spark._common import (
    REGION_COLUMN,
    deprecated_spelling,
    open_table,
    require_spec,
)
from memwal_query.spark.ingest_schema import (
    DEFAULT_BUFFER_ROWS,
    DEFAULT_FENCE_RETRIES,
    FLUSH_MODES,
    MODES,
    PACKED_DDL,
    RESULT_DDL,
)
from memwal_query.spark.ingest_tasks import (
    end_job,
    job_failure,
    new_job,
    pack_batches,
    route_batches,
    write_partition,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from memwal_query.table import MemWalTable


@dataclass(frozen=True)
class RegionWriteResult:
    """What one Spark task wrote into one region.

    Attributes
    ----------
    region_id : str
    upserted, deleted : int
        Rows put and keys deleted.
    generation : int or None
        Newest generation flushed by the task (None when it flushed none).
    epoch : int
        Writer epoch the task claimed the region with.
    partition, attempt : int
        Spark partition id and attempt number of the task.
    already_written : bool
        The region already held this write's ``stream_batch`` durably (an earlier
        attempt of the batch wrote it): the rows are counted, nothing was written again.
    """

    region_id: str
    upserted: int
    deleted: int
    generation: int | None
    epoch: int
    partition: int
    attempt: int
    already_written: bool = False


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
    parallelism: int | None = None,
    flush: bool | str = True,
    buffer_rows: int = DEFAULT_BUFFER_ROWS,
    writer_options: dict[str, Any] | None = None,
    storage_options: dict[str, str] | None = None,
    partial: bool = False,
    fence_retries: int = DEFAULT_FENCE_RETRIES,
    num_partitions: int | None = None,
    schema_mode: str | None = None,
    stream_batch: tuple[str, int] | None = None,
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
    parallelism : int, optional
        Write tasks (each owns whole regions). Default: the session's default
        parallelism.
    flush : {True, False, "due"}
        ``True`` (default): each task flushes its MemTables as generations before it
        reports success. ``"due"``: a task flushes a region only when its unflushed
        rows (those replayed from the region's WAL included) pass the writer's
        ``max_memtable_rows``, ``max_memtable_bytes``, ``max_wal_entries`` or
        ``max_memtable_age`` (their defaults, or ``writer_options``); the rest stays in
        the WAL, so repeated small writes (a stream's micro-batches) make generations
        by size and age and each task replays at most that much. ``False``: the rows
        stay in the WAL. Rows in the WAL are durable and every default reader sees them;
        the next writer of the region replays them.
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
    num_partitions : int, optional
        Deprecated spelling of ``parallelism``.
    schema_mode : {None, "merge"}
        Columns of the DataFrame the table lacks: None (default) refuses them;
        ``"merge"`` adds them (nullable, with their Arrow types) before any task runs,
        as :meth:`MemWalTable.write` does (``order_by`` columns that are not table
        columns stay sort-only).
    stream_batch : tuple of (str, int), optional
        ``(stream id, batch id)``: this write is that batch of a stream (the streaming
        sink passes its sink id and Spark's batch id; batch ids of a stream grow). Each
        task holds a region's rows to its end and writes them as one WAL entry that
        records the batch; a task writing the batch again (a retried task, a replayed
        micro-batch) writes nothing into a region that already holds it durably (see
        docs/spark.md, "Exactly-once, physically").

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
    if num_partitions is not None:
        deprecated_spelling("memwal_query.spark.write(num_partitions=)", "parallelism=")
        parallelism = num_partitions if parallelism is None else parallelism
    if parallelism is None:
        parallelism = max(1, df.sparkSession.sparkContext.defaultParallelism)
    order = [order_by] if isinstance(order_by, str) else list(order_by or [])
    if schema_mode == "merge" and (mode == "upsert" or delete_column is not None):
        _add_columns(df, uri, storage_options, [delete_column, *order])
    elif schema_mode is not None:
        raise ValueError(f"schema_mode must be None or 'merge', got {schema_mode!r}")
    options = _options(
        df, uri, mode, delete_column, order, storage_options, flush, buffer_rows, writer_options
    )
    options["partial"] = bool(partial)
    options["fence_retries"] = max(0, int(fence_retries))
    if stream_batch is not None:
        stream, number = stream_batch
        if not isinstance(stream, str) or not stream or int(number) < 0:
            raise MemWalError(f"stream_batch={stream_batch!r}: give (stream id, batch id >= 0)")
        options["stream_batch"] = (stream, int(number))
    if mode == "upsert" or delete_column is not None:
        data = [c for c in df.columns if c not in options["ignore"]]
        table = open_table(uri, storage_options)
        missing = [c for c in table.schema.names if c not in data]
        if partial:
            check_partial_sources(require_spec(table), missing, table.catalog.lance_schema)
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
            .repartition(parallelism, REGION_COLUMN)
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
    failure = job_failure(options)
    if failure is not None:  # bad input values, found while routing: nothing written
        raise failure
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

    Parameters
    ----------
    df : DataFrame
    uri : str
        The table.
    mode : str
        ``"upsert"`` or ``"delete"``, as for :func:`write`.
    delete_column : str, optional
        As for :func:`write`.
    storage_options : dict, optional
        Object-store options.

    Returns
    -------
    DataFrame
        ``df`` with the column ``__memwal_region``.
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
    flush: bool | str = True,
    buffer_rows: int = DEFAULT_BUFFER_ROWS,
    writer_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate the request in the driver; the options the executor functions get."""
    if mode not in MODES:
        raise MemWalError(f"mode must be one of {MODES}, got {mode!r}")
    if not any(flush is m or (isinstance(m, str) and flush == m) for m in FLUSH_MODES):
        raise MemWalError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
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
            raise SchemaError(
                f"column(s) {extra} are not in the table schema {table.schema.names}; add "
                "them with t.alter.add_columns(...), or write with schema_mode='merge'"
            )
        _check_types(df, table, data)
    else:
        _check_types(df, table, table.primary_key)
    if delete_column is not None:
        flag = _arrow_type(df.schema[delete_column].dataType)
        if flag is not None and not (pa.types.is_boolean(flag) or pa.types.is_integer(flag)):
            raise SchemaError(f"delete_column {delete_column!r} must be boolean, not {flag}")
    return ignore


def _add_columns(
    df: DataFrame, uri: str, storage_options: dict[str, str] | None, skip: list[str | None]
) -> None:
    """Add the DataFrame's columns the table lacks (``schema_mode="merge"``)."""
    from memwal_query.format.schema import extra_columns

    table = open_table(uri, storage_options)
    names = [c for c in df.columns if c not in skip and c != REGION_COLUMN]
    fields = []
    for c in names:
        if table.schema.get_field_index(c) >= 0:
            continue
        t = _arrow_type(df.schema[c].dataType)
        if t is None:
            raise SchemaError(f"column {c!r}: Spark type {df.schema[c].dataType} has no Arrow type")
        fields.append(pa.field(c, t))
    extra = extra_columns(pa.schema(fields), table.schema)
    if extra:
        table.alter.add_columns(extra)


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
