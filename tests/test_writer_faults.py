"""Writer under faults: fencing after GC, adopted WAL entries, in-doubt and failed WAL
writes, hostile WAL entries, background flush failures. Real Lance tables on disk; the
only stand-ins inject a storage failure (or run a second writer at a chosen moment)."""

import datetime as dt
import time

import pyarrow as pa
import pytest

import memwal_query as mq
import memwal_query.write.flush as flush_mod
from memwal_query.exceptions import StorageError
from memwal_query.format.schema import storage_schema, with_tombstone
from memwal_query.format.wal import Wal, encode_entry
from memwal_query.storage import paths
from memwal_query.write.memtable import MemTable

from helpers import BASIC_SCHEMA, basic_rows


def live(t: mq.MemWalTable, writers=None, **kw) -> dict[int, tuple]:
    rows = t.to_table(writers=writers, **kw).to_pylist()
    return {r["id"]: (r["val"], r["name"]) for r in rows}


def wal_of(t: mq.MemWalTable, region_id: str) -> Wal:
    return Wal(t.catalog.io, paths.wal_dir(t.uri, region_id), region_id)


def wait_until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def fail_wal_writes(monkeypatch, t: mq.MemWalTable, state: dict, store_first: bool = False):
    """WAL writes fail while ``state["fail"]`` (> 0 counts down, True stays on).

    ``store_first``: the object is stored, then the call fails (an in-doubt write,
    e.g. a timeout after the request reached the store).
    """
    orig = t.catalog.io.put_if_not_exists

    def put_if_not_exists(path, data):
        if path.endswith(".arrow") and state["fail"]:
            if not isinstance(state["fail"], bool):
                state["fail"] -= 1
            if store_first:
                orig(path, data)
            raise StorageError(f"{path}: injected failure")
        return orig(path, data)

    monkeypatch.setattr(t.catalog.io, "put_if_not_exists", put_if_not_exists)


# -- W1: fencing checked before a put is acknowledged ----------------------------------------
def test_fenced_put_into_garbage_collected_wal_slot_is_not_acknowledged(table):
    a = table.writer()  # epoch 1
    b = table.writer(a.region_id)  # epoch 2; a does not know yet
    b.put(basic_rows([100]))  # WAL position 1
    b.flush()  # replay_after = 1
    b.close()
    table.maintenance.merge()
    removed = table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    assert wal_of(table, a.region_id).path(1) in removed  # position 1 is free again
    with pytest.raises(mq.FencedError):
        a.put(basic_rows([555], val=[5.55]))  # lands at position 1: must not be acked
    with pytest.raises(mq.FencedError):
        a.put(basic_rows([556]))
    with pytest.raises(mq.FencedError):
        a.flush()
    c = table.writer(a.region_id)
    view = live(table, [c])
    assert 100 in view and 555 not in view
    c.close()


def test_own_flushes_do_not_fence_the_writer(table):
    w = table.writer(max_memtable_rows=4)
    for i in range(12):  # three background flushes commit manifest versions meanwhile
        w.put(basic_rows([1000 + i]))
    w.flush()
    assert w.manifest().writer_epoch == w.epoch
    w.put(basic_rows([2000]))  # a version it did not see commit: its own, fine
    w.close()
    assert all(k in live(table) for k in [*range(1000, 1012), 2000])


# -- W2: non-durable writer adopts an entry in WAL order ---------------------------------------
def test_non_durable_adopted_entry_goes_before_unsynced_rows(table):
    a = table.writer()  # epoch 1, durable
    b = table.writer(a.region_id, durable=False, wal_flush_interval=3600)  # epoch 2
    b.put(basic_rows([7], val=[2.0], name=["from B"]))  # buffered, not in the WAL
    try:  # stored at position 1 (then a learns it is fenced: not acknowledged)
        a.put(basic_rows([7], val=[1.0], name=["from A"]))
    except mq.FencedError:
        pass
    b.sync()  # position 1 is taken: adopts a's entry, writes its own at 2
    wal = wal_of(table, b.region_id)
    assert [wal.read(p).table.column("name").to_pylist() for p in (1, 2)] == [
        ["from A"],
        ["from B"],
    ]
    assert b.stats.adopted_entries == 1
    # Read-your-writes and a flush agree with replay (WAL order): B's write is newest.
    assert [e.position for e in wal.replay(0, b.epoch)] == [1, 2]
    assert live(table, [b])[7] == (2.0, "from B")
    assert b.flush() == 1
    b.close()
    assert live(table)[7] == (2.0, "from B")


def test_memtable_adopt_keeps_wal_order():
    schema = storage_schema(BASIC_SCHEMA)

    def rows(i):
        return with_tombstone(basic_rows([i]), False).cast(schema)

    m = MemTable("r", 1, schema)
    m.append(rows(1), 1)  # in the WAL
    m.append(rows(2), None)  # buffered
    m.begin_sync()  # a sync writes row 2 ...
    m.append(rows(3), None)  # ... while row 3 is put
    m.adopt(rows(4), 2)  # someone's entry at position 2: before row 2
    m.end_sync(3)  # row 2 landed at 3; row 3 still buffered
    m.adopt(rows(5), 4)  # next adopted entry: before row 3
    assert m.to_table().column("id").to_pylist() == [1, 4, 2, 5, 3]
    assert (m.first_wal_position, m.last_wal_position) == (1, 4)
    m.begin_sync()
    m.end_sync(5)
    m.adopt(rows(6), 6)  # nothing buffered: at the end
    assert m.to_table().column("id").to_pylist() == [1, 4, 2, 5, 3, 6]


# -- W3: non-durable failed WAL write keeps the rows buffered ----------------------------------
def test_non_durable_failed_sync_keeps_rows_buffered(table, monkeypatch):
    w = table.writer(durable=False, wal_flush_interval=3600)
    state = {"fail": 1}
    fail_wal_writes(monkeypatch, table, state)
    w.put(basic_rows([1001]))
    with pytest.raises(StorageError):
        w.sync()
    w.put(basic_rows([1002]))
    w.sync()  # must write 1001 too
    w.close(flush=False)  # "crash": the next writer replays the WAL
    w2 = mq.MemWalTable.open(table.uri).writer(w.region_id)
    view = live(table, [w2])
    assert 1001 in view and 1002 in view
    w2.close(flush=False)


def test_non_durable_background_sync_error_surfaces_and_ticker_survives(table, monkeypatch):
    w = table.writer(durable=False, wal_flush_interval=0.05)
    state = {"fail": True}
    fail_wal_writes(monkeypatch, table, state)
    w.put(basic_rows([1001]))
    wait_until(lambda: w.stats.wal_write_errors >= 2)  # retried after the first failure
    assert w._ticker.is_alive()
    with pytest.raises(StorageError):
        w.put(basic_rows([1002]))  # the background error, raised before writing anything
    assert 1002 not in live(table, [w]) and 1001 in live(table, [w])
    state["fail"] = False
    w.sync()
    w.put(basic_rows([1003]))
    wait_until(lambda: wal_of(table, w.region_id).exists(2))  # the ticker still works
    w2 = mq.MemWalTable.open(table.uri).writer(w.region_id)
    view = live(table, [w2])
    assert 1001 in view and 1003 in view and 1002 not in view
    w2.close(flush=False)


# -- W4: an in-doubt WAL write does not fence the writer ---------------------------------------
@pytest.mark.parametrize("durable", [True, False])
def test_in_doubt_wal_write_is_adopted_not_self_fencing(table, monkeypatch, durable):
    w = table.writer(durable=durable, wal_flush_interval=3600)
    state = {"fail": 0}
    fail_wal_writes(monkeypatch, table, state, store_first=True)
    w.put(basic_rows([1], val=[1.0]))
    state["fail"] = 1
    with pytest.raises(StorageError):  # stored, but the writer can't know
        w.put(basic_rows([1], val=[1.5])) if durable else w.sync()
    w.put(basic_rows([2], val=[2.0]))
    w.sync()
    assert w.stats.adopted_entries == 1
    view = live(table, [w])
    assert view[1] == (1.5 if durable else 1.0, "n1") and view[2] == (2.0, "n2")
    w.close(flush=False)
    w2 = mq.MemWalTable.open(table.uri).writer(w.region_id)
    assert live(table, [w2]) == view  # replay agrees with the writer's MemTable
    w2.close()
    assert live(table) == view  # and so does the flush


# -- W5: hostile WAL entries -------------------------------------------------------------------
GOOD = with_tombstone(basic_rows([1]), False)


def _with_meta(key: bytes, value: bytes) -> bytes:
    t = pa.ipc.open_stream(encode_entry(GOOD, 1, 1)).read_all()
    t = t.replace_schema_metadata({**t.schema.metadata, key: value})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


HOSTILE = {
    "generation not an integer": lambda: _with_meta(b"generation", b"x"),
    "num_rows not an integer": lambda: _with_meta(b"num_rows", b"x"),
    "epoch not an integer": lambda: _with_meta(b"writer_epoch", b"-1"),
    "no primary-key column": lambda: encode_entry(
        pa.table({"val": [1.0], "name": ["x"], "_tombstone": [False]}), 1, 1
    ),
    "NULL primary key": lambda: encode_entry(
        pa.table(
            {"id": pa.array([None], pa.int64()), "val": [1.0], "name": ["x"], "_tombstone": [False]}
        ),
        1,
        1,
    ),
    "string primary key": lambda: encode_entry(
        pa.table({"id": ["5"], "val": [1.0], "name": ["x"], "_tombstone": [False]}), 1, 1
    ),
    "NULL _tombstone": lambda: encode_entry(
        pa.table({"id": [5], "val": [1.0], "_tombstone": pa.array([None], pa.bool_())}), 1, 1
    ),
    "_tombstone not bool": lambda: encode_entry(
        pa.table({"id": [5], "val": [1.0], "_tombstone": [0]}), 1, 1
    ),
    "uncastable value": lambda: encode_entry(
        pa.table({"id": [5], "val": ["abc"], "_tombstone": [False]}), 1, 1
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_wal_entry_on_replay_is_a_typed_error(table, case):
    w = table.writer()
    w.close()
    wal = wal_of(table, w.region_id)
    table.catalog.io.put_if_not_exists(wal.path(1), HOSTILE[case]())
    with pytest.raises(mq.WalCorruptError) as e:
        table.writer(w.region_id)
    assert wal.path(1) in str(e.value)


@pytest.mark.parametrize("case", ["NULL primary key", "string primary key"])
def test_hostile_wal_entry_at_next_position_is_a_typed_error(table, case):
    w = table.writer()
    wal = wal_of(table, w.region_id)
    table.catalog.io.put_if_not_exists(wal.path(1), HOSTILE[case]())  # "an older writer's" entry
    with pytest.raises(mq.WalCorruptError) as e:
        w.put(basic_rows([1]))
    assert wal.path(1) in str(e.value)
    assert live(table, [w]) == live(table, consistency="strong")  # nothing was applied
    with pytest.raises(mq.WalCorruptError) as e:  # a default reader reads the WAL
        live(table)
    assert wal.path(1) in str(e.value)
    w.close(flush=False)


# -- W7: background flush failures -------------------------------------------------------------
def flaky_flush(monkeypatch, failures: int) -> dict:
    state = {"fail": failures}
    orig = flush_mod.write_generation

    def write_generation(*args, **kwargs):
        if state["fail"]:
            state["fail"] -= 1
            raise OSError("injected: transient store error")
        return orig(*args, **kwargs)

    monkeypatch.setattr(flush_mod, "write_generation", write_generation)
    return state


def flushed(w) -> list[int]:
    return [g.generation for g in w.manifest().flushed_generations]


def test_background_flush_failure_is_surfaced_once_and_retried(table, monkeypatch):
    flaky_flush(monkeypatch, 1)
    w = table.writer(max_memtable_rows=3)
    w.put(basic_rows([101, 102, 103]))  # seals generation 1; its flush fails
    wait_until(lambda: w.stats.flush_errors == 1 and not w._flush_active)
    with pytest.raises(OSError, match="injected"):
        w.put(basic_rows([201]))  # raised once, before writing anything
    wait_until(lambda: flushed(w) == [1])  # retried without a flush() call
    w.put(basic_rows([201, 202, 203]))  # seals generation 2: flushed in the background
    wait_until(lambda: w.stats.flushed_generations == [1, 2])
    assert flushed(w) == [1, 2]
    assert w.flush() is None  # nothing left, no stale error
    w.close()
    view = live(table)
    assert all(k in view for k in (101, 102, 103, 201, 202, 203))


def test_flush_retries_and_does_not_raise_a_resolved_error(table, monkeypatch):
    flaky_flush(monkeypatch, 1)
    w = table.writer(max_memtable_rows=3)
    w.put(basic_rows([101, 102, 103]))
    wait_until(lambda: w.stats.flush_errors == 1 and not w._flush_active)
    assert w.flush() == 1  # retries generation 1 itself
    w.put(basic_rows([104]))  # the error was resolved: not raised later
    assert w.flush() == 2
    w.close()


def test_flush_raises_when_its_own_attempt_fails(table, monkeypatch):
    flaky_flush(monkeypatch, 2)
    w = table.writer()
    w.put(basic_rows([1]))
    with pytest.raises(OSError, match="injected"):
        w.flush()
    w.put(basic_rows([2]))  # flush() reported the error: not raised again
    with pytest.raises(OSError, match="injected"):
        w.flush()
    assert w.flush() == 2  # generations 1 (retried) and 2
    w.close()


def test_flush_raises_a_failure_of_the_drain_it_started_before_it_waits(table, monkeypatch):
    """flush() seals and starts the drain; when that drain fails before flush() looks at
    the outcome, flush() still raises it (it does not wipe it and retry quietly)."""
    flaky_flush(monkeypatch, 1)
    w = table.writer()
    w.put(basic_rows([1]))
    real_seal = w._seal

    def seal_then_let_the_drain_finish(force: bool) -> None:
        real_seal(force)
        wait_until(lambda: not w._flush_active)

    monkeypatch.setattr(w, "_seal", seal_then_let_the_drain_finish)
    with pytest.raises(OSError, match="injected"):
        w.flush()
    monkeypatch.setattr(w, "_seal", real_seal)
    assert w.flush() == 1  # retried
    w.close()


def test_background_fencing_keeps_the_fenced_error_type(table, monkeypatch):
    orig = flush_mod.write_generation
    w = table.writer(max_memtable_rows=2)
    other = {}

    def write_generation(*args, **kwargs):
        if not other:
            other["writer"] = table.writer(w.region_id)  # claims meanwhile
        return orig(*args, **kwargs)

    monkeypatch.setattr(flush_mod, "write_generation", write_generation)
    w.put(basic_rows([1, 2]))  # acknowledged; seals; the background flush is fenced
    wait_until(lambda: w._failed is not None)
    with pytest.raises(mq.FencedError):
        w.put(basic_rows([3]))
    with pytest.raises(mq.FencedError):
        w.sync()
    with pytest.raises(mq.FencedError):
        w.flush()
    w.close()  # fenced: nothing to do, no error
    newer = other["writer"]
    assert 1 in live(table, [newer]) and 2 in live(table, [newer])
    newer.close()


def gen_dirs(t: mq.MemWalTable, region_id: str) -> set[str]:
    """Generation directories present under the region directory."""
    return {n for n in t.catalog.io.list(paths.region_dir(t.uri, region_id)) if "_gen_" in n}


def test_failed_flush_leaves_unreferenced_dir_and_retry_uses_new_prefix(table, monkeypatch):
    import memwal_query.storage.crashpoints as crashpoints

    orig = crashpoints.point
    state = {"fail": 1}

    def point(name: str) -> None:
        if name == "flush.mid" and state["fail"]:
            state["fail"] -= 1  # the generation's Lance table is written, then this fails
            raise OSError("injected: store error mid-flush")
        orig(name)

    monkeypatch.setattr(crashpoints, "point", point)
    w = table.writer()
    w.put(basic_rows([101, 102]))
    with pytest.raises(OSError, match="mid-flush"):
        w.flush()
    (orphan,) = gen_dirs(table, w.region_id)
    assert orphan.endswith("_gen_1") and flushed(w) == []  # written, referenced by nobody
    assert w.flush() == 1  # the retry
    (ref,) = w.manifest().flushed_generations
    assert ref.path.endswith("_gen_1") and ref.path != orphan  # a new random prefix
    assert gen_dirs(table, w.region_id) == {orphan, ref.path}
    w.close()
    view = live(table)
    assert 101 in view and 102 in view


KILLED_FLUSH = """
import sys, pyarrow as pa, memwal_query as mq
t = mq.MemWalTable.open(sys.argv[1])
w = t.writer()
assert w.region_id == sys.argv[2]
w.put(pa.table({"id": pa.array([501, 502], pa.int64()), "val": [1.0, 2.0], "name": ["a", "b"]}))
w.flush()  # MEMWAL_CRASH_AT=flush.mid: SIGKILL after the Lance table is written
"""


def test_flush_killed_midway_is_retried_by_next_writer_under_new_prefix(table):
    import os
    import signal
    import subprocess
    import sys

    from helpers import default_region

    region = default_region()
    env = {**os.environ, "MEMWAL_CRASH_AT": "flush.mid"}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_FLUSH, table.uri, region], env=env, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    (orphan,) = gen_dirs(table, region)
    w = table.writer(region)  # replays the acknowledged put from the WAL
    assert not w.manifest().flushed_generations and w.stats.replayed_rows == 2
    assert w.flush() == 1
    (ref,) = w.manifest().flushed_generations
    assert ref.path != orphan and ref.path.endswith("_gen_1")
    w.close()
    view = live(table)
    assert view[501] == (1.0, "a") and view[502] == (2.0, "b")
