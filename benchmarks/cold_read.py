"""The first query of a process against plain Lance on the same rows.

Builds a base of ``--rows`` rows (default 10,000,000; vectorised data generation) with
``--regions`` bucket regions (default 32), then ``--upserts`` upserts (default a tenth of
the base, a fifth of them new keys) and ``--deletes`` deletes (default 1/200 of the
base) in ``--generations`` rounds, each flushed (every region gets a generation per
round). A plain Lance dataset holds the deduplicated result (computed independently
with numpy from the generated rows). Then, in new processes (one per measurement,
ours and plain Lance alternating, so that a change of load hits both alike):

- cold ``count(*)`` (``MemWalTable.count_rows`` / ``LanceDataset.count_rows``) and cold
  full ``to_table()``: wall time of the query after the imports (the table opened
  inside the timing) and the child's peak RSS (``resource.getrusage``, imports
  included);
- warm full read: p50 of ``--reps`` reads after one untimed read, ours and plain
  interleaved in one process;
- first lookup touching a generation: single-key lookups of keys whose newest version
  lives in a different generation each, in a new process after one lookup that
  touched none of them, against the same lookups repeated.

Every answer is checked: the counts and the full reads' contents (key and value sums
in each child; one full comparison row for row in the parent).

Usage: ``python benchmarks/cold_read.py [--rows 1000000] [--cold 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import lineitem_rows as rows  # noqa: E402
from _common import machine, print_table, uptime  # noqa: E402

_CHILD = r"""
import json, os, resource, sys, time
os.environ.setdefault("LANCE_LOG", "error")
import lance, numpy as np, pyarrow as pa, pyarrow.compute as pc
import memwal_query as mq
import memwal_query.table, memwal_query.read.provider, memwal_query.search  # noqa: imports
mode, uri, arg = sys.argv[1], sys.argv[2], sys.argv[3]


def digest(t):
    return [t.num_rows, pc.sum(t.column("id")).as_py(), round(pc.sum(t.column("price")).as_py(), 3)]


out = {}
s = time.perf_counter()
if mode == "ours_count":
    out["answer"] = mq.MemWalTable.open(uri).count_rows()
elif mode == "plain_count":
    out["answer"] = lance.dataset(uri).count_rows()
elif mode == "ours_full":
    out["answer"] = digest(mq.MemWalTable.open(uri).to_table())
elif mode == "plain_full":
    out["answer"] = digest(lance.dataset(uri).to_table())
elif mode == "warm":
    plain_uri, reps = arg.split(",")
    t = mq.MemWalTable.open(uri)
    ds = lance.dataset(plain_uri)
    t.to_table(), ds.to_table()
    ours, plain = [], []
    for _ in range(int(reps)):
        s1 = time.perf_counter(); t.to_table(); ours.append(time.perf_counter() - s1)
        s1 = time.perf_counter(); ds.to_table(); plain.append(time.perf_counter() - s1)
    out["ours"], out["plain"] = float(np.median(ours)), float(np.median(plain))
elif mode == "lookups":
    keys = [int(k) for k in arg.split(",")]
    t = mq.MemWalTable.open(uri)
    t.lookup([keys[0]])  # opens the view, the base and one generation
    first, later = [], []
    for k in keys[1:]:
        s1 = time.perf_counter(); got = t.lookup([k]); first.append(time.perf_counter() - s1)
        assert got.num_rows == 1, (k, got.num_rows)
    for k in keys[1:]:
        s1 = time.perf_counter(); t.lookup([k]); later.append(time.perf_counter() - s1)
    out["first"], out["later"] = float(np.median(first)), float(np.median(later))
out["s"] = time.perf_counter() - s
out["code"] = os.path.dirname(os.path.dirname(mq.__file__))
# VmHWM: the peak of this process image (ru_maxrss would include the parent's, which
# Linux carries across fork + exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
peak_kb = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["rss_mb"] = peak_kb / 1024
print(json.dumps(out))
"""


def child(mode: str, uri: str, arg: str = "") -> dict:
    started = time.perf_counter()
    got = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, uri, arg],
        capture_output=True,
        text=True,
        env={**os.environ},
        cwd=os.path.dirname(HERE.parent),  # not a checkout: PYTHONPATH picks the code
    )
    if got.returncode:
        raise RuntimeError(f"{mode} failed:\n{got.stderr[-4000:]}")
    out = json.loads(got.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - started  # interpreter, imports, query, exit
    return out


def build(root: str, args: argparse.Namespace) -> tuple[str, str, np.ndarray]:
    """Our table and the plain Lance dataset of its deduplicated rows; keys whose newest
    version is in a different generation each (for the lookups)."""
    import memwal_query as mq

    n = args.rows
    ours, plain = f"{root}/ours", f"{root}/plain"
    rng = np.random.default_rng(1)
    base = rows(np.arange(n), rng)
    step = 2_000_000
    for start in range(0, n, step):
        part = base.slice(start, step)
        lance.write_dataset(part, ours, mode="append" if start else "create")
    spec = mq.bucket_spec(lance.dataset(ours).lance_schema, "id", args.regions)
    t = mq.MemWalTable.initialize(ours, region_spec=spec)
    t.configure_writers(max_memtable_rows=10**9, max_memtable_bytes=1 << 40)
    new = args.upserts // 5
    keys = np.concatenate([rng.choice(n, args.upserts - new, replace=False), np.arange(n, n + new)])
    rng.shuffle(keys)
    gone = rng.choice(n + new, args.deletes, replace=False)
    frames, seqs, dead_flags = [base], [np.full(n, -1)], [np.zeros(n, bool)]
    lookup_keys = []
    started = time.perf_counter()
    for i, (ups, dels) in enumerate(
        zip(np.array_split(keys, args.generations), np.array_split(gone, args.generations))
    ):
        up = rows(ups, rng)
        t.write(up)
        if len(dels):
            t.delete(pa.table({"id": pa.array(dels, pa.int64())}))
        t.flush()
        frames.append(up)
        seqs.append(np.full(len(ups), 2 * i))
        dead_flags.append(np.zeros(len(ups), bool))
        frames.append(rows(dels, rng))
        seqs.append(np.full(len(dels), 2 * i + 1))
        dead_flags.append(np.ones(len(dels), bool))
        lookup_keys.append(int(ups[0]))
    print(f"  ingest + flushes {time.perf_counter() - started:.1f} s ({uptime()})", flush=True)
    t.close()
    allrows = pa.concat_tables(frames)
    ids = allrows.column("id").to_numpy()
    order = np.lexsort((np.concatenate(seqs), ids))
    last = np.ones(len(order), bool)
    last[:-1] = ids[order][1:] != ids[order][:-1]
    pick = order[last]
    pick = pick[~np.concatenate(dead_flags)[pick]]
    lance.write_dataset(allrows.take(pa.array(np.sort(pick))), plain)
    # keys whose newest version is the upsert of its round (not upserted or deleted later)
    newest_seq = np.concatenate(seqs)[order[last]]
    sorted_ids = ids[order[last]]
    dead = np.concatenate(dead_flags)[order[last]]
    keep = []
    for i, k in enumerate(lookup_keys):  # one key per round: a few dozen
        j = np.searchsorted(sorted_ids, k)
        if newest_seq[j] == 2 * i and not dead[j]:
            keep.append(k)
    return ours, plain, np.array(keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--regions", type=int, default=32)
    parser.add_argument("--upserts", type=int, default=None, help="default rows / 10")
    parser.add_argument("--deletes", type=int, default=None, help="default rows / 200")
    parser.add_argument("--generations", type=int, default=40)
    parser.add_argument("--cold", type=int, default=3, help="processes per cold figure")
    parser.add_argument("--reps", type=int, default=5, help="warm reads per figure")
    parser.add_argument("--root", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", default=None, help="build once into this directory, reuse it")
    args = parser.parse_args()
    args.upserts = args.upserts or args.rows // 10
    args.deletes = args.deletes or args.rows // 200
    root = args.keep or tempfile.mkdtemp(prefix="cold-read-", dir=args.root)
    try:
        ours, plain = f"{root}/ours", f"{root}/plain"
        if not (args.keep and Path(f"{root}/lookup_keys.npy").exists()):
            started = time.perf_counter()
            ours, plain, lookup_keys = build(root, args)
            np.save(f"{root}/lookup_keys.npy", lookup_keys)
            print(f"built in {time.perf_counter() - started:.1f} s ({uptime()})", flush=True)
        lookup_keys = np.load(f"{root}/lookup_keys.npy")
        import memwal_query as mq

        got = mq.MemWalTable.open(ours).to_table().sort_by("id")
        want = lance.dataset(plain).to_table().sort_by("id")
        assert got.equals(want.select(got.column_names)), "answers differ from plain Lance"
        print(f"answers identical to plain Lance ({got.num_rows:,} rows)", flush=True)
        del got, want
        figures: dict[str, list[dict]] = {}
        loads = [uptime()]
        for _ in range(args.cold):
            for mode, uri in (
                ("ours_count", ours),
                ("plain_count", plain),
                ("ours_full", ours),
                ("plain_full", plain),
            ):
                figures.setdefault(mode, []).append(child(mode, uri))
        loads.append(uptime())
        warm = child("warm", ours, f"{plain},{args.reps}")
        lookups = child("lookups", ours, ",".join(map(str, lookup_keys.tolist())))
        loads.append(uptime())
        codes = {f["code"] for fs in figures.values() for f in fs} | {warm["code"], lookups["code"]}
        for kind in ("count", "full"):
            answers = {
                json.dumps(f["answer"]) for m in ("ours", "plain") for f in figures[f"{m}_{kind}"]
            }
            assert len(answers) == 1, f"{kind}: answers differ: {answers}"

        def med(mode: str, key: str) -> float:
            return statistics.median(f[key] for f in figures[mode])

        def ratios(mode: str, key: str) -> float:
            # per round (interleaved pairs), then the median
            pairs = zip(figures[f"ours_{mode}"], figures[f"plain_{mode}"])
            return statistics.median(a[key] / b[key] for a, b in pairs)

        table = []
        for kind, what in (("count", "cold count(*)"), ("full", "cold full to_table()")):
            for label, key in (
                ("query s", "s"),
                ("process s", "process_s"),
                ("peak RSS MB", "rss_mb"),
            ):
                ours, plain = med(f"ours_{kind}", key), med(f"plain_{kind}", key)
                table.append([what if key == "s" else "", label, ours, plain, ratios(kind, key)])
        table.append(
            ["warm full read", "s p50", warm["ours"], warm["plain"], warm["ours"] / warm["plain"]]
        )
        table.append(
            [
                f"lookup, {len(lookup_keys) - 1} generations",
                "first ms p50 / later",
                lookups["first"] * 1e3,
                lookups["later"] * 1e3,
                lookups["first"] / lookups["later"],
            ]
        )
        print_table(
            f"first query of a process, {args.rows:,}-row base, {args.regions} regions, "
            f"{args.upserts:,} upserts + {args.deletes:,} deletes in {args.generations} rounds "
            f"({machine()}, {time.strftime('%Y-%m-%d')}; memwal_query from {', '.join(codes)}; "
            f"{' / '.join(loads)})",
            ["query", "figure", "ours", "plain Lance", "ratio"],
            table,
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
