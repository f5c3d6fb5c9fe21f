"""Fault-injection harness: a workload killed with SIGKILL, then recovered and checked.

``python tests/crash_harness.py --iterations N --seed S [--stress]`` runs it standalone
(``--stress``: 2000 iterations); ``tests/test_crash.py`` runs it in CI, and
``benchmarks/crash_campaign.py`` runs it at scale. Each iteration forks a worker (from a
forkserver that has the libraries loaded), which performs a seeded random sequence of
durable puts, deletes, flushes, merges, index catch-ups and GC on a table with two
regions and a maintained index, logging each operation before it starts and when it is
acknowledged. The
worker dies at a named crash point (``MEMWAL_CRASH_AT``) or is killed at a random time.
Until every point has been hit (``cover``, the default), each iteration aimed at a point
takes one not hit yet (drawn at random), and its worker ends its random operations with
a fixed sequence that passes every point (:data:`REACH_ALL`: puts and deletes in both
regions, flushes, a merge taking the merger's two-commit paths, an index catch-up, GC):
each such iteration hits its point, so any run of at least ``len(POINTS)`` aimed
iterations has hit them all, whatever the seed.
The harness then reopens the table, recovers each region (a new writer replays the
WAL), and compares the deduplicated view with the model of acknowledged operations: the
one operation in flight when the worker died may or may not be visible; nothing else
may differ.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter

POINTS = (
    "wal.after_write",
    "manifest.before_commit",
    "manifest.after_commit",
    "flush.mid",
    "merge.before_commit",
    "merge.after_update",
    "merge.between_commits",
    "merge.after_commit",
    "catchup.mid",
    "gc.mid",
)
KEYS = 60
TIMER_STRATA = 4
# Operations (op, region, keys) passing every crash point from any state of the table:
# in each region, upserts of base keys and deletes of keys not upserted (written to the
# WAL, committed to the region manifest), flushed; one merge of both regions, an index
# catch-up over what it merged, and GC of the merged generations.
REACH_ALL = (
    ("put", 0, [0, 2]),
    ("delete", 0, [4]),
    ("put", 1, [1, 3]),
    ("delete", 1, [5]),
    ("flush", 0, []),
    ("flush", 1, []),
    ("merge_all", 0, []),
    ("catch_up", 0, []),
    ("gc", 0, []),
)


def _schema():
    import pyarrow as pa

    pk = {"lance-schema:unenforced-primary-key": "true"}
    return pa.schema([pa.field("id", pa.int64(), False, pk), pa.field("v", pa.int64())])


def _log(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())
    os.fsync(fd)


def worker(
    uri: str,
    regions: list[str],
    seed: int,
    crash_at: str | None,
    log_path: str,
    max_ops: int = 12,
    storage_options: dict[str, str] | None = None,
    reach: bool = False,
) -> None:
    """The workload (runs in a forked child; never returns normally when crashing).

    ``reach``: after the random operations, run :data:`REACH_ALL` (each operation
    logged like the others), which passes every crash point; aimed at a point of the
    merger's two-commit paths, the merger takes one (its own Update, then the marker;
    or the deletes, then the upserts)."""
    if crash_at:
        os.environ["MEMWAL_CRASH_AT"] = crash_at
    else:
        os.environ.pop("MEMWAL_CRASH_AT", None)
    import datetime as dt

    import pyarrow as pa

    import memwal_query as mq

    rng = random.Random(seed)
    if rng.random() < 0.5:
        # a merged batch's deletes in a commit of their own (the large-base path)
        from memwal_query.maintain import merger

        merger.SEPARATE_DELETE_MIN_BASE_ROWS = 0
    if rng.random() < 0.5:
        # a batch with upserts as the merger's own Update, then its marker
        from memwal_query.maintain import merger

        merger.REWRITE_MIN_BASE_ROWS = 0
    target = (crash_at or "").partition(":")[0]
    if reach and target in ("merge.after_update", "merge.between_commits"):
        # points of the two-commit paths: the merger's own Update (which passes both),
        # else (drawn above) the deletes committed first (which passes the second)
        from memwal_query.maintain import merger

        if target == "merge.after_update":
            merger.REWRITE_MIN_BASE_ROWS = 0
        merger.SEPARATE_DELETE_MIN_BASE_ROWS = 0
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    t = mq.MemWalTable.open(uri, storage_options=storage_options)
    writers = [
        t.writer(region_values={"p": r}, max_memtable_rows=rng.choice([5, 20, 1000]))
        for r in range(len(regions))
    ]
    n_random = rng.randint(3, max_ops)
    steps = n_random + (len(REACH_ALL) if reach else 0)
    for i in range(steps):
        if i < n_random:
            ops = ["put", "delete", "flush", "merge", "catch_up", "gc"]
            op = rng.choices(ops, [6, 2, 2, 1, 1, 1])[0]
            r = rng.randrange(len(regions))
            keys = sorted(
                {k for k in (rng.randrange(KEYS) for _ in range(rng.randint(1, 5))) if k % 2 == r}
            )
        else:
            op, r, keys = REACH_ALL[i - n_random]
        rec = {"op": op, "region": r, "keys": keys, "v": seed * 1000 + i}
        _log(fd, {"begin": rec})
        if op == "put" and keys:
            writers[r].put(pa.table({"id": keys, "v": [rec["v"]] * len(keys)}, schema=_schema()))
        elif op == "delete" and keys:
            writers[r].delete(pa.table({"id": pa.array(keys, pa.int64())}))
        elif op == "flush":
            writers[r].flush()
        elif op == "merge":  # one region, or both (their generations share a commit)
            t.maintenance.merge(regions=[regions[r]] if i % 2 else None, max_generations=2)
        elif op == "merge_all":  # every unmerged generation of both regions
            t.maintenance.merge()
        elif op == "catch_up":
            t.maintenance.catch_up_indexes()
        elif op == "gc":
            t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))
        _log(fd, {"ack": rec})
    os._exit(0)


def apply(model: dict[int, int], rec: dict) -> dict[int, int]:
    out = dict(model)
    if rec["op"] == "put":
        for k in rec["keys"]:
            out[k] = rec["v"]
    elif rec["op"] == "delete":
        for k in rec["keys"]:
            out.pop(k, None)
    return out


def run(
    iterations: int,
    seed: int,
    root: str | None = None,
    verbose: bool = False,
    crash_rate: float = 0.7,
    max_ops: int = 12,
    timer_max: float = 1.5,
    uri: str | None = None,
    storage_options: dict[str, str] | None = None,
    cover: bool = True,
) -> dict:
    """Run the harness; returns figures (iterations, crash points hit, rows checked).

    ``crash_rate``: the share of iterations aimed at a named crash point (the others are
    killed by a timer at a random time, or complete); ``max_ops``: the most operations
    a worker performs (at least 3); ``timer_max``: the latest a timer kills (seconds).
    ``uri`` (default ``{root}/t``) and ``storage_options`` place the table elsewhere,
    for example on an object store; the operations log stays in ``root``. ``cover``:
    make the aimed runs reach the points not hit yet (see the module docs); off, a run
    of a few iterations spends no time on merges it was not drawn to make.
    """
    import lance
    import pyarrow as pa

    import memwal_query as mq

    root = root or tempfile.mkdtemp(prefix="memwal-crash-")
    uri = uri or os.path.join(root, "t")
    so = storage_options or None
    base = pa.table({"id": list(range(KEYS)), "v": [0] * KEYS}, schema=_schema())
    lance.write_dataset(base, uri, storage_options=so)
    lance.dataset(uri, storage_options=so).create_scalar_index("v", "BTREE", name="v_idx")
    from helpers import parity_spec

    t0 = mq.MemWalTable.initialize(
        uri,
        region_spec=parity_spec(lance.dataset(uri, storage_options=so)),
        maintained_indexes=["v_idx"],
        storage_options=storage_options,
    )
    regions = [t0.catalog.region_id_for({"p": i}) for i in range(2)]  # keys k live in region k % 2
    model = {k: 0 for k in range(KEYS)}
    rng = random.Random(seed)
    ctx = mp.get_context("forkserver")
    hits: Counter = Counter()
    rows_checked = 0
    log_path = os.path.join(root, "ops.log")
    timed = 0  # iterations left to the timer so far
    for it in range(iterations):
        crash_at, reach = None, False
        if rng.random() < crash_rate:
            # Until every point was hit, an aimed run takes a point not hit yet (at its
            # first hit) and its worker ends by passing every point: it is hit there.
            # Without ``cover``, half of the crash runs aim at a point not hit yet, as
            # they come (no run is made to reach it).
            unhit = [p for p in POINTS if not hits[p]]
            if unhit and cover:
                crash_at, reach = f"{rng.choice(unhit)}:1", True
            elif unhit and rng.random() < 0.5:
                crash_at = f"{rng.choice(unhit)}:1"
            else:
                crash_at = f"{rng.choice(POINTS)}:{rng.randint(1, 3)}"
        open(log_path, "w").close()
        proc = ctx.Process(
            target=worker,
            args=(uri, regions, seed * 100_000 + it, crash_at, log_path, max_ops, so, reach),
        )
        proc.start()
        # Uniform over (0.05, timer_max) in TIMER_STRATA strata taken in turn, the
        # earliest first: every few timed runs one is killed early in its workload.
        stratum = timed % TIMER_STRATA
        deadline = 0.05 + (timer_max - 0.05) * (stratum + rng.random()) / TIMER_STRATA
        if crash_at is None:
            timed += 1
        proc.join(deadline if crash_at is None else 60)
        killed_by_timer = proc.is_alive()
        if killed_by_timer:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited just now, on its own
                killed_by_timer = False
            proc.join()
        if proc.exitcode == -signal.SIGKILL and not killed_by_timer:
            hits[crash_at.split(":")[0]] += 1
        elif killed_by_timer:
            hits["timer"] += 1
        else:
            hits["completed"] += 1
        # Replay the log: acknowledged ops are certain, one started op may be in flight.
        inflight = None
        with open(log_path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                entry = json.loads(line)
                if "begin" in entry:
                    inflight = entry["begin"]
                else:
                    model = apply(model, entry["ack"])
                    inflight = None
        # Recover and check.
        t = mq.MemWalTable.open(uri, storage_options=storage_options)
        writers = [t.writer(region_values={"p": i}) for i in range(len(regions))]
        rows = t.to_table(writers=writers).to_pylist()
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)), f"seed {seed} iteration {it}: duplicate keys"
        view = {r["id"]: r["v"] for r in rows}
        rows_checked += len(rows)
        if view != model:
            alt = apply(model, inflight) if inflight else None
            assert view == alt, (
                f"seed {seed} iteration {it} crash_at={crash_at}: view != model\n"
                f"missing={ {k: v for k, v in model.items() if view.get(k) != v} }\n"
                f"extra={ {k: v for k, v in view.items() if model.get(k) != v} }"
            )
            model = alt
        for w in writers:
            w.close(flush=rng.random() < 0.5)
        if verbose:
            print(f"iteration {it}: crash_at={crash_at} timer={killed_by_timer} ok", flush=True)
    return {
        "iterations": iterations,
        "hits": dict(hits),
        "points_missed": [p for p in POINTS if not hits[p]],
        "rows_checked": rows_checked,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--stress", action="store_true", help="2000 iterations")
    parser.add_argument("--crash-rate", type=float, default=0.7)
    parser.add_argument("--max-ops", type=int, default=12)
    parser.add_argument("--timer-max", type=float, default=1.5)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    n = 2000 if args.stress else args.iterations
    print(f"crash harness: seed {args.seed}, {n} iterations", flush=True)
    started = time.perf_counter()
    figures = run(
        n,
        args.seed,
        verbose=args.verbose,
        crash_rate=args.crash_rate,
        max_ops=args.max_ops,
        timer_max=args.timer_max,
    )
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    mp.set_forkserver_preload(["memwal_query", "lance", "pyarrow", "datafusion", "crash_harness"])
    main()
