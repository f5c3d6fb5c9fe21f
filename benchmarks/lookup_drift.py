"""Where a live reader's 10-key lookup spends its time as a streamed table ages.

Builds a ``--rows``-row base in ``--regions`` bucket regions, then runs ``--steps``
steps: one writer process appends ``--step`` stream values (``scale_stream``'s steady
key mix), one maintenance pass runs (merges, index catch-up, compaction, GC), and each
reader (a long-lived process per ``--reader NAME=ENV,...``, e.g. different Lance cache
bounds) runs ``--lookups`` lookups of 10 live keys, timing the lookup's phases (view
resolution, MemTable/WAL-tail probes, generation probes, the base's key lookup) in CPU
and wall milliseconds. The first lookup after each step (the first on a new base
version, as most of the stream reader's are) is reported apart from the later ones.
Prints per step and reader: the base's fragments, fragments with deletion files,
index segments and the Lance session's cache bytes, and the phase medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402
from reader_tick import write_values  # noqa: E402
from scale_stream import LOOKUP_PHASES, NEW_EVERY, lookup_phase_timer, scale_base  # noqa: E402

import memwal_query as mq  # noqa: E402

PHASES = (*LOOKUP_PHASES, "gc", "trim")


def reader(uri: str, rows: int, lookups: int) -> None:
    """Child process: per line on stdin (the acknowledged values), ``lookups`` lookups."""
    from memwal_query.search.memory import memory_usage

    acc = lookup_phase_timer()
    r = mq.MemWalTable.open(uri)
    rng = np.random.default_rng(5)
    for line in sys.stdin:
        acked = int(line)
        lo, hi = acked // NEW_EVERY + 1, rows + acked // NEW_EVERY
        per: list[dict[str, float]] = []
        for _ in range(lookups):
            for v in acc.values():
                v[0] = v[1] = 0.0
            keys = pa.table({"id": pa.array(rng.integers(lo, hi, 10), pa.int64())})
            c, w = time.process_time(), time.perf_counter()
            r.lookup(keys, consistency="latest")
            got = {"cpu": time.process_time() - c, "wall": time.perf_counter() - w}
            for p, (pc_, pw) in acc.items():
                got[f"{p} cpu"], got[f"{p} wall"] = pc_, pw
            got["other cpu"] = got["cpu"] - sum(got[f"{p} cpu"] for p in LOOKUP_PHASES)
            per.append(got)
        out = {f"first {k}": v * 1e3 for k, v in per[0].items()}
        later = per[1:] or per
        out.update({k: float(np.median([x[k] for x in later])) * 1e3 for k in later[0]})
        ds = r.catalog.dataset()
        frags = ds.get_fragments()
        out["fragments"] = len(frags)
        out["deletion files"] = sum(1 for f in frags if f.metadata.deletion_file is not None)
        out["index segments"] = len([i for i in ds.describe_indices() if i.name == "id_idx"])
        out["lance cache MB"] = memory_usage(r)["lance_cache_bytes"] / 2**20
        print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--regions", type=int, default=32)
    p.add_argument("--step", type=int, default=1_000_000, help="stream values per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lookups", type=int, default=9)
    p.add_argument("--root", default=None)
    p.add_argument(
        "--reader",
        action="append",
        default=None,
        help="NAME or NAME=VAR=VALUE,VAR=VALUE: a reader process with these environment "
        "variables (repeat for paired readers of the same steps)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        reader(args.child, args.rows, args.lookups)
        return
    root = args.root or tempfile.mkdtemp(prefix="memwal-lookup-drift-")
    uri = f"{root}/t"
    shutil.rmtree(uri, ignore_errors=True)
    scale_base(uri, args.rows, args.regions)
    print(machine(), flush=True)
    t = mq.MemWalTable.open(uri)
    t.configure_writers(max_memtable_age=1e9)
    readers = []
    for spec in args.reader or ["default"]:
        name, _, env_spec = spec.partition("=")
        env = dict(os.environ)
        for kv in filter(None, env_spec.split(",")):
            k, _, v = kv.partition("=")
            env[k] = v
        cmd = [sys.executable, os.path.abspath(__file__), "--child", uri]
        cmd += ["--rows", str(args.rows), "--lookups", str(args.lookups)]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        child = subprocess.Popen(cmd, text=True, env=env, **pipes)
        readers.append((name, child))
    rows_out = []
    n = 0
    try:
        for step in range(args.steps):
            write_values(t, n, args.step, args.rows, "steady")
            n += args.step
            t.maintain()
            order = readers if step % 2 == 0 else readers[::-1]
            for name, child in order:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{n}\n")
                child.stdin.flush()
                got = json.loads(child.stdout.readline())
                got.update(step=step + 1, reader=name, load=os.getloadavg()[0])
                rows_out.append(got)
                print(json.dumps(got), flush=True)
    finally:
        for _, child in readers:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()
        t.close(flush=False)
    header = ["step", "reader", "fragments", "deletion files", "index segments"]
    header += ["lance cache MB", "first wall", "first cpu", "wall", "cpu"]
    header += [f"{ph} cpu" for ph in (*LOOKUP_PHASES, "other", "gc", "trim")]
    header += ["first base wall", "base wall", "load"]
    print_table(
        f"Lookup of 10 keys by phase, {args.rows:,} rows, {args.regions} regions, "
        f"{args.step:,} values per step (ms; later = median of {args.lookups - 1})",
        header,
        [[r[h] for h in header] for r in rows_out],
    )


if __name__ == "__main__":
    main()
