"""Maintenance at scale: ``t.maintenance.maintain()`` vs one Lance ``merge_insert`` of the
same rows.

A base of ``--rows`` rows (default 10,000,000; TPC-H ``lineitem``-like columns: key,
two ints, two floats, a short string) with ``--regions`` bucket regions (default 8 and
32), then a stream of ``--upserts`` upserts (default 10% of the base, 20% of them new
keys) and ``--deletes`` deletes (default 0.5%) written in ``--generations`` rounds, each
flushed (every region gets a generation per round). Then, side by side in one run:

- ``t.maintenance.maintain()`` (the default policy: merge every due region, compaction by read cost,
  key index extended, snapshots, GC) against plain Lance doing the same to a copy of
  the base: one ``merge_insert`` of the newest live rows (the target's reference: it
  does not apply the deletes), then a ``when_matched_delete`` of the deleted keys
  (Lance's cheapest way to apply them), then the key index extended over the new rows.
  Three ratios are printed: against the ``merge_insert`` alone, against it plus the
  delete (the same rows changed), and against all three (the same work). ``--passes``
  passes (default 3), each on a fresh copy of the table, run in turns with the plain
  run on a fresh copy of its base, the dirty pages of the copies written out before
  each (``os.sync``); the figures are the medians (the machine's load drifts); the
  CPU seconds of the pass and of the ``merge_insert`` (all threads) are printed too,
  a figure the load disturbs less;
- the answer: our table after the pass equals the plain Lance table, row for row;
- single-key lookup p50 (``t.lookup``) and full read (``t.to_table()``) right before and
  right after the pass, with plain Lance's own figures on its copy for reference; the
  reads after the pass (full, and filtered on ``quantity < 5``) run in turns with the
  same reads of a copy of the table taken before the pass, on Lance's own deletion
  path (the reader told to leave fragments with deletion files to Lance's scan
  instead of reading their deleted rows and masking them) and with plain Lance's reads
  of its copy, medians of ``--repeat`` (wall and CPU seconds: the CPU seconds, all
  threads, are disturbed less by the machine's load), with what Lance alone decodes for
  the full read before and after the pass (the base with row ids; after it, the deleted
  rows too), and the first full read of each table opened anew (before the pass it
  finds the newest row per key of every generation; after it, it reads the deletion
  files). ``--compact-rewrite-rows`` sets the pass's ``compact_rewrite_rows`` (a
  smaller base then keeps the deletion files a 10M-row base keeps).

``uptime`` is printed with the figures: the machine is shared, quote the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import lineitem_rows as rows  # noqa: E402
from _common import machine, print_table, uptime  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.maintain.policy import MaintenancePolicy  # noqa: E402
from memwal_query.read import deletions  # noqa: E402

FILTER = pc.field("quantity") < 5  # ~8% of the rows


def median_of(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - s)
    return statistics.median(out)


def paired(fns: dict[str, object], repeat: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds (all threads) of each of ``fns``, run in turns (one
    of each per round) so that the machine's load drifts over all alike (the CPU
    seconds are disturbed less by the load)."""
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            cpu, s = cpu_seconds(), time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - s, cpu_seconds() - cpu))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in out.items()
    }


def first_read(path: str) -> tuple[float, float]:
    """Wall and CPU seconds of the first full read of a table opened anew."""
    table = mq.MemWalTable.open(path)
    cpu, s = cpu_seconds(), time.perf_counter()
    table.to_table()
    return time.perf_counter() - s, cpu_seconds() - cpu


class lance_deletion_path:
    """Within it, our reader leaves fragments with deletion files to Lance's own scan
    (range by range) instead of reading their deleted rows and masking them."""

    def __enter__(self) -> None:
        deletions.READ_DELETED_ROWS = False

    def __exit__(self, *exc: object) -> None:
        deletions.READ_DELETED_ROWS = True


def masked_path(fn):
    def lance_path():
        with lance_deletion_path():
            fn()

    return lance_path


def lookup_p50(fn, keys: np.ndarray) -> float:
    out = []
    for k in keys:
        s = time.perf_counter()
        fn(int(k))
        out.append(time.perf_counter() - s)
    return statistics.median(out)


def build_base(path: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    step = 2_000_000
    for start in range(0, n, step):
        part = rows(np.arange(start, min(n, start + step)), rng)
        lance.write_dataset(part, path, mode="append" if start else "create")


def stream(n: int, upserts: int, deletes: int, generations: int, seed: int):
    """The rounds: (upsert rows, deleted keys) per round; keys of a round are distinct."""
    rng = np.random.default_rng(seed)
    new = int(upserts * 0.2)
    keys = np.concatenate([rng.choice(n, upserts - new, replace=False), np.arange(n, n + new)])
    rng.shuffle(keys)
    gone = rng.choice(n, deletes, replace=False)
    out = []
    for ups, dels in zip(
        np.array_split(keys, generations), np.array_split(gone, generations), strict=True
    ):
        # a round's deletes are not among its own upserts (a later round may write it again)
        dels = dels[~np.isin(dels, ups)]
        out.append((rows(ups, rng), dels))
    return out


def newest(rounds) -> tuple[pa.Table, np.ndarray]:
    """The last write of each key over the rounds: live rows and deleted keys."""
    frames, order = [], []
    for i, (ups, dels) in enumerate(rounds):
        frames.append(ups.append_column("_del", pa.array(np.zeros(ups.num_rows, bool))))
        order.append(np.full(ups.num_rows, 2 * i))
        d = rows(dels, np.random.default_rng(i)).append_column(
            "_del", pa.array(np.ones(len(dels), bool))
        )
        frames.append(d)
        order.append(np.full(len(dels), 2 * i + 1))
    allrows = pa.concat_tables(frames)
    seq = np.concatenate(order)
    ids = allrows.column("id").to_numpy()
    idx = np.lexsort((seq, ids))
    last = np.ones(len(idx), bool)
    last[:-1] = ids[idx][1:] != ids[idx][:-1]
    pick = allrows.take(pa.array(idx[last]))
    dead = pick.column("_del").to_numpy(zero_copy_only=False)
    live = pick.filter(pa.array(~dead)).drop_columns(["_del"])
    return live, pick.column("id").to_numpy()[dead]


def cpu_seconds() -> float:
    """CPU seconds this process has used (all threads, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain_merge(
    path: str, live: pa.Table, dead: np.ndarray
) -> tuple[tuple[float, float, float], float]:
    """One ``merge_insert`` of the newest rows, then a ``when_matched_delete`` of the
    deleted keys (through the key column: Lance's default, the key index, runs out of
    its join memory pool for 1M source rows), then the key index extended over the new
    rows (a delta segment, as maintenance does). Wall seconds of each of the three, and
    the CPU seconds of the ``merge_insert``."""
    cpu, started = cpu_seconds(), time.perf_counter()
    builder = lance.dataset(path).merge_insert("id").use_index(False)
    builder.when_matched_update_all().when_not_matched_insert_all().execute(live)
    mi_s, mi_cpu = time.perf_counter() - started, cpu_seconds() - cpu
    started = time.perf_counter()
    lance.dataset(path).merge_insert("id").use_index(False).when_matched_delete().execute(
        pa.table({"id": pa.array(dead, pa.int64())})
    )
    del_s = time.perf_counter() - started
    started = time.perf_counter()
    lance.dataset(path).optimize.optimize_indices(num_indices_to_merge=0)
    index_s = time.perf_counter() - started
    return (round(mi_s, 3), round(del_s, 3), round(index_s, 3)), mi_cpu


def run(root: str, base: str, args, regions: int) -> list[list[object]]:
    ours, plain = f"{root}/ours{regions}", f"{root}/plain{regions}"
    shutil.copytree(base, ours)
    shutil.copytree(base, plain)
    spec = mq.bucket_spec(lance.dataset(ours).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(ours, region_spec=spec)
    lance.dataset(plain).create_scalar_index("id", "BTREE")
    rounds = stream(args.rows, args.upserts, args.deletes, args.generations, seed=7)

    t.configure_writers(max_memtable_rows=10**9, max_memtable_bytes=1 << 40)
    started = time.perf_counter()
    for ups, dels in rounds:
        t.write(ups)
        if len(dels):
            t.delete(pa.table({"id": pa.array(dels, pa.int64())}))
        t.flush()
    ingest = time.perf_counter() - started
    gens = sum(
        len(t.catalog.region_manifest(r).flushed_generations) for r in t.catalog.region_ids()
    )
    t.close()

    live, dead = newest(rounds)
    rng = np.random.default_rng(3)
    keys = np.concatenate(
        [
            rng.choice(live.column("id").to_numpy(), args.lookups // 2),
            rng.choice(args.rows, args.lookups // 2),
        ]
    )
    reader = mq.MemWalTable.open(ours)
    reader.to_table()  # warm: the first read of a process
    look_before = lookup_p50(lambda k: reader.lookup(pa.array([k], pa.int64())), keys)
    # the table as it is before the pass, read in turns with the one after it
    pre = f"{root}/pre{regions}"
    shutil.copytree(ours, pre)

    print(f"  {regions} regions: {gens} generations written; maintain ({uptime()})", flush=True)
    policy = (
        MaintenancePolicy()
        if args.compact_rewrite_rows is None
        else MaintenancePolicy(compact_rewrite_rows=args.compact_rewrite_rows or None)
    )
    # --passes passes, each on a fresh copy of the table before the pass, in turns with
    # plain Lance on a fresh copy of its base; the page cache's dirty pages (the
    # copies) are written out before each timed run; the last runs keep their tables
    plain_runs: list[tuple[tuple[float, float, float], float]] = []
    ours_runs: list[tuple[float, float]] = []
    for i in range(args.passes):
        last = i == args.passes - 1
        plain_run, ours_run = (
            (plain, ours) if last else (f"{root}/plainrun{regions}", f"{root}/oursrun{regions}")
        )
        if not last:
            shutil.copytree(plain, plain_run)
            shutil.copytree(pre, ours_run)
        os.sync()
        plain_runs.append(plain_merge(plain_run, live, dead))
        os.sync()
        t = mq.MemWalTable.open(ours_run)
        marks: list[tuple[str, float]] = []
        cpu, started = cpu_seconds(), time.perf_counter()
        report = t.maintenance.maintain(
            policy,
            progress=lambda step, done, total, marks=marks: marks.append(
                (step, time.perf_counter())
            ),
        )
        ours_runs.append((time.perf_counter() - started, cpu_seconds() - cpu))
        steps: dict[str, float] = {}
        last_mark = started
        for step, at in marks:  # time since the previous report, charged to the step
            steps[step] = steps.get(step, 0.0) + at - last_mark
            last_mark = at
        print(
            f"    pass {i + 1}: {ours_runs[-1][0]:.3f} s (CPU {ours_runs[-1][1]:.3f} s); plain "
            f"merge_insert, delete, index (s): {plain_runs[-1][0]} ({uptime()})",
            flush=True,
        )
        print("      steps (s): " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()), flush=True)
        if not last:
            shutil.rmtree(plain_run)
            shutil.rmtree(ours_run)
    print("   ", "\n    ".join(report.lines()[-6:]), flush=True)
    maintain_s = statistics.median(w for w, _ in ours_runs)
    maintain_cpu = statistics.median(c for _, c in ours_runs)
    mi_s, del_s, index_s = (statistics.median(r[0][j] for r in plain_runs) for j in range(3))
    mi_cpu = statistics.median(c for _, c in plain_runs)
    same_work = mi_s + del_s + index_s

    reader = mq.MemWalTable.open(ours)
    reader.to_table()
    merged = lance.dataset(ours).get_fragments()
    with_files = [f for f in merged if f.num_deletions]
    print(
        f"    after the pass: {len(with_files)} of {len(merged)} fragments have deletion "
        f"files, {sum(f.num_deletions for f in with_files):,} deleted of "
        f"{sum(f.physical_rows for f in with_files):,} rows",
        flush=True,
    )

    def full() -> None:
        reader.to_table()

    def filtered() -> None:
        reader.to_table(filter=FILTER)

    # first reads of the tables opened anew (before the pass: the newest row per key of
    # every generation is found; after it: the deletion files are read), then the
    # steady reads of the tables opened here, in turns
    first_before, first_after = first_read(pre), first_read(ours)
    unmerged = mq.MemWalTable.open(pre)
    unmerged.to_table()
    pre_ds, ours_ds = lance.dataset(pre), lance.dataset(ours)
    timed = paired(
        {
            "full, before the pass": lambda: unmerged.to_table(),
            "filtered, before the pass": lambda: unmerged.to_table(filter=FILTER),
            "full": full,
            "full, Lance's deletion path": masked_path(full),
            "full, plain Lance": lambda: lance.dataset(plain).to_table(),
            "filtered": filtered,
            "filtered, Lance's deletion path": masked_path(filtered),
            "filtered, plain Lance": lambda: lance.dataset(plain).to_table(filter=FILTER),
            # what Lance decodes for our full read, before and after the pass
            "Lance decode, before the pass": lambda: pre_ds.scanner(with_row_id=True).to_table(),
            "Lance decode": lambda: ours_ds.scanner(
                with_row_id=True, include_deleted_rows=True
            ).to_table(),
        },
        args.repeat,
    )
    after = {k: wall for k, (wall, _) in timed.items()}
    cpu_after = {k: cpu for k, (_, cpu) in timed.items()}

    def cpu_row(what: str, read: str) -> list[object]:
        """A row of the table: CPU seconds of ``read`` before the pass, after / before."""
        before = cpu_after[f"{read}, before the pass"]
        return ["", what, before, cpu_after[read] / before]

    scan_after, plain_scan = after["full"], after["full, plain Lance"]
    scan_before = after["full, before the pass"]
    filtered_before = after["filtered, before the pass"]
    shutil.rmtree(pre)
    look_after = lookup_p50(lambda k: reader.lookup(pa.array([k], pa.int64())), keys)
    pds = lance.dataset(plain)
    plain_look = lookup_p50(lambda k: pds.to_table(filter=f"id = {k}"), keys)

    got = reader.to_table().sort_by("id")
    want = lance.dataset(plain).to_table().sort_by("id")
    assert (
        got.num_rows
        == want.num_rows
        == args.rows
        + live.num_rows
        - int(pc.sum(pc.less(live.column("id"), args.rows)).as_py())
        - len(dead)
    ), (got.num_rows, want.num_rows)
    assert got.equals(want.select(got.column_names)), "answers differ from plain Lance"
    print(f"    answers identical to plain Lance ({got.num_rows:,} rows) ({uptime()})", flush=True)
    batches = len({m.seconds for m in report.merged if m.seconds})  # one figure per commit

    # A second pass that rewrites every fragment with a deletion file (what restoring
    # the read speed of a clean base costs when the merge touched every fragment).
    started = time.perf_counter()
    compacted = t.maintenance.maintain(MaintenancePolicy(compact_deleted_share=0.0))
    compact_s = time.perf_counter() - started
    reader = mq.MemWalTable.open(ours)
    reader.to_table()
    scan_compacted = median_of(lambda: reader.to_table(), args.repeat)
    print(f"    then compacted: {compacted.compact_reason} ({uptime()})", flush=True)
    return [
        [
            f"{regions} regions, {gens} generations",
            "maintain() / merge_insert",
            maintain_s,
            maintain_s / mi_s,
        ],
        ["", "maintain() / (merge_insert + delete)", maintain_s, maintain_s / (mi_s + del_s)],
        ["", "maintain() / (merge_insert + delete + index)", maintain_s, maintain_s / same_work],
        ["", "CPU s: maintain() / merge_insert", maintain_cpu, maintain_cpu / mi_cpu],
        ["", "merge_insert (live rows, median of the runs)", mi_s, 1.0],
        ["", "+ delete of the deleted keys", mi_s + del_s, (mi_s + del_s) / mi_s],
        ["", "+ key index extended", same_work, same_work / mi_s],
        ["", f"ingest ({len(rounds)} rounds)", ingest, float("nan")],
        ["", "merge batches", float(batches), float("nan")],
        ["", "lookup p50 ms before / after", look_before * 1e3, look_after / look_before],
        ["", "lookup p50 ms after (plain Lance)", plain_look * 1e3, look_after / plain_look],
        [
            "",
            "first full read s before / after (tables opened anew)",
            first_before[0],
            first_after[0] / first_before[0],
        ],
        [
            "",
            "first full read CPU s before / after",
            first_before[1],
            first_after[1] / first_before[1],
        ],
        ["", "full read s before / after", scan_before, scan_after / scan_before],
        cpu_row("full read CPU s before / after", "full"),
        cpu_row("Lance decode CPU s before / after (deleted rows too)", "Lance decode"),
        ["", "full read s after (plain Lance)", plain_scan, scan_after / plain_scan],
        [
            "",
            "full read s after, Lance's deletion path / before",
            after["full, Lance's deletion path"],
            after["full, Lance's deletion path"] / scan_before,
        ],
        [
            "",
            "filtered read s before / after",
            filtered_before,
            after["filtered"] / filtered_before,
        ],
        cpu_row("filtered read CPU s before / after", "filtered"),
        [
            "",
            "filtered read s after (plain Lance)",
            after["filtered, plain Lance"],
            after["filtered"] / after["filtered, plain Lance"],
        ],
        [
            "",
            "filtered read s after, Lance's deletion path / before",
            after["filtered, Lance's deletion path"],
            after["filtered, Lance's deletion path"] / filtered_before,
        ],
        ["", "compacting pass s / x merge_insert", compact_s, compact_s / mi_s],
        ["", "full read s compacted / before", scan_compacted, scan_compacted / scan_before],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--regions", default="8,32")
    parser.add_argument("--upserts", type=int, default=None, help="default rows / 10")
    parser.add_argument("--deletes", type=int, default=None, help="default rows / 200")
    parser.add_argument("--generations", type=int, default=40)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="timed maintain() passes, each on a fresh copy, in turns with plain Lance",
    )
    parser.add_argument(
        "--compact-rewrite-rows",
        type=int,
        default=None,
        help="the pass's compact_rewrite_rows (0: None; default: the policy's default); a "
        "small value keeps the deletion files a smaller base would have rewritten",
    )
    parser.add_argument("--root", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()
    args.upserts = args.upserts or args.rows // 10
    args.deletes = args.deletes or args.rows // 200
    root = tempfile.mkdtemp(prefix="maintain-scale-", dir=args.root)
    try:
        base = f"{root}/base"
        started = time.perf_counter()
        build_base(base, args.rows, seed=1)
        print(f"base of {args.rows:,} rows in {time.perf_counter() - started:.1f} s", flush=True)
        out: list[list[object]] = []
        for regions in (int(r) for r in args.regions.split(",")):
            out += run(root, base, args, regions)
        print_table(
            f"maintain() of {args.upserts:,} upserts + {args.deletes:,} deletes in "
            f"{args.generations} rounds into a {args.rows:,}-row base ({machine()}, "
            f"{time.strftime('%Y-%m-%d')}, {uptime()} at the end)",
            ["shape", "what", "seconds / ms", "ratio"],
            out,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
