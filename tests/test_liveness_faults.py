"""Writer liveness under hostile conditions: a heartbeat write whose outcome is lost,
and a process forked while it has live writers. In both cases the writer must keep
its heartbeat fresh, so that a maintainer never judges a live writer gone."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import memwal_query as mq
from memwal_query.exceptions import StorageError
from memwal_query.write import liveness

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import basic_rows  # noqa: E402


def _stored(table, w) -> liveness.Heartbeat:
    hb = liveness.read(table.catalog.io, table.uri, w.region_id).heartbeat
    assert hb is not None
    return hb


def test_a_heartbeat_write_that_landed_but_reported_failure_does_not_stop_the_beat(
    table, monkeypatch
):
    # An object store can apply a write and lose its answer (a timeout, a retried
    # conditional put answered 412). The writer must recognise its own beat, not
    # conclude that a maintainer took the region over.
    w = table.writer(heartbeat_interval=3600.0)  # the test drives every refresh
    w.put(basic_rows([100]))
    io = table.catalog.io
    real = io.write
    failed = []

    def landed_then_failed(path, data, *a, **k):
        real(path, data, *a, **k)
        if path.endswith(liveness.HEARTBEAT_NAME) and not failed:
            failed.append(path)
            raise StorageError("the answer to the heartbeat write was lost")

    monkeypatch.setattr(io, "write", landed_then_failed)
    w._beat()  # lands, reported failed
    assert failed
    monkeypatch.setattr(io, "write", real)
    time.sleep(0.01)
    w._beat()
    assert _stored(table, w).beat_at == w._last_beat
    time.sleep(0.01)
    w._beat()  # still beating
    assert _stored(table, w).beat_at == w._last_beat
    assert w in set(liveness.HEARTBEATS._writers)
    w.put(basic_rows([101]))
    w.close(flush=False)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")
def test_a_forked_child_does_not_beat_its_parents_writers(table):
    # A child process inherits copies of the parent's writers. If its heartbeat thread
    # refreshed them, the parent's next compare-and-swap would fail and the parent
    # would stop beating: a live writer judged gone and fenced.
    w = table.writer(heartbeat_interval=0.001)
    w.put(basic_rows([100]))
    gate = threading.Event()
    held = threading.Event()

    def hold(_w) -> None:  # the parent's thread waits here, between two refreshes
        held.set()
        gate.wait(60)

    liveness.HEARTBEATS.hook = hold
    try:
        assert held.wait(30)
        seen = _stored(table, w)
        pid = os.fork()
        if pid == 0:  # the child: a refresh pass of its own heartbeat thread
            code = 0
            try:
                liveness.HEARTBEATS.hook = None
                liveness.HEARTBEATS._beat_due()
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _stored(table, w) == seen  # the child wrote no beat for the parent's writer
    finally:
        liveness.HEARTBEATS.hook = None
        gate.set()
    # The parent's own thread goes on beating: its compare-and-swap still succeeds.
    deadline = time.monotonic() + 30
    while _stored(table, w).beat_at <= seen.beat_at:
        assert time.monotonic() < deadline, "the parent's writer stopped beating"
        time.sleep(0.005)
    assert _stored(table, w).owner == w._heartbeat_owner
    assert w in set(liveness.HEARTBEATS._writers)
    w.put(basic_rows([101]))
    w.close(flush=False)
    assert sorted(mq.MemWalTable.open(table.uri).to_table()["id"].to_pylist())[-2:] == [100, 101]


def test_an_error_escaping_one_refresh_does_not_stop_the_heartbeat_thread(table):
    # One thread refreshes every writer of the process: an error escaping one refresh
    # must neither end it (every writer would then look gone) nor skip the others.
    w = table.writer(heartbeat_interval=0.02)
    raised = threading.Event()

    def hook(_w) -> None:
        if not raised.is_set():
            raised.set()
            raise RuntimeError("an unexpected error in a refresh")

    liveness.HEARTBEATS.hook = hook
    try:
        assert raised.wait(10)
        before = w._last_beat
        deadline = time.monotonic() + 10
        while w._last_beat == before:
            assert time.monotonic() < deadline, "the heartbeat thread stopped"
            time.sleep(0.01)
    finally:
        liveness.HEARTBEATS.hook = None
    w.close(flush=False)
