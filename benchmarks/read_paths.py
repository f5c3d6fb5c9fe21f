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

Consistency costs (``--consistency-only`` runs just these): the default consistency
(``latest``: every acknowledged write, the WAL tail included) vs ``strong`` (flushed rows
only), read by another table object, for a filtered ``count(*)`` on a 200k-row table and
a point lookup, at 1, 16 and 64 regions with nothing unflushed, on local disk and on the
local S3 server (moto) with ``--s3-latency`` ms added to every request; then the cost
of each unflushed WAL entry (cold: read and decoded; warm: from the entry cache).
"""

from __future__ import annotations

import argparse
import contextlib
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


CONSISTENCY_ROWS = 200_000
CONSISTENCY_QUERY = "SELECT count(*) FROM {} WHERE cat = 7"


class _Delayed:
    """WSGI middleware adding ``delay.value`` seconds to every request (a remote
    store's latency; a shared ``multiprocessing.Value`` the benchmark sets)."""

    def __init__(self, app, delay) -> None:
        self.app = app
        self.delay = delay

    def __call__(self, environ, start_response):
        if self.delay.value:
            time.sleep(self.delay.value)
        return self.app(environ, start_response)


def _serve_s3(delay, ready) -> None:
    """Child process: the local S3 server (tests/s3server.py) with ``_Delayed``, in its
    own process as a remote store would be (in the benchmark's process, moto's request
    handling competes with the reader for the GIL)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from s3server import LocalS3Server

    server = LocalS3Server().start()
    server._server.app = _Delayed(server._server.app, delay)
    server.create_bucket("bench")
    ready.put(server.storage_options())
    while True:
        time.sleep(3600)


class _Latency:
    """Set the child server's added latency for a block (setup runs without it)."""

    def __init__(self, value, seconds: float) -> None:
        self.value = value
        self.seconds = seconds

    def __enter__(self):
        self.value.value = self.seconds

    def __exit__(self, *exc):
        self.value.value = 0.0


def _interleaved(fns: dict, repeat: int) -> dict:
    """Median seconds of each fn, the fns run in turn (so drift hits them alike)."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            s = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - s)
    return {name: median(ts) for name, ts in times.items()}


def consistency_case(uri: str, options: dict, regions: int, repeat: int, delay=None) -> list:
    """Default vs strong at ``regions`` regions, nothing unflushed: one row of figures."""
    rng = np.random.default_rng(3)
    data = rows(np.arange(CONSISTENCY_ROWS), rng)
    lance.write_dataset(data, uri, storage_options=options or None)
    spec = mq.unsharded_spec() if regions == 1 else mq.bucket_spec(data.schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec, storage_options=options or None)
    t.write(rows(rng.choice(CONSISTENCY_ROWS, 20_000, replace=False), rng))
    t.close()  # flushed: nothing unflushed
    reader = mq.MemWalTable.open(uri, storage_options=options or None)
    assert len(reader.catalog.region_ids()) == regions
    ctx = datafusion.SessionContext()
    ctx.register_table("d", reader.provider())
    ctx.register_table("s", reader.provider(consistency="strong"))
    key = pa.array([12_345], pa.int64())
    with delay or contextlib.nullcontext():
        got = _interleaved(
            {
                "query default": lambda: ctx.sql(CONSISTENCY_QUERY.format("d")).to_arrow_table(),
                "query strong": lambda: ctx.sql(CONSISTENCY_QUERY.format("s")).to_arrow_table(),
                "lookup default": lambda: reader.lookup(key),
                "lookup strong": lambda: reader.lookup(key, consistency="strong"),
            },
            repeat,
        )
    qd, qs = got["query default"], got["query strong"]
    ld, ls = got["lookup default"], got["lookup strong"]
    return [regions, qd * 1e3, qs * 1e3, f"{qd / qs:.2f}x", ld * 1e3, ls * 1e3, f"{ld / ls:.2f}x"]


def unflushed_cost(uri: str, options: dict, repeat: int, entries: int = 50, delay=None) -> list:
    """Milliseconds per unflushed WAL entry (100 rows each) for the default query, cold
    (entries read and decoded) and warm (entry cache), one region."""
    from memwal_query.read import waltail

    rng = np.random.default_rng(5)
    lance.write_dataset(
        rows(np.arange(CONSISTENCY_ROWS), rng), uri, storage_options=options or None
    )
    t = mq.MemWalTable.initialize(uri, storage_options=options or None)
    reader = mq.MemWalTable.open(uri, storage_options=options or None)
    ctx = datafusion.SessionContext()
    ctx.register_table("d", reader.provider())

    def query():
        return ctx.sql(CONSISTENCY_QUERY.format("d")).to_arrow_table()

    def cold():
        waltail.forget()
        return query()

    w = t.writer()
    with delay or contextlib.nullcontext():
        none = _interleaved({"q": query}, repeat)["q"]
    for _ in range(entries):
        w.put(rows(rng.choice(CONSISTENCY_ROWS, 100, replace=False), rng))
    with delay or contextlib.nullcontext():
        got = _interleaved({"cold": cold, "warm": query}, repeat)
    w.close(flush=False)
    return [
        entries,
        none * 1e3,
        got["cold"] * 1e3,
        got["warm"] * 1e3,
        (got["cold"] - none) / entries * 1e3,
        (got["warm"] - none) / entries * 1e3,
    ]


def consistency_costs(repeat: int, latency_ms: float, region_counts=(1, 16, 64)) -> None:
    """Print default vs strong (see the module docs), local disk then local S3."""
    import multiprocessing

    header = [
        "regions",
        "query default ms",
        "query strong ms",
        "default/strong",
        "lookup default ms",
        "lookup strong ms",
        "default/strong",
    ]
    cost_header = [
        "unflushed entries",
        "none ms",
        "cold ms",
        "warm ms",
        "cold ms/entry",
        "warm ms/entry",
    ]
    load = os.getloadavg()
    where = f"{machine()}, load {load[0]:.2f} {load[1]:.2f}"
    with tempfile.TemporaryDirectory() as root:
        out = [consistency_case(f"{root}/r{n}", {}, n, repeat) for n in region_counts]
        print_table(
            f"Default (latest) vs strong, nothing unflushed, local disk "
            f"({CONSISTENCY_ROWS:,} rows, `{CONSISTENCY_QUERY.format('t')}`; {where})",
            header,
            out,
        )
        cost = [unflushed_cost(f"{root}/u", {}, repeat)]
        print_table("Cost per unflushed WAL entry (100 rows), local disk", cost_header, cost)
    mp = multiprocessing.get_context("spawn")
    value, ready = mp.Value("d", 0.0), mp.Queue()
    child = mp.Process(target=_serve_s3, args=(value, ready), daemon=True)
    child.start()
    try:
        opts = ready.get(timeout=120)
        delay = _Latency(value, latency_ms / 1e3)
        base = f"s3://bench/{uuid.uuid4().hex}"
        out = [
            consistency_case(f"{base}/r{n}", opts, n, max(3, repeat // 2), delay)
            for n in region_counts
        ]
        print_table(
            f"Default (latest) vs strong, nothing unflushed, local S3 server (moto, its own "
            f"process) + {latency_ms:g} ms per request ({where})",
            header,
            out,
        )
        cost = [unflushed_cost(f"{base}/u", opts, max(3, repeat // 2), delay=delay)]
        print_table(
            f"Cost per unflushed WAL entry (100 rows), local S3 + {latency_ms:g} ms",
            cost_header,
            cost,
        )
    finally:
        child.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--key", choices=["int64", "string"], default="int64", help="primary-key type"
    )
    parser.add_argument(
        "--consistency-only", action="store_true", help="only the consistency costs"
    )
    parser.add_argument(
        "--s3-latency", type=float, default=5.0, help="ms added to each local S3 request"
    )
    args = parser.parse_args()
    consistency_costs(max(args.repeat, 7), args.s3_latency)
    if args.consistency_only:
        return
    base_rows = 100_000 if args.quick else 1_000_000
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        t, w = setup(root, base_rows, args.key)
        print(f"setup: {time.perf_counter() - started:.1f}s", file=sys.stderr)
        base = lance.dataset(t.uri)
        snap = native_snapshot(t, w.region_id)
        ctx = datafusion.SessionContext()
        ctx.register_table("live", t.provider(writers=[w]))  # + live MemTable
        ctx.register_table("flushed", t.provider(consistency="strong"))  # flushed only

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
