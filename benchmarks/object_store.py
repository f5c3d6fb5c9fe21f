"""Object stores vs local disk: durable puts, flush, lookups and scans, with plain Lance's
scan on the same store as the yardstick, in one run.

Columns: local disk, and each object store (S3 via moto, Azure via Azurite, GCS via the
loopback stand-in; see ``tests/stores.py``) reached through the loopback proxy of
``tests/faultproxy.py``, which adds ``--latency-ms`` to every request (each value of the
list is a column per store; 0 measures the emulators alone). Per column:

- **durable put p50**: sequential ``put`` calls of 100 new rows (one WAL entry each);
- **flush**: sealing the MemTable of those puts into a generation (median of 3);
- **lookup p50**: ``lookup`` of 10 random keys across the base and 2 generations;
- **scan**: ``SELECT *`` through DataFusion over the base plus 2 generations of upserts
  (decoded-generation caches cleared before each), median;
- **plain Lance scan**: ``lance.dataset(uri).to_table()`` of the base table alone on the
  same store, median; **scan / Lance** is the cost of the LSM read (extra requests for
  manifests, generations and dedup) as a ratio.

The emulators run on this machine (moto and the GCS stand-in in this process, Azurite
in Node.js): absolute figures measure request patterns and emulator overhead, not cloud
latency; the added-latency columns show how the request count scales with a round trip.
"""

from __future__ import annotations

import argparse
import os
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
from _common import machine, median, pct, print_table  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from stores import STORES, start_store  # noqa: E402

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
NAMES = {"s3": "S3 (moto)", "azure": "Azure (Azurite)", "gcs": "GCS (stand-in)"}


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
    """The whole workload on one table URI; returns the measurements (seconds)."""
    rng = np.random.default_rng(7)
    so = storage_options or None
    base = rows(np.arange(args.base_rows), rng)
    lance.write_dataset(base, uri, max_rows_per_file=args.base_rows, storage_options=so)
    t = mq.MemWalTable.initialize(uri, storage_options=storage_options)
    w = t.writer(max_memtable_rows=10**9, max_memtable_bytes=1 << 40)
    next_id = args.base_rows
    puts, flushes = [], []
    for round_ in range(3):
        for i in range(args.warmup + args.puts if round_ == 0 else args.puts // 4):
            batch = rows(np.arange(next_id, next_id + 100), rng)
            next_id += 100
            started = time.perf_counter()
            w.put(batch)
            if round_ == 0 and i >= args.warmup:
                puts.append(time.perf_counter() - started)
        if round_:  # upserts of 5 % of the base, so that the generations overlap it
            for chunk in np.array_split(rng.choice(args.base_rows, args.base_rows // 20), 10):
                w.put(rows(chunk, rng))
        started = time.perf_counter()
        w.flush()
        flushes.append(time.perf_counter() - started)
    w.close()
    expected = next_id
    lookups = []
    for _ in range(args.lookups):
        keys = pa.array(rng.choice(next_id, 10, replace=False), pa.int64())
        started = time.perf_counter()
        got = t.lookup(keys)
        lookups.append(time.perf_counter() - started)
        assert got.num_rows == 10, got.num_rows
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    scans, lance_scans = [], []
    for i in range(args.repeat + 1):
        clear_read_caches()
        started = time.perf_counter()
        n = ctx.sql("SELECT * FROM t").to_arrow_table().num_rows
        if i:
            scans.append(time.perf_counter() - started)
        assert n == expected, (n, expected)
        started = time.perf_counter()
        m = lance.dataset(uri, storage_options=so).to_table().num_rows
        if i:
            lance_scans.append(time.perf_counter() - started)
        assert m >= args.base_rows
    return {
        "put_p50": pct(puts, 50),
        "flush": median(flushes),
        "lookup_p50": pct(lookups, 50),
        "scan": median(scans),
        "lance_scan": median(lance_scans),
        "rows": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50k base rows, 40 puts")
    parser.add_argument("--base-rows", type=int, default=None)
    parser.add_argument("--puts", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency-ms", default="0,20", help="comma-separated list")
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args()
    if args.base_rows is None:
        args.base_rows = 50_000 if args.quick else 300_000
    if args.puts is None:
        args.puts = 40 if args.quick else 100
    latencies = [float(x) for x in args.latency_ms.split(",")]

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        results["local disk"] = run(os.path.join(root, "t"), {}, args)
    for kind in args.stores.split(","):
        server = start_store(kind)
        try:
            server.create_bucket(BUCKET)
            for ms in latencies:
                with FaultProxy(server.upstream, latency=ms / 1000) as proxy:
                    options = server.storage_options(endpoint=proxy.endpoint)
                    uri = f"{server.root(BUCKET)}/{uuid.uuid4().hex}/t"
                    name = f"{NAMES[kind]} +{ms:g} ms"
                    results[name] = run(uri, options, args)
                    results[name]["requests"] = proxy.requests
                print(f"{name}: done", file=sys.stderr, flush=True)
        finally:
            server.stop()

    print(
        f"\nmachine: {machine()}; load average {os.getloadavg()[0]:.2f}; "
        f"pylance {lance.__version__}, datafusion {datafusion.__version__}"
    )
    print(
        f"workload: {args.puts} durable puts of 100 rows, 3 flushes, {args.lookups} lookups "
        f"of 10 keys, scan of {results['local disk']['rows']:,} live rows "
        f"(base {args.base_rows:,} + 3 generations)"
    )
    names = list(results)
    metrics = [
        ("durable put p50 (ms)", "put_p50", 1e3),
        ("flush (ms, median)", "flush", 1e3),
        ("lookup p50 (ms)", "lookup_p50", 1e3),
        ("scan (s, median)", "scan", 1.0),
        ("plain Lance scan (s)", "lance_scan", 1.0),
    ]
    table = [[label, *(results[n][key] * scale for n in names)] for label, key, scale in metrics]
    table.append(
        ["scan / Lance", *(f"{results[n]['scan'] / results[n]['lance_scan']:.2f}x" for n in names)]
    )
    table.append(["requests (whole run)", *(results[n].get("requests", "-") for n in names)])
    print_table("Object stores vs local disk", ["metric", *names], table)


if __name__ == "__main__":
    main()
