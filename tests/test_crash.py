"""Crash tests: SIGKILL at named crash points and random times, then recovery."""

import multiprocessing as mp
import os

import crash_harness
import pytest

SEED = int(os.environ.get("MEMWAL_CRASH_SEED", "20261122"))
ITERATIONS = int(os.environ.get("MEMWAL_CRASH_ITERATIONS", "200"))


@pytest.mark.slow
def test_crash_harness(tmp_path):
    mp.set_forkserver_preload(["memwal_query", "lance", "pyarrow", "crash_harness"])
    figures = crash_harness.run(ITERATIONS, SEED, root=str(tmp_path))
    print(f"crash harness seed={SEED}: {figures}")
    assert figures["iterations"] == ITERATIONS
    hit = {k for k, v in figures["hits"].items() if v}
    # The seeded schedule reaches most crash points (all with enough iterations).
    assert len(hit & set(crash_harness.POINTS)) >= 5, figures
    assert figures["rows_checked"] > 0
