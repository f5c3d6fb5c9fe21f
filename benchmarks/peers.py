"""Upsert tables side by side: memwal_query vs delta-rs MERGE, plain Lance merge_insert
and Apache Paimon (pypaimon).

Workload (what a user choosing an upsert table in Python would try): a base of 1M rows
(id int64 key, val float64, cat int32, name string), then 200 upserts of 100 rows each,
half of them new keys, each durable before the next starts; then a full read of the
newest row per key. Every engine must give the same answer (checked). Prints the
per-upsert p50/p99, the full read, the ratios to ours, and what "durable" and "visible
to another process" mean for each engine.

Peers come from the ``peers`` extra (``pip install -e '.[peers]'``: deltalake); an engine
that is not installed is skipped with a message. pypaimon 2.x requires pyarrow < 20 (this
project needs newer), so it has to run from its own virtualenv: ``--paimon-python
/path/to/venv/bin/python`` runs the Paimon part there (it needs numpy, pyarrow<20 and
pypaimon, plus pypaimon-rust for the Rust runtime a Paimon user would run).

Full reads are timed interleaved by default: round after round, every engine's read
once per round (rotated order), so each meets the same machine load; ``--sequential``
times each engine's reads in one block instead (the figures then move with the load).

``--quick``: a 100k-row base and 50 upserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, pct, print_table, timed  # noqa: E402

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
        pa.field("name", pa.string()),
    ]
)
UPSERT_ROWS = 100

SEMANTICS = {
    "memwal_query": (
        "put returns once its WAL entry (Arrow IPC) is written with put-if-not-exists and "
        "fsync (file and directory)",
        "flushed generations at once (each query re-resolves the sources); unflushed rows "
        "after the writer's flush (MemTable -> generation), or by replaying the WAL tail; "
        "readers in the writer's process pass writers=[w] and see them at once",
    ),
    "delta-rs": (
        "MERGE returns after the new _delta_log commit (put-if-absent); on local disk "
        "through object_store's LocalFileSystem, which does not fsync by default",
        "at commit: a newly opened DeltaTable (or update_incremental) reads the new version",
    ),
    "Lance merge_insert": (
        "execute returns after the new manifest version is committed; on local disk no "
        "fsync by default (object_store's LocalFileSystem)",
        "at commit: lance.dataset(uri) opens the newest version",
    ),
    "Paimon (Python)": (
        "commit returns after the new snapshot file is written (pypaimon's Python runtime "
        "requests no fsync; the Rust runtime's was not checked)",
        "at commit (a new snapshot); the read merges the LSM sorted runs per bucket",
    ),
}


def base_table(n: int, rng: np.random.Generator) -> pa.Table:
    ids = np.arange(n, dtype=np.int64)
    return table_of(ids, rng)


def table_of(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "val": pa.array(rng.random(len(ids))),
            "cat": pa.array(rng.integers(0, 100, len(ids)), pa.int32()),
            "name": pa.array(np.char.add("n", ids.astype(str))),
        },
        schema=SCHEMA,
    )


def upsert_batches(base_rows: int, count: int, rng: np.random.Generator) -> list[pa.Table]:
    """``count`` batches of UPSERT_ROWS rows: half existing keys, half new ones."""
    out = []
    next_new = base_rows
    for _ in range(count):
        old = rng.choice(base_rows, UPSERT_ROWS // 2, replace=False)
        new = np.arange(next_new, next_new + UPSERT_ROWS - len(old))
        next_new += len(new)
        out.append(table_of(np.concatenate([old, new]).astype(np.int64), rng))
    return out


def expected(base: pa.Table, batches: list[pa.Table]) -> pa.Table:
    """Newest row per key (the reference answer), sorted by id."""
    import datafusion

    ctx = datafusion.SessionContext()
    stamped = [base.append_column("_seq", pa.array(np.zeros(base.num_rows, np.int64)))]
    for i, b in enumerate(batches, 1):
        stamped.append(b.append_column("_seq", pa.array(np.full(b.num_rows, i, np.int64))))
    ctx.from_arrow(pa.concat_tables(stamped), name="all_rows")
    q = (
        "SELECT id, val, cat, name FROM (SELECT *, row_number() OVER (PARTITION BY id "
        "ORDER BY _seq DESC) AS rn FROM all_rows) WHERE rn = 1 ORDER BY id"
    )
    return ctx.sql(q).to_arrow_table().cast(SCHEMA)


def same(got: pa.Table, want: pa.Table) -> bool:
    got = got.select(SCHEMA.names).cast(SCHEMA).sort_by("id")
    return got.equals(want)


def run_ours(root: str, base: pa.Table, batches: list[pa.Table]) -> dict:
    """Our upserts (``RegionWriter.put``: durable in the WAL), and the reads a user would
    call: ``MemWalTable.to_table()`` with the writer's MemTable (read-your-writes), the
    same through DataFusion SQL, and a second table with the same upserts flushed, read
    by another table object (what another process sees)."""
    import datafusion
    import lance

    import memwal_query as mq

    schema = SCHEMA.set(0, pa.field("id", pa.int64(), False, PK))

    def build(uri: str) -> tuple[object, object, list[float]]:
        lance.write_dataset(base.cast(schema), uri, max_rows_per_file=len(base))
        t = mq.MemWalTable.initialize(uri)
        w = t.writer()
        lat = []
        for b in batches:
            s = time.perf_counter()
            w.put(b.cast(schema))
            lat.append(time.perf_counter() - s)
        return t, w, lat

    t, w, lat = build(f"{root}/ours")
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    flushed_t, flushed_w, _ = build(f"{root}/ours_flushed")
    flushed_w.close(flush=True)
    other = mq.MemWalTable.open(f"{root}/ours_flushed")
    return {
        "upserts": lat,
        "reads": {
            "": lambda: t.to_table(writers=[w]),
            "SQL SELECT * (DataFusion)": lambda: ctx.sql("SELECT * FROM t").to_arrow_table(),
            "after flush, another table object": lambda: other.to_table(),
        },
        "close": lambda: w.close(flush=False),
    }


def run_delta(root: str, base: pa.Table, batches: list[pa.Table]) -> dict | None:
    try:
        from deltalake import DeltaTable, write_deltalake
    except ImportError:
        print("delta-rs skipped: pip install -e '.[peers]' (deltalake)", file=sys.stderr)
        return None
    uri = f"{root}/delta"
    write_deltalake(uri, base)
    dt = DeltaTable(uri)
    lat = []
    for b in batches:
        s = time.perf_counter()
        (
            dt.merge(b, predicate="t.id = s.id", source_alias="s", target_alias="t")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )
        lat.append(time.perf_counter() - s)
    return {
        "upserts": lat,
        "reads": {
            "": lambda: DeltaTable(uri).to_pyarrow_table(),
            # the writer's own DeltaTable: no log replay
            "with the writer's DeltaTable (no reopen)": lambda: dt.to_pyarrow_table(),
        },
    }


def run_lance(root: str, base: pa.Table, batches: list[pa.Table]) -> dict:
    import lance

    uri = f"{root}/lance"
    ds = lance.write_dataset(base, uri, max_rows_per_file=len(base))
    lat = []
    for b in batches:
        s = time.perf_counter()
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(b)
        lat.append(time.perf_counter() - s)
    return {"upserts": lat, "reads": {"": lambda: lance.dataset(uri).to_table()}}


READ_CALLS = (
    "Full read = what a user of each engine calls for the whole table as a pyarrow "
    "Table: ours `MemWalTable.to_table(writers=[w])` (base + the writer's MemTable, "
    "newest row per key), delta-rs `DeltaTable(uri).to_pyarrow_table()` on a newly "
    "opened table, Lance `lance.dataset(uri).to_table()`, Paimon a read builder's "
    "`to_arrow` over a newly loaded table."
)


def time_reads(readers: dict[str, Callable[[], object]], repeat: int, interleaved: bool):
    """Seconds of ``repeat`` calls of every reader (after one untimed call each).

    Interleaved: round after round, each reader once per round, the order rotated each
    round, so that every engine's reads meet the same machine load (on a shared
    machine the load moves the figures 2-5x within a minute). Otherwise each reader's
    calls run in one block, one reader after the other."""
    names = list(readers)
    for name in names:
        readers[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    if not interleaved:
        for name in names:
            out[name] = timed(readers[name], repeat, warmup=0)
        return out
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            s = time.perf_counter()
            readers[name]()
            out[name].append(time.perf_counter() - s)
    return out


PAIMON_SCRIPT = r"""
import json, sys, time
import pyarrow as pa, pyarrow.ipc as ipc
from pypaimon import CatalogFactory, Schema

root, data, out, repeat = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rust = sys.argv[5] == "rust"  # pypaimon-rust: native write, commit and read
with pa.memory_map(data) as f:
    tables = ipc.open_file(f).read_all()
batch_no = tables.column("_batch").to_numpy()
tables = tables.drop_columns(["_batch"])
catalog = CatalogFactory.create({"warehouse": root})
catalog.create_database("db", True)
options = {"bucket": "4", "file.format": "parquet"}
if rust:
    options.update({k: "true" for k in (
        "write.native.enabled", "commit.native.enabled", "read.native.enabled")})
schema = Schema.from_pyarrow_schema(tables.schema, primary_keys=["id"], options=options)
catalog.create_table("db.t", schema, False)
table = catalog.get_table("db.t")

def write(t):
    wb = table.new_batch_write_builder()
    w, c = wb.new_write(), wb.new_commit()
    w.write_arrow(t)
    c.commit(w.prepare_commit())
    w.close(); c.close()

write(tables.filter(pa.compute.equal(pa.array(batch_no), 0)))
lat = []
for i in range(1, int(batch_no.max()) + 1):
    t = tables.filter(pa.compute.equal(pa.array(batch_no), i))
    s = time.perf_counter(); write(t); lat.append(time.perf_counter() - s)

def read():
    t = catalog.get_table("db.t")
    rb = t.new_read_builder()
    return rb.new_read().to_arrow(rb.new_scan().plan().splits())

answer = read()
reads = []
for _ in range(repeat):
    s = time.perf_counter(); read(); reads.append(time.perf_counter() - s)
with pa.OSFile(out + ".arrow", "wb") as f:
    with ipc.new_file(f, answer.schema) as w:
        w.write_table(answer)
json.dump({"upserts": lat, "read_times": reads}, open(out, "w"))
"""


def run_paimon(
    root: str,
    base: pa.Table,
    batches: list[pa.Table],
    repeat: int,
    python: str | None,
    runtime: str,
) -> dict | None:
    """Paimon primary-key table (4 buckets) in ``python``'s venv, with pypaimon's Python
    runtime or its Rust one (``pypaimon-rust``: native write, commit and read). Its
    reads are timed there, one after the other (not interleaved with the others)."""
    if not python:
        if runtime == "python":  # one message for both runtimes
            print(
                "Paimon skipped: pypaimon needs pyarrow < 20; pass --paimon-python with "
                "the python of a venv holding pypaimon (and pypaimon-rust)",
                file=sys.stderr,
            )
        return None
    data = f"{root}/paimon_input.arrow"
    if not os.path.exists(data):
        parts = [base.append_column("_batch", pa.array(np.zeros(base.num_rows, np.int32)))]
        for i, b in enumerate(batches, 1):
            parts.append(b.append_column("_batch", pa.array(np.full(b.num_rows, i, np.int32))))
        with pa.OSFile(data, "wb") as f, pa.ipc.new_file(f, parts[0].schema) as w:
            w.write_table(pa.concat_tables(parts))
    out = f"{root}/paimon_{runtime}.json"
    script = f"{root}/paimon_run.py"
    Path(script).write_text(PAIMON_SCRIPT)
    proc = subprocess.run(
        [python, script, f"{root}/paimon_{runtime}", data, out, str(repeat), runtime],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(f"Paimon ({runtime}) failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    res = json.loads(Path(out).read_text())
    with pa.memory_map(out + ".arrow") as f:
        res["answer"] = pa.ipc.open_file(f).read_all()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k-row base, 50 upserts")
    parser.add_argument("--repeat", type=int, default=9, help="full reads timed per engine")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time each engine's full reads in one block (default: interleaved rounds)",
    )
    parser.add_argument("--paimon-python", help="python of a venv with pypaimon (see above)")
    args = parser.parse_args()
    base_rows, count = (100_000, 50) if args.quick else (1_000_000, 200)
    rng = np.random.default_rng(11)
    base = base_table(base_rows, rng)
    batches = upsert_batches(base_rows, count, rng)
    want = expected(base, batches)
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        runs = {
            "memwal_query": lambda: run_ours(root, base, batches),
            "delta-rs": lambda: run_delta(root, base, batches),
            "Lance merge_insert": lambda: run_lance(root, base, batches),
            "Paimon (Python)": lambda: run_paimon(
                root, base, batches, args.repeat, args.paimon_python, "python"
            ),
            "Paimon (Rust)": lambda: run_paimon(
                root, base, batches, args.repeat, args.paimon_python, "rust"
            ),
        }
        readers: dict[tuple[str, str], Callable[[], object]] = {}
        for name, fn in runs.items():
            started = time.perf_counter()
            res = fn()
            if res is None:
                continue
            print(f"{name}: {time.perf_counter() - started:.1f}s", file=sys.stderr)
            results[name] = res
            if "answer" in res and not same(res["answer"], want):
                raise SystemExit(f"{name} gave a different answer")
            for label, read in res.get("reads", {}).items():
                if not same(read(), want):
                    raise SystemExit(f"{name} ({label or 'full read'}) gave a different answer")
                readers[(name, label)] = read
        load_reads = os.getloadavg()
        times = time_reads(readers, args.repeat, not args.sequential)
        for (name, label), secs in times.items():
            results[name].setdefault("read_times_by", {})[label] = secs
        for res in results.values():
            if "close" in res:
                res["close"]()
    load_after = os.getloadavg()
    ours = results["memwal_query"]
    ours_p50 = pct(ours["upserts"], 50)
    ours_read = median(ours["read_times_by"][""])
    rows = []
    for name, r in results.items():
        p50 = pct(r["upserts"], 50)
        by = r.get("read_times_by") or {"": r["read_times"]}
        for label, secs in by.items():
            upserts = [p50 * 1e3, pct(r["upserts"], 99) * 1e3] if not label else ["", ""]
            ratio = [p50 / ours_p50] if not label else [""]
            rows.append(
                [
                    f"{name}, {label}" if label else name,
                    *upserts,
                    min(secs) * 1e3,
                    median(secs) * 1e3,
                    *ratio,
                    median(secs) / ours_read,
                ]
            )
    mode = (
        "each engine's reads one after the other (--sequential)"
        if args.sequential
        else f"interleaved: {args.repeat} rounds, every read once per round in rotated order"
    )
    load = "/".join(f"{x[0]:.1f}" for x in (load_before, load_reads, load_after))
    print_table(
        f"{base_rows:,}-row base, {count} durable upserts of {UPSERT_ROWS} rows (half new "
        f"keys), then a full read of the newest row per key; same answer checked "
        f"({machine()}, {time.strftime('%Y-%m-%d %H:%M')}, load average {load} at "
        f"start / reads / end)",
        [
            "engine",
            "upsert p50 ms",
            "upsert p99 ms",
            "full read best ms",
            "full read median ms",
            "upsert / ours",
            "read / ours (median)",
        ],
        rows,
    )
    print(f"\n{READ_CALLS} Reads timed {mode}", end="")
    if args.sequential:
        print(".")
    else:
        print(
            " (the fairer measure on a shared machine: every engine meets the same load; "
            "timed one engine after the other, the figures move 2-5x with the load); "
            "Paimon's reads run in its own process, one after the other."
        )
    print_table(
        "What durable and visible mean",
        ["engine", "durable when", "visible to another process"],
        [[name, *SEMANTICS[name.replace("Rust", "Python")]] for name in results],
    )


if __name__ == "__main__":
    main()
