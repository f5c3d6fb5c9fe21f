"""Durable write throughput: memwal_query vs pylance's native MemWAL vs merge_insert.

One process, the same data: a 1M-row base table (no maintained indexes); durable puts
of 100-row and of 10k-row batches through

- memwal_query's ``RegionWriter`` (``durable=True``: each put returns once in the WAL),
- pylance's native ``mem_wal_writer(durable_write=True)``,
- plain Lance ``merge_insert`` per batch (each batch a commit).

Prints rows/s and put latency p50/p99 with ratios. Run: ``python benchmarks/write_throughput.py``
(``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, pct, print_table  # noqa: E402

import memwal_query as mq  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
    ]
)


def make_rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "val": pa.array(rng.random(len(ids))),
            "cat": pa.array(rng.integers(0, 100, len(ids)), pa.int32()),
        },
        schema=SCHEMA,
    )


def make_base(path: str, n: int) -> None:
    rng = np.random.default_rng(0)
    lance.write_dataset(make_rows(np.arange(n), rng), path, max_rows_per_file=n)


def batches(n_batches: int, size: int, base_rows: int, seed: int) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = rng.integers(0, int(base_rows * 1.2), size)  # ~20% new keys
        out.append(make_rows(np.unique(ids), rng))
    return out


def run_puts(put, data: list[pa.Table]) -> tuple[float, list[float]]:
    lat = []
    start = time.perf_counter()
    for t in data:
        s = time.perf_counter()
        put(t)
        lat.append(time.perf_counter() - s)
    return time.perf_counter() - start, lat


def bench_ours(root: str, data: list[pa.Table]) -> tuple[float, list[float]]:
    uri = f"{root}/ours"
    t = mq.MemWalTable.open(uri)
    w = t.writer(durable=True)
    try:
        return run_puts(w.put, data)
    finally:
        w.close(flush=False)


def bench_native(root: str, data: list[pa.Table]) -> tuple[float, list[float]]:
    ds = lance.dataset(f"{root}/native")
    w = ds.mem_wal_writer(str(uuid.uuid4()), durable_write=True)
    try:
        return run_puts(w.put, data)
    finally:
        w.close()


def bench_merge_insert(root: str, data: list[pa.Table]) -> tuple[float, list[float]]:
    uri = f"{root}/plain"

    def put(t: pa.Table) -> None:
        ds = lance.dataset(uri)
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(t)

    return run_puts(put, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    args = parser.parse_args()
    base_rows = 100_000 if args.quick else 1_000_000
    plans = [(100, 60 if args.quick else 300), (10_000, 5 if args.quick else 30)]
    with tempfile.TemporaryDirectory() as root:
        for name in ("ours", "native", "plain"):
            make_base(f"{root}/{name}", base_rows)
        mq.MemWalTable.initialize(f"{root}/ours")
        lance.dataset(f"{root}/native").initialize_mem_wal()
        rows = []
        for size, n in plans:
            data = batches(n, size, base_rows, seed=size)
            total_rows = sum(t.num_rows for t in data)
            results = {}
            for name, fn in (
                ("memwal_query", bench_ours),
                ("pylance native MemWAL", bench_native),
                ("Lance merge_insert", bench_merge_insert),
            ):
                elapsed, lat = fn(root, data)
                results[name] = (total_rows / elapsed, pct(lat, 50) * 1e3, pct(lat, 99) * 1e3)
            native_rps = results["pylance native MemWAL"][0]
            for name, (rps, p50, p99) in results.items():
                rows.append([f"{size:,}", name, rps, p50, p99, rps / native_rps])
        print_table(
            f"Durable puts, base {base_rows:,} rows ({machine()}, {time.strftime('%Y-%m-%d')})",
            ["rows/put", "writer", "rows/s", "p50 ms", "p99 ms", "x native rows/s"],
            rows,
        )


if __name__ == "__main__":
    main()
