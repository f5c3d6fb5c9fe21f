"""Search across LSM levels: vector search recall and latency vs pylance's native
``LsmVectorSearchPlanner``, and point lookups vs ``LsmPointLookupPlanner``.

Setup: a base table (100k rows; ``--quick`` 20k) with 32-d clustered vectors and an
IVF_PQ index maintained in generations, 3 flushed generations of upserts (20% new keys)
and deletes. recall@10 is measured against exact brute force over the deduplicated data.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")  # pylance's deprecation warnings flood stderr

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from lance.mem_wal import LsmPointLookupPlanner, LsmVectorSearchPlanner, ShardSnapshot  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, pct, print_table  # noqa: E402

import memwal_query as mq  # noqa: E402

DIM, K = 32, 10
PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), False, PK), pa.field("vec", pa.list_(pa.float32(), DIM))]
)


def vectors(n: int, rng: np.random.Generator, centers: np.ndarray) -> np.ndarray:
    which = rng.integers(0, len(centers), n)
    return (centers[which] + rng.standard_normal((n, DIM)) * 0.3).astype(np.float32)


def table_of(ids: np.ndarray, vecs: np.ndarray) -> pa.Table:
    flat = pa.array(vecs.ravel(), pa.float32())
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "vec": pa.FixedSizeListArray.from_arrays(flat, DIM)},
        schema=SCHEMA,
    )


def _ms(lat: list[float]) -> list[float]:
    return [pct(lat, 50) * 1e3, pct(lat, 99) * 1e3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--queries", type=int, default=50)
    args = parser.parse_args()
    n = 20_000 if args.quick else 100_000
    rng = np.random.default_rng(5)
    centers = rng.standard_normal((64, DIM)) * 3
    with tempfile.TemporaryDirectory() as root:
        uri = f"{root}/t"
        lance.write_dataset(table_of(np.arange(n), vectors(n, rng, centers)), uri)
        lance.dataset(uri).create_index(
            "vec", "IVF_PQ", name="vec_idx", num_partitions=64, num_sub_vectors=8
        )
        t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx"])
        w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
        for _ in range(3):
            m = n // 20
            ids = np.concatenate(
                [rng.choice(n, int(m * 0.8), replace=False), rng.integers(n, 2 * n, m // 5)]
            )
            w.put(table_of(ids, vectors(len(ids), rng, centers)))
            w.delete(pa.table({"id": pa.array(rng.choice(n, m // 20), pa.int64())}))
            w.flush()
        w.close()
        man = t.catalog.region_manifest(w.region_id)
        snap = ShardSnapshot(w.region_id).with_current_generation(man.current_generation)
        for g in man.flushed_generations:
            snap = snap.with_sstable(g.generation, g.path)
        base = lance.dataset(uri)
        live = t.to_table()
        mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
        live_ids = live.column("id").to_numpy()
        planner = LsmVectorSearchPlanner(base, [snap], "vec")
        queries = vectors(args.queries, rng, centers)

        def run(fn) -> tuple[list[float], float]:
            lat, rec = [], []
            fn(queries[0])  # warm up
            for q in queries:
                s = time.perf_counter()
                got = fn(q)
                lat.append(time.perf_counter() - s)
                truth = set(live_ids[np.argsort(((mat - q) ** 2).sum(1))[:K]].tolist())
                rec.append(len(truth & set(got)) / K)
            return lat, float(np.mean(rec))

        ours_lat, ours_rec = run(lambda q: t.vector_search("vec", q, k=K)["id"].to_pylist())
        native_lat, native_rec = run(
            lambda q: (
                planner.plan_search(pa.array(q, pa.float32()), k=K, nprobes=20)
                .to_table()
                .column("id")
                .to_pylist()
            )
        )
        rows = [
            [
                "memwal_query vector_search",
                pct(ours_lat, 50) * 1e3,
                pct(ours_lat, 99) * 1e3,
                ours_rec,
            ],
            [
                "native LsmVectorSearchPlanner",
                pct(native_lat, 50) * 1e3,
                pct(native_lat, 99) * 1e3,
                native_rec,
            ],
        ]
        print_table(
            f"Vector search k=10, nprobes=20, {n:,}-row base + 3 generations "
            f"({machine()}, {time.strftime('%Y-%m-%d')})",
            ["searcher", "p50 ms", "p99 ms", "recall@10"],
            rows,
        )
        keys = rng.integers(0, n, 100)
        lookup = LsmPointLookupPlanner(base, [snap])
        lat_o, lat_n = [], []
        for k in keys:
            arr = pa.array([k], pa.int64())
            s = time.perf_counter()
            a = t.lookup(arr)
            lat_o.append(time.perf_counter() - s)
            s = time.perf_counter()
            b = lookup.plan_lookup(arr).to_table()
            lat_n.append(time.perf_counter() - s)
            assert a.column("id").to_pylist() == b.column("id").to_pylist()
        print_table(
            "Single-key point lookup (same keys, same answers)",
            ["reader", "p50 ms", "p99 ms"],
            [
                ["memwal_query lookup", pct(lat_o, 50) * 1e3, pct(lat_o, 99) * 1e3],
                ["native LsmPointLookupPlanner", pct(lat_n, 50) * 1e3, pct(lat_n, 99) * 1e3],
            ],
        )


if __name__ == "__main__":
    main()
