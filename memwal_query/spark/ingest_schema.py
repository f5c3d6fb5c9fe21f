"""Constants and Arrow schemas shared by the driver and executor sides of Spark ingest."""

from __future__ import annotations

import pyarrow as pa

from memwal_query.spark._common import REGION_COLUMN
from memwal_query.write.routing import DEFAULT_BUFFER_ROWS, DEFAULT_FENCE_RETRIES

__all__ = ["DEFAULT_BUFFER_ROWS", "DEFAULT_FENCE_RETRIES"]

MODES = ("upsert", "delete")
FLUSH_DUE = "due"
"""``flush=`` value: flush a region's rows when the writer's flush thresholds say so."""
FLUSH_MODES = (True, False, FLUSH_DUE)
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
        pa.field("already_written", pa.bool_()),
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
    "partition int, attempt int, already_written boolean"
)
