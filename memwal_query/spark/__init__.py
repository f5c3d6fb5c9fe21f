"""Apache Spark (PySpark 4.x) integration: ingest, streaming sink, merge, reader.

::

    from memwal_query import spark as mqs

    mqs.write(df, uri, mode="upsert")                      # batch DataFrame -> regions
    query = stream_df.writeStream.foreachBatch(mqs.sink(uri)).start()
    mqs.merge(spark, uri)                                  # merge regions as Spark tasks
    mqs.maintain(spark, uri, policy=MaintenancePolicy())   # merge over a policy, catch up, GC
    mqs.register_source(spark)
    spark.read.format("memwal").load(uri)                  # deduplicated LSM view

Needs the ``spark`` extra (``pip install memwal_query[spark]``) and a table initialized
with a region spec. Importing this module sets ``PYSPARK_PYTHON`` to the running
interpreter when it is unset (:func:`~memwal_query.spark._common.default_worker_python`).
See ``docs/spark.md`` and the submodules for the guarantees:
:mod:`~memwal_query.spark.ingest` (routing, task retries and fencing),
:mod:`~memwal_query.spark.streaming` (exactly-once micro-batches),
:mod:`~memwal_query.spark.merge` (commit coordination) and
:mod:`~memwal_query.spark.source` (partitions, pruning, pushdown).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memwal_query.exceptions import JobEndedError
from memwal_query.spark._common import (
    REGION_COLUMN,
    InjectedFault,
    default_worker_python,
    region_id_array,
)

# Submodules named like a function (merge, maintain) are imported now, so that the
# functions, bound after them, are what the names hold; both are light.
from memwal_query.spark.maintain import MaintainSummary, maintain
from memwal_query.spark.merge import MergedGeneration, MergeSummary, merge, pending_generations

if TYPE_CHECKING:
    from memwal_query.spark.datasource import MemWalDataSource
    from memwal_query.spark.ingest import RegionWriteResult, WriteResult, route, write
    from memwal_query.spark.source import (
        changes_frame,
        filter_expression,
        read,
        register_source,
    )
    from memwal_query.spark.streaming import MemWalSink, sink

# Loaded on first use: a Spark Python worker that only reads (it unpickles the data
# source from memwal_query.spark.source) imports neither ingest nor the sink.
_LAZY = {
    "RegionWriteResult": "ingest",
    "WriteResult": "ingest",
    "route": "ingest",
    "write": "ingest",
    "MemWalDataSource": "datasource",
    "changes_frame": "source",
    "filter_expression": "source",
    "read": "source",
    "register_source": "source",
    "MemWalSink": "streaming",
    "sink": "streaming",
}


_SUBMODULES = frozenset(
    ["changes", "datasource", "ingest", "ingest_schema", "ingest_tasks", "source", "streaming"]
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"memwal_query.spark.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memwal_query.spark' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memwal_query.spark.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


default_worker_python()  # workers run this interpreter unless PYSPARK_PYTHON says otherwise

__all__ = [
    "REGION_COLUMN",
    "InjectedFault",
    "JobEndedError",
    "MaintainSummary",
    "MemWalDataSource",
    "MemWalSink",
    "MergeSummary",
    "MergedGeneration",
    "RegionWriteResult",
    "WriteResult",
    "changes_frame",
    "filter_expression",
    "maintain",
    "merge",
    "pending_generations",
    "read",
    "region_id_array",
    "route",
    "register_source",
    "sink",
    "write",
]
