"""The change feed and time travel in Spark (see :mod:`memwal_query.read.changes`).

Batch::

    df = spark.read.format("memwal").option("changes_since", cursor).load(uri)
    df, cursor = changes_frame(spark, uri, since=cursor)   # spark.source; the next cursor

``changes_since`` is a cursor, a base version, an ISO timestamp, or ``earliest``.
The end of the read is fixed when Spark plans it (option ``changes_until``, default
the end of the feed then), and each region is one partition reading its WAL entries
``(since, until]``: re-running the plan reads the same changes.

Structured Streaming::

    q = (spark.readStream.format("memwal").option("changes_since", "earliest")
         .option("consumer", "etl").load(uri)
         .writeStream.option("checkpointLocation", ckpt)...start())

Offsets are ``{"r": {region: position}}`` JSON; Spark stores them in the checkpoint,
so a restarted query resumes after the last committed batch. With
``option("consumer", name)`` each offset Spark commits is registered as that
consumer's cursor, so GC keeps what the query has not consumed (Spark commits a
batch's source offsets when the next batch starts: the registration trails by up to
one batch, which only makes GC keep more). Start Spark before lance is imported in
the driver process (see the README): a streaming source's planning worker did not
start otherwise in our tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from memwal_query.read.changes import (
    Cursor,
    change_schema,
    changes,
    end_cursor,
    start_cursor,
)
from memwal_query.read.consumers import _earliest_positions
from memwal_query.read.view import DEFAULT_CONSISTENCY
from memwal_query.spark._common import (
    CHANGES_SINCE,
    _spark_compatible,
    _spark_schema,
    _storage_options,
    open_table,
)

if TYPE_CHECKING:
    from memwal_query.table import MemWalTable

SINCE = CHANGES_SINCE
UNTIL = "changes_until"


def spark_changes_schema(table: MemWalTable) -> StructType:
    """Spark schema of the change feed of ``table``."""
    return _spark_schema(change_schema(table.schema))


class RegionChanges(InputPartition):
    """WAL entries ``(start, end]`` of one region."""

    def __init__(self, region_id: str, start: int, end: int) -> None:
        super().__init__((region_id, start, end))
        self.region_id = region_id
        self.start = start
        self.end = end


def _start(table: MemWalTable, since: str | None) -> Cursor:
    if since is None or since.strip().lower() in ("", "earliest"):
        return Cursor(_earliest_positions(table.catalog), table.catalog.lineage)
    cursor = start_cursor(table.catalog, since)
    assert cursor is not None
    return cursor


def _split(start: Cursor, end: Cursor) -> list[InputPartition]:
    return [
        RegionChanges(r, start.positions.get(r, 0), e)
        for r, e in sorted(end.positions.items())
        if e > start.positions.get(r, 0)
    ]


class _ChangesReading:
    """What the batch and streaming readers share: options and reading one region."""

    def __init__(self, uri: str, options: dict[str, str], schema: StructType) -> None:
        self.uri = uri
        self.options = {k.lower(): v for k, v in options.items()}
        self.storage_options = _storage_options(self.options)
        self.consistency = self.options.get("consistency", DEFAULT_CONSISTENCY)
        self.spark_schema = schema

    def _read_region(self, part: RegionChanges) -> Iterator[pa.RecordBatch]:
        table = open_table(self.uri, self.storage_options)
        got = changes(
            table.catalog,
            Cursor({part.region_id: part.start}, table.catalog.lineage),
            consistency="latest",
            regions=[part.region_id],
            until=Cursor({part.region_id: part.end}, table.catalog.lineage),
        ).table
        fields = [pa.field(f.name, _spark_compatible(f.type), f.nullable) for f in got.schema]
        out = got.cast(pa.schema(fields))
        yield from out.to_batches()


class MemWalChangesReader(_ChangesReading, DataSourceReader):
    """Batch reader of the change feed (one partition per region)."""

    def partitions(self) -> list[InputPartition]:
        """Fix ``(since, until]`` now and split it by region."""
        table = open_table(self.uri, self.storage_options)
        start = _start(table, self.options.get(SINCE))
        until = self.options.get(UNTIL)
        end = (
            start_cursor(table.catalog, until)
            if until
            else end_cursor(table.catalog, self.consistency)
        )
        assert end is not None
        return _split(start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The changes of one region's range."""
        assert isinstance(partition, RegionChanges)
        yield from self._read_region(partition)


class MemWalChangesStreamReader(_ChangesReading, DataSourceStreamReader):
    """Structured Streaming source of the change feed (offsets: per-region positions)."""

    def initialOffset(self) -> dict:  # noqa: N802 - PySpark's name
        """Where a new query starts (``changes_since``, default the earliest kept)."""
        table = open_table(self.uri, self.storage_options)
        return {"r": _start(table, self.options.get(SINCE)).positions}

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:  # noqa: N802
        """The end of the feed now (PySpark's name; ``start``/``limit`` of its admission
        control are not used: every change up to the end is one batch)."""
        table = open_table(self.uri, self.storage_options)
        return {"r": end_cursor(table.catalog, self.consistency).positions}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """One partition per region with changes in ``(start, end]``."""
        return _split(Cursor(dict(start["r"])), Cursor(dict(end["r"])))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The changes of one region's range."""
        assert isinstance(partition, RegionChanges)
        yield from self._read_region(partition)

    def commit(self, end: dict) -> None:
        """Spark committed everything up to ``end``: advance the registered consumer."""
        name = self.options.get("consumer")
        if name:
            table = open_table(self.uri, self.storage_options)
            table.consumers.register(name, Cursor(dict(end["r"]), table.catalog.lineage))
