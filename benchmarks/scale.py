"""Scale: query cost against the number of unmerged generations and regions.

Shapes (base table with an IVF_PQ vector index and an INVERTED full-text index, both
maintained in every generation; each flushed generation upserts ``--gen-rows`` rows
of existing keys): 1 region x 1, 10, 50 and 200 generations, 16 and 64 regions x 1,
64 x 3 (192 generations). Per shape: single-key lookup p50, vector search k=10 p50 (nprobes 20,
the default refine) with recall@10 against exact search over the deduplicated rows,
full-text search k=10 p50 (two-word queries), the same two searches with a filter on
the newest rows (``id >= base/2``; recall@10 of the filtered vector search against
exact search over the matching deduplicated rows), and the cold first query (in a new
process: open the table, first vector search; imports excluded; wall clock and CPU
time of the process, medians of 3 processes; the same for the first full-text search).

Targets: vector and FTS at 192 generations <= 2x the 1-generation latency,
recall@10 >= 0.95; lookup at 64 regions <= 1.2x 1 region; cold first query at 192
generations <= 150 ms, on a 500k-row base; the default here is
100k rows (``--base``) so that a run takes a few minutes on a 2-core machine.

At the same shapes, pylance's native planners (``lance.mem_wal``: LsmScanner, point
lookup, vector search) read the same table, each answer checked against ours
(``benchmarks/scale_native.py``; ``--no-native`` skips them). Then the streaming section
(``benchmarks/scale_stream.py``; ``--stream-minutes``, default 10, 0 skips it): a steady
stream of upserts with ``memwal maintain URI --watch`` running alongside as a real
process, per-minute figures, first vs last minute, and a final check of every key
against a model. ``--shapes ""`` runs the streaming section alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, pct, print_table  # noqa: E402

import memwal_query as mq  # noqa: E402

DIM, K = 32, 10
PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
        pa.field("text", pa.string()),
    ]
)
WORDS = np.array([f"w{i}" for i in range(2000)])
SHAPES = [(1, 1), (1, 10), (1, 50), (1, 200), (16, 1), (64, 1), (64, 3)]


def vectors(n: int, rng: np.random.Generator, centers: np.ndarray) -> np.ndarray:
    which = rng.integers(0, len(centers), n)
    return (centers[which] + rng.standard_normal((n, DIM)) * 0.3).astype(np.float32)


def rows(ids: np.ndarray, rng: np.random.Generator, centers: np.ndarray) -> pa.Table:
    vecs = vectors(len(ids), rng, centers)
    # Zipf-like word choice: a few frequent words, a long tail
    words = WORDS[np.minimum(rng.zipf(1.3, (len(ids), 8)) - 1, len(WORDS) - 1)]
    text = [" ".join(w) for w in words.tolist()]
    flat = pa.array(vecs.ravel(), pa.float32())
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(flat, DIM),
            "text": pa.array(text),
        },
        schema=SCHEMA,
    )


def build_base(root: str, n: int, rng: np.random.Generator, centers: np.ndarray) -> str:
    uri = f"{root}/base"
    lance.write_dataset(rows(np.arange(n), rng, centers), uri, max_rows_per_file=n)
    ds = lance.dataset(uri)
    ds.create_index("vec", "IVF_PQ", name="vec_idx", num_partitions=64, num_sub_vectors=8)
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    return uri


def build_shape(
    root: str,
    base_uri: str,
    n: int,
    regions: int,
    gens: int,
    gen_rows: int,
    rng: np.random.Generator,
    centers: np.ndarray,
) -> mq.MemWalTable:
    uri = f"{root}/t_{regions}x{gens}"
    shutil.copytree(base_uri, uri)
    spec = None
    if regions > 1:
        spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec, maintained_indexes=["vec_idx", "text_idx"])
    t.configure_writers(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    for _ in range(gens):
        ids = rng.choice(n, gen_rows * regions, replace=False)
        t.write(rows(ids, rng, centers))
        t.flush()
    t.close()
    return t


def p50_ms(fn: Callable[[int], object], reps: int) -> float:
    """p50 of ``fn(1..reps)`` in steady state (each call made once untimed first: the
    first touch of a region or generation is what the cold column measures)."""
    for i in range(reps):
        fn(i)
    lat = []
    for i in range(reps):
        s = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - s)
    return pct(lat, 50) * 1e3


COLD = """
import sys, time
import numpy as np
import memwal_query as mq
import memwal_query.search
import memwal_query.read.view
import memwal_query.table
q = np.array([float(x) for x in sys.argv[2].split(",")], np.float32)
s = time.perf_counter()
c = time.process_time()
t = mq.MemWalTable.open(sys.argv[1])
if sys.argv[3] == "vector":
    t.vector_search("vec", q, k=10)
else:
    t.fts_search("text", sys.argv[3], k=10)
print((time.perf_counter() - s) * 1e3, (time.process_time() - c) * 1e3)
"""


def cold_first_query(
    uri: str, q: np.ndarray, runs: int = 3, fts: str | None = None
) -> tuple[float, float]:
    """ms from opening the table to the first vector search's answer (with ``fts``: the
    first full-text search for those words), in a new process (imports excluded), wall
    clock and CPU (all threads of the process: what the query costs whatever the
    machine's load); medians of ``runs`` processes."""
    import subprocess

    arg = ",".join(map(str, q.tolist()))
    wall, cpu = [], []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", COLD, uri, arg, fts or "vector"],
            capture_output=True,
            text=True,
            check=True,
        )
        w, c = out.stdout.strip().splitlines()[-1].split()
        wall.append(float(w))
        cpu.append(float(c))
    return float(np.median(wall)), float(np.median(cpu))


def measure(t: mq.MemWalTable, n: int, queries: np.ndarray, reps: int) -> dict[str, float]:
    cold, cold_cpu = cold_first_query(t.uri, queries[0])
    cold_fts, cold_fts_cpu = cold_first_query(t.uri, queries[0], fts="w3 w10")
    live = t.to_table(columns=["id", "vec"])
    mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
    live_ids = live.column("id").to_numpy()
    keys = np.random.default_rng(1).integers(0, n, reps + 1)
    lookup = p50_ms(lambda i: t.lookup(pa.array([keys[i]], pa.int64())), reps)
    rec = []

    def vs(i: int) -> None:
        q = queries[i % len(queries)]
        got = t.vector_search("vec", q, k=K, columns=["id"])["id"].to_pylist()
        truth = live_ids[np.argsort(((mat - q) ** 2).sum(1))[:K]].tolist()
        if i:
            rec.append(len(set(truth) & set(got)) / K)

    vector = p50_ms(vs, reps)
    terms = [f"w{i} w{i + 7}" for i in range(3, 3 + reps + 1)]
    fts = p50_ms(lambda i: t.fts_search("text", terms[i], k=K, columns=["id"]), reps)
    return {
        "lookup": lookup,
        "vector": vector,
        "recall": float(np.mean(rec)),
        "fts": fts,
        "cold": cold,
        "cold_cpu": cold_cpu,
        "cold_fts": cold_fts,
        "cold_fts_cpu": cold_fts_cpu,
        **measure_filtered(t, n, queries, terms, reps, mat, live_ids),
    }


def measure_filtered(
    t: mq.MemWalTable,
    n: int,
    queries: np.ndarray,
    terms: list[str],
    reps: int,
    mat: np.ndarray,
    live_ids: np.ndarray,
) -> dict[str, float]:
    """Vector and full-text search p50 with a filter (``id >= n/2``, half the keys),
    and the filtered vector search's recall@10 against exact search over the live rows
    that match."""
    flt = f"id >= {n // 2}"
    keep = live_ids >= n // 2
    fmat, fids = mat[keep], live_ids[keep]
    rec = []

    def vs(i: int) -> None:
        q = queries[i % len(queries)]
        got = t.vector_search("vec", q, k=K, filter=flt, columns=["id"])["id"].to_pylist()
        assert all(x >= n // 2 for x in got), "a row outside the filter"
        truth = fids[np.argsort(((fmat - q) ** 2).sum(1))[:K]].tolist()
        if i:
            rec.append(len(set(truth) & set(got)) / K)

    fvector = p50_ms(vs, reps)
    ffts = p50_ms(lambda i: t.fts_search("text", terms[i], k=K, filter=flt, columns=["id"]), reps)
    return {"fvector": fvector, "frecall": float(np.mean(rec)), "ffts": ffts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=100_000, help="base table rows")
    parser.add_argument("--gen-rows", type=int, default=500, help="rows per generation")
    parser.add_argument("--reps", type=int, default=20, help="queries per figure")
    parser.add_argument("--shapes", default=",".join(f"{r}x{g}" for r, g in SHAPES))
    parser.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run pylance's native MemWAL planners at each shape",
    )
    add_stream_args(parser)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((64, DIM)) * 3
    queries = vectors(args.reps + 1, rng, centers)
    results = []
    with tempfile.TemporaryDirectory() as root:
        if not shapes:
            return stream(args, centers)
        s = time.perf_counter()
        base_uri = build_base(root, args.base, rng, centers)
        print(f"base of {args.base:,} rows built in {time.perf_counter() - s:.1f} s", flush=True)
        for regions, gens in shapes:
            s = time.perf_counter()
            t = build_shape(root, base_uri, args.base, regions, gens, args.gen_rows, rng, centers)
            built = time.perf_counter() - s
            m = measure(t, args.base, queries, args.reps)
            if args.native:
                m.update(native(t, args.base, queries, args.reps))
            print(f"  {regions}x{gens}: built in {built:.1f} s, {m}", flush=True)
            results.append(((regions, gens), m))
    print_shapes(args, results)
    if args.native:
        print_native(args, results)
    if args.stream_minutes > 0:
        stream(args, centers)


def print_shapes(args: argparse.Namespace, results: list) -> None:
    first = results[0][1]
    table = []
    for (regions, gens), m in results:
        table.append(
            [
                f"{regions} region(s) x {gens} gen(s)",
                m["lookup"],
                m["lookup"] / first["lookup"],
                m["vector"],
                m["vector"] / first["vector"],
                m["recall"],
                m["fts"],
                m["fts"] / first["fts"],
                m["fvector"],
                m["fvector"] / first["fvector"],
                m["frecall"],
                m["ffts"],
                m["ffts"] / first["ffts"],
                m["cold"],
                m["cold_cpu"],
                m["cold_fts"],
                m["cold_fts_cpu"],
            ]
        )
    print_table(
        f"Scale: {args.base:,}-row base, {args.gen_rows} rows per generation, p50 of "
        f"{args.reps} queries ({machine()}, {time.strftime('%Y-%m-%d')})",
        [
            "shape",
            "lookup ms",
            "x1st",
            "vector ms",
            "x1st",
            "recall@10",
            "fts ms",
            "x1st",
            "filtered vector ms",
            "x1st",
            "recall@10",
            "filtered fts ms",
            "x1st",
            "cold 1st ms",
            "cold cpu ms",
            "cold 1st fts ms",
            "cold fts cpu ms",
        ],
        table,
    )
    print(
        "targets: lookup 64 regions <= 1.2x; vector and fts (filtered too) 192 "
        "generations <= 2x; "
        "recall@10 >= 0.95; cold first query at 192 generations <= 150 ms"
    )


# -- pylance's native planners at the same shapes (benchmarks/scale_native.py) -------


def native(t: mq.MemWalTable, n: int, queries: np.ndarray, reps: int) -> dict[str, object]:
    from scale_native import native_measure

    live = t.to_table(columns=["id", "vec"])
    mat = np.stack(live.column("vec").to_numpy(zero_copy_only=False))
    live_ids = live.column("id").to_numpy()

    def truth(q: np.ndarray) -> list[int]:
        return live_ids[np.argsort(((mat - q) ** 2).sum(1))[:K]].tolist()

    return native_measure(t, n, queries, reps, truth)


def print_native(args: argparse.Namespace, results: list) -> None:
    from scale_native import NATIVE_HEADER, native_rows

    print_table(
        "pylance native MemWAL planners at the same shapes (lance.mem_wal, pylance "
        f"{lance.__version__}; scan = columns id, text; p50 ms)",
        NATIVE_HEADER,
        native_rows(results),
    )
    print(
        "a native cell that is not a figure says why it is not one (the planner failed, "
        "or answered with other rows than the deduplicated table)"
    )


# -- the streaming section (benchmarks/scale_stream.py) --------------------------------


def add_stream_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("streaming section")
    g.add_argument("--stream-minutes", type=float, default=10, help="0: skip the section")
    g.add_argument("--stream-rate", type=int, default=1000, help="rows/s written")
    g.add_argument("--stream-new-share", type=float, default=0.1, help="share of new keys")
    g.add_argument("--stream-base", type=int, default=50_000, help="base table rows")
    g.add_argument("--stream-regions", type=int, default=4)
    g.add_argument("--stream-flush-seconds", type=float, default=5)
    g.add_argument("--stream-watch-seconds", type=float, default=5, help="maintain --watch")
    g.add_argument("--stream-retention-hours", type=float, default=1 / 60)
    g.add_argument("--stream-log", help="keep the maintainer's JSON reports in this file")


def stream(args: argparse.Namespace, centers: np.ndarray) -> None:
    from scale_stream import run_stream

    with tempfile.TemporaryDirectory() as root:
        ok = run_stream(
            root,
            minutes=args.stream_minutes,
            rate=args.stream_rate,
            base_rows=args.stream_base,
            regions=args.stream_regions,
            flush_seconds=args.stream_flush_seconds,
            watch_seconds=args.stream_watch_seconds,
            retention_hours=args.stream_retention_hours,
            new_share=args.stream_new_share,
            log_copy=args.stream_log,
            dim=DIM,
            centers=centers,
            words=WORDS,
        )
    print(f"stream answer checks: {'all ok' if ok else 'FAILED'}; load average {os.getloadavg()}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
