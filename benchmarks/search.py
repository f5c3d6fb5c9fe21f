"""Search across LSM levels: vector search recall and latency vs plain Lance and
pylance's native ``LsmVectorSearchPlanner``, and point lookups vs ``LsmPointLookupPlanner``.

Setup 1 (``--vs-lance``, on by default): a 200k-row base (``--quick`` 40k) with 32-d
vectors in 64 clusters and an IVF_PQ index of 64 partitions x 8 sub-vectors, with 1 and
with 64 unmerged generations of 1,000 upserted rows each. ``MemWalTable.vector_search``
with its defaults against a plain Lance table holding the same live rows and the same
index, queried with ``nprobes=20, refine_factor=20`` and with the smallest
``refine_factor`` that reaches our recall; queries interleaved, medians; the ratio is
ours / plain Lance.

Setup 2: a base table (100k rows; ``--quick`` 20k) with the same kind of vectors and an
IVF_PQ index maintained in generations, 3 flushed generations of upserts (20% new keys)
and deletes, against ``LsmVectorSearchPlanner``.

recall@10 is measured against exact brute force over the deduplicated data.

Setup 3 (``--first-lookup-only`` runs it alone): the first lookup touching a newly
flushed generation of a stream's size (``--generation-rows``, default 100,000: a
writer's default ``max_memtable_rows``) in a reader that keeps following the table. A
1,000,000-row base (``--quick`` 200k); each of ``--rounds`` rounds upserts that many
rows (and deletes 2% as many keys) and flushes; the reader then looks up one absent
key (its view follows; no generation touched), then 10 keys of the new generation
(first), then the same keys again; p50 over the rounds. The same for SQL ``WHERE id IN
(...)`` of 10 other keys through :meth:`MemWalTable.provider`. Only public API, so the
same script measures another checkout (``PYTHONPATH``) for a before/after pair.
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


PLAIN_REFINE = (20, 40, 60, 80, 100, 150, 200)
"""``refine_factor`` values tried for plain Lance (the smallest reaching our recall)."""


def vs_plain_lance(root: str, n: int, generations: int, queries: int) -> list[list[object]]:
    """Rows of the ours-vs-plain-Lance table for one number of unmerged generations."""
    rng = np.random.default_rng(11)
    centers = rng.standard_normal((64, DIM)) * 3
    uri = f"{root}/lsm_{generations}"
    lance.write_dataset(table_of(np.arange(n), vectors(n, rng, centers)), uri)
    index = dict(name="vec_idx", num_partitions=64, num_sub_vectors=8)
    lance.dataset(uri).create_index("vec", "IVF_PQ", **index)
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx"])
    w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    for _ in range(generations):
        ids = rng.choice(n, 1000, replace=False)
        w.put(table_of(ids, vectors(len(ids), rng, centers)))
        w.flush()
    w.close()
    live = t.to_table(columns=["id", "vec"])
    plain_uri = f"{root}/plain_{generations}"
    plain = lance.write_dataset(live, plain_uri)
    plain.create_index("vec", "IVF_PQ", **index)
    plain = lance.dataset(plain_uri)
    mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
    live_ids = live.column("id").to_numpy()
    qs = vectors(queries, rng, centers)
    truth = [set(live_ids[np.argsort(((mat - q) ** 2).sum(1))[:K]].tolist()) for q in qs]

    def ours(q: np.ndarray) -> list[int]:
        return t.vector_search("vec", q, k=K)["id"].to_pylist()

    def lance_rf(rf: int):
        def search(q: np.ndarray) -> list[int]:
            nearest = {"column": "vec", "q": q, "k": K, "nprobes": 20, "refine_factor": rf}
            return plain.to_table(nearest=nearest)["id"].to_pylist()

        return search

    runners = {"ours": ours, **{f"lance rf={rf}": lance_rf(rf) for rf in PLAIN_REFINE}}
    lat: dict[str, list[float]] = {name: [] for name in runners}
    rec: dict[str, list[float]] = {name: [] for name in runners}
    for fn in runners.values():
        fn(qs[0])  # warm up
    for i, q in enumerate(qs):  # interleaved: the machine's load hits every searcher alike
        for name, fn in runners.items():
            s = time.perf_counter()
            got = fn(q)
            lat[name].append(time.perf_counter() - s)
            rec[name].append(len(truth[i] & set(got)) / K)
    t.close()
    p50 = {name: pct(v, 50) * 1e3 for name, v in lat.items()}
    recall = {name: float(np.mean(v)) for name, v in rec.items()}
    same = f"lance rf={PLAIN_REFINE[0]}"
    reach = [f"lance rf={rf}" for rf in PLAIN_REFINE if recall[f"lance rf={rf}"] >= recall["ours"]]
    rows: list[list[object]] = [
        [generations, "memwal_query (defaults)", p50["ours"], recall["ours"], "-"],
        [
            generations,
            f"plain Lance nprobes=20 {same[6:]}",
            p50[same],
            recall[same],
            p50["ours"] / p50[same],
        ],
    ]
    if reach:
        eq = reach[0]
        rows.append(
            [
                generations,
                f"plain Lance nprobes=20 {eq[6:]} (same recall)",
                p50[eq],
                recall[eq],
                p50["ours"] / p50[eq],
            ]
        )
    else:
        rows.append([generations, "plain Lance: no refine_factor tried reaches it", "-", "-", "-"])
    return rows


def first_lookup(root: str, base_rows: int, gen_rows: int, rounds: int) -> list[list[object]]:
    """Setup 3: first and repeated lookups after each flush (see the module docs)."""
    import datafusion

    uri = f"{root}/first"
    rng = np.random.default_rng(3)
    ids = np.arange(base_rows, dtype=np.int64)
    base = pa.table({"id": ids, "v": ids}, schema=pa.schema([SCHEMA.field(0), ("v", pa.int64())]))
    lance.write_dataset(base, uri)
    lance.dataset(uri).create_scalar_index("id", "BTREE")
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    reader = mq.MemWalTable.open(uri)
    reader.lookup(pa.array([0], pa.int64()))
    lat: dict[str, list[float]] = {k: [] for k in ("first", "again", "sql first", "sql again")}
    for r in range(rounds):
        keys = rng.integers(0, base_rows, gen_rows)
        w.put(pa.table({"id": keys, "v": np.full(gen_rows, r + 1)}, schema=base.schema))
        w.delete(pa.table({"id": rng.integers(0, base_rows, gen_rows // 50)}))
        w.flush()
        reader.lookup(pa.array([-1], pa.int64()))  # the view follows; no generation touched
        probe = pa.array(rng.choice(keys, 10), pa.int64())
        for name in ("first", "again"):
            s = time.perf_counter()
            reader.lookup(probe)
            lat[name].append(time.perf_counter() - s)
        sql = f"SELECT * FROM t WHERE id IN ({','.join(map(str, rng.choice(keys, 10)))})"
        ctx = datafusion.SessionContext()
        ctx.register_table("t", reader.provider())
        for name in ("sql first", "sql again"):
            s = time.perf_counter()
            ctx.sql(sql).to_arrow_table()
            lat[name].append(time.perf_counter() - s)
    w.close()
    first, again = pct(lat["first"], 50), pct(lat["again"], 50)
    sql_first, sql_again = pct(lat["sql first"], 50), pct(lat["sql again"], 50)
    return [
        ["t.lookup, 10 keys", first * 1e3, again * 1e3, first / again],
        ["SQL WHERE id IN (10 keys)", sql_first * 1e3, sql_again * 1e3, sql_first / sql_again],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument(
        "--vs-lance-only", action="store_true", help="only the ours-vs-plain-Lance table"
    )
    parser.add_argument("--first-lookup-only", action="store_true", help="only setup 3")
    parser.add_argument("--generation-rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        base_rows = 200_000 if args.quick else 1_000_000
        rows = first_lookup(root, base_rows, args.generation_rows, args.rounds)
        load = os.getloadavg()
        print_table(
            f"First lookup touching a newly flushed {args.generation_rows:,}-row generation, "
            f"live reader, {base_rows:,}-row base, p50 of {args.rounds} flushes ({machine()}, "
            f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
            f"{time.strftime('%Y-%m-%d')})",
            ["query", "first ms", "again ms", "first / again"],
            rows,
        )
    if args.first_lookup_only:
        return
    with tempfile.TemporaryDirectory() as root:
        size = 40_000 if args.quick else 200_000
        rows = []
        for gens in (1, 64):
            rows += vs_plain_lance(root, size, gens, max(args.queries, 100))
        load = os.getloadavg()
        print_table(
            f"Vector search k=10 vs plain Lance with the same live rows, {size:,}-row base, "
            f"IVF_PQ 64x8 ({machine()}, load average {load[0]:.1f} {load[1]:.1f} "
            f"{load[2]:.1f}, {time.strftime('%Y-%m-%d')})",
            ["unmerged generations", "searcher", "p50 ms", "recall@10", "ratio ours / it"],
            rows,
        )
    if args.vs_lance_only:
        return
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
