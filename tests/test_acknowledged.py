"""Acknowledged means visible, and nothing waits on a writer that is gone.

With real processes:

- a process writes with ``t.write`` and exits without ``close``: a new process's default
  readers (SQL through ``mq.register`` and ``memwal sql``, ``to_table``, ``count_rows``,
  ``lookup``, vector search, DuckDB, Polars) return the rows, and the exit flushed them;
- a writer process killed with SIGKILL mid-stream: every acknowledged row is read by a
  default reader of another process, and one ``maintain`` pass flushes and merges them,
  so plain Lance reads them;
- ``maintain`` never fences a writer whose heartbeat is fresh: the heartbeat is paused
  and resumed around the maintainer's decision (deterministically, no sleeps to win a
  race), and a control run shows that a writer whose heartbeat stays paused is fenced
  (``MemWalTable.write`` then claims the region again);
- the table as a context manager flushes the writers ``write`` opened.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.maintain.policy import MaintenancePolicy
from memwal_query.maintain.recover import recover_abandoned
from memwal_query.write import liveness

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from proc_writer import row  # noqa: E402

from helpers import basic_rows  # noqa: E402

BASE = list(range(10))


def _table(tmp_path) -> str:
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.concat_tables([row(k, float(k)) for k in BASE]), uri)
    mq.MemWalTable.initialize(uri)
    return uri


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


def _writer(uri: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "proc_writer.py"), uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _send(p: subprocess.Popen, line: str) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    reply = p.stdout.readline().strip()
    assert reply.startswith("ok"), reply
    return reply


def _read_in_another_process(uri: str, keys: list[int]) -> dict[str, list[int] | int]:
    ran = subprocess.run(
        [sys.executable, os.path.join(HERE, "proc_reader.py"), uri, *map(str, keys)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def _memwal_sql(uri: str, query: str) -> list[int]:
    ran = subprocess.run(
        [sys.executable, "-m", "memwal_query", "sql", uri, query, "--format", "json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    return [json.loads(line)["id"] for line in ran.stdout.splitlines() if line]


@pytest.mark.slow  # three Python processes
def test_a_process_that_exits_without_close_is_read_by_every_default_reader(tmp_path):
    uri = _table(tmp_path)
    p = _writer(uri)
    _send(p, "write 100 7")
    _send(p, "write 101 8")
    _send(p, "exit")  # no close: the interpreter exits normally
    assert p.wait(60) == 0
    want = sorted([*BASE, 100, 101])
    got = _read_in_another_process(uri, [100, 101, 5])
    assert got.pop("count_rows") == len(want)
    assert got.pop("lookup") == [100, 101, 5]
    for reader, ids in got.items():
        assert sorted(ids) == want, reader
    assert sorted(_memwal_sql(uri, "SELECT id FROM t")) == want
    # and the exit flushed them: flushed rows only (strong) has them too
    t = mq.MemWalTable.open(uri)
    assert sorted(t.to_table(consistency="strong")["id"].to_pylist()) == want
    assert t.maintenance.status().unflushed_rows == 0


@pytest.mark.slow  # a writer process
def test_a_killed_writers_acknowledged_rows_are_read_then_recovered_and_merged(tmp_path):
    uri = _table(tmp_path)
    p = _writer(uri)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("stream 1000 100000 3\n")
    p.stdin.flush()
    acked: list[int] = []
    while len(acked) < 60:
        line = p.stdout.readline().split()
        assert line and line[0] == "ack", line
        acked.append(int(line[1]))
    p.send_signal(signal.SIGKILL)  # mid-stream: writes are in flight
    p.wait(60)
    acked += [int(line.split()[1]) for line in p.stdout.read().splitlines() if line]
    t = mq.MemWalTable.open(uri)
    seen = set(t.to_table(columns=["id"])["id"].to_pylist())
    assert set(acked) <= seen and set(BASE) <= seen
    st = t.maintenance.status()
    (region,) = st.regions.values()
    assert region.unflushed_rows > 0 and region.oldest_unflushed_age is not None
    assert st.live_rows == len(seen)
    # one maintenance pass, once the writer has been silent for abandoned_after
    policy = MaintenancePolicy(abandoned_after=dt.timedelta(seconds=0.3))
    time.sleep(0.5)
    report = t.maintenance.maintain(policy)
    assert [r.region_id for r in report.recovered] == t.catalog.region_ids()
    assert report.merged
    plain = set(lance.dataset(uri).to_table(columns=["id"])["id"].to_pylist())
    assert seen <= plain  # every acknowledged row is in the base table
    after = t.maintenance.status()
    (region,) = after.regions.values()
    assert region.unflushed_rows == 0 and not region.writer_alive
    assert after.live_rows == len(plain)


# -- maintain never fences a live writer ----------------------------------------------
class _PausedHeartbeat:
    """Holds one writer's heartbeat refreshes at the process's heartbeat thread."""

    def __init__(self, writer: mq.RegionWriter) -> None:
        self.writer = writer
        self.held = threading.Event()
        self.gate = threading.Event()

    def __enter__(self) -> _PausedHeartbeat:
        def hook(w: mq.RegionWriter) -> None:
            if w is self.writer and not self.gate.is_set():
                self.held.set()
                assert self.gate.wait(60)

        liveness.HEARTBEATS.hook = hook
        assert self.held.wait(10)
        return self

    def resume(self) -> None:
        """Let the held refresh go on, and wait until it landed."""
        before = self.writer._last_beat
        self.gate.set()
        deadline = time.monotonic() + 10
        while self.writer._last_beat == before:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        liveness.HEARTBEATS.hook = None
        self.gate.set()


ABANDONED_AFTER = 0.2


@pytest.fixture
def idle_writer(table):
    w = table.writer(heartbeat_interval=0.02)
    w.put(_basic_row(table, 100))  # durable, unflushed: the region has a WAL tail
    yield table, w
    liveness.HEARTBEATS.hook = None
    try:
        w.close(flush=False)
    except mq.FencedError:
        pass


def _basic_row(table, key: int) -> pa.Table:
    return basic_rows([key])


def _stale(paused: _PausedHeartbeat) -> None:
    """Wait until the held writer's heartbeat is older than ABANDONED_AFTER."""
    while time.time() - paused.writer._last_beat <= ABANDONED_AFTER * 1.5:
        time.sleep(0.01)


@pytest.mark.parametrize("resume_at", ["before the maintainer reads", "at its decision"])
def test_maintain_never_fences_a_writer_whose_heartbeat_resumes(idle_writer, resume_at):
    table, w = idle_writer
    other = mq.MemWalTable.open(table.uri)
    decisions: list[str] = []
    with _PausedHeartbeat(w) as paused:
        _stale(paused)
        if resume_at == "before the maintainer reads":
            paused.resume()

        def decided(region_id: str) -> None:
            decisions.append(region_id)
            paused.resume()  # the writer's refresh lands before the take-over

        got = recover_abandoned(other.catalog, ABANDONED_AFTER, decided=decided)
    assert got == []
    assert decisions == ([] if resume_at == "before the maintainer reads" else [w.region_id])
    w.put(_basic_row(table, 101))  # not fenced
    assert table.catalog.region_manifest(w.region_id).writer_epoch == w.epoch


def test_a_writer_whose_heartbeat_stays_paused_is_recovered(idle_writer):
    # The control: without the refresh the maintainer takes the region over.
    table, w = idle_writer
    other = mq.MemWalTable.open(table.uri)
    with _PausedHeartbeat(w) as paused:
        _stale(paused)
        got = recover_abandoned(other.catalog, ABANDONED_AFTER)
        assert [r.region_id for r in got] == [w.region_id] and got[0].generation == 1
        with pytest.raises(mq.FencedError):
            w.put(_basic_row(table, 101))
    assert 100 in other.to_table(consistency="strong")["id"].to_pylist()


def test_a_region_claimed_by_a_writer_while_it_is_recovered_is_left_to_that_writer(
    idle_writer,
):
    # The recovering writer is fenced by a new writer of the region between its claim and
    # its flush: recovery skips the region (no error), and the new writer replays the WAL.
    from memwal_query.write.writer import RegionWriter

    table, w = idle_writer
    other, third = mq.MemWalTable.open(table.uri), mq.MemWalTable.open(table.uri)
    claimed: list[mq.RegionWriter] = []

    def open_then_lose_the_region(region_id: str) -> mq.RegionWriter:
        recovering = RegionWriter(other.catalog, region_id)
        claimed.append(third.writer(region_id))
        return recovering

    with _PausedHeartbeat(w) as paused:
        _stale(paused)
        got = recover_abandoned(other.catalog, ABANDONED_AFTER, open_then_lose_the_region)
    assert got == [] and len(claimed) == 1
    (new,) = claimed
    new.put(_basic_row(table, 101))  # the region's writer now, not fenced
    new.close()
    ids = mq.MemWalTable.open(table.uri).to_table()["id"].to_pylist()
    assert ids.count(100) == 1 and ids.count(101) == 1


def test_a_table_fenced_by_recovery_claims_again_on_its_next_write(table):
    table.configure_writers(heartbeat_interval=0.02)
    table.write(_basic_row(table, 100))
    (w,) = table.writers()
    other = mq.MemWalTable.open(table.uri)
    with _PausedHeartbeat(w) as paused:
        _stale(paused)
        assert [r.region_id for r in recover_abandoned(other.catalog, ABANDONED_AFTER)] == [
            w.region_id
        ]
    table.write(_basic_row(table, 101))  # fenced: claims the region again, as after any fence
    assert table.writers()[0] is not w
    ids = other.to_table()["id"].to_pylist()
    assert 100 in ids and 101 in ids
    table.close()


def test_the_table_as_a_context_manager_flushes_its_writers(table):
    with mq.MemWalTable.open(table.uri) as t:
        t.write(_basic_row(t, 100))
    strong = mq.MemWalTable.open(table.uri).to_table(consistency="strong")
    assert 100 in strong["id"].to_pylist()
