"""The streaming section of ``benchmarks/scale.py``: a steady stream of
upserts for ``--stream-minutes`` with ``memwal maintain URI --watch`` running alongside
as a real subprocess.

The stream: every tick (0.5 s) the rows due at ``--stream-rate`` rows/s are written
through :meth:`MemWalTable.write` (a share ``--stream-new-share`` of new keys, 10% by
default, the rest updates of existing keys; each row with a vector, a text and
``seq``, the global write number), plus about 2% of the tick's keys deleted; every
``--stream-flush-seconds`` the writers flush (a new generation per region). Each tick
then runs one single-key lookup, one vector search (k=10) and one full-text search
through the same table (MemTables included), and the same lookup and vector search
(same key and query vector, ``nprobes`` 20 and ``refine_factor`` 20 as
:meth:`MemWalTable.vector_search`'s defaults) on the base table's latest version alone
with plain Lance: the base table doubles during a default run (the new keys), so the
ratio ours / base-only is what says whether the LSM's own overhead (unmerged
generations, MemTables, dedup) stays flat. Every minute it prints the unmerged
generations (mean and max of samples taken at each flush), p50 of the minute's
lookups, vector and full-text searches, the base-only p50s and the two ratios, the
rows/s achieved, the generation directories on disk, the base table's rows, versions,
fragments and index segments, the maintainer's passes, both processes' RSS and what the
reader's own holders hold (:func:`memwal_query.memory_usage`: the Arrow pool, the
table's Lance caches, decoded generation columns); at the end the first-minute vs
last-minute ratios, and it verifies the answer: every key's newest ``seq`` equals a
model kept alongside (nothing lost, nothing doubled, no deleted key back) - through
the reader with live MemTables, after a final flush, and in the
base table itself after a final full merge.


Run on its own (``python benchmarks/scale_stream.py``) it is the at-scale stream: a
10,000,000-row base (``--rows``; 20,000,000 with ``--large``) in 32 bucket regions
(``--regions``), a sustained stream of upserts (one value in 50 a new key) and deletes
(one value in 50) for ``--minutes`` (default 30) with ``memwal maintain URI --watch``
alongside as a real process, and a reader process (this one) that runs ``count(*)``, a
filtered aggregate and a 10-key lookup every ``--query-every`` seconds (default 5).
The writer is a separate process: Python :meth:`MemWalTable.write` (default), or
Spark Structured Streaming with ``--spark`` (a rate source, ``foreachBatch(mqs.sink(uri,
delete_column=..., order_by="seq"))``, micro-batches every ``--trigger-seconds``). The
stream's value ``v`` (0, 1, 2, ...) decides its row: key ``base + v // 50`` when
``v % 50 == 0`` (a new key), a delete when ``v % 50 == 7``, else an update, ``seq = v``;
so the model of the table after ``N`` values is computed at the end, whichever writer
wrote them. The key mix (``--mix``): ``steady`` (default) deletes key ``v // 50``, the
oldest live key, and updates key ``v // 50 + 1 + (v * 1000003 mod (base - 1))``, a live
one: the table keeps the base's live rows from the first minute to the last, so a
query's last / first ratio is the LSM's drift alone. ``growing`` updates and deletes key
``v * 1000003 mod base``: a deleted key comes back with its next update, so the new
keys grow the table (by 1.36x in 30 minutes at 100k rows/s) and every query that
reads each live row grows with it. The reader prints the live rows (its ``count(*)``)
per minute and the ratios last / first both raw and per live row.

The rate: ``--rate`` rows/s, or by default the highest the machine holds, found by a
calibration burst (the Python writer writes flat out for ``--calibrate-seconds`` with the
maintainer running and the reader querying every ``--query-every`` seconds) and streamed at
``--rate-share`` (0.6) of it; Spark: 20,000 rows/s unless ``--rate`` is given, with the
headroom (micro-batch seconds / trigger interval) and the rate it implies printed. Per
minute: target and achieved rows/s, unmerged generations (mean, max), ``count(*)``, filtered
and lookup p50, the reader's, maintainer's and writer's RSS, the maintainer's passes and
merged generations, the base's live rows, its physical rows per live row and the rows its
primary-key index leaves unindexed (means over the ticks: the wear scans and lookups pay
until a pass compacts and indexes), the load average; then last minute / first minute
ratios, and the final checks: every key's newest ``seq`` against the model in the live
reader, a reopened table, and the base table alone after the WAL tails are flushed and
everything merged. In the work directory: ``reader_memory.jsonl`` (per minute, what the
reader's caches, Lance session and C heap hold, the base's fragments, fragments with a
deletion file and primary-key index segments, the reader's Python objects) and
``lookup_phases.jsonl`` (per tick, each query's wall and CPU milliseconds and the
lookup's by phase: view resolution, MemTable and WAL-tail probes, opening generations,
the base's key lookup, garbage collection, heap trims)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import local_spark, machine, pct, print_table, stop_process  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.format.index import INDEX_NAME  # noqa: E402
from memwal_query.maintain.policy import MaintenancePolicy, plan_regions  # noqa: E402
from memwal_query.search.vector import DEFAULT_REFINE_FACTOR  # noqa: E402

TICK = 0.5
LATENCIES = ("lookup", "vector", "fts", "base lookup", "base vector")
DELETE_SHARE = 0.02


def stream_schema(dim: int) -> pa.Schema:
    pk = {"lance-schema:unenforced-primary-key": "true"}
    return pa.schema(
        [
            pa.field("id", pa.int64(), False, pk),
            pa.field("seq", pa.int64()),
            pa.field("vec", pa.list_(pa.float32(), dim)),
            pa.field("text", pa.string()),
        ]
    )


def stream_rows(
    ids: np.ndarray,
    seq: np.ndarray,
    rng: np.random.Generator,
    centers: np.ndarray,
    words: np.ndarray,
) -> pa.Table:
    dim = centers.shape[1]
    vecs = centers[rng.integers(0, len(centers), len(ids))]
    vecs = (vecs + rng.standard_normal((len(ids), dim)) * 0.3).astype(np.float32)
    picked = words[np.minimum(rng.zipf(1.3, (len(ids), 8)) - 1, len(words) - 1)]
    text = pa.array([" ".join(w) for w in picked.tolist()])
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "seq": pa.array(seq, pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel(), pa.float32()), dim),
            "text": text,
        },
        schema=stream_schema(dim),
    )


def queries(
    t: mq.MemWalTable,
    rng: np.random.Generator,
    keys: int,
    centers: np.ndarray,
    words: np.ndarray,
    lat: dict[str, list[float]],
    base: lance.LanceDataset | None = None,
) -> None:
    """One lookup, one vector search and one full-text search; their seconds into ``lat``.

    With ``base`` (the base table's latest version, plain Lance), the same lookup and
    vector search on it alone too (``base lookup``, ``base vector``): what the same
    queries cost a table of the base's size without the LSM's generations and MemTables.
    """
    k = int(rng.integers(0, keys))
    key = pa.array([k], pa.int64())
    dim = centers.shape[1]
    q = (centers[rng.integers(0, len(centers))] + rng.standard_normal(dim) * 0.3).astype(np.float32)
    text = f"{words[rng.integers(3, 60)]} {words[rng.integers(3, 300)]}"
    nearest = {"column": "vec", "q": q, "k": 10, "nprobes": 20}
    nearest["refine_factor"] = DEFAULT_REFINE_FACTOR  # MemWalTable.vector_search's defaults
    calls: list[tuple[str, Callable[[], object]]] = [
        ("lookup", lambda: t.lookup(key, columns=["id", "seq"])),
        ("vector", lambda: t.vector_search("vec", q, k=10, columns=["id"])),
        ("fts", lambda: t.fts_search("text", text, k=10, columns=["id"])),
    ]
    if base is not None:
        calls += [
            ("base lookup", lambda: base.to_table(columns=["id", "seq"], filter=f"id = {k}")),
            (
                "base vector",
                lambda: base.to_table(
                    nearest=nearest, columns=["id"], disable_scoring_autoprojection=True
                ),
            ),
        ]
    for name, fn in calls:
        s = time.perf_counter()
        fn()
        lat[name].append(time.perf_counter() - s)


def held_mb(t: mq.MemWalTable) -> list[float]:
    """[Arrow pool, the table's Lance caches, decoded generation columns] in MB: what
    this process holds by holder (:func:`memwal_query.memory_usage`)."""
    use = mq.memory_usage(t)
    keys = ("arrow_pool_bytes", "lance_cache_bytes", "generation_columns_bytes")
    return [use[k] / 2**20 for k in keys]


def reader_memory(t: mq.MemWalTable) -> dict[str, float]:
    """What this process holds, by holder, in MB: :func:`memwal_query.memory_usage`'s
    byte counts, the Lance sessions of the opened generations, and glibc's heap (in
    use and free-but-kept: numpy arrays and the Lance extension's native allocations;
    the Arrow pool is mimalloc's, reported apart)."""
    from memwal_query.search.caches import OPEN_GENERATIONS

    use = {k: v / 2**20 for k, v in mq.memory_usage(t).items() if k.endswith("bytes")}
    gens = list(OPEN_GENERATIONS._items.values())
    use["open_generation_sessions"] = (
        sum(g._ds.session().size_bytes() for g in gens if g._ds is not None) / 2**20
    )
    try:
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()
            ]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Info
        info = libc.mallinfo2()
        use["glibc_in_use"] = (info.uordblks + info.hblkhd) / 2**20
        use["glibc_free_kept"] = info.fordblks / 2**20
    except (OSError, AttributeError):
        pass
    use["rss"] = rss_mb(os.getpid())
    return use


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MB (0 when unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def gen_dirs(uri: str) -> int:
    """Generation directories on disk (all regions)."""
    root = Path(uri) / "_mem_wal"
    return sum(1 for p in root.glob("*/*_gen_*") if p.is_dir())


def unmerged(t: mq.MemWalTable) -> int:
    """Unmerged flushed generations over all regions."""
    return sum(len(p.generations) for p in plan_regions(t.catalog, MaintenancePolicy()))


def verify(seq: pa.Table, model: np.ndarray, what: str) -> str:
    """'ok' when ``seq`` (id, seq) holds each live key of ``model`` once with its seq
    (keys are indices into ``model``: counted with a dense table, no sort)."""
    ids = seq.column("id").to_numpy()
    got = seq.column("seq").to_numpy()
    problems = []
    unknown = (ids < 0) | (ids >= len(model))
    if unknown.any():
        problems.append(f"{int(unknown.sum())} unknown keys (e.g. {ids[unknown][:5].tolist()})")
        ids, got = ids[~unknown], got[~unknown]
    counts = np.bincount(ids, minlength=len(model))
    live = model >= 0
    doubled = int((counts > 1).sum())
    if doubled:
        problems.append(f"{doubled} doubled keys")
    missing = np.flatnonzero(live & (counts == 0))
    if len(missing):
        problems.append(f"{len(missing)} lost keys (e.g. {missing[:5].tolist()})")
    extra = np.flatnonzero(~live & (counts > 0))
    if len(extra):
        problems.append(f"{len(extra)} deleted keys back (e.g. {extra[:5].tolist()})")
    wrong = np.flatnonzero(live[ids] & (model[ids] != got))
    if len(wrong):
        problems.append(f"{len(wrong)} stale values (e.g. id {ids[wrong[0]]})")
    status = "ok" if not problems else "WRONG: " + "; ".join(problems)
    n_live = int(live.sum())
    print(f"  verify {what}: {len(seq):,} rows, {n_live:,} live keys in the model: {status}")
    return status


def run_stream(
    root: str,
    *,
    minutes: float,
    rate: int,
    base_rows: int,
    regions: int,
    flush_seconds: float,
    watch_seconds: float,
    retention_hours: float,
    new_share: float,
    log_copy: str | None,
    dim: int,
    centers: np.ndarray,
    words: np.ndarray,
) -> bool:
    """Run the stream; print the per-minute table; True when every check holds."""
    rng = np.random.default_rng(11)
    uri = f"{root}/stream"
    base = stream_rows(np.arange(base_rows), np.zeros(base_rows, np.int64), rng, centers, words)
    lance.write_dataset(base, uri)
    ds = lance.dataset(uri)
    ds.create_index("vec", "IVF_PQ", name="vec_idx", num_partitions=32, num_sub_vectors=8)
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    spec = mq.bucket_spec(ds.lance_schema, "id", regions) if regions > 1 else None
    t = mq.MemWalTable.initialize(uri, region_spec=spec, maintained_indexes=["vec_idx", "text_idx"])
    # MemTables flush on the benchmark's clock only
    t.configure_writers(max_memtable_rows=10_000_000, max_memtable_bytes=1 << 40)
    capacity = base_rows + int(rate * (minutes * 60 + 60) * new_share) + 10 * rate
    model = np.full(capacity, -1, np.int64)
    model[:base_rows] = 0
    next_key, next_seq = base_rows, 1

    cmd = [sys.executable, "-m", "memwal_query", "maintain", uri, "--watch", str(watch_seconds)]
    cmd += ["--retention-hours", str(retention_hours), "--json"]
    log = open(f"{root}/maintain.log", "w")  # noqa: SIM115 - closed below
    maint = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(
        f"\nstream: {base_rows:,}-row base, {regions} region(s), {rate:,} rows/s for "
        f"{minutes:g} min, flush every {flush_seconds:g} s, `memwal maintain --watch "
        f"{watch_seconds:g} --retention-hours {retention_hours:g}` (pid {maint.pid})",
        flush=True,
    )
    minutes_out: list[list[object]] = []
    lat: dict[str, list[float]] = {k: [] for k in LATENCIES}
    # plain Lance on the base table alone, sharing the table's Lance caches (same
    # entries: no second copy in this process's memory, and as warm as the table's)
    plain = lance.dataset(uri, session=t.catalog.dataset().session())
    start = time.perf_counter()
    last_flush = minute_start = start
    written = minute_rows = 0
    minute = 1
    seen: list[int] = [0]
    samples: list[int] = []
    qrng = np.random.default_rng(3)
    try:
        while True:
            now = time.perf_counter()
            if minute > minutes or now - start >= minutes * 60 + 30:
                break
            due = int(rate * (now - start)) - written
            if due > 0:
                keys = np.unique(
                    np.concatenate(
                        [
                            rng.integers(0, next_key, due - int(due * new_share)),
                            np.arange(next_key, next_key + int(due * new_share)),
                        ]
                    )
                )
                next_key = max(next_key, int(keys[-1]) + 1)
                dels = rng.random(len(keys)) < DELETE_SHARE
                ups = keys[~dels]
                seq = np.arange(next_seq, next_seq + len(ups))
                next_seq += len(ups)
                t.write(stream_rows(ups, seq, rng, centers, words))
                model[ups] = seq
                if dels.any():
                    t.delete(pa.table({"id": pa.array(keys[dels], pa.int64())}))
                    model[keys[dels]] = -1
                written += due
                minute_rows += len(keys)
            if now - last_flush >= flush_seconds:
                t.flush()
                last_flush = now
                samples.append(unmerged(t))
            base_now = plain.checkout_version(plain.latest_version)
            queries(t, qrng, next_key, centers, words, lat, base_now)
            end = time.perf_counter()
            if end - minute_start >= 60:
                p50 = {k: pct(v, 50) * 1e3 for k, v in lat.items()}
                row = [
                    minute,
                    float(np.mean(samples)) if samples else 0.0,
                    max(samples, default=0),
                    p50["lookup"],
                    p50["vector"],
                    p50["fts"],
                    p50["base lookup"],
                    p50["base vector"],
                    p50["lookup"] / p50["base lookup"],
                    p50["vector"] / p50["base vector"],
                    minute_rows / (end - minute_start),
                    gen_dirs(uri),
                    *base_shape(uri),
                    *passes(f"{root}/maintain.log", seen),
                    rss_mb(maint.pid),
                    rss_mb(os.getpid()),
                    *held_mb(t),
                    os.getloadavg()[0],
                ]
                minutes_out.append(row)
                print("  minute " + " | ".join(_short(c) for c in row), flush=True)
                if maint.poll() is not None:
                    raise RuntimeError(f"the maintainer exited with {maint.returncode}")
                lat = {k: [] for k in lat}
                samples = []
                minute_rows, minute_start, minute = 0, end, minute + 1
            time.sleep(max(0.0, TICK - (time.perf_counter() - now)))
        elapsed = time.perf_counter() - start
        t.flush()
    finally:
        stop_process(maint)
        log.close()
    header = [
        "minute",
        "unmerged gens (mean)",
        "(max)",
        "lookup p50 ms",
        "vector p50 ms",
        "fts p50 ms",
        "base-only lookup p50 ms",
        "base-only vector p50 ms",
        "lookup / base-only",
        "vector / base-only",
        "rows/s",
        "gen dirs",
        "base rows",
        "base versions",
        "base fragments",
        "index segments",
        "passes",
        "merged gens",
        "pass s (mean)",
        "pass errors",
        "maintainer MB",
        "reader MB",
        "reader Arrow MB",
        "reader Lance cache MB",
        "reader gen cache MB",
        "load 1 min",
    ]
    title = "Streaming with `memwal maintain --watch` alongside, per minute"
    print_table(title, header, minutes_out)
    ok = True
    if len(minutes_out) >= 2:
        first, last = minutes_out[0], minutes_out[-1]
        ratios = {
            h: float(last[i]) / float(first[i]) if float(first[i]) else float("nan")
            for i, h in enumerate(header)
            if i in (1, 3, 4, 5, 6, 7, 8, 9, 10)
        }
        print(
            "last minute / first minute: " + ", ".join(f"{h} {r:.2f}x" for h, r in ratios.items())
        )
    if log_copy:
        shutil.copy(f"{root}/maintain.log", log_copy)
        print(f"maintainer log: {log_copy}")
    rate_now = written / elapsed
    print(f"written {written:,} rows in {elapsed:.0f} s ({rate_now:,.0f} rows/s); final checks:")
    ok &= verify(t.to_table(columns=["id", "seq"]), model[:next_key], "reader") == "ok"
    t.close()
    reopened = mq.MemWalTable.open(uri)
    ok &= verify(reopened.to_table(columns=["id", "seq"]), model[:next_key], "reopened") == "ok"
    reopened.maintenance.maintain(MaintenancePolicy(merge_over_generations=0, merge_over_rows=0))
    base_now = lance.dataset(uri).to_table(columns=["id", "seq"])
    ok &= verify(base_now, model[:next_key], "base table after a full merge") == "ok"
    clean_table(reopened, minutes_out[-1] if minutes_out else None, next_key, centers, words)
    return bool(ok)


def clean_table(
    t: mq.MemWalTable, last: list[object] | None, keys: int, centers: np.ndarray, words: np.ndarray
) -> None:
    """The same queries on the table after the stream, everything merged, the base
    compacted into as few fragments as Lance makes and each index in one segment: what
    a table of that size costs without any accumulated work. The last minute's
    figures divided by these say what the stream's pending work still costs."""
    t.maintenance.maintain(
        MaintenancePolicy(merge_over_generations=0, compact_fragments=0, max_index_segments=1)
    )
    lat: dict[str, list[float]] = {k: [] for k in LATENCIES}
    rng = np.random.default_rng(5)
    for _ in range(60):
        queries(t, rng, keys, centers, words, lat)
    clean = [pct(lat[k], 50) * 1e3 for k in ("lookup", "vector", "fts")]
    print(
        "the same table after the stream, fully merged, compacted, indexes in one segment "
        f"({lance.dataset(t.uri).count_rows():,} rows): lookup {clean[0]:.1f} ms, vector "
        f"{clean[1]:.1f} ms, fts {clean[2]:.1f} ms (p50 of 60)"
    )
    if last is not None:
        streamed = [float(last[i]) for i in (3, 4, 5)]  # type: ignore[arg-type]
        print(
            "last streaming minute / that table: "
            + ", ".join(
                f"{k} {a / b:.2f}x"
                for k, a, b in zip(("lookup", "vector", "fts"), streamed, clean, strict=True)
            )
        )


def base_shape(uri: str) -> list[int]:
    """[rows, versions, fragments, index segments (all indexes)] of the base table.

    Read again when the maintainer's GC removed a version while Lance listed them."""
    for attempt in range(5):
        try:
            ds = lance.dataset(uri)
            segments = sum(
                len(ix.segments) for ix in ds.describe_indices() if ix.name != INDEX_NAME
            )
            return [ds.count_rows(), len(ds.versions()), len(ds.get_fragments()), segments]
        except (ValueError, OSError):
            if attempt == 4:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def passes(log: str, seen: list[int]) -> list[object]:
    """[passes, generations merged, mean pass seconds, passes with errors] of the
    maintainer's JSON reports since the last call (``seen[0]``: lines read so far)."""
    lines = [x for x in Path(log).read_text().splitlines() if x.startswith("{")]
    reports = []
    for x in lines[seen[0] :]:
        try:
            reports.append(json.loads(x))
        except ValueError:  # a line being written
            break
    seen[0] += len(reports)
    secs = [r["seconds"] for r in reports]
    return [
        len(reports),
        sum(len(r["merged"]) for r in reports),
        float(np.mean(secs)) if secs else 0.0,
        sum(1 for r in reports if r["errors"]),
    ]


def _short(c: object) -> str:
    return f"{c:.1f}" if isinstance(c, float) else str(c)


# -- the at-scale stream (run as a script) -----------------------------------------------
KEY_PRIME = 1_000_003
NEW_EVERY = 50
DELETE_EVERY, DELETE_AT = 50, 7
SCALE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, {"lance-schema:unenforced-primary-key": "true"}),
        pa.field("seq", pa.int64()),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
    ]
)


MIXES = ("steady", "growing")


def stream_keys(
    values: np.ndarray, base_rows: int, mix: str = "steady"
) -> tuple[np.ndarray, np.ndarray]:
    """(key, is_delete) of stream values (see the module docs).

    ``steady``: the delete at ``v`` (``v % 50 == 7``) removes key ``v // 50``, the oldest
    live key, and updates pick a live key above it, so the live keys are always the
    window ``v // 50 + 1 .. base_rows + v // 50`` (one new key in, one old key out, per
    50 values). ``growing``: updates and deletes pick any base key; a deleted key comes
    back with its next update, so the new keys grow the table."""
    new = values % NEW_EVERY == 0
    dels = values % DELETE_EVERY == DELETE_AT
    block = values // NEW_EVERY
    if mix == "steady":
        others = np.where(dels, block, block + 1 + (values * KEY_PRIME) % (base_rows - 1))
    else:
        others = (values * KEY_PRIME) % base_rows
    ids = np.where(new, base_rows + block, others)
    return ids.astype(np.int64), dels


def spark_key_sql(base_rows: int, mix: str = "steady") -> str:
    """:func:`stream_keys`'s key as a Spark SQL expression of ``value``."""
    new = f"CASE WHEN value % {NEW_EVERY} = 0 THEN {base_rows} + value DIV {NEW_EVERY} "
    if mix == "steady":
        return (
            new + f"WHEN value % {DELETE_EVERY} = {DELETE_AT} THEN value DIV {NEW_EVERY} "
            f"ELSE value DIV {NEW_EVERY} + 1 + pmod(value * {KEY_PRIME}, {base_rows - 1}) END"
        )
    return new + f"ELSE pmod(value * {KEY_PRIME}, {base_rows}) END"


def scale_rows(ids: np.ndarray, seq: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "id": ids,
            "seq": seq.astype(np.int64),
            "val": seq * 0.5,
            "cat": (seq % 100).astype(np.int32),
        },
        schema=SCALE_SCHEMA,
    )


def stream_model(n: int, base_rows: int, mix: str = "steady") -> np.ndarray:
    """Newest ``seq`` of every key after stream values ``0 .. n-1`` (-1: deleted)."""
    model = np.full(base_rows + n // NEW_EVERY + 1, -1, np.int64)
    model[:base_rows] = 0
    values = np.arange(n, dtype=np.int64)
    ids, dels = stream_keys(values, base_rows, mix)
    uniq, first = np.unique(ids[::-1], return_index=True)
    last = n - 1 - first
    model[uniq] = np.where(dels[last], -1, values[last])
    return model


def write_progress(path: str, state: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(state))
    os.replace(tmp, path)


def read_progress(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


class _Stop:
    """Set by SIGTERM/SIGINT: the writer finishes its current batch and stops."""

    def __init__(self) -> None:
        self.now = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, *_: object) -> None:
        self.now = True


def python_writer(args: argparse.Namespace) -> None:
    """Child process: write the stream with :meth:`MemWalTable.write` until stopped."""
    stop = _Stop()
    t = mq.MemWalTable.open(args.uri)
    n = 0
    state: dict[str, object] = {"acked": 0, "rate": args.rate, "pid": os.getpid()}

    def write(count: int) -> None:
        nonlocal n
        values = np.arange(n, n + count, dtype=np.int64)
        ids, dels = stream_keys(values, args.rows, args.mix)
        t.write(scale_rows(ids[~dels], values[~dels]))
        if dels.any():
            t.delete(pa.table({"id": pa.array(ids[dels], pa.int64())}))
        n += count

    if not args.rate:  # calibration: flat out, with the maintainer running
        started = time.perf_counter()
        while time.perf_counter() - started < args.calibrate_seconds and not stop.now:
            write(20_000)
            state["acked"] = n
            write_progress(args.progress, state)
        top = n / (time.perf_counter() - started)
        state["calibrated"] = top
        state["rate"] = args.rate = int(top * args.rate_share)
    state["stream_from"] = n
    write_progress(args.progress, state)
    started, done = time.perf_counter(), 0
    while not stop.now:
        due = int(args.rate * (time.perf_counter() - started)) - done
        if due > 0:
            write(due)
            done += due
            state["acked"] = n
            write_progress(args.progress, state)
        time.sleep(max(0.0, TICK / 2 - (time.perf_counter() - started) % (TICK / 2)))
    t.close()  # flushes: the final checks see everything acknowledged
    state["acked"], state["done"] = n, True
    write_progress(args.progress, state)


def spark_writer(args: argparse.Namespace) -> None:
    """Child process: a Structured Streaming query writing the stream through the sink."""
    stop = _Stop()
    spark = local_spark("memwal_query-scale-stream")
    from pyspark.sql import functions as F

    from memwal_query import spark as mqs

    rate = args.rate or 20_000
    stream = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rate)
        .option("numPartitions", 2)
        .load()
        .select(
            F.expr(spark_key_sql(args.rows, args.mix)).alias("id"),
            F.col("value").alias("seq"),
            (F.col("value") * 0.5).alias("val"),
            (F.col("value") % 100).cast("int").alias("cat"),
            (F.col("value") % DELETE_EVERY == DELETE_AT).alias("is_delete"),
        )
    )
    sink = mqs.sink(args.uri, sink_id="scale", delete_column="is_delete", order_by="seq")
    state: dict[str, object] = {"acked": 0, "rate": rate, "pid": os.getpid(), "batches": []}
    batches: list[list[float]] = []

    def each(df, batch_id: int) -> None:  # noqa: ANN001 - Spark's DataFrame
        if stop.now:  # not written, not counted: the model ends at the previous batch
            state["stopped_at"] = batch_id
            write_progress(args.progress, state)
            return
        started = time.perf_counter()
        sink(df, batch_id)
        result = sink.last_result
        assert result is not None
        state["acked"] = int(state["acked"]) + result.rows  # type: ignore[call-overload]
        gens = sum(1 for r in result.regions if r.generation is not None)
        batches.append([time.time(), time.perf_counter() - started, result.rows, gens])
        state["batches"] = batches[-200:]
        write_progress(args.progress, state)

    query = (
        stream.writeStream.foreachBatch(each)
        .option("checkpointLocation", f"{args.progress}.checkpoint")
        .trigger(processingTime=f"{args.trigger_seconds} seconds")
        .start()
    )
    while not stop.now and query.isActive:
        time.sleep(0.2)
    while query.isActive and "stopped_at" not in state:
        time.sleep(0.2)  # the batch running when told to stop finishes (and counts)
    query.stop()
    state["done"] = True
    write_progress(args.progress, state)
    spark.stop()


def scale_base(uri: str, rows: int, regions: int) -> mq.MemWalTable:
    step = 2_000_000
    for start in range(0, rows, step):
        ids = np.arange(start, min(rows, start + step), dtype=np.int64)
        part = scale_rows(ids, np.zeros(len(ids), np.int64))
        part = part.set_column(2, "val", pa.array(ids * 1.0))
        lance.write_dataset(part, uri, mode="append" if start else "create")
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE", name="id_idx")
    return mq.MemWalTable.initialize(
        uri, region_spec=mq.bucket_spec(ds.lance_schema, "id", regions)
    )


LOOKUP_PHASES = ("resolve", "memtables", "generations", "base")
"""The phases of a lookup :func:`lookup_phase_timer` times (view resolution, MemTable
and WAL-tail probes, opening generations, the base's key lookup)."""


def lookup_phase_timer() -> dict[str, list[float]]:
    """Wrap the lookup's phase functions in this process with CPU/wall accumulators:
    ``{phase: [cpu s, wall s]}`` (reset them between lookups), ``gc`` (seconds in
    Python's garbage collector) and ``trim`` (giving the C heap's free pages back)."""
    import gc

    from memwal_query.search import pointlookup
    from memwal_query.storage import cache as read_caches

    acc: dict[str, list[float]] = {p: [0.0, 0.0] for p in (*LOOKUP_PHASES, "gc", "trim")}

    def wrap(mod: object, name: str, phase: str) -> None:
        fn = getattr(mod, name)

        def timed(*a: object, **k: object) -> object:
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[phase][0] += time.process_time() - c
                acc[phase][1] += time.perf_counter() - w

        setattr(mod, name, timed)

    wrap(pointlookup.view, "resolve", "resolve")
    wrap(pointlookup, "_memtable_lookup", "memtables")
    wrap(pointlookup, "_gen_info", "generations")
    wrap(pointlookup, "_base_lookup", "base")
    wrap(read_caches, "release_free_heap", "trim")
    started = [0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0], started[1] = time.process_time(), time.perf_counter()
        else:
            acc["gc"][0] += time.process_time() - started[0]
            acc["gc"][1] += time.perf_counter() - started[1]

    gc.callbacks.append(on_gc)
    return acc


def scale_queries(
    r: mq.MemWalTable,
    rng: np.random.Generator,
    keys: tuple[int, int],
    lat: dict[str, list[float]],
    phases: dict[str, list[float]] | None = None,
) -> tuple[int, int]:
    """The queries of one tick (the lookup of 10 keys in ``keys``, a range), their
    seconds into ``lat``; returns the unflushed WAL rows (all regions) the ``count(*)``
    read and its answer (the table's live rows)."""
    import datafusion

    ctx = datafusion.SessionContext()
    provider = r.provider(consistency="latest")
    ctx.register_table("t", provider)
    tail = live = 0
    for name, sql in (
        ("count", "SELECT count(*) FROM t"),
        ("filtered", "SELECT count(*), sum(val) FROM t WHERE cat = 7"),
    ):
        s, c = time.perf_counter(), time.process_time()
        got = ctx.sql(sql).to_arrow_table()
        lat[name].append(time.perf_counter() - s)
        lat.setdefault(f"{name} cpu", []).append(time.process_time() - c)
        if name == "count":
            live = int(got.column(0)[0].as_py())
            if provider.last_plan is not None:
                tail = sum(m.num_rows for g in provider.last_plan.regions for m in g.memtables)
    before = {p: list(v) for p, v in (phases or {}).items()}
    s, c = time.perf_counter(), time.process_time()
    r.lookup(pa.table({"id": pa.array(rng.integers(*keys, 10), pa.int64())}), consistency="latest")
    lat["lookup"].append(time.perf_counter() - s)
    lat.setdefault("lookup cpu", []).append(time.process_time() - c)
    for p, v in (phases or {}).items():  # the lookup's own share of each phase
        lat.setdefault(f"lookup {p} cpu", []).append(v[0] - before[p][0])
        lat.setdefault(f"lookup {p} wall", []).append(v[1] - before[p][1])
    return tail, live


def base_wear(uri: str) -> list[float] | None:
    """[live rows, physical rows / live rows, rows the primary-key index leaves
    unindexed] of the base table's latest version: what its scans and lookups pay for
    merges not yet compacted and indexed (None when the maintainer's GC removed the
    version while it was read)."""
    try:
        ds = lance.dataset(uri)
        fragments = ds.get_fragments()
        physical = sum(f.metadata.physical_rows for f in fragments)
        live = physical - sum(f.metadata.num_deletions for f in fragments)
        unindexed = ds.stats.index_stats("id_idx")["num_unindexed_rows"]
    except (ValueError, OSError):
        return None
    return [float(live), physical / max(live, 1), float(unindexed)]


def base_wear_shape(uri: str) -> dict[str, int]:
    """The base's latest version's fragments, those with a deletion file, and the
    primary-key index's segments; and this process's Python objects (the garbage
    collector's work)."""
    import gc

    out = {"python_objects": len(gc.get_objects())}
    try:
        ds = lance.dataset(uri)
        frags = ds.get_fragments()
        out["base_fragments"] = len(frags)
        out["base_deletion_files"] = sum(f.metadata.deletion_file is not None for f in frags)
        out["pk_index_segments"] = sum(i.name == "id_idx" for i in ds.describe_indices())
    except (ValueError, OSError):
        pass
    return out


def flush_wal_tails(t: mq.MemWalTable) -> int:
    """Flush every region's unflushed WAL entries (the Spark sink leaves the last ones
    there); returns the generations made."""
    made = 0
    for region_id in t.catalog.region_ids():
        with t.writer(region_id=region_id) as w:
            made += w.flush() is not None
    return made


def scale_main(args: argparse.Namespace) -> bool:
    if args.large:
        args.rows = 20_000_000
    root = args.root or tempfile.mkdtemp(prefix="memwal-scale-stream-")
    uri = f"{root}/t"
    started = time.perf_counter()
    scale_base(uri, args.rows, args.regions)
    print(
        f"base: {args.rows:,} rows, {args.regions} regions, built in "
        f"{time.perf_counter() - started:.0f} s ({root})",
        flush=True,
    )
    cmd = [sys.executable, "-m", "memwal_query", "maintain", uri, "--watch", str(args.watch)]
    cmd += ["--retention", "3m", "--json"]
    log = open(f"{root}/maintain.log", "w")  # noqa: SIM115 - closed below
    maint = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    progress = f"{root}/progress.json"
    child = [sys.executable, os.path.abspath(__file__), "--child", "spark" if args.spark else "py"]
    child += ["--uri", uri, "--rows", str(args.rows), "--rate", str(args.rate or 0)]
    child += ["--mix", args.mix]
    child += ["--progress", progress, "--calibrate-seconds", str(args.calibrate_seconds)]
    child += ["--rate-share", str(args.rate_share), "--trigger-seconds", str(args.trigger_seconds)]
    wlog = open(f"{root}/writer.log", "w")  # noqa: SIM115 - closed below
    writer = subprocess.Popen(child, stdout=wlog, stderr=subprocess.STDOUT)
    r = mq.MemWalTable.open(uri)
    phases = lookup_phase_timer()
    header = [
        "minute",
        "target rows/s",
        "rows/s",
        "unmerged gens (mean)",
        "(max)",
        "WAL-tail rows (mean)",
        "count(*) p50 ms",
        "filtered p50 ms",
        "lookup p50 ms",
        "reader CPU s",
        "reader CPU ms per tick",
        "reader MB",
        "reader Arrow MB",
        "maintainer MB",
        "writer MB",
        "passes",
        "merged gens",
        "base live rows",
        "base physical / live (mean)",
        "PK unindexed rows (mean)",
        "load 1 min",
        "live rows (count(*), last)",
    ]
    out: list[list[object]] = []
    wear: list[list[float]] = []
    lat: dict[str, list[float]] = {"count": [], "filtered": [], "lookup": []}
    samples: list[int] = []
    tails: list[int] = []
    seen = [0]
    rng = np.random.default_rng(3)
    ok = True
    try:
        # wait for the stream proper (after the calibration burst, or Spark's start)
        # the reader queries during the burst as it will during the stream: the rate
        # found is what the writer holds beside the maintainer and the reader
        while "stream_from" not in read_progress(progress) and not args.spark:
            if writer.poll() is not None:
                raise RuntimeError(f"the writer exited with {writer.returncode}")
            tick = time.perf_counter()
            if "pid" in read_progress(progress):
                acked_now = int(read_progress(progress).get("acked", 0))
                oldest = acked_now // NEW_EVERY + 1 if args.mix == "steady" else 0
                scale_queries(
                    r,
                    rng,
                    (oldest, args.rows + acked_now // NEW_EVERY),
                    {"count": [], "filtered": [], "lookup": []},
                )
            time.sleep(max(0.0, args.query_every - (time.perf_counter() - tick)))
        state = read_progress(progress)
        if "calibrated" in state:
            print(
                f"calibration: the Python writer holds {state['calibrated']:,.0f} rows/s flat "
                f"out with the maintainer running and the reader querying; streaming at "
                f"{state['rate']:,} rows/s "
                f"({args.rate_share:g} of it)",
                flush=True,
            )
        t0 = minute_start = time.perf_counter()
        cpu0 = time.process_time()
        acked0 = int(state.get("acked", 0))
        minute = 1 - args.warmup
        while minute <= args.minutes:
            tick = time.perf_counter()
            state = read_progress(progress)
            acked_now = int(state.get("acked", 0))
            keys = args.rows + acked_now // NEW_EVERY
            oldest = acked_now // NEW_EVERY + 1 if args.mix == "steady" else 0
            for v in phases.values():
                v[0] = v[1] = 0.0
            tail, live = scale_queries(r, rng, (oldest, keys), lat, phases)
            with open(f"{root}/lookup_phases.jsonl", "a") as f:
                tick_row = {k: lat[k][-1] * 1e3 for k in lat if lat[k]}
                tick_row.update({f"{p} cpu": v[0] * 1e3 for p, v in phases.items()})
                tick_row.update({f"{p} wall": v[1] * 1e3 for p, v in phases.items()})
                tick_row.update(minute=minute, t=time.perf_counter() - t0)
                f.write(json.dumps(tick_row) + "\n")
            tails.append(tail)
            samples.append(unmerged(r))
            worn = base_wear(uri)
            if worn is not None:
                wear.append(worn)
            if writer.poll() is not None:
                raise RuntimeError(f"the writer exited with {writer.returncode}")
            now = time.perf_counter()
            if now - minute_start >= 60:
                acked = int(state.get("acked", 0))
                row = [
                    minute if minute > 0 else f"warm-up {minute + args.warmup}",
                    int(state.get("rate", 0)),
                    (acked - acked0) / (now - minute_start),
                    float(np.mean(samples)),
                    max(samples),
                    int(np.mean(tails)),
                    pct(lat["count"], 50) * 1e3,
                    pct(lat["filtered"], 50) * 1e3,
                    pct(lat["lookup"], 50) * 1e3,
                    time.process_time() - cpu0,
                    (time.process_time() - cpu0) * 1e3 / len(tails),
                    rss_mb(os.getpid()),
                    pa.total_allocated_bytes() / 2**20,
                    rss_mb(maint.pid),
                    rss_mb(writer.pid),
                    *passes(f"{root}/maintain.log", seen)[:2],
                    wear[-1][0] if wear else 0.0,
                    float(np.mean([w[1] for w in wear])) if wear else 0.0,
                    float(np.mean([w[2] for w in wear])) if wear else 0.0,
                    os.getloadavg()[0],
                    live,
                ]
                out.append(row)
                print("  minute " + " | ".join(_short(c) for c in row), flush=True)
                with open(f"{root}/reader_memory.jsonl", "a") as f:
                    f.write(
                        json.dumps({"minute": row[0], **reader_memory(r), **base_wear_shape(uri)})
                        + "\n"
                    )
                if maint.poll() is not None:
                    raise RuntimeError(f"the maintainer exited with {maint.returncode}")
                lat = {k: [] for k in lat}
                samples, tails, acked0, minute_start, minute = [], [], acked, now, minute + 1
                wear = []
                cpu0 = time.process_time()
            time.sleep(max(0.0, args.query_every - (time.perf_counter() - tick)))
        elapsed = time.perf_counter() - t0
    finally:
        stop_process(writer, signal.SIGTERM, 300)
        wlog.close()
        stop_process(maint, timeout=120)
        log.close()
    state = read_progress(progress)
    if writer.returncode != 0 or not state.get("done"):
        print(Path(f"{root}/writer.log").read_text()[-3000:])
        raise RuntimeError(f"the writer failed (exit {writer.returncode})")
    mode = "Spark Structured Streaming sink" if args.spark else "Python MemWalTable.write"
    print_table(
        f"At-scale stream ({mode}, {args.rows:,}-row base, {args.regions} regions, "
        f"`memwal maintain --watch {args.watch:g}` alongside), per minute",
        header,
        out,
    )
    if len(out) >= 2:
        first, last = out[min(args.warmup, len(out) - 2)], out[-1]
        print(
            "last minute / first minute: "
            + ", ".join(
                f"{header[i]} {float(last[i]) / float(first[i]):.2f}x"
                for i in (2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 17, 18, 19)
                if float(first[i])
            )
        )
        measured = out[min(args.warmup, len(out) - 2) :]
        span = max(1, min(WINDOW_MINUTES, len(measured) // 3))
        print(
            f"last {span} minutes / first {span} minutes (medians of the minutes: the "
            "maintainer's cycle spans minutes, a single minute catches one phase of it): "
            + ", ".join(
                f"{header[i]} {_window_ratio(measured, i, span):.2f}x"
                for i in (3, 6, 7, 8, 10, 11)
                if float(first[i])
            )
        )
        grown = float(last[21]) / float(first[21])
        print(
            f"live rows last / first minute {grown:.2f}x ({args.mix} key mix); per live row: "
            + ", ".join(
                f"{header[i]} {float(last[i]) / float(first[i]) / grown:.2f}x"
                for i in (6, 7, 10)
                if float(first[i])
            )
        )
    if args.spark and state.get("batches"):
        b = np.array(state["batches"], dtype=float)
        secs = float(np.median(b[:, 1]))
        rate = int(state["rate"])
        print(
            f"Spark micro-batches (last {len(b)}): median {secs:.2f} s for a "
            f"{args.trigger_seconds:g}-s trigger ({secs / args.trigger_seconds:.0%} of it), "
            f"{np.median(b[:, 2]):,.0f} rows; generations made per micro-batch: "
            f"{b[:, 3].mean():.2f} (of {args.regions} regions); the sink would hold about "
            f"{rate * args.trigger_seconds / secs:,.0f} rows/s at this trigger"
        )
    n = int(state["acked"])
    print(f"stream: {n:,} values acknowledged in {elapsed:.0f} s; final checks:")
    model = stream_model(n, args.rows, args.mix)
    ok &= verify(r.to_table(columns=["id", "seq"], consistency="latest"), model, "reader") == "ok"
    reopened = mq.MemWalTable.open(uri)
    got = reopened.to_table(columns=["id", "seq"], consistency="latest")
    ok &= verify(got, model, "reopened") == "ok"
    made = flush_wal_tails(reopened)
    print(f"  WAL tails flushed: {made} generation(s)")
    reopened.maintenance.maintain(MaintenancePolicy(merge_over_generations=0, merge_over_rows=0))
    base_now = lance.dataset(uri).to_table(columns=["id", "seq"])
    ok &= verify(base_now, model, "base table after a full merge") == "ok"
    if not args.keep and not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return bool(ok)


WINDOW_MINUTES = 5
"""Minutes in each window of the windowed ratio (medians of the first and last ones)."""


def _window_ratio(rows: list[list[object]], column: int, span: int) -> float:
    """Median of ``column`` over the last ``span`` rows / over the first ``span`` rows."""
    first = float(np.median([float(str(r[column])) for r in rows[:span]]))
    last = float(np.median([float(str(r[column])) for r in rows[-span:]]))
    return last / first if first else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="base table rows")
    parser.add_argument("--large", action="store_true", help="a 20,000,000-row base")
    parser.add_argument("--regions", type=int, default=32)
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="minutes streamed and printed before minute 1 (the ratios compare minute 1 "
        "and the last: the caches, unmerged generations and WAL tails filled)",
    )
    parser.add_argument("--rate", type=int, default=0, help="rows/s (0: calibrate)")
    parser.add_argument(
        "--mix",
        choices=MIXES,
        default="steady",
        help="steady: deletes remove the oldest keys, the live rows stay the base's; "
        "growing: deleted keys come back with later updates, new keys grow the table",
    )
    parser.add_argument("--rate-share", type=float, default=0.6)
    parser.add_argument("--calibrate-seconds", type=float, default=20.0)
    parser.add_argument("--query-every", type=float, default=5.0, help="seconds")
    parser.add_argument("--watch", type=float, default=10.0, help="maintainer pass seconds")
    parser.add_argument("--spark", action="store_true", help="write through the Spark sink")
    parser.add_argument("--trigger-seconds", type=float, default=2.0)
    parser.add_argument("--root", default=None, help="work directory (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--child", choices=["py", "spark"], help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "py":
        python_writer(args)
    elif args.child == "spark":
        spark_writer(args)
    else:
        print(f"{machine()}, load average {os.getloadavg()[0]:.1f}", flush=True)
        sys.exit(0 if scale_main(args) else 1)


if __name__ == "__main__":
    main()
