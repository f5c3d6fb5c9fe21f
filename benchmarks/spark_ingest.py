"""Spark ingest throughput: memwal_query regions vs plain Lance ``merge_insert``.

One run, one local SparkSession, the same rows (half updates of existing keys, half new
keys) written into copies of the same base table by

- ``mqs.write``: route by region spec (16 bucket regions), one task per group of
  regions, durable WAL puts, each region flushed as a generation before the task ends
  (and once more with ``flush=False``: durable in the WAL only);
- ``merge_insert per task``: Spark tasks each ``merge_insert`` their partition into the
  base table (concurrent commits; Lance retries conflicts);
- ``merge_insert from driver``: the rows collected to the driver (``toArrow``) and
  written with one ``merge_insert``;
- and, for reference, ``mqs.merge`` of the regions written by ``mqs.write`` (the
  deferred cost of the LSM write).

Prints rows/s per method. Run: ``python benchmarks/spark_ingest.py`` (``--quick`` for a
smaller run). Needs PySpark and Java 17.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.regions.spec import bucket_spec  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
        pa.field("name", pa.string()),
    ]
)


def base_rows(n: int) -> pa.Table:
    ids = np.arange(n, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "val": ids * 1.0,
            "cat": (ids % 100).astype(np.int32),
            "name": pa.array([f"base{i}" for i in range(n)]),
        },
        schema=SCHEMA,
    )


def make_spark(cores: int):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spark = (
            SparkSession.builder.master(f"local[{cores}]")
            .appName("memwal-spark-ingest-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(cores))
            .config("spark.default.parallelism", str(cores))
            .config("spark.driver.memory", "4g")
            .getOrCreate()
        )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def input_df(spark, base: int, rows: int, partitions: int):
    """``rows`` rows: ids from base/2 (half update existing keys, half are new)."""
    from pyspark.sql import functions as F

    start = base // 2
    return spark.range(start, start + rows, 1, partitions).select(
        F.col("id"),
        (F.col("id") * 0.5).alias("val"),
        (F.col("id") % 7).cast("int").alias("cat"),
        F.concat(F.lit("new"), F.col("id").cast("string")).alias("name"),
    )


def merge_insert_task(uri: str):
    """mapInArrow function: merge_insert this partition's rows into the base table."""

    def run(batches):
        import lance as lance_mod

        rows = pa.Table.from_batches(list(batches))
        if rows.num_rows:
            rows = rows.cast(SCHEMA)
            ds = lance_mod.dataset(uri)
            (
                ds.merge_insert("id")
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .conflict_retries(100)
                .execute(rows)
            )
        yield pa.RecordBatch.from_pydict({"rows": [rows.num_rows]})

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows to ingest")
    parser.add_argument("--base-rows", type=int, default=1_000_000, help="base table rows")
    parser.add_argument("--regions", type=int, default=16, help="bucket regions")
    parser.add_argument("--cores", type=int, default=min(4, os.cpu_count() or 2))
    parser.add_argument("--quick", action="store_true", help="200k rows, 200k base rows")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.base_rows = 200_000, 200_000

    from memwal_query import spark as mqs

    work = tempfile.mkdtemp(prefix="memwal-spark-bench-")
    try:
        seed = os.path.join(work, "seed")
        ds = lance.write_dataset(base_rows(args.base_rows), seed)
        spec = bucket_spec(ds.lance_schema, "id", args.regions)

        def fresh(name: str, memwal: bool) -> str:
            uri = os.path.join(work, name)
            shutil.copytree(seed, uri)
            if memwal:
                mq.MemWalTable.initialize(uri, region_spec=spec)
            return uri

        spark = make_spark(args.cores)
        # Warm up the JVM, the Python workers and their imports (not measured).
        warm = fresh("warm", True)
        mqs.write(input_df(spark, args.base_rows, 10_000, args.cores), warm)
        mqs.merge(spark, warm)

        results = []
        df = input_df(spark, args.base_rows, args.rows, args.cores)
        df.count()

        uri = fresh("memwal", True)
        t0 = time.perf_counter()
        res = mqs.write(df, uri)
        t_write = time.perf_counter() - t0
        assert res.upserted == args.rows
        results.append([f"mqs.write ({args.regions} regions, flushed)", args.rows, t_write])
        t0 = time.perf_counter()
        summary = mqs.merge(spark, uri)
        t_merge = time.perf_counter() - t0
        assert not summary.pending
        expected = max(args.base_rows, args.base_rows // 2 + args.rows)
        assert lance.dataset(uri).count_rows() == expected

        uri = fresh("memwal_wal", True)
        t0 = time.perf_counter()
        res = mqs.write(df, uri, flush=False)
        t_wal = time.perf_counter() - t0
        assert res.upserted == args.rows
        results.append(
            [f"mqs.write ({args.regions} regions, WAL only: flush=False)", args.rows, t_wal]
        )

        uri = fresh("mi_task", False)
        t0 = time.perf_counter()
        df.mapInArrow(merge_insert_task(uri), "rows long").collect()
        t_task = time.perf_counter() - t0
        assert lance.dataset(uri).count_rows() == expected
        results.append([f"merge_insert per task ({args.cores} tasks)", args.rows, t_task])

        uri = fresh("mi_driver", False)
        t0 = time.perf_counter()
        rows = df.toArrow().cast(SCHEMA)
        (
            lance.dataset(uri)
            .merge_insert("id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(rows)
        )
        t_driver = time.perf_counter() - t0
        assert lance.dataset(uri).count_rows() == expected
        results.append(["merge_insert from driver (1 commit)", args.rows, t_driver])
        results.append([f"mqs.merge afterwards ({args.regions} regions)", args.rows, t_merge])
        spark.stop()

        table = [[name, n, secs, n / secs, f"{t_task / secs:.2f}x"] for name, n, secs in results]
        print(
            f"\nSpark local[{args.cores}], {machine()}; base table {args.base_rows:,} rows, "
            f"{args.rows:,} rows ingested (half updates)"
        )
        print_table(
            "Spark ingest",
            ["method", "rows", "seconds", "rows/s", "vs merge_insert per task"],
            table,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
