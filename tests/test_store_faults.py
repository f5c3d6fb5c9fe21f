"""Faults of real object stores survived on every store: a seeded campaign of 503/500/429
answers, timeouts and dropped connections (before or after the store applied the
request) during puts, flushes, merges, GC and reads (see ``store_faults.py``).

CI runs a short form (``MEMWAL_STORE_FAULTS`` faults per store, default 30, seed
``MEMWAL_STORE_FAULTS_SEED``); ``python benchmarks/fault_campaign.py`` runs the full one.
"""

from __future__ import annotations

import os
import urllib.parse

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import store_faults  # noqa: E402
from stores import STORES  # noqa: E402

FAULTS = int(os.environ.get("MEMWAL_STORE_FAULTS", "30"))
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


class OneShot:
    """A plan faulting the ``nth`` request (1-based) whose path contains ``marker``
    and whose method is ``method``, with ``fault``; nothing else."""

    def __init__(self, method: str, marker: str, fault: tuple[str, str], nth: int = 1) -> None:
        self.method, self.marker, self.fault, self.nth = method, marker, fault, nth
        self.seen = 0

    def __call__(self, method: str, path: str):
        if method == self.method and self.marker in urllib.parse.unquote(path):
            self.seen += 1
            if self.seen == self.nth:
                return self.fault
        return None


def _params():
    return [pytest.param(kind, marks=pytest.mark.slow) if kind != "s3" else kind for kind in STORES]


@pytest.mark.parametrize("fault", [("503", "after"), ("drop", "after"), ("500", "before")])
@pytest.mark.parametrize("kind", _params())
def test_wal_put_whose_answer_is_lost_is_acknowledged_once(kind, fault, store_pool):
    """The store applies a WAL entry's create-only put but the answer is lost (a 5xx the
    client retries into a 412 for its own object, or a dropped connection), or it fails
    before applying it: the put is acknowledged, and the row is there exactly once."""
    import uuid

    import lance
    from faultproxy import FaultProxy

    import memwal_query as mq
    from memwal_query.storage import paths

    from helpers import basic_rows

    server = store_pool.get(kind)
    plan = OneShot("PUT", "/wal/", fault, nth=2)  # the first WAL put goes through
    with FaultProxy(server.upstream, plan=plan) as proxy:
        options = server.storage_options(endpoint=proxy.endpoint)
        uri = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}/t"
        lance.write_dataset(basic_rows(range(5)), uri, storage_options=options)
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        w = t.writer()
        w.put(basic_rows([100]))
        w.put(basic_rows([101], val=[-1.0]))  # its WAL put meets the fault
        assert proxy.faults == 1 and plan.seen >= 2
        w.put(basic_rows([102]))
        entries = t.catalog.io.list(paths.wal_dir(t.uri, w.region_id))
        assert len(entries) == 3, entries  # one entry per put, none doubled or lost
        w.close(flush=False)
        rows = mq.MemWalTable.open(uri, storage_options=options).writer(w.region_id)
        got = t.to_table(writers=[rows]).to_pylist()
        rows.close()
    ids = [r["id"] for r in got]
    assert sorted(ids) == [0, 1, 2, 3, 4, 100, 101, 102]
    assert {r["id"]: r["val"] for r in got}[101] == -1.0


@pytest.mark.parametrize("kind", _params())
def test_lease_release_whose_answer_is_lost_still_releases(kind, store_pool):
    """The conditional overwrite that releases the index lock lands, but the answer is
    a 503 and the client's retry gets 412 (the version moved on, by our own write):
    the release is recognised as done, the lease is not reported lost, and the next
    holder takes a released lease, not an expired one."""
    import json
    import uuid

    from faultproxy import FaultProxy

    from memwal_query.storage.factory import file_io_for
    from memwal_query.storage.lease import LeaseLock

    server = store_pool.get(kind)
    plan = OneShot("PUT", ".index.lock", ("503", "after"), nth=2)  # 1: create, 2: release
    with FaultProxy(server.upstream, plan=plan) as proxy:
        options = server.storage_options(endpoint=proxy.endpoint)
        root = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}"
        io = file_io_for(root, options)
        path = root + "/.index.lock"
        holder = LeaseLock(io, path, ttl=30)
        with holder:
            pass
        assert proxy.faults == 1
        assert not holder.lost and json.loads(io.read(path))["released"] is True
        with LeaseLock(io, path, timeout=5) as successor:
            assert successor.took_over is None
