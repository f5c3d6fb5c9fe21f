"""Crash campaign (not CI): many thousands of randomized SIGKILL crash points.

Runs ``tests/crash_harness.py`` in batches (a fresh real table per batch, ``--jobs``
batches at a time, each with its own seed) until ``--crashes`` workers were killed or
``--minutes`` ran out. Every iteration forks a worker doing durable puts, deletes,
flushes, merges (one region or both in one commit), index catch-up and GC; it is killed
with SIGKILL at a named crash point (``memwal_query.storage.crashpoints``) or by a timer at a
random moment; the harness then recovers every region and checks every acknowledged
write against its model (the one operation in flight may or may not be visible;
nothing else may differ). A failing batch stops the campaign and prints its seed
(``python tests/crash_harness.py --seed S --iterations N`` replays it).

Prints one line per batch and the totals as JSON::

    python benchmarks/crash_campaign.py --crashes 10000 --jobs 2
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
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "..", "tests", "crash_harness.py")


def _start(
    seed: int, iterations: int, crash_rate: float, max_ops: int, timer_max: float
) -> tuple[subprocess.Popen, str]:
    tmp = tempfile.mkdtemp(prefix="memwal-campaign-")
    env = dict(os.environ, TMPDIR=tmp)
    cmd = [
        sys.executable,
        HARNESS,
        "--seed",
        str(seed),
        "--iterations",
        str(iterations),
        "--crash-rate",
        str(crash_rate),
        "--max-ops",
        str(max_ops),
        "--timer-max",
        str(timer_max),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, tmp


def main() -> int:
    """Run the campaign; exit status 1 when a batch failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crashes", type=int, default=10_000, help="Stop after this many.")
    parser.add_argument("--minutes", type=float, default=240.0, help="Time budget.")
    parser.add_argument("--jobs", type=int, default=2, help="Batches run at once.")
    parser.add_argument("--batch", type=int, default=200, help="Iterations per batch.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the first batch.")
    parser.add_argument(
        "--crash-rate", type=float, default=0.5, help="Share of iterations aimed at a point."
    )
    parser.add_argument("--max-ops", type=int, default=12, help="Most operations per worker.")
    parser.add_argument(
        "--timer-max", type=float, default=0.6, help="Latest random kill (s; harness: 1.5)."
    )
    args = parser.parse_args()
    started = time.perf_counter()
    deadline = started + args.minutes * 60
    hits: Counter = Counter()
    totals = Counter()
    running: list[tuple[int, subprocess.Popen, str]] = []
    seed = args.seed
    failed = None

    def crashes() -> int:
        return sum(v for k, v in hits.items() if k != "completed")

    while True:
        while (
            failed is None
            and len(running) < args.jobs
            and crashes() < args.crashes
            and time.perf_counter() < deadline
        ):
            proc, tmp = _start(seed, args.batch, args.crash_rate, args.max_ops, args.timer_max)
            running.append((seed, proc, tmp))
            seed += 1
        if not running:
            break
        time.sleep(0.5)
        for item in list(running):
            s, proc, tmp = item
            if proc.poll() is None:
                continue
            running.remove(item)
            out, err = proc.communicate()
            shutil.rmtree(tmp, ignore_errors=True)
            lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                failed = {"seed": s, "status": proc.returncode, "stderr": err.decode()[-3000:]}
                print(f"batch seed {s} FAILED (status {proc.returncode})", flush=True)
                print(err.decode()[-3000:], flush=True)
                continue
            figures = json.loads(lines[-1])
            hits.update(figures["hits"])
            totals["iterations"] += figures["iterations"]
            totals["rows_checked"] += figures["rows_checked"]
            totals["batches"] += 1
            print(
                f"batch seed {s}: {figures['iterations']} iterations, "
                f"{sum(v for k, v in figures['hits'].items() if k != 'completed')} crashes, "
                f"{figures['seconds']} s; total crashes {crashes()} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    summary = {
        "crashes": crashes(),
        "named_point_crashes": sum(v for k, v in hits.items() if k not in ("completed", "timer")),
        "timer_kills": hits.get("timer", 0),
        "completed_without_crash": hits.get("completed", 0),
        **totals,
        "hits": dict(sorted(hits.items())),
        "seeds": [args.seed, seed - 1],
        "seconds": round(time.perf_counter() - started, 1),
        "failed": failed,
    }
    print(json.dumps(summary, indent=2), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
