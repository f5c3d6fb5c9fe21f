"""Crash tests: SIGKILL at named crash points and random times, then recovery.

CI runs 80 seeded iterations (``MEMWAL_CRASH_ITERATIONS``, ``MEMWAL_CRASH_SEED``): the
harness aims each crash run at a point not hit yet and makes it reach that point, until
every point is hit (within the first dozen or so iterations); later points and hits are
drawn at random. A failure message names the seed and iteration, and ``python
tests/crash_harness.py --seed S --iterations N`` replays it (``--stress`` for 2000
iterations).
"""

import multiprocessing as mp
import os

import crash_harness
import pytest

from memwal_query.storage import crashpoints

SEED = int(os.environ.get("MEMWAL_CRASH_SEED", "20261122"))
ITERATIONS = int(os.environ.get("MEMWAL_CRASH_ITERATIONS", "80"))
# enough iterations that at least len(POINTS) of them aim at a point, and a few are
# left to the timer, at any seed (each is so with a probability of 0.7 and 0.3)
COVERING = 40


def test_harness_covers_every_crash_point():
    """The harness aims at every point the library defines (and no unknown one)."""
    assert set(crash_harness.POINTS) == set(crashpoints.POINTS)
    assert {
        "wal.after_write",  # after a WAL entry is written
        "manifest.before_commit",
        "manifest.after_commit",
        "flush.mid",  # mid MemTable flush
        "merge.after_commit",  # after the data commit, before the merger goes on
        "gc.mid",
    } <= set(crashpoints.POINTS)


@pytest.mark.slow
def test_crash_harness(tmp_path, capsys):
    mp.set_forkserver_preload(["memwal_query", "lance", "pyarrow", "crash_harness"])
    print(f"crash harness seed={SEED} iterations={ITERATIONS}")  # shown on failure
    figures = crash_harness.run(ITERATIONS, SEED, root=str(tmp_path))
    with capsys.disabled():  # the figures of every run, in the CI log
        print(f"\ncrash harness seed={SEED}: {figures}")
    assert figures["iterations"] == ITERATIONS
    assert figures["rows_checked"] > 0
    # Every named crash point was reached and the process killed there.
    if ITERATIONS >= COVERING:
        assert figures["points_missed"] == [], figures
    assert figures["hits"].get("timer", 0) > 0 or ITERATIONS < COVERING, figures


STORE_ITERATIONS = int(os.environ.get("MEMWAL_CRASH_STORE_ITERATIONS", "6"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "azure", "gcs"])
def test_crash_harness_on_object_stores(kind, store_pool, tmp_path, capsys):
    """The same harness with the table on each object store: a worker killed in the
    middle of its requests (at a crash point or by a timer) loses no acknowledged
    operation and doubles none."""
    import uuid

    mp.set_forkserver_preload(["memwal_query", "lance", "pyarrow", "crash_harness"])
    server = store_pool.get(kind)
    uri = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}/t"
    figures = crash_harness.run(
        STORE_ITERATIONS,
        SEED,
        root=str(tmp_path),
        uri=uri,
        storage_options=server.storage_options(),
        timer_max=3.0,
        cover=False,  # six runs: the points they happen to reach (local runs cover all)
    )
    with capsys.disabled():
        print(f"\ncrash harness on {kind} seed={SEED}: {figures}")
    assert figures["iterations"] == STORE_ITERATIONS and figures["rows_checked"] > 0
