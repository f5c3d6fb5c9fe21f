"""Object store vs local disk: durable put latency and full-scan throughput, in one run.

The same workload on a local directory and on a local S3-compatible server (moto on
127.0.0.1, the server the tests use, see ``tests/s3server.py``):

- **put latency**: sequential durable ``put`` calls of 100 new rows each (one WAL entry
  per put: Arrow IPC encode + put-if-not-exists, fsync'd locally), p50/p99;
- **scan throughput**: ``SELECT * FROM t`` through DataFusion over a base table of
  ``--base-rows`` rows plus 2 flushed generations of 5 % upserts each, rows/s; the
  process-wide generation caches are cleared before every scan so that each one reads
  the generations from storage again.

moto is a Python server in this process, so the "S3" figures measure memwal_query's
request pattern plus moto's overhead, not AWS latency (typically 10-30 ms for a PUT).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import datafusion
import lance
import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import machine, median, pct, print_table, timed  # noqa: E402
from s3server import LocalS3Server  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.read import newer, sources  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
        pa.field("name", pa.string()),
    ]
)
BUCKET = "memwal-bench"


def rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    """Rows of SCHEMA for ``ids``."""
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "val": pa.array(rng.random(len(ids))),
            "cat": pa.array(rng.integers(0, 100, len(ids)), pa.int32()),
            "name": pa.array([f"name-{i}" for i in ids]),
        },
        schema=SCHEMA,
    )


def clear_read_caches() -> None:
    """Forget decoded generations so the next scan reads them from storage."""
    sources.GENERATION_CACHE.clear()
    newer.FLUSHED_VIEWS.clear()


def run(uri: str, storage_options: dict[str, str], args: argparse.Namespace) -> dict:
    """The whole workload on one table URI; returns the measurements."""
    rng = np.random.default_rng(7)
    so = storage_options or None
    lance.write_dataset(
        rows(np.arange(args.base_rows), rng),
        uri,
        max_rows_per_file=args.base_rows,
        storage_options=so,
    )
    t = mq.MemWalTable.initialize(uri, storage_options=storage_options)
    w = t.writer(max_memtable_rows=10**9, max_memtable_bytes=1 << 40)
    next_id = args.base_rows
    latencies = []
    for i in range(args.warmup + args.puts):
        batch = rows(np.arange(next_id, next_id + 100), rng)
        next_id += 100
        started = time.perf_counter()
        w.put(batch)
        if i >= args.warmup:
            latencies.append(time.perf_counter() - started)
    w.flush()
    for _ in range(2):
        ids = rng.choice(args.base_rows, args.base_rows // 20, replace=False)
        for chunk in np.array_split(ids, 10):
            w.put(rows(chunk, rng))
        w.flush()
    w.close()

    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    expected = args.base_rows + 100 * (args.warmup + args.puts)
    counted: list[int] = []

    def scan() -> None:
        clear_read_caches()
        counted.append(ctx.sql("SELECT * FROM t").to_arrow_table().num_rows)

    scans = timed(scan, repeat=args.repeat, warmup=1)
    assert set(counted) == {expected}, (counted, expected)
    return {
        "p50": pct(latencies, 50),
        "p99": pct(latencies, 99),
        "puts_per_s": len(latencies) / sum(latencies),
        "scan_s": median(scans),
        "scan_rows_per_s": expected / median(scans),
        "rows": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k base rows, 100 puts")
    parser.add_argument("--base-rows", type=int, default=None)
    parser.add_argument("--puts", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.base_rows is None:
        args.base_rows = 100_000 if args.quick else 500_000
    if args.puts is None:
        args.puts = 100 if args.quick else 300

    results = {}
    with tempfile.TemporaryDirectory() as root:
        results["local disk"] = run(f"{root}/t", {}, args)
    with LocalS3Server() as server:
        server.create_bucket(BUCKET)
        uri = f"s3://{BUCKET}/{uuid.uuid4().hex}/t"
        results["local S3 server (moto)"] = run(uri, server.storage_options(), args)

    local, s3 = results["local disk"], results["local S3 server (moto)"]
    print(
        f"\nmachine: {machine()}; pylance {lance.__version__}, datafusion {datafusion.__version__}"
    )
    print(
        f"workload: {args.puts} durable puts of 100 rows (after {args.warmup} warm-up), "
        f"scan of {local['rows']:,} live rows (base {args.base_rows:,} + 2 generations)"
    )
    table = [
        ["durable put p50 (ms)", local["p50"] * 1e3, s3["p50"] * 1e3, s3["p50"] / local["p50"]],
        ["durable put p99 (ms)", local["p99"] * 1e3, s3["p99"] * 1e3, s3["p99"] / local["p99"]],
        [
            "sequential puts/s",
            local["puts_per_s"],
            s3["puts_per_s"],
            s3["puts_per_s"] / local["puts_per_s"],
        ],
        [
            "full SQL scan (s, median)",
            local["scan_s"],
            s3["scan_s"],
            s3["scan_s"] / local["scan_s"],
        ],
        [
            "full SQL scan (rows/s)",
            local["scan_rows_per_s"],
            s3["scan_rows_per_s"],
            s3["scan_rows_per_s"] / local["scan_rows_per_s"],
        ],
    ]
    table = [[name, a, b, f"{ratio:.2f}x"] for name, a, b, ratio in table]
    print_table(
        "Local S3 server vs local disk",
        ["metric", "local disk", "local S3 server (moto)", "S3 / local"],
        table,
    )


if __name__ == "__main__":
    main()
