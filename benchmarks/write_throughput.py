"""Durable write throughput: memwal_query vs pylance's native MemWAL vs merge_insert.

One process, the same data: a 1M-row base table (no maintained indexes); durable puts
of 100-row and of 10k-row batches through

- memwal_query's ``RegionWriter`` (``durable=True``: each put returns once in the WAL),
- pylance's native ``mem_wal_writer(durable_write=True)``,
- plain Lance ``merge_insert`` per batch (each batch a commit).

Prints rows/s and put latency p50/p99 with ratios. Run: ``python benchmarks/write_throughput.py``
(``--quick`` for a smaller run).

The "sustained" section (``--sustained SECONDS``, default 60; 0 skips it) puts 10k-row
batches continuously into a table with a maintained 128-d IVF_PQ vector index, with the
default writer settings, and prints rows/s, the unflushed MemTables and the RSS every
few seconds, then the peak RSS growth: backpressure (``max_unflushed_memtables``) must
hold the put rate to the flush rate and memory flat.
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
from _common import SCHEMA, machine, make_rows, median, pct, print_table, timed  # noqa: E402

import memwal_query as mq  # noqa: E402


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


def rss_mib() -> float:
    """Resident memory of this process now (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sustained(root: str, seconds: float, dim: int = 128, base_rows: int = 100_000) -> None:
    """Continuous 10k-row durable puts into a table with a maintained vector index."""
    rng = np.random.default_rng(7)
    uri = f"{root}/sustained"
    schema = pa.schema([*SCHEMA, pa.field("vec", pa.list_(pa.float32(), dim))])

    def rows(ids: np.ndarray) -> pa.Table:
        flat = pa.array(rng.standard_normal(len(ids) * dim).astype(np.float32))
        base = make_rows(ids, rng)
        return base.append_column("vec", pa.FixedSizeListArray.from_arrays(flat, dim)).cast(schema)

    ds = lance.write_dataset(rows(np.arange(base_rows)), uri)
    ds.create_index("vec", "IVF_PQ", num_partitions=16, num_sub_vectors=16, name="vec_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx"])
    w = t.writer()
    batch = [rows(rng.integers(0, base_rows * 2, 10_000)) for _ in range(8)]
    rss0 = rss_mib()
    peak = rss0
    samples = []
    put = 0
    start = last = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        w.put(batch[put % len(batch)])
        put += 1
        peak = max(peak, rss_mib())
        if now - last >= 5:
            last = now
            samples.append(
                [f"{now - start:.0f}", put * 10_000 / (now - start), len(w._sealed), rss_mib()]
            )
    elapsed = time.perf_counter() - start
    w.close(flush=False)
    print_table(
        f"Sustained 10k-row durable puts, maintained 128-d IVF_PQ index, default settings "
        f"({machine()}, {time.strftime('%Y-%m-%d')})",
        ["t s", "rows/s so far", "unflushed MemTables", "RSS MiB"],
        samples,
    )
    print(
        f"\n{put * 10_000 / elapsed:,.0f} rows/s over {elapsed:.0f} s; "
        f"{w.stats.memtable_flushes} flushes ({w.stats.flushed_rows:,} rows, "
        f"{w.stats.flushed_rows / max(w.stats.flush_seconds, 1e-9):,.0f} rows/s of flush "
        f"time); peak RSS growth {peak - rss0:,.0f} MiB (limit 1,024)"
    )


def tiny_puts(root: str, n: int) -> None:
    """``n`` sequential one-row durable puts at default settings: how many WAL entries
    stay unflushed, and what a query over the table (writer handed in) costs then."""
    uri = f"{root}/tiny"
    rng = np.random.default_rng(3)
    make_base(uri, 100_000)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    start = time.perf_counter()
    for i in range(n):
        w.put(make_rows(np.array([200_000 + i]), rng))
    elapsed = time.perf_counter() - start
    deadline = time.perf_counter() + 60
    while w._sealed and time.perf_counter() < deadline:  # let queued flushes finish
        time.sleep(0.05)
    unflushed = w._active.appends
    lat = timed(lambda: t.to_table(columns=["id"], writers=[w]).num_rows, repeat=5)
    print(
        f"\n{n:,} one-row durable puts: {n / elapsed:,.0f} puts/s; "
        f"{w.stats.memtable_flushes} flushes (max_wal_entries="
        f"{w.max_wal_entries}); {unflushed} WAL entries unflushed at the end; full read "
        f"with the writer handed in: {median(lat) * 1e3:.1f} ms"
    )
    w.close(flush=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument(
        "--sustained", type=float, default=60, help="seconds of the sustained section (0: skip)"
    )
    parser.add_argument("--only-sustained", action="store_true", help="skip the put tables")
    parser.add_argument(
        "--tiny-puts", type=int, default=20_000, help="one-row puts of the tiny section (0: skip)"
    )
    args = parser.parse_args()
    if args.only_sustained:
        with tempfile.TemporaryDirectory() as root:
            if args.tiny_puts:
                tiny_puts(root, args.tiny_puts)
            sustained(root, args.sustained)
        return
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
        if args.tiny_puts:
            tiny_puts(root, args.tiny_puts)
        if args.sustained > 0:
            sustained(root, args.sustained)


if __name__ == "__main__":
    main()
