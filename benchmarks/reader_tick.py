"""The live reader's cost per tick of ``benchmarks/scale_stream.py``, without a stream.

Builds a ``--rows``-row base in ``--regions`` bucket regions (once, copied per mix),
then for each key mix (``--mix``, default both: see ``scale_stream.stream_keys``)
writes ``--fill`` stream values through one open table (its MemTables flush to
generations at the writer's default thresholds; the rest stays as unflushed WAL
tails), starts a reader in a fresh process and runs ``--ticks`` ticks: the writer
appends ``--step`` more values, then the reader runs the stream reader's three
queries (``count(*)``, a filtered aggregate, a 10-key lookup). No maintainer runs, so
the state only grows, the same for both mixes. Prints, per mix, the reader's CPU
seconds per tick (``time.process_time``: the machine is shared, wall time is noisy)
and the p50 of each query's CPU and wall milliseconds over the ticks after the first
(the first builds the caches from nothing; the later ones extend them by a little, as
on a live stream).

``--code DIR`` (repeatable): a reader process per DIR (its ``PYTHONPATH``, e.g. two
worktrees), all reading the same ticks, taking turns at going first: a paired
comparison of two versions on one state. ``--profile DIR``: ``py-spy record --format
raw`` of each reader over the ticks after the first (``MIX-N.txt`` in DIR).

Memory: each reader's resident set and what holds it after every tick (RSS, its
anonymous part, glibc's heap in use and free, Arrow's pool, the Lance sessions, the read
path's caches, anonymous mappings by kind) go to ``ticks-MIX-HEAP-N.json`` in ``--root``;
the table prints first / last / largest RSS. ``--heap MODE`` (repeatable, times each
``--code``) runs readers with different allocator settings on the same ticks;
``--maintain-every N`` flushes and runs a maintenance pass every N ticks, so the state
stops growing as on a stream with its maintainer (the base gets a new version, the
views of merged generations are replaced).
"""

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
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402
from scale_stream import MIXES, NEW_EVERY, scale_base, scale_rows, stream_keys  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.maintain.policy import MaintenancePolicy  # noqa: E402

QUERIES = ("count", "filtered", "lookup")


def write_values(t: mq.MemWalTable, start: int, count: int, rows: int, mix: str) -> None:
    """Stream values ``start .. start + count - 1`` as ``scale_stream``'s writer writes
    them (upserts, then the deletes), in chunks of at most 500,000."""
    for lo in range(start, start + count, 500_000):
        values = np.arange(lo, min(start + count, lo + 500_000), dtype=np.int64)
        ids, dels = stream_keys(values, rows, mix)
        t.write(scale_rows(ids[~dels], values[~dels]))
        if dels.any():
            t.delete(pa.table({"id": pa.array(ids[dels], pa.int64())}))
    for w in t._routed.writers():  # the flushes under way end: readers see one state
        w.flush_due()


def reader(uri: str, rows: int) -> None:
    """Child process: one tick per line read from stdin, its figures as a JSON line."""
    import datafusion

    heap = os.environ.get("MEMWAL_TICK_HEAP", "default")
    if heap == "bound":
        from memwal_query.storage.heap import bound_process_heap

        bound_process_heap()
    if heap.startswith("trim:"):  # glibc's trim threshold fixed at this many MiB
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, int(heap[5:]) << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    r = mq.MemWalTable.open(uri)
    rng = np.random.default_rng(3)
    for line in sys.stdin:
        acked = int(line)
        out: dict[str, float] = {}
        tick_cpu = time.process_time()
        ctx = datafusion.SessionContext()
        provider = r.provider(consistency="latest")
        ctx.register_table("t", provider)
        for name, sql in (
            ("count", "SELECT count(*) FROM t"),
            ("filtered", "SELECT count(*), sum(val) FROM t WHERE cat = 7"),
        ):
            c, w = time.process_time(), time.perf_counter()
            got = ctx.sql(sql).to_arrow_table()
            out[f"{name} cpu"], out[f"{name} wall"] = (
                time.process_time() - c,
                time.perf_counter() - w,
            )
            out[f"{name} answer"] = float(got.column(0)[0].as_py())
        keys = pa.table(
            {"id": pa.array(rng.integers(0, rows + acked // NEW_EVERY, 10), pa.int64())}
        )
        c, w = time.process_time(), time.perf_counter()
        r.lookup(keys, consistency="latest")
        out["lookup cpu"], out["lookup wall"] = time.process_time() - c, time.perf_counter() - w
        out["tick cpu"] = time.process_time() - tick_cpu
        if heap in ("release", "bound"):
            from memwal_query.storage.heap import release_unused_memory

            c = time.process_time()
            release_unused_memory()
            out["release cpu"] = time.process_time() - c
        out.update(heap_figures(r))
        if provider.last_plan is not None:
            plan = provider.last_plan
            out["tail rows"] = sum(m.num_rows for g in plan.regions for m in g.memtables)
            out["generations"] = len(plan.generations)
        print(json.dumps(out), flush=True)


def heap_mode(text: str) -> str:
    """A ``--heap`` value, checked."""
    if text in ("default", "glibc", "release", "bound") or (
        text.split(":")[0] in ("trim", "arenas") and text.split(":")[-1].isdigit()
    ):
        return text
    raise argparse.ArgumentTypeError(f"unknown --heap {text!r}")


def heap_figures(t: mq.MemWalTable) -> dict[str, float]:
    """This process's resident memory and what holds it, in MB: RSS and its anonymous
    part, glibc's heap in use and free (``mallinfo2``; the free part counts pages already
    given back too), Arrow's pool, the Lance sessions and the read path's caches."""
    from scale_stream import reader_memory, rss_mb

    use = reader_memory(t)
    out = {k: use.get(k, 0.0) for k in ("rss", "glibc_in_use", "glibc_free_kept")}
    out["rss_anon"] = rss_mb(os.getpid(), "RssAnon")
    out["arrow"] = use.get("arrow_pool_bytes", 0.0)
    out["lance"] = use.get("lance_cache_bytes", 0.0)
    out["caches"] = use.get("caches_bytes", 0.0)
    out.update(anon_mappings())
    return out


def anon_mappings() -> dict[str, float]:
    """Resident MB of this process's anonymous memory by mapping: glibc's main heap
    (``[heap]``), mappings of 60 MB or more (glibc's thread arenas are 64 MiB, mimalloc's
    segments larger), the smaller ones."""
    out = {"smaps heap": 0.0, "smaps big": 0.0, "smaps small": 0.0}
    kind = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    name = head[5] if len(head) > 5 else ""
                    kind = (
                        "smaps heap"
                        if name == "[heap]"
                        else None
                        if name
                        else "smaps big"
                        if hi - lo >= 60 << 20
                        else "smaps small"
                    )
                elif head[0] == "Rss:" and kind is not None:
                    out[kind] += int(head[1]) / 1024
    except OSError:
        pass
    return out


def run_mix(args: argparse.Namespace, template: str, mix: str) -> list[dict[str, float]]:
    """The ticks of one mix: a row of medians per reader (one per ``--code``)."""
    uri = f"{args.root}/{mix}"
    shutil.rmtree(uri, ignore_errors=True)
    shutil.copytree(template, uri)
    t = mq.MemWalTable.open(uri)
    # generations by rows only (not by age): the same state however loaded the machine
    t.configure_writers(max_memtable_age=1e9)
    write_values(t, 0, args.fill, args.rows, mix)
    n = args.fill
    readers = []
    for code, heap in args.readers:
        env = dict(os.environ, MEMWAL_TICK_HEAP=heap)
        if heap == "glibc" or heap.startswith("trim:"):
            # a tunable that changes nothing: the library leaves glibc's settings be
            env["GLIBC_TUNABLES"] = "glibc.malloc.perturb=0"
        if heap.startswith("arenas:"):  # glibc's arena cap; the library's thresholds stay
            env["MALLOC_ARENA_MAX"] = heap[7:]
        if code:
            env["PYTHONPATH"] = code
        cmd = [sys.executable, os.path.abspath(__file__), "--child", uri, "--rows", str(args.rows)]
        readers.append(
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        )
    spies: list[subprocess.Popen] = []
    ticks: list[list[dict[str, float]]] = [[] for _ in readers]
    try:
        for i in range(args.ticks):
            write_values(t, n, args.step, args.rows, mix)
            n += args.step
            if args.maintain_every and (i + 1) % args.maintain_every == 0:
                t.flush()  # what a stream's maintainer sees: generations, merged
                t.maintenance.maintain(MaintenancePolicy(merge_over_generations=0))
            order = list(range(len(readers)))
            if i % 2:
                order.reverse()  # paired readers take turns at going first
            for j in order:
                child = readers[j]
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{n}\n")
                child.stdin.flush()
                ticks[j].append(json.loads(child.stdout.readline()))
            if args.profile and not spies:  # the ticks after the first
                os.makedirs(args.profile, exist_ok=True)
                for j, child in enumerate(readers):
                    spy = [str(Path(sys.executable).parent / "py-spy"), "record"]
                    spy += ["--format", "raw", "-r", "100", "--pid", str(child.pid)]
                    spy += ["-o", f"{args.profile}/{mix}-{j}.txt"]
                    spies.append(
                        subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    )
                time.sleep(1)
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        for child in readers:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()
        t.close(flush=False)  # the WAL tails stay: the state can be read again
    for (code, heap), got in zip(args.readers, ticks):
        with open(f"{args.root}/ticks-{mix}-{heap}-{len(code)}.json", "w") as f:
            json.dump(got, f)
    out = []
    for got in ticks:
        later = got[1:] or got
        row = {k: float(np.median([x[k] for x in later])) for k in later[0]}
        row["first tick cpu"] = got[0]["tick cpu"]
        for k in ("rss", "rss_anon", "glibc_free_kept", "glibc_in_use"):
            row[f"{k} first"], row[f"{k} last"] = got[0][k], got[-1][k]
        row["rss max"] = max(x["rss"] for x in got)
        row["rss series"] = [x["rss"] for x in got]  # type: ignore[assignment]
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--regions", type=int, default=32)
    p.add_argument("--fill", type=int, default=6_000_000, help="stream values before the ticks")
    p.add_argument("--step", type=int, default=450_000, help="values written between ticks")
    p.add_argument("--ticks", type=int, default=8)
    p.add_argument("--mix", choices=(*MIXES, "both"), default="both")
    p.add_argument("--root", default=None, help="keep the tables here (the base is reused)")
    p.add_argument("--profile", default=None, help="py-spy raw profiles of the reader here")
    p.add_argument(
        "--code",
        action="append",
        default=None,
        help="PYTHONPATH of a reader (repeat: paired readers of the same ticks, e.g. two "
        "worktrees); default: this process's",
    )
    p.add_argument(
        "--heap",
        action="append",
        default=None,
        type=heap_mode,
        help="a reader per --code and --heap (repeat: paired): 'default'; 'glibc': glibc's "
        "own thresholds (the environment sets a tunable, the library steps aside); "
        "'release': release_unused_memory() after each tick; 'bound': bound_process_heap() "
        "first and release_unused_memory() after each tick; 'trim:MIB': glibc's trim "
        "threshold fixed at MIB; 'arenas:N': the default with at most N glibc arenas "
        "(MALLOC_ARENA_MAX)",
    )
    p.add_argument(
        "--maintain-every",
        type=int,
        default=0,
        help="flush and run a maintenance pass every N ticks (the state stops growing: "
        "a stream with its maintainer); default 0: never",
    )
    p.add_argument("--rss-every", type=int, default=0, help="print RSS every N ticks")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        reader(args.child, args.rows)
        return
    args.code = args.code or [""]
    args.heap = args.heap or ["default"]
    args.readers = [(code, heap) for code in args.code for heap in args.heap]
    args.root = args.root or tempfile.mkdtemp(prefix="memwal-reader-tick-")
    template = f"{args.root}/base-{args.rows}-{args.regions}"
    if not os.path.exists(f"{template}/.done"):
        shutil.rmtree(template, ignore_errors=True)
        started = time.perf_counter()
        scale_base(template, args.rows, args.regions)
        Path(f"{template}/.done").write_text("")
        print(f"base built in {time.perf_counter() - started:.0f} s", flush=True)
    print(machine(), flush=True)
    mixes = MIXES if args.mix == "both" else (args.mix,)
    header = ["mix", "reader", "tick CPU ms (p50)", "first tick CPU ms"]
    header += [f"{q} CPU ms" for q in QUERIES] + [f"{q} wall ms" for q in QUERIES]
    header += ["WAL-tail rows", "generations", "live rows"]
    mem_header = ["mix", "reader", "RSS MB first", "last", "max", "last/first"]
    mem_header += ["RssAnon first", "last", "glibc in use last", "glibc free last"]
    mem_header += ["release CPU ms (p50)"]
    out, mem = [], []
    for mix in mixes:
        for (code, heap), r in zip(args.readers, run_mix(args, template, mix)):
            name = f"{code or 'this'} {heap}"
            out.append(
                [mix, name, r["tick cpu"] * 1e3, r["first tick cpu"] * 1e3]
                + [r[f"{q} cpu"] * 1e3 for q in QUERIES]
                + [r[f"{q} wall"] * 1e3 for q in QUERIES]
                + [int(r.get("tail rows", 0)), int(r.get("generations", 0))]
                + [int(r["count answer"])]
            )
            mem.append(
                [mix, name, r["rss first"], r["rss last"], r["rss max"]]
                + [r["rss last"] / r["rss first"], r["rss_anon first"], r["rss_anon last"]]
                + [r["glibc_in_use last"], r["glibc_free_kept last"]]
                + [r.get("release cpu", 0.0) * 1e3]
            )
            if args.rss_every:
                series = r["rss series"][:: args.rss_every]  # type: ignore[index]
                print(f"{mix} {name} RSS MB:", " ".join(f"{x:.0f}" for x in series))
    title = (
        f"Reader per tick, {args.rows:,} rows, {args.regions} regions, {args.fill:,} values "
        f"then {args.step:,} per tick, p50 over {args.ticks - 1} ticks "
        f"(load {os.getloadavg()[0]:.2f})"
    )
    print_table(title, header, out)
    print_table(f"Reader memory per tick (load {os.getloadavg()[0]:.2f})", mem_header, mem)


if __name__ == "__main__":
    main()
