"""Spark reader: ``spark.read.format("memwal")`` vs Spark reading the same rows as Parquet.

Setup: a 1M-row base table (id int64, val float64, cat int32) and 3 flushed generations
of 50k upserts each (a third new keys): 1.1M live rows. The deduplicated view is also
written as Parquet (one file per ~1M rows), which Spark reads with its native reader.

Queries, each on a freshly loaded DataFrame ("cold": the first query, which plans the
view) and then again on it ("warm": best of ``--repeat``):

- ``count(*)``;
- a filtered aggregate ``sum(val) WHERE cat = 7``.

Prints seconds and the ratio ours / Parquet (targets: <= 2x for ``count(*)``, <= 1.5x
for the filtered aggregate). ``--rows`` scales the base table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402
from _common import make_rows as rows  # noqa: E402

import memwal_query as mq  # noqa: E402


def setup(root: str, base_rows: int) -> mq.MemWalTable:
    rng = np.random.default_rng(3)
    uri = f"{root}/t"
    lance.write_dataset(rows(np.arange(base_rows), rng), uri, max_rows_per_file=base_rows)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    per_gen = base_rows // 20
    fresh = np.arange(base_rows, base_rows + base_rows // 10)
    for g in range(3):
        new = fresh[g * len(fresh) // 3 : (g + 1) * len(fresh) // 3]
        old = rng.choice(base_rows, per_gen - len(new), replace=False)
        w.put(rows(np.concatenate([old, new]), rng))
        w.flush()
    w.close(flush=False)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from memwal_query import spark as mqs

    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        t = setup(root, args.rows)
        view = t.to_table()
        parquet = f"{root}/parquet"
        os.makedirs(parquet)
        pq.write_table(view, f"{parquet}/part-0.parquet", row_group_size=128 * 1024)
        print(
            f"setup: {time.perf_counter() - started:.1f}s, {view.num_rows:,} rows", file=sys.stderr
        )
        spark = (
            SparkSession.builder.master("local[2]")
            .appName("memwal_query-spark-read")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        mqs.register_source(spark)

        def ours():
            return spark.read.format("memwal").load(t.uri)

        def theirs():
            return spark.read.parquet(parquet)

        queries = [
            ("count(*)", lambda df: df.count()),
            (
                "sum(val) WHERE cat = 7",
                lambda df: df.where("cat = 7").agg(F.sum("val")).collect()[0][0],
            ),
        ]
        # warm up the JVM and the Python workers once (not part of any figure)
        ours().count()
        theirs().count()
        out = []
        for name, q in queries:
            figures = {}
            answers = {}
            for label, load in (("ours", ours), ("parquet", theirs)):
                df = load()
                s = time.perf_counter()
                answers[label] = q(df)
                cold = time.perf_counter() - s
                warm = []
                for _ in range(args.repeat):
                    s = time.perf_counter()
                    q(df)
                    warm.append(time.perf_counter() - s)
                figures[label] = (cold, min(warm))
            a, b = answers["ours"], answers["parquet"]
            same = a == b if isinstance(a, int) else abs(a - b) <= 1e-6 * max(1.0, abs(b))
            if not same:
                raise SystemExit(f"{name}: ours {a} != parquet {b}")
            (oc, ow), (pc, pw) = figures["ours"], figures["parquet"]
            out.append([name, oc, pc, oc / pc, ow, pw, ow / pw])
        print_table(
            f"Spark reader, {view.num_rows:,} rows (base {args.rows:,} + 3 generations) "
            f"({machine()}, local[2], {time.strftime('%Y-%m-%d')})",
            [
                "query",
                "ours cold s",
                "parquet cold s",
                "cold ratio",
                "ours warm s",
                "parquet warm s",
                "warm ratio",
            ],
            out,
        )
        spark.stop()


if __name__ == "__main__":
    main()
