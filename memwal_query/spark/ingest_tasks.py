"""Executor side of :mod:`memwal_query.spark.ingest`: write-job markers, routing rows
to regions, packing them for the shuffle, and writing one region's rows per task
(:func:`write_partition`, run by ``mapInArrow``).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    AlreadyExistsError,
    FencedError,
    JobEndedError,
    MemWalError,
    ObjectNotFoundError,
    PrimaryKeyError,
    SchemaError,
)
from memwal_query.format.rowfile import aligned
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
from memwal_query.write.routing import concurrently

if TYPE_CHECKING:
    from memwal_query.table import MemWalTable
    from memwal_query.write.writer import RegionWriter

from memwal_query.spark.ingest_schema import (
    DEFAULT_FENCE_RETRIES,
    FLUSH_DUE,
    JOB_MARKER_TTL,
    PACKED_SCHEMA,
    PAYLOAD_COLUMN,
    RESULT_SCHEMA,
)


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
            old = stamp.isdigit() and int(stamp) < cutoff
            if old and (name.endswith(".done") or name.endswith(".failed")):
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


def fail_job(options: dict[str, Any], error: SchemaError) -> None:
    """Executor: record that this task's rows are bad input (a NULL key, a value that does
    not convert), instead of failing the task: Spark would print the executor's Java
    stack trace on the console. The first failure recorded wins; the write stage then
    writes nothing (:func:`job_failure`) and the driver raises it."""
    io = file_io_for(options["uri"], options["storage_options"])
    body = json.dumps({"type": type(error).__name__, "message": str(error)}).encode()
    try:
        io.put_if_not_exists(join(jobs_dir(options["uri"]), f"{options['job']}.failed"), body)
    except AlreadyExistsError:
        pass


def job_failure(options: dict[str, Any]) -> SchemaError | None:
    """The bad-input error a task of this write job recorded (:func:`fail_job`), or None."""
    io = file_io_for(options["uri"], options["storage_options"])
    try:
        found = json.loads(io.read(join(jobs_dir(options["uri"]), f"{options['job']}.failed")))
    except ObjectNotFoundError:
        return None
    cls = PrimaryKeyError if found.get("type") == "PrimaryKeyError" else SchemaError
    return cls(str(found.get("message", "")))


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
        check_partial_sources(spec, missing, table.catalog.lance_schema)
    return spec.evaluate(rows, table.catalog.lance_schema)


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
    input batch instead of converting every row to Spark's row format and back. Rows
    that cannot be written (a NULL key, a value that does not convert) end the task
    quietly, recorded by :func:`fail_job` (stage 2 starts only after every stage-1 task
    ended, so it sees the record and writes nothing).
    """
    table = open_table(options["uri"], options["storage_options"])
    for batch in batches:
        if batch.num_rows == 0:
            continue
        try:
            ids = batch_region_ids(table, batch, options)
        except SchemaError as e:  # bad input: recorded for the driver, nothing written
            fail_job(options, e)
            return
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
        yield aligned(pa.ipc.open_stream(payload[i].as_buffer()).read_all())


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
        # The region already held this write's stream batch: nothing was written again.
        self.skipped = False
        # A run of the batch other than its last was (maybe) written: every later run is
        # then written too (see _applied).
        self._wrote_part = False
        # A row of the region and whether it was a delete (to claim the region again).
        self._first: tuple[pa.Table, bool] | None = None

    def _open(self, first: pa.Table, is_delete: bool) -> RegionWriter:
        if job_ended(self.options):  # do not even claim (it would fence a later job)
            raise JobEndedError(self.region_id, self.options["job"])
        spec_id = require_spec(self.table).spec_id
        values = region_values(self.table, first, is_delete)
        region = {name: values.column(name)[0].as_py() for name in values.schema.names}
        writer = self.table.writer(
            region_values=region, spec_id=spec_id, **self.options["writer_options"]
        )
        if writer.region_id != self.region_id:
            # Routing and writer disagree: the spec changed after the rows were routed
            # (a retried task opens the table again), or a bug.
            writer.close(flush=False)
            raise MemWalError(
                f"routed region {self.region_id} but the writer derived {writer.region_id} "
                f"(region spec {spec_id}): if the table's region spec changed during the "
                "job, run the job again (upserts and deletes are idempotent)"
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

        With ``order_by`` or ``stream_batch`` everything is kept until :meth:`finish`
        (sorted, and written as one WAL entry recording the batch).
        """
        self.buffer.append(rows)
        self.buffered += rows.num_rows
        held = self.options["order"] or self.options.get("stream_batch")
        if not held and self.buffered >= self.options["buffer_rows"]:
            self.drain()

    def _applied(self, writer: RegionWriter) -> bool:
        """Whether the region already holds this write's stream batch durably (an earlier
        attempt of the same batch got that far): then nothing is written again.

        Only decided before this attempt wrote (or tried to write) a run of the batch
        that does not record it: a racing attempt's entry recording the batch may have
        been adopted during that write, and the run stored after it; skipping the later
        runs would leave that run's rows over the batch's later ones (a delete lost).
        Such an attempt writes every run (rows stored twice, the batch's order kept)."""
        batch = self.options.get("stream_batch")
        if batch is None or (self._wrote_part and not self.skipped):
            return False
        if writer.applied_batch(batch[0]) == batch[1]:
            self.skipped = True
        return self.skipped

    def _run(self, writer: RegionWriter, tag: tuple[str, int] | None, write: Any) -> Any:
        """``write()`` one run of the buffer unless the region already holds the batch
        (:meth:`_applied`); ``tag``: the batch the run records (None: not the last)."""
        if self._applied(writer):
            return True
        if tag is None and self.options.get("stream_batch") is not None:
            self._wrote_part = True  # before the write: it may land even if it raises
        return write()

    def drain(self) -> None:
        """Write the buffer: one durable put/delete per run of upserts or deletes (the
        last one records the stream batch, if any)."""
        if not self.buffer:
            return
        rows = pa.concat_tables(self.buffer, promote_options="default")
        self.buffer, self.buffered = [], 0
        if self.options["order"]:
            rows = rows.sort_by([(c, "ascending") for c in self.options["order"]])
        deletes = _delete_mask(rows, self.options)
        data = _data(rows, self.options)
        schema, pk = self.table.schema, self.table.primary_key
        batch = self.options.get("stream_batch")
        if deletes.any() and not deletes.all() and not self.options.get("partial"):
            self._put_and_delete(data, deletes, batch)
            return
        bounds = np.flatnonzero(np.diff(deletes.astype(np.int8))) + 1
        starts, ends = [0, *bounds.tolist()], [*bounds.tolist(), rows.num_rows]
        for i, (start, end) in enumerate(zip(starts, ends)):
            run = data.slice(start, end - start)
            is_delete = bool(deletes[start])
            tag = batch if i == len(starts) - 1 else None
            if is_delete:
                keys = coerce_keys(run, schema, pk)
                self._retrying(
                    run,
                    is_delete,
                    lambda w, k=keys, b=tag: self._run(w, b, lambda: w._delete_routed(k, b)),
                )
                self.deleted += keys.num_rows
            else:
                # Routed with spec.evaluate on these coerced rows: put without re-checking.
                full, missing = coerce_partial_rows(run, schema, pk)
                if missing and not self.options.get("partial"):
                    raise SchemaError(f"column(s) {missing} are missing from the input")
                self._retrying(
                    run,
                    is_delete,
                    lambda w, f=full, m=missing, b=tag: self._run(
                        w, b, lambda: w._put_routed(f, m, b)
                    ),
                )
                self.upserted += run.num_rows
            fault("ingest.after_put")
            if armed("ingest.fence_after_put"):  # tests: another writer claims the region
                assert self.writer is not None
                self.table.writer(region_values=self.writer.region_values).close(flush=False)

    def _put_and_delete(
        self, data: pa.Table, deletes: np.ndarray, batch: tuple[str, int] | None
    ) -> None:
        """Interleaved upserts and deletes as one durable write, in their order,
        recording ``batch``."""
        schema, pk = self.table.schema, self.table.primary_key
        up_idx, del_idx = np.flatnonzero(~deletes), np.flatnonzero(deletes)
        keys = coerce_keys(data.take(pa.array(del_idx)), schema, pk)
        full, missing = coerce_partial_rows(data.take(pa.array(up_idx)), schema, pk)
        if missing:
            raise SchemaError(f"column(s) {missing} are missing from the input")
        order = pa.array(np.argsort(np.concatenate([up_idx, del_idx]), kind="stable"))
        first = int(up_idx[0])  # claims the region by an upsert row, as a put would
        self._retrying(
            data.slice(first, 1),
            False,
            lambda w: self._applied(w) or w._put_and_delete_routed(full, keys, order, batch),
        )
        self.upserted += full.num_rows
        self.deleted += keys.num_rows
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
        """Write what is buffered, then flush (always, when due, or never: see
        :func:`memwal_query.spark.write`'s ``flush``) and close the writer."""
        self.drain()
        if self.writer is None:
            return
        flush = self.options["flush"]
        if flush is True or flush == FLUSH_DUE:
            # Fenced here, the rows are still durable (acknowledged): flush them through
            # a new claim, which replays them.
            assert self._first is not None
            if flush is True:
                self.generation = self._retrying(*self._first, lambda w: w.flush())
            else:  # by the writer's thresholds; the rest stays in the WAL
                self._retrying(*self._first, lambda w: w.flush_due())
                assert self.writer is not None
                flushed = self.writer.stats.flushed_generations  # while writing, too
                self.generation = flushed[-1] if flushed else None
        assert self.writer is not None
        # Without flush: syncs the WAL, replayed later. Rows left in the WAL on purpose
        # wait for the next batch's writer (handoff), not for maintenance's next pass.
        self.writer.close(flush=False, handoff=flush is not True)

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
    if job_failure(options) is not None:  # a routing task found bad input: write nothing
        return
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
        out["already_written"].append(sink.skipped)
    if sinks:
        yield pa.RecordBatch.from_pydict(out, schema=RESULT_SCHEMA)
