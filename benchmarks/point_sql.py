"""SQL point queries (``WHERE id = k``, ``WHERE id IN (10 keys)``) vs ``t.lookup`` vs
plain Lance, with the key-pinned newer view and without, for integer, string and
composite primary keys (``--kinds``).

Setup (per key kind and shape, built in a temp dir): a base table of ``--base`` rows
(``int``: key ``id`` int64; ``str``: key ``id`` string ``k{n}``; ``pair``: key ``(a,
b)`` = (n mod 7, ``s{n div 7}``), the 10 keys asked as ``(a = .. AND b = ..) OR ..``;
``v`` int64, ``cat`` int32; a
BTREE index on ``id`` or ``b``) split into R bucket regions, then G
flushed generations of ``--gen-rows`` upserted keys per region (and a few deletes),
then a small live MemTable. Shapes: ``--shapes`` (regions x generations).

Each round first writes and flushes one small batch (untimed: the query after a flush
is the case measured, when the view's caches hold all generations but the newest),
then runs every query once, alternating the order of "pushed" (key-pinned newer view,
the default) and "full" (``pointview.POINT_KEYS_MAX = 0``: the newest version of every
key in all unmerged generations, filtered) so both see the same load. Prints medians
(ms) and ratios against plain Lance's ``to_table(filter="id IN ...")`` on the base
table's same rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, print_table  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.read import pointview  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
KEY_FIELDS = {
    "int": [pa.field("id", pa.int64(), nullable=False, metadata=PK)],
    "str": [pa.field("id", pa.string(), nullable=False, metadata=PK)],
    "pair": [
        pa.field("a", pa.int64(), nullable=False, metadata=PK),
        pa.field("b", pa.string(), nullable=False, metadata=PK),
    ],
}
INDEXED = {"int": "id", "str": "id", "pair": "b"}  # BTREE; also the bucket column


def schema_of(kind: str) -> pa.Schema:
    return pa.schema([*KEY_FIELDS[kind], pa.field("v", pa.int64()), pa.field("cat", pa.int32())])


def key_columns(kind: str, ids: np.ndarray) -> dict[str, pa.Array]:
    ids = np.asarray(ids, np.int64)
    if kind == "int":
        return {"id": pa.array(ids)}
    if kind == "str":
        return {"id": pc.binary_join_element_wise("k", pc.cast(pa.array(ids), pa.string()), "")}
    b = pc.binary_join_element_wise("s", pc.cast(pa.array(ids // 7), pa.string()), "")
    return {"a": pa.array(ids % 7), "b": b}


def rows(ids: np.ndarray, value: int, kind: str = "int") -> pa.Table:
    ids = np.asarray(ids, np.int64)
    cols = {
        **key_columns(kind, ids),
        "v": np.full(len(ids), value, np.int64),
        "cat": (ids % 100).astype(np.int32),
    }
    return pa.table(cols, schema=schema_of(kind))


def conditions(kind: str, keys: np.ndarray) -> tuple[str, str]:
    """(the IN condition of ``keys``, the = condition of the first)."""
    if kind == "int":
        return f"id IN ({','.join(map(str, keys))})", f"id = {int(keys[0])}"
    if kind == "str":
        listed = ",".join(f"'k{int(k)}'" for k in keys)
        return f"id IN ({listed})", f"id = 'k{int(keys[0])}'"
    whole = " OR ".join(f"(a = {int(k) % 7} AND b = 's{int(k) // 7}')" for k in keys)
    k = int(keys[0])
    return whole, f"a = {k % 7} AND b = 's{k // 7}'"


def base_table(root: str, n: int, kind: str = "int") -> str:
    uri = f"{root}/base_{kind}"
    step = 1 << 20
    data = (rows(np.arange(s, min(n, s + step)), 0, kind) for s in range(0, n, step))
    lance.write_dataset(
        pa.RecordBatchReader.from_batches(
            schema_of(kind), (b for t in data for b in t.to_batches())
        ),
        uri,
        max_rows_per_file=1 << 22,
    )
    lance.dataset(uri).create_scalar_index(INDEXED[kind], "BTREE")
    return uri


def build(
    root: str, base_uri: str, n: int, regions: int, gens: int, gen_rows: int, kind: str = "int"
):
    uri = f"{root}/t_{kind}_{regions}x{gens}"
    shutil.copytree(base_uri, uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, INDEXED[kind], regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    t.configure_writers(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    rng = np.random.default_rng(regions * 1000 + gens)
    pk = list(t.primary_key)
    for g in range(gens):
        t.write(rows(rng.choice(n, gen_rows * regions, replace=False), g + 1, kind))
        gone = rng.choice(n, gen_rows * regions // 50 + 1, replace=False)
        t.delete(rows(gone, 0, kind).select(pk))
        t.flush()
    t.write(rows(rng.choice(n, 1000, replace=False), 99, kind))  # a live MemTable
    return t, uri


def measure(
    t, base_uri: str, n: int, rounds: int, rng: np.random.Generator, kind: str = "int"
) -> dict:
    base = lance.dataset(base_uri)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    lat: dict[str, list[float]] = {}

    def time_it(name: str, fn, *args) -> None:
        s = time.perf_counter()
        fn(*args)
        lat.setdefault(name, []).append(time.perf_counter() - s)

    def sql(where: str) -> pa.Table:
        return ctx.sql(f"SELECT * FROM t WHERE {where}").to_arrow_table()

    limit = pointview.POINT_KEYS_MAX
    for r in range(rounds):
        t.write(rows(rng.choice(n, 200, replace=False), 1000 + r, kind))
        t.flush()
        keys = rng.choice(n, 10, replace=False)
        in_cond, eq_cond = conditions(kind, keys)
        modes = ["pushed", "full"] if r % 2 == 0 else ["full", "pushed"]
        for mode in modes:
            pointview.POINT_KEYS_MAX = limit if mode == "pushed" else 0
            try:
                time_it(f"IN {mode}", sql, in_cond)
                time_it(f"= {mode}", sql, eq_cond)
            finally:
                pointview.POINT_KEYS_MAX = limit
        time_it("lookup", t.lookup, rows(keys, 0, kind).select(list(t.primary_key)))
        time_it("lance IN", base.to_table, None, in_cond)
        time_it("lance =", base.to_table, None, eq_cond)
    return {name: median(v) * 1e3 for name, v in lat.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=1_000_000)
    parser.add_argument(
        "--gen-rows", type=int, default=2000, help="upserts per region per generation"
    )
    parser.add_argument("--shapes", default="8x1,8x16,32x16,32x64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kinds", default="int,str,pair", help="key kinds: int, str, pair")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    print(f"# {machine()}; load {os.getloadavg()[0]:.2f}; base {args.base:,} rows")
    out = []
    root = tempfile.mkdtemp(prefix="mq_point_sql_")
    try:
        rng = np.random.default_rng(7)
        for kind in args.kinds.split(","):
            base_uri = base_table(root, args.base, kind)
            for regions, gens in shapes:
                s = time.perf_counter()
                t, uri = build(root, base_uri, args.base, regions, gens, args.gen_rows, kind)
                took = time.perf_counter() - s
                print(f"  {kind} {regions}x{gens}: built in {took:.0f} s", flush=True)
                m = measure(t, base_uri, args.base, args.rounds, rng, kind)
                t.close()
                shutil.rmtree(uri, ignore_errors=True)
                out.append(
                    [
                        f"{kind}: {regions} regions x {gens} gens",
                        m["IN full"],
                        m["IN pushed"],
                        m["IN full"] / m["IN pushed"],
                        m["IN pushed"] / m["lance IN"],
                        m["= full"],
                        m["= pushed"],
                        m["= full"] / m["= pushed"],
                        m["= pushed"] / m["lance ="],
                        m["lookup"],
                        m["lance IN"],
                    ]
                )
            shutil.rmtree(base_uri, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(
        f"SQL point queries after a flush, {args.base:,}-row base (median ms; load "
        f"{os.getloadavg()[0]:.2f} at the end)",
        [
            "shape",
            "IN (10) full view",
            "IN (10) pushed",
            "speed-up",
            "pushed / Lance",
            "= k full view",
            "= k pushed",
            "speed-up",
            "pushed / Lance",
            "t.lookup 10 keys",
            "Lance IN (10)",
        ],
        out,
    )


if __name__ == "__main__":
    main()
