"""Faults of real object stores survived on every store: a seeded campaign of 503/500/429
answers, timeouts and dropped connections (before or after the store applied the
request) during puts, flushes, merges, GC and reads (see ``store_faults.py``).

CI runs a short form (``MEMWAL_STORE_FAULTS`` faults per store, default 12, seed
``MEMWAL_STORE_FAULTS_SEED``); ``python benchmarks/fault_campaign.py`` runs the full one.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import store_faults  # noqa: E402
from stores import STORES  # noqa: E402

FAULTS = int(os.environ.get("MEMWAL_STORE_FAULTS", "12"))
SEED = int(os.environ.get("MEMWAL_STORE_FAULTS_SEED", "20261127"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", STORES)
def test_fault_campaign(kind, store_pool, capsys):
    server = store_pool.get(kind)
    print(f"fault campaign on {kind}: seed={SEED} faults={FAULTS}")  # shown on failure
    figures = store_faults.run(kind, server, seed=SEED, faults=FAULTS, bucket=store_pool.BUCKET)
    with capsys.disabled():  # the figures of every run, in the CI log
        print("\n" + store_faults.summary([figures]))
    assert figures["faults"] >= FAULTS
    assert figures["rows_checked"] > 0 and figures["reads_checked"] > 0
    assert figures["fsck_findings"] == 0
