"""Merge throughput: memwal_query's merger vs plain Lance merge_insert of the same rows,
and the read latency of the reader benchmark's queries while a merge runs.

Setup as ``read_paths.py``: a 1M-row base (``--quick``: 100k), 3 flushed generations of
50k upserts each (20% new keys), the same base copied for the plain ``merge_insert`` run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import datafusion
import lance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, pct, print_table  # noqa: E402
from read_paths import rows, upserts  # noqa: E402

import memwal_query as mq  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    base_rows = 100_000 if args.quick else 1_000_000
    with tempfile.TemporaryDirectory() as root:
        rng = np.random.default_rng(1)
        uri, plain = f"{root}/t", f"{root}/plain"
        lance.write_dataset(rows(np.arange(base_rows), rng), uri, max_rows_per_file=base_rows)
        shutil.copytree(uri, plain)
        t = mq.MemWalTable.initialize(uri)
        w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
        batches = []
        for _ in range(3):
            data = rows(upserts(int(base_rows * 0.05), base_rows, rng), rng)
            batches.append(data)
            w.put(data)
            w.flush()
        w.close()
        total = sum(b.num_rows for b in batches)

        ctx = datafusion.SessionContext()
        ctx.register_table("t", t.provider())

        def query() -> float:
            s = time.perf_counter()
            ctx.sql("SELECT id, val FROM t WHERE cat = 7").to_arrow_table()
            return time.perf_counter() - s

        started = time.perf_counter()
        merged = t.maintenance.merge().merged
        ours = time.perf_counter() - started
        assert len(merged) == 3

        started = time.perf_counter()
        for b in batches:
            ds = lance.dataset(plain)
            ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(b)
        plain_s = time.perf_counter() - started
        assert lance.dataset(plain).count_rows() == lance.dataset(uri).count_rows()

        # Read latency while a second round of 3 generations is merged.
        w = t.writer(w.region_id, max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
        for _ in range(3):
            w.put(rows(upserts(int(base_rows * 0.05), base_rows, rng), rng))
            w.flush()
        w.close()
        idle = [query() for _ in range(10)]
        during: list[float] = []
        merged2: list = []
        merger = threading.Thread(target=lambda: merged2.extend(t.maintenance.merge().merged))
        merger.start()
        during.append(query())  # at least one query overlaps the merge
        while merger.is_alive():
            during.append(query())
        merger.join()
        assert len(merged2) == 3

        print_table(
            f"Merge of 3 generations ({total:,} rows) into a {base_rows:,}-row base "
            f"({machine()}, {time.strftime('%Y-%m-%d')})",
            ["merger", "seconds", "rows/s", "x merge_insert"],
            [
                ["memwal_query t.maintenance.merge()", ours, total / ours, plain_s / ours],
                ["Lance merge_insert (same rows)", plain_s, total / plain_s, 1.0],
            ],
        )
        print_table(
            "Read latency of `SELECT id, val WHERE cat = 7` (ms)",
            ["when", "queries", "p50", "p99"],
            [
                ["idle", len(idle), median(idle) * 1e3, pct(idle, 99) * 1e3],
                ["during merge", len(during), median(during) * 1e3, pct(during, 99) * 1e3],
            ],
        )


if __name__ == "__main__":
    main()
