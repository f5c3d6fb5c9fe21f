"""First query of a cold process over a base whose fragments all carry deletion files, on
the S3 emulator behind a loopback proxy adding a round trip to every request.

A base of ``--fragments`` fragments (``--rows`` rows each, a BTREE index on the key),
with a third of each fragment's rows deleted at random (one deletion file per
fragment), is read by fresh processes, each timing its first query after opening the
table:

- **full read**: ``to_table()``;
- **point**: ``to_table(filter=id == k)`` (through the index);
- **narrow filter**: ``to_table(columns=[id, v], filter=v < 10)`` (about 1%);

and the same read with plain Lance (``lance.dataset(uri)``) in a fresh process as the
yardstick. Per query: median milliseconds of ``--repeat`` processes, the median
count of GETs of deletion files (``_deletions/``) the proxy saw, and the milliseconds
the reader spent choosing the scan's path (``deletions.reads_deleted``: reading the
deletion files). ``--trees`` lists
source trees to compare (each put first on the children's ``PYTHONPATH``; default
this one), e.g. the main branch and a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import machine, median, print_table  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from stores import start_store  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("v", pa.int64()),
        pa.field("name", pa.string()),
    ]
)
BUCKET = "memwal-bench"
QUERIES = ["full read", "point", "narrow filter"]

CHILD = """
import json, sys, time
import lance, pyarrow.compute as pc
uri, options, query, plain = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if plain:
    t = lance.dataset(uri, storage_options=options)
else:
    import memwal_query as mq
    from memwal_query.read import deletions
    decide, spent = deletions.reads_deleted, []
    def timed(*a, **k):
        s = time.perf_counter()
        try:
            return decide(*a, **k)
        finally:
            spent.append(time.perf_counter() - s)
    deletions.reads_deleted = timed
    t = mq.MemWalTable.open(uri, storage_options=options)
args = {
    "full read": {},
    "point": {"filter": pc.field("id") == 4242},
    "narrow filter": {"columns": ["id", "v"], "filter": pc.field("v") < 10},
}[query]
start = time.perf_counter()
n = t.to_table(**args).num_rows
ms = (time.perf_counter() - start) * 1e3
print(json.dumps({"ms": ms, "rows": n, "choice_ms": 0 if plain else sum(spent) * 1e3}))
"""


class _Counter:
    """A fault plan injecting no fault: counts GETs of deletion files."""

    def __init__(self) -> None:
        self.gets = 0
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> None:
        if method == "GET" and "_deletions/" in path:
            with self._lock:
                self.gets += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fragments", type=int, default=48)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trees", default=str(HERE.parent), help="comma-separated")
    args = parser.parse_args()
    server = start_store("s3")
    results: dict[str, dict[str, str]] = {}
    try:
        server.create_bucket(BUCKET)
        counter = _Counter()
        with FaultProxy(server.upstream, plan=counter, latency=args.latency_ms / 1000) as proxy:
            options = server.storage_options(endpoint=proxy.endpoint)
            uri = f"{server.root(BUCKET)}/{uuid.uuid4().hex}/t"
            n = args.fragments * args.rows
            ids = np.arange(n)
            rng = np.random.default_rng(0)
            table = pa.table(
                {
                    "id": ids,
                    "v": rng.integers(0, 1000, n),
                    "name": pa.array([f"n{i}" for i in ids]),
                },
                schema=SCHEMA,
            )
            ds = lance.write_dataset(
                table, uri, max_rows_per_file=args.rows, storage_options=options
            )
            ds.create_scalar_index("id", "BTREE")
            gone = np.sort(rng.choice(n, n // 3, replace=False))
            # one delete: one deletion file per fragment
            ds.delete(f"id IN ({','.join(map(str, gone))})")
            import memwal_query as mq

            mq.MemWalTable.initialize(uri, storage_options=options)
            runs = [("plain Lance", "", True)] + [
                (f"memwal {Path(tree).name}", tree, False) for tree in args.trees.split(",")
            ]
            for name, tree, plain in runs:
                env = {**os.environ, "PYTHONPATH": tree} if tree else dict(os.environ)
                row: dict[str, str] = {}
                for query in QUERIES:
                    ms, gets, choice = [], [], []
                    for _ in range(args.repeat):
                        before = counter.gets
                        out = subprocess.run(
                            [
                                sys.executable,
                                "-c",
                                CHILD,
                                uri,
                                json.dumps(options),
                                query,
                                "1" if plain else "0",
                            ],
                            env=env,
                            cwd=tree or None,  # python -c imports from its directory first
                            capture_output=True,
                            text=True,
                            check=True,
                        )
                        got = json.loads(out.stdout.strip().splitlines()[-1])
                        ms.append(got["ms"])
                        choice.append(got["choice_ms"])
                        gets.append(counter.gets - before)
                    row[query] = (
                        f"{median(ms):.0f} ms ({median(gets):.0f} GETs"
                        + ("" if plain else f", choice {median(choice):.0f} ms")
                        + ")"
                    )
                results[name] = row
                print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(
        f"\nmachine: {machine()}; load average {os.getloadavg()[0]:.2f}; "
        f"{args.fragments} fragments x {args.rows} rows, +{args.latency_ms:g} ms per request"
    )
    print_table(
        "First query of a cold process (median ms, deletion-file GETs)",
        ["reader", *QUERIES],
        [[name, *(row[q] for q in QUERIES)] for name, row in results.items()],
    )


if __name__ == "__main__":
    main()
