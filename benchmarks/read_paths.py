"""Read paths: SQL scans over an LSM table vs plain Lance vs pylance's native LsmScanner.

Setup (built once per run in a temp dir): a 1M-row base table (id int64, val float64,
cat int32, vec 32-d float32); 150k upserts (20% new keys) flushed as 3 generations of
one region; 50k more upserts in a live MemTable.

Prints medians and ratios for ``SELECT count(*)``, ``SELECT id, val`` (all rows) and
``WHERE cat = 7``; point lookups when the search module is available. "plain Lance" is
Lance's own scanner on the base table alone (for ``count(*)`` a scan of the ``id``
column, since a metadata count would not be a scan).
Then the same aggregate (``SELECT cat, count(*), sum(val) ... GROUP BY cat``) through
DataFusion, DuckDB and Polars over one MemWalDataset (engines not installed are skipped).
``--quick`` uses a 100k-row base; ``--key string`` makes the key a string (``user-<n>``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import datafusion
import lance
import numpy as np
import pyarrow as pa
from lance.mem_wal import LsmPointLookupPlanner, LsmScanner, ShardSnapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, pct, print_table, timed  # noqa: E402

import memwal_query as mq  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
DIM = 32
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)


def key_array(ids: np.ndarray, key: str = "int64") -> pa.Array:
    """Key values: the ids themselves, or strings ``user-<id>`` with ``key="string"``."""
    if key == "string":
        return pa.array(np.char.add("user-", np.asarray(ids).astype(str)))
    return pa.array(ids, pa.int64())


def rows(ids: np.ndarray, rng: np.random.Generator, key: str = "int64") -> pa.Table:
    vec = rng.standard_normal((len(ids), DIM), dtype=np.float32)
    schema = SCHEMA
    if key == "string":
        schema = SCHEMA.set(0, pa.field("id", pa.string(), nullable=False, metadata=PK))
    return pa.table(
        {
            "id": key_array(ids, key),
            "val": pa.array(rng.random(len(ids))),
            "cat": pa.array(rng.integers(0, 100, len(ids)), pa.int32()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel()), DIM),
        },
        schema=schema,
    )


def upserts(n: int, base: int, rng: np.random.Generator) -> np.ndarray:
    new = int(n * 0.2)
    old = rng.choice(base, n - new, replace=False)
    fresh = rng.choice(np.arange(base, base * 2), new, replace=False)
    ids = np.concatenate([old, fresh])
    rng.shuffle(ids)
    return ids


def setup(root: str, base_rows: int, key: str = "int64"):
    rng = np.random.default_rng(42)
    uri = f"{root}/t"
    lance.write_dataset(rows(np.arange(base_rows), rng, key), uri, max_rows_per_file=base_rows)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    n_flushed = int(base_rows * 0.15)
    for _ in range(3):
        ids = upserts(n_flushed // 3, base_rows, rng)
        for chunk in np.array_split(ids, 10):
            w.put(rows(chunk, rng, key))
        w.flush()
    for chunk in np.array_split(upserts(base_rows // 20, base_rows, rng), 10):
        w.put(rows(chunk, rng, key))
    return t, w


def native_snapshot(t: mq.MemWalTable, region_id: str) -> ShardSnapshot:
    m = t.catalog.region_manifest(region_id)
    snap = ShardSnapshot(region_id).with_current_generation(m.current_generation)
    for g in m.flushed_generations:
        snap = snap.with_sstable(g.generation, g.path)
    return snap


AGGREGATE = "SELECT cat, count(*) AS n, sum(val) AS s FROM t GROUP BY cat ORDER BY cat"


def engine_times(t: mq.MemWalTable, w: mq.RegionWriter, repeat: int) -> None:
    """The same aggregate through each engine over one MemWalDataset (+ live MemTable)."""
    ds = t.provider(writers=[w])
    ctx = datafusion.SessionContext()
    ctx.register_table("t", ds)
    runs = {"DataFusion": lambda: ctx.sql(AGGREGATE).to_arrow_table()}
    try:
        import duckdb

        con = duckdb.connect()
        con.register("t", ds)
        runs["DuckDB"] = lambda: con.sql(AGGREGATE).to_arrow_table()
    except ImportError:
        print("DuckDB not installed (pip install -e '.[duckdb]'): skipped", file=sys.stderr)
    try:
        import polars as pl

        sql = pl.SQLContext(t=pl.scan_pyarrow_dataset(ds))
        runs["Polars"] = lambda: sql.execute(AGGREGATE).collect()
    except ImportError:
        print("Polars not installed (pip install -e '.[polars]'): skipped", file=sys.stderr)
    want = ctx.sql(AGGREGATE).to_arrow_table()
    out = []
    first = None
    for name, run in runs.items():
        got = pa.table(run()) if name == "Polars" else run()
        assert got.column("n").to_pylist() == want.column("n").to_pylist(), name
        m = median(timed(run, repeat))
        first = first or m
        out.append([name, m * 1e3, m / first])
    print_table(
        f"Same aggregate through each engine ({AGGREGATE!r})",
        ["engine", "median ms", "ratio to DataFusion"],
        out,
    )


def stale_set_times(repeat: int) -> None:
    """The set of overwritten base-row addresses: numpy (what the reader uses) against
    pyroaring (is it the better structure? skipped if absent).

    Two uses: building Lance's ``row_addr_blocklist`` (a serialized RowAddrTreeMap) for
    unfiltered scans, and testing a 65,536-row batch's addresses against the set
    (filtered scans with hashed keys). Addresses in 1M-row fragments, 1% and 10% stale.
    """
    rng = np.random.default_rng(5)
    frag_rows, frags = 1_000_000, 4
    out = []
    for share in (0.01, 0.10):
        flat = np.sort(rng.choice(frag_rows * frags, int(frag_rows * frags * share), False))
        stale = ((flat // frag_rows).astype(np.uint64) << np.uint64(32)) | (
            flat % frag_rows
        ).astype(np.uint64)
        row: list[object] = [f"{share:.0%} of {frag_rows * frags:,} rows"]
        out.append(row + _stale_set_row(stale, frags, repeat))
    print_table(
        "Overwritten base-row addresses: numpy sorted array vs pyroaring",
        [
            "stale rows",
            "numpy blocklist build ms",
            "numpy probe 64k ms",
            "pyroaring build ms",
            "pyroaring probe 64k ms",
        ],
        out,
    )


def _stale_set_row(stale: np.ndarray, frags: int, repeat: int) -> list[object]:
    from memwal_query.format.rowaddrs import row_address_treemap
    from memwal_query.read.dedup import in_sorted

    batch = stale[0] + np.arange(65_536, dtype=np.uint64)  # one base batch's addresses
    row: list[object] = [
        median(timed(lambda: row_address_treemap(stale), repeat)) * 1e3,
        median(timed(lambda: in_sorted(batch, stale), repeat)) * 1e3,
    ]
    try:
        from pyroaring import BitMap, BitMap64
    except ImportError:
        print("pyroaring not installed: numpy side only", file=sys.stderr)
        return [*row, "", ""]
    fragment = stale >> np.uint64(32)

    def roaring_build() -> bytes:  # the same RowAddrTreeMap, bitmaps by pyroaring
        parts = []
        for f in range(frags):
            offsets = (stale[fragment == f] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            parts.append(BitMap(offsets).serialize())
        return b"".join(parts)

    whole = BitMap64(stale)

    def roaring_probe() -> np.ndarray:  # no vectorised "contains": intersect, then isin
        hit = whole & BitMap64(batch)
        return np.isin(batch, np.asarray(hit.to_array(), dtype=np.uint64))

    assert (roaring_probe() == in_sorted(batch, stale)).all()
    return [
        *row,
        median(timed(roaring_build, repeat)) * 1e3,
        median(timed(roaring_probe, repeat)) * 1e3,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--key", choices=["int64", "string"], default="int64", help="primary-key type"
    )
    args = parser.parse_args()
    base_rows = 100_000 if args.quick else 1_000_000
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        t, w = setup(root, base_rows, args.key)
        print(f"setup: {time.perf_counter() - started:.1f}s", file=sys.stderr)
        base = lance.dataset(t.uri)
        snap = native_snapshot(t, w.region_id)
        ctx = datafusion.SessionContext()
        ctx.register_table("live", t.provider(writers=[w]))  # + live MemTable
        ctx.register_table("flushed", t.provider())  # flushed generations only

        def native(project=None, filt=None):
            def run():
                s = LsmScanner.from_snapshots(base, [snap])
                if project:
                    s = s.project(project)
                if filt:
                    s = s.filter(filt)
                return s.to_table()

            return run

        queries = [
            (
                "SELECT count(*)",
                lambda: ctx.sql("SELECT count(*) FROM live").to_arrow_table(),
                lambda: ctx.sql("SELECT count(*) FROM flushed").to_arrow_table(),
                lambda: base.to_table(columns=["id"]).num_rows,  # a scan, not metadata
                lambda: LsmScanner.from_snapshots(base, [snap]).count_rows(),
            ),
            (
                "SELECT id, val",
                lambda: ctx.sql("SELECT id, val FROM live").to_arrow_table(),
                lambda: ctx.sql("SELECT id, val FROM flushed").to_arrow_table(),
                lambda: base.to_table(columns=["id", "val"]),
                native(["id", "val"]),
            ),
            (
                "WHERE cat = 7",
                lambda: ctx.sql("SELECT * FROM live WHERE cat = 7").to_arrow_table(),
                lambda: ctx.sql("SELECT * FROM flushed WHERE cat = 7").to_arrow_table(),
                lambda: base.to_table(filter="cat = 7"),
                native(None, "cat = 7"),
            ),
        ]
        out = []
        for name, live_q, flushed_q, plain_q, native_q in queries:
            m_live = median(timed(live_q, args.repeat))
            m_flushed = median(timed(flushed_q, args.repeat))
            m_plain = median(timed(plain_q, args.repeat))
            m_native = median(timed(native_q, max(1, args.repeat // 2)))
            out.append(
                [
                    name,
                    m_live * 1e3,
                    m_flushed * 1e3,
                    m_plain * 1e3,
                    m_native * 1e3,
                    m_live / m_plain,
                    m_flushed / m_native,
                ]
            )
        print_table(
            f"Scans, {base_rows:,}-row base + 3 generations + live MemTable, {args.key} keys "
            f"({machine()}, {time.strftime('%Y-%m-%d')})",
            [
                "query",
                "ours +MemTable ms",
                "ours flushed ms",
                "plain Lance ms",
                "native LsmScanner ms",
                "ours/plain",
                "ours flushed/native",
            ],
            out,
        )
        # consistency="latest": another process (a second table object, no writer handed
        # in) reads the writer's durable WAL entries not yet flushed (the live MemTable)
        from memwal_query.read import view

        other = mq.MemWalTable.open(t.uri)
        ctx.register_table("latest", other.provider(consistency="latest"))
        want = ctx.sql("SELECT count(*) AS n FROM live").to_arrow_table()["n"][0].as_py()
        got = ctx.sql("SELECT count(*) AS n FROM latest").to_arrow_table()["n"][0].as_py()
        assert got == want, (got, want)
        latest_rows = []
        for label, fn in (
            ("resolve view: strong", lambda: view.resolve(other.catalog, "strong")),
            (
                "resolve view: latest (reads WAL tail)",
                lambda: view.resolve(other.catalog, "latest"),
            ),
            (
                "count(*) strong (flushed only)",
                lambda: ctx.sql("SELECT count(*) FROM flushed").to_arrow_table(),
            ),
            (
                "count(*) latest (+ WAL tail)",
                lambda: ctx.sql("SELECT count(*) FROM latest").to_arrow_table(),
            ),
            (
                "count(*) in-process MemTable",
                lambda: ctx.sql("SELECT count(*) FROM live").to_arrow_table(),
            ),
        ):
            latest_rows.append([label, median(timed(fn, args.repeat)) * 1e3])
        print_table(
            f"consistency=latest from another table object ({base_rows // 20:,} unflushed rows "
            "in 10 WAL entries)",
            ["step", "ms"],
            latest_rows,
        )
        lookup_rows = []
        keys = np.random.default_rng(7).integers(0, base_rows, 200)
        if hasattr(t, "lookup"):
            lat = []
            for k in keys:
                s = time.perf_counter()
                t.lookup(key_array([k], args.key), writers=[w])
                lat.append(time.perf_counter() - s)
            lookup_rows.append(["memwal_query lookup", pct(lat, 50) * 1e3, pct(lat, 99) * 1e3])
        planner = LsmPointLookupPlanner(base, [snap])
        lat = []
        for k in keys[:50]:
            s = time.perf_counter()
            planner.plan_lookup(key_array([k], args.key)).to_table()
            lat.append(time.perf_counter() - s)
        lookup_rows.append(["native LsmPointLookupPlanner", pct(lat, 50) * 1e3, pct(lat, 99) * 1e3])
        print_table("Single-key point lookup", ["reader", "p50 ms", "p99 ms"], lookup_rows)
        engine_times(t, w, args.repeat)
        stale_set_times(args.repeat)
        w.close(flush=False)


if __name__ == "__main__":
    main()
