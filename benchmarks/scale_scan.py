"""Scans and cold lookups against the number of unmerged generations, for one
or more checkouts of memwal_query in one run (before/after a change).

Builds the shapes of ``benchmarks/scale.py`` (a ``--base``-row base, generations of
``--gen-rows`` upserted rows: 1 region x 1 and x 200 generations, 64 regions x 3) once,
then, for every checkout given with ``--code`` (a directory put first on ``PYTHONPATH``;
default: this one), in new processes:

- warm scans (median of ``--rounds`` processes), p50 of ``--reps`` after one untimed
  call: ``MemWalTable.to_table`` of ``id, text`` (what ``scale.py``'s scan column
  measures), the same through DataFusion SQL, ``count_rows``, and a filtered SQL scan
  (``text LIKE 'w1 %'``), with plain Lance's ``to_table`` of the base for the ratio
  (scan / plain Lance in the same process);
- cold: a new process opens the table and runs one scan, or one single-key lookup
  (imports excluded; median of ``--cold`` processes; wall clock).

The checkouts alternate, round by round and process by process, so that a change of
load on the machine hits them alike.

Usage: ``python benchmarks/scale_scan.py --code /path/to/before --code /path/to/after``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = [(1, 1), (1, 200), (64, 3)]

_WORKER = r"""
import json, os, sys, time
os.environ.setdefault("LANCE_LOG", "error")
import datafusion, lance, numpy as np, pyarrow as pa
import memwal_query as mq
import memwal_query.table, memwal_query.read.provider, memwal_query.search  # noqa: imports excluded
uri, mode, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from _common import median, timed
cols = ["id", "text"]


def p50(fn):
    return median(timed(fn, reps)) * 1e3


s = time.perf_counter()
t = mq.MemWalTable(uri)
if os.path.dirname(os.path.dirname(os.path.realpath(mq.__file__))) != sys.argv[5]:
    raise SystemExit(f"memwal_query imported from {mq.__file__}, not {sys.argv[5]}")
if mode == "cold_scan":
    t.to_table(columns=cols)
    print(json.dumps({"ms": (time.perf_counter() - s) * 1e3}))
elif mode == "cold_lookup":
    t.lookup([12345])
    print(json.dumps({"ms": (time.perf_counter() - s) * 1e3}))
else:
    base = lance.dataset(uri)
    # the Python API first, as scale.py measures it (a DataFusion session created
    # first was measured to change the figure of the old code: ~45 ms -> ~15 ms)
    out = {"scan": p50(lambda: t.to_table(columns=cols))}
    ctx = datafusion.SessionContext()
    ctx.register_dataset("t", t.provider())
    out |= {
        "sql": p50(lambda: ctx.sql("SELECT id, text FROM t").to_arrow_table()),
        "count": p50(lambda: t.count_rows()),
        "filtered": p50(
            lambda: ctx.sql("SELECT id, text FROM t WHERE text LIKE 'w1 %'").to_arrow_table()
        ),
        "plain": p50(lambda: base.to_table(columns=cols)),
    }
    print(json.dumps(out))
"""


def run(code: str, uri: str, mode: str, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": code, "LANCE_LOG": "error"}
    real = os.path.realpath(code)
    out = subprocess.run(
        # -P: not the current directory first on sys.path (it may hold another checkout)
        [sys.executable, "-P", "-c", _WORKER, uri, mode, str(reps), str(HERE), real],
        env=env,
        cwd=os.path.dirname(uri),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", action="append", help="checkout(s) to measure")
    parser.add_argument("--base", type=int, default=100_000)
    parser.add_argument("--gen-rows", type=int, default=500)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3, help="warm processes per figure")
    parser.add_argument("--cold", type=int, default=5, help="processes per cold figure")
    parser.add_argument("--root", help="build the tables here (default: a temporary dir)")
    args = parser.parse_args()
    codes = args.code or [str(HERE.parent)]
    sys.path.insert(0, str(HERE))
    import scale

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((64, scale.DIM)).astype(np.float32) * 3
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        base = scale.build_base(root, args.base, rng, centers)
        uris = {}
        for r, g in SHAPES:
            scale.build_shape(root, base, args.base, r, g, args.gen_rows, rng, centers)
            uris[(r, g)] = f"{root}/t_{r}x{g}"
        print(f"load average before: {os.getloadavg()}", flush=True)
        rows = []
        for (r, g), uri in uris.items():
            warm: dict[str, list[dict]] = {code: [] for code in codes}
            cold: dict[str, dict[str, list[float]]] = {
                code: {"cold_scan": [], "cold_lookup": []} for code in codes
            }
            for _ in range(args.rounds):
                for code in codes:
                    w = run(code, uri, "warm", args.reps)
                    warm[code].append({**w, "ratio": w["scan"] / w["plain"]})
            for _ in range(args.cold):
                for code in codes:
                    for m in ("cold_scan", "cold_lookup"):
                        cold[code][m].append(run(code, uri, m, 0)["ms"])
            for code in codes:
                w = {k: float(np.median([x[k] for x in warm[code]])) for k in warm[code][0]}
                c = {m: float(np.median(v)) for m, v in cold[code].items()}
                rows.append((f"{r}x{g}", code, w, c))
                print(f"  {r}x{g} {code}: {w} {c}", flush=True)
        print(f"load average after: {os.getloadavg()}")
    print(
        f"\n{'shape':6} {'code':24} {'scan':>6} {'xLance':>6} {'sql':>6} {'count':>6} "
        f"{'filt':>6} {'lance':>6} {'cold scan':>9} {'cold lookup':>11}   (ms, p50)"
    )
    for shape, code, w, c in rows:
        print(
            f"{shape:6} {code[-24:]:24} {w['scan']:6.1f} {w['ratio']:6.2f} "
            f"{w['sql']:6.1f} {w['count']:6.1f} {w['filtered']:6.1f} {w['plain']:6.1f} "
            f"{c['cold_scan']:9.1f} {c['cold_lookup']:11.1f}"
        )
    print(time.strftime("%Y-%m-%d %H:%M"))


if __name__ == "__main__":
    main()
