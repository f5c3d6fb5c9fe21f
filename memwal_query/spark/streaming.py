"""Structured Streaming sink: ``foreachBatch(mqs.sink(uri))``.

:func:`sink` returns a :class:`MemWalSink` that writes each micro-batch with
:func:`memwal_query.spark.write` (``flush="due"`` by default: a region becomes a
generation when its unflushed rows pass a long-lived writer's thresholds) and returns
only once every row of the batch is durable.

Contract: exactly once, in the deduplicated view and in storage. A marker per
committed batch (``_mem_wal/_spark/sinks/{sink_id}/{batch_id:020d}.json``,
put-if-not-exists after the batch's rows are durable) makes a replayed batch whose id
is not above the newest marker a no-op. A batch replayed before its marker is written
again with ``stream_batch=(sink_id, batch_id)``: each region's rows of a batch are one
WAL entry recording the batch, and a region that already holds the batch (in its WAL
tail or, once flushed, in its manifest) is skipped, so no row is stored twice.
``sink_id`` defaults to the streaming query's id (kept in the checkpoint); the newest
``keep_markers`` markers are kept.

The crash cases, the exceptions and the flush policy: docs/spark.md ("Streaming sink:
exactly-once, in the view and in storage").
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import AlreadyExistsError, MemWalError
from memwal_query.spark._common import SPARK_DIR, fault
from memwal_query.spark.ingest import WriteResult, write
from memwal_query.spark.ingest_schema import FLUSH_DUE
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import join, normalize_uri
from memwal_query.storage.paths import mem_wal_root

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_SINK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MARKER = re.compile(r"^(\d{20})\.json$")
QUERY_ID_PROPERTY = "sql.streaming.queryId"


def markers_dir(uri: str, sink_id: str) -> str:
    """``{table}/_mem_wal/_spark/sinks/{sink_id}``."""
    if not _SINK_ID.match(sink_id):
        raise MemWalError(f"sink id {sink_id!r} must match {_SINK_ID.pattern}")
    return join(mem_wal_root(normalize_uri(uri)), SPARK_DIR, "sinks", sink_id)


class MemWalSink:
    """``foreachBatch`` function writing each micro-batch into a MemWAL table.

    Obtain one with :func:`sink`. Picklable; holds no Spark or writer state between
    batches (each batch claims its regions anew, replaying their WAL).

    Parameters
    ----------
    uri : str
        Table URI (initialized, with a region spec).
    sink_id : str, optional
        Key of the committed-batch markers; default: the streaming query id.
    keep_markers : int
        Markers kept (older ones are deleted).
    storage_options : dict, optional
        Object-store options of the table.
    **write_options
        Passed to :func:`memwal_query.spark.write` (``mode``, ``delete_column``,
        ``order_by``, ``flush`` (default ``"due"``), ``writer_options``,
        ``parallelism``...).
    """

    def __init__(
        self,
        uri: str,
        sink_id: str | None = None,
        keep_markers: int = 100,
        storage_options: dict[str, str] | None = None,
        **write_options: Any,
    ) -> None:
        self.uri = normalize_uri(uri)
        self.sink_id = sink_id
        if sink_id is not None:
            markers_dir(self.uri, sink_id)  # validate early
        self.keep_markers = max(1, keep_markers)
        self.storage_options = dict(storage_options or {})
        self.write_options = {"flush": FLUSH_DUE, **write_options}
        self.last_result: WriteResult | None = None
        self.skipped: list[int] = []

    def _sink_id(self, batch_df: DataFrame) -> str:
        if self.sink_id is not None:
            return self.sink_id
        query_id = batch_df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
        if not query_id:
            raise MemWalError(
                "the streaming query id is not available here; pass sink_id= to mqs.sink"
            )
        return query_id

    def committed_batches(self, sink_id: str) -> list[int]:
        """Batch ids with a marker, ascending."""
        io = file_io_for(self.uri, self.storage_options)
        out = []
        for name in io.list(markers_dir(self.uri, sink_id)):
            m = _MARKER.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        """Write one micro-batch (skipped when its marker says it is already written)."""
        sink_id = self._sink_id(batch_df)
        done = self.committed_batches(sink_id)
        if done and batch_id <= done[-1]:
            self.skipped.append(batch_id)
            return
        started = time.time()
        result = write(
            batch_df,
            self.uri,
            storage_options=self.storage_options,
            stream_batch=(sink_id, batch_id),
            **self.write_options,
        )
        self.last_result = result
        fault("sink.before_marker")
        self._mark(sink_id, batch_id, result, started, done)
        fault("sink.after_marker")

    def _mark(
        self, sink_id: str, batch_id: int, result: WriteResult, started: float, done: list[int]
    ) -> None:
        io = file_io_for(self.uri, self.storage_options)
        directory = markers_dir(self.uri, sink_id)
        body = {
            "batch_id": batch_id,
            "upserted": result.upserted,
            "deleted": result.deleted,
            "regions": result.by_region(),
            "started": started,
            "committed": time.time(),
        }
        try:
            io.put_if_not_exists(
                join(directory, f"{batch_id:020d}.json"), json.dumps(body).encode()
            )
        except AlreadyExistsError:
            pass  # a concurrent replay of the same batch marked it first
        for old in done[: max(0, len(done) + 1 - self.keep_markers)]:
            io.delete(join(directory, f"{old:020d}.json"))


def sink(uri: str, sink_id: str | None = None, **options: Any) -> MemWalSink:
    """A ``foreachBatch`` function writing micro-batches into the table at ``uri``.

    Example::

        query = (stream_df.writeStream.foreachBatch(mqs.sink(uri))
                 .option("checkpointLocation", ckpt).start())

    Parameters
    ----------
    uri : str
        The table.
    sink_id : str, optional
        Names the sink's batch markers (see :class:`MemWalSink`).
    **options
        The other parameters of :class:`MemWalSink`.

    Returns
    -------
    MemWalSink
        Callable as ``(batch_df, batch_id)``; exactly-once per batch id (see
        docs/spark.md).
    """
    return MemWalSink(uri, sink_id, **options)
