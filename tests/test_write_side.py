"""Write-side correctness: one key lives in one region whatever API is used, upserts
never silently lose columns (partial updates are explicit), re-initializing does not
resurrect leftovers, writers apply backpressure, multi-region writes say what is
durable, and fenced writers of ``t.write`` claim their region again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
import uuid
import warnings

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

import memwal_query as mq
from memwal_query.cli.commands import main as cli_main
from memwal_query.regions.spec import bucket_spec
from memwal_query.storage import paths
from memwal_query.write import flush as flush_mod

from helpers import BASIC_SCHEMA, PK, basic_rows, pk_schema

HERE = os.path.dirname(os.path.abspath(__file__))


def sql_rows(t: mq.MemWalTable, writers=None, where: str = "") -> dict:
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=writers))
    got = ctx.sql(f"SELECT * FROM t {where}").to_arrow_table().to_pylist()
    return {r["id"]: r for r in got}


def region_dirs(uri: str) -> list[str]:
    root = os.path.join(uri, "_mem_wal")
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if not d.startswith("_"))


def wal_files(uri: str) -> int:
    return sum(
        len(os.listdir(os.path.join(uri, "_mem_wal", r, "wal")))
        for r in region_dirs(uri)
        if os.path.isdir(os.path.join(uri, "_mem_wal", r, "wal"))
    )


@pytest.fixture
def uri(tmp_path) -> str:
    u = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(10)), u)
    return u


# ----------------------------------------------------------------------------------------
# 1. a key lives in exactly one region
# ----------------------------------------------------------------------------------------
def test_default_spec_is_one_region_and_pylance_sees_it(uri):
    t = mq.MemWalTable.initialize(uri)
    assert t.region_spec.fields[0].transform == "unsharded"
    details = lance.dataset(uri).mem_wal_index_details()
    assert details["sharding_specs"][0]["fields"][0]["transform"] == "unsharded"
    assert t.catalog.lineage  # a fresh lineage token


def test_writer_without_arguments_claims_the_one_region_and_fences(uri):
    mq.MemWalTable.initialize(uri)
    a, b = mq.MemWalTable.open(uri), mq.MemWalTable.open(uri)
    wa = a.writer()
    wa.put(basic_rows([1], val=[10.0]))
    wb = b.writer()  # the same region: fences wa, replays its entry
    assert wb.region_id == wa.region_id
    with pytest.raises(mq.FencedError):
        wa.put(basic_rows([2], val=[20.0]))
    wb.put(basic_rows([1], val=[11.0]))
    wb.close()
    assert region_dirs(uri) == [wa.region_id]
    t = mq.MemWalTable.open(uri)
    assert sql_rows(t)[1]["val"] == 11.0
    assert t.lookup([1]).column("val").to_pylist() == [11.0]


def test_t_write_and_writer_share_the_region(uri):
    t = mq.MemWalTable.initialize(uri)
    written = t.write(basic_rows([1]))
    w = mq.MemWalTable.open(uri).writer()
    assert list(written) == [w.region_id]
    w.close()


def test_a_region_is_never_created_by_a_made_up_id(uri):
    t = mq.MemWalTable.initialize(uri)
    with pytest.raises(mq.RegionSpecError, match="there is no region"):
        t.writer(str(uuid.uuid4()))
    assert region_dirs(uri) == []


def test_wrong_region_rows_refused_without_writing(tmp_path):
    u = str(tmp_path / "b")
    ds = lance.write_dataset(basic_rows(range(10)), u)
    t = mq.MemWalTable.initialize(u, region_spec=bucket_spec(ds, "id", 4))
    values = t.region_spec.evaluate(basic_rows(range(10)), t.catalog.lance_schema).column(0)
    b0 = values[0].as_py()
    other = next(i for i in range(10) if values[i].as_py() != b0)
    w = t.writer(region_values={"bucket": b0})
    with pytest.raises(mq.WrongRegionError):
        w.put(basic_rows([0, other]))
    with pytest.raises(mq.WrongRegionError):
        w.put(basic_rows([other]), partial=True)
    assert wal_files(u) == 0
    with pytest.raises(mq.RegionSpecError, match="several regions"):
        t.writer()
    w.close()


def test_manual_region_of_an_older_table_is_recovery_only(tmp_path):
    """A pylance table without spec holds a manual region with unflushed rows: we can
    claim it to replay and flush it, but its new rows go to the routed region."""
    u = str(tmp_path / "m")
    lance.write_dataset(basic_rows(range(3)), u)
    lance.dataset(u).initialize_mem_wal()
    shard = str(uuid.uuid4())
    with lance.dataset(u).mem_wal_writer(shard) as nw:
        nw.put(basic_rows([1], val=[100.0]))
    t = mq.MemWalTable.open(u)
    assert t.region_spec is None
    w = t.writer(shard)
    with pytest.raises(mq.WrongRegionError, match="not a region of the table's region spec"):
        w.put(basic_rows([7]))
    w.close()  # flushes the replayed rows
    t.write(basic_rows([8], val=[8.5]))
    t.close()
    got = sql_rows(mq.MemWalTable.open(u))
    assert got[1]["val"] == 100.0 and got[8]["val"] == 8.5 and 7 not in got
    assert len(region_dirs(u)) == 2


# -- real processes ------------------------------------------------------------------------
DIM = 4


def proc_table(tmp_path) -> str:
    u = str(tmp_path / "p")
    vec = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(3 * DIM), pa.float32()), DIM)
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("val", pa.float64()),
            pa.field("name", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    base = pa.table(
        {"id": [1, 2, 3], "val": [0.0] * 3, "name": ["k1 v0", "k2 v0", "k3 v0"], "vec": vec},
        schema=schema,
    )
    ds = lance.write_dataset(base, u)
    ds.create_scalar_index("name", "INVERTED", name="name_idx")
    mq.MemWalTable.initialize(u, maintained_indexes=["name_idx"])
    return u


class Proc:
    """A real writer process (tests/proc_writer.py) driven over stdin."""

    def __init__(self, uri: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "proc_writer.py"), uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        assert self.read() == "ready"

    def read(self) -> str:
        line = self.p.stdout.readline().strip()
        assert line, f"writer process died (exit {self.p.poll()})"
        return line

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def cmd(self, line: str) -> str:
        self.send(line)
        out = self.read()
        assert out.startswith("ok"), out
        return out[2:].strip()

    def close(self) -> None:
        self.cmd("close")
        self.p.wait(timeout=60)


def agree(t: mq.MemWalTable, expected: dict[int, float]) -> None:
    """SQL, lookup, vector search and FTS all see exactly ``expected``."""
    got = sql_rows(t)
    assert {k: r["val"] for k, r in got.items()} == expected
    keys = sorted(expected)
    looked = t.lookup(keys)
    assert dict(zip(looked.column("id").to_pylist(), looked.column("val").to_pylist())) == (
        expected
    )
    for k, v in expected.items():
        hit = t.vector_search("vec", np.full(DIM, v, np.float32), k=len(expected))
        by_id = dict(zip(hit.column("id").to_pylist(), hit.column("val").to_pylist()))
        assert by_id[k] == v
        assert len(by_id) == len(expected)  # one version per key
        fts = t.fts_search("name", f"k{k}", k=10)
        assert fts.column("id").to_pylist() == [k]
        assert fts.column("val").to_pylist() == [v]


@pytest.mark.slow
def test_two_processes_writing_the_same_keys_in_turn(tmp_path):
    u = proc_table(tmp_path)
    a, b = Proc(u), Proc(u)
    try:
        a.cmd("write 1 1")
        b.cmd("write 1 2")  # claims the region: fences a's writer
        a.cmd("write 1 3")  # a's t.write claims it again and wins (later acknowledged)
        b.cmd("write 2 20")
        a.cmd("write 2 21")
        b.cmd("write 4 40")
        # the writer API: a second writer fences the first, which then fails loudly
        a.cmd("writer")
        b.cmd("writer")
        a.send("put 3 30")
        assert a.read().startswith("err FencedError")
        b.cmd("put 3 31")
    finally:
        a.close()
        b.close()
    assert len(region_dirs(u)) == 1
    agree(mq.MemWalTable.open(u), {1: 3.0, 2: 21.0, 3: 31.0, 4: 40.0})


@pytest.mark.slow
def test_two_processes_writing_the_same_keys_concurrently(tmp_path):
    u = proc_table(tmp_path)
    a, b = Proc(u), Proc(u)
    try:
        a.send("loop 10 12 100")
        b.send("loop 10 12 200")
        times_a = json.loads(a.read()[2:])
        times_b = json.loads(b.read()[2:])
    finally:
        a.close()
        b.close()
    t = mq.MemWalTable.open(u)
    got = {k: r["val"] for k, r in sql_rows(t).items()}
    assert sorted(got) == [1, 2, 3, *range(10, 22)]
    for i, k in enumerate(range(10, 22)):
        (sa, ea), (sb, eb) = times_a[i], times_b[i]
        if ea < sb:  # b's write began after a's was acknowledged: b's is later
            assert got[k] == 200.0
        elif eb < sa:
            assert got[k] == 100.0
        else:
            assert got[k] in (100.0, 200.0)
    expected = {k: got[k] for k in got}
    agree(t, expected)
    assert len(region_dirs(u)) == 1


# ----------------------------------------------------------------------------------------
# 2. upserts with missing columns
# ----------------------------------------------------------------------------------------
def test_missing_columns_are_refused_everywhere(uri):
    t = mq.MemWalTable.initialize(uri)
    w = mq.MemWalTable.open(uri).writer()
    partial_rows = pa.table({"id": [1], "val": [5.0]})
    for call in (lambda: w.put(partial_rows), lambda: t.write(partial_rows)):
        with pytest.raises(mq.SchemaError, match=r"\['name'\] are missing"):
            call()
    assert wal_files(uri) == 0
    w.close()
    assert sql_rows(t)[1]["name"] == "n1"


def test_explicit_nulls_are_still_written(uri):
    t = mq.MemWalTable.initialize(uri)
    t.write(pa.table({"id": [1], "val": [None], "name": [None]}, schema=BASIC_SCHEMA))
    t.close()
    assert sql_rows(t)[1]["name"] is None


def test_partial_updates_across_base_generations_and_memtables(uri):
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(basic_rows([2], val=[2.5], name=["gen"]))
    w.flush()  # key 2 in generation 1
    w.put(basic_rows([3], val=[3.5], name=["mem"]))  # key 3 in the MemTable
    w.delete(pa.table({"id": [4]}))
    w.put(pa.table({"id": [1, 2, 3, 4, 50], "val": [10.0, 20.0, 30.0, 40.0, 50.0]}), partial=True)
    w.put(pa.table({"id": [2], "name": ["renamed"]}), partial=True)
    got = sql_rows(t, writers=[w])
    assert {k: (r["val"], r["name"]) for k, r in got.items() if k in (1, 2, 3, 4, 50)} == {
        1: (10.0, "n1"),  # from the base
        2: (20.0, "renamed"),  # generation, then this writer's own partial row
        3: (30.0, "mem"),  # from the MemTable
        4: (40.0, None),  # deleted: a new key
        50: (50.0, None),  # new key
    }
    w.flush()
    t.maintenance.merge()
    t2 = mq.MemWalTable.open(uri)
    t2.write(pa.table({"id": [1], "name": ["after merge"]}), partial=True)
    assert sql_rows(t2, writers=t2.writers())[1] == {"id": 1, "val": 10.0, "name": "after merge"}
    w.close()


def test_partial_update_of_a_new_key_needs_non_nullable_columns(tmp_path):
    u = str(tmp_path / "nn")
    schema = pk_schema(pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.string()))
    lance.write_dataset(pa.table({"id": [1], "a": [1], "b": ["x"]}, schema=schema), u)
    t = mq.MemWalTable.initialize(u)
    t.write(pa.table({"id": [1], "b": ["y"]}), partial=True)  # existing key: a kept
    with pytest.raises(mq.SchemaError, match="'a' is missing from a partial update"):
        t.write(pa.table({"id": [1, 2], "b": ["z", "new"]}), partial=True)
    t.close()
    assert sql_rows(t) == {1: {"id": 1, "a": 1, "b": "y"}}


def test_partial_update_with_a_composite_key(tmp_path):
    u = str(tmp_path / "ck")
    schema = pa.schema(
        [
            pa.field("k1", pa.string(), False, PK),
            pa.field("k2", pa.int32(), False, PK),
            pa.field("a", pa.float64()),
            pa.field("b", pa.string()),
        ]
    )
    base = pa.table(
        {"k1": ["x", "x", "y"], "k2": [1, 2, 1], "a": [1.0, 2.0, 3.0], "b": list("pqr")}
    )
    lance.write_dataset(base.cast(schema), u)
    t = mq.MemWalTable.initialize(u)
    t.write(pa.table({"k1": ["x", "z"], "k2": [2, 9], "b": ["Q", "new"]}), partial=True)
    t.close()
    got = {(r["k1"], r["k2"]): (r["a"], r["b"]) for r in t.to_table().to_pylist()}
    assert got == {
        ("x", 1): (1.0, "p"),
        ("x", 2): (2.0, "Q"),
        ("y", 1): (3.0, "r"),
        ("z", 9): (None, "new"),
    }


def test_partial_update_waits_for_concurrent_puts_of_the_writer(uri):
    """Partial updates of one writer from many threads never lose each other's columns."""
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(basic_rows([1], val=[0.0], name=["start"]))

    def bump(i: int) -> None:
        w.put(pa.table({"id": [1], "val": [float(i)]}), partial=True)

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    w.put(pa.table({"id": [1], "name": ["renamed"]}), partial=True)
    for th in threads:
        th.join()
    row = sql_rows(t, writers=[w])[1]
    assert row["name"] == "renamed"
    w.close()


def test_cli_ingest_refuses_missing_columns_unless_partial(uri, tmp_path):
    import pyarrow.parquet as pq

    mq.MemWalTable.initialize(uri)
    f = str(tmp_path / "part.parquet")
    pq.write_table(pa.table({"id": [1, 77], "val": [9.0, 7.7]}), f)
    runner = CliRunner()
    res = runner.invoke(cli_main, ["ingest", uri, f])
    assert res.exit_code != 0 and "'name'" in res.output and "--partial" in res.output
    assert wal_files(uri) == 0
    res = runner.invoke(cli_main, ["ingest", uri, f, "--partial"])
    assert res.exit_code == 0, res.output
    got = sql_rows(mq.MemWalTable.open(uri))
    assert (got[1]["val"], got[1]["name"]) == (9.0, "n1")
    assert (got[77]["val"], got[77]["name"]) == (7.7, None)


# ----------------------------------------------------------------------------------------
# 3. re-initialize over leftovers
# ----------------------------------------------------------------------------------------
def test_initialize_over_leftovers_refuses_then_reset_removes(uri):
    t = mq.MemWalTable.initialize(uri)
    t.write(basic_rows([1], val=[111.0]))
    t.close()  # flushed: a generation in _mem_wal
    old = region_dirs(uri)
    lance.write_dataset(basic_rows([1, 2], val=[1.0, 2.0]), uri, mode="overwrite")
    with pytest.raises(mq.LeftoverRegionsError) as err:
        mq.MemWalTable.initialize(uri)
    assert err.value.regions == old and old[0] in str(err.value)
    assert region_dirs(uri) == old  # unchanged
    t2 = mq.MemWalTable.initialize(uri, reset=True)
    assert region_dirs(uri) == []
    assert {k: r["val"] for k, r in sql_rows(t2).items()} == {1: 1.0, 2: 2.0}


def test_cli_init_reset(uri):
    t = mq.MemWalTable.initialize(uri)
    t.write(basic_rows([1], val=[111.0]))
    t.close()
    lance.write_dataset(basic_rows([1], val=[1.0]), uri, mode="overwrite")
    schema_before = lance.dataset(uri).schema
    runner = CliRunner()
    res = runner.invoke(cli_main, ["init", uri, "--primary-key", "id"])
    assert res.exit_code != 0 and "--reset" in res.output
    assert lance.dataset(uri).schema == schema_before  # refused before touching the table
    res = runner.invoke(cli_main, ["init", uri, "--primary-key", "id", "--reset"])
    assert res.exit_code == 0, res.output
    assert {k: r["val"] for k, r in sql_rows(mq.MemWalTable.open(uri)).items()} == {1: 1.0}


def test_region_of_another_lineage_is_not_read_nor_claimed(tmp_path):
    old_uri, new_uri = str(tmp_path / "old"), str(tmp_path / "new")
    for u in (old_uri, new_uri):
        lance.write_dataset(basic_rows(range(3)), u)
    old = mq.MemWalTable.initialize(old_uri)
    old.write(basic_rows([1], val=[999.0]))
    old.close()
    new = mq.MemWalTable.initialize(new_uri)
    (region,) = region_dirs(old_uri)
    # e.g. restored from a backup, or written by a writer still running from before
    shutil.copytree(
        os.path.join(old_uri, "_mem_wal", region), os.path.join(new_uri, "_mem_wal", region)
    )
    new = mq.MemWalTable.open(new_uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sql_rows(new)[1]["val"] == 1.0
        assert new.lookup([1]).column("val").to_pylist() == [1.0]
    assert any("another lineage" in str(c.message) for c in caught)
    with pytest.raises(mq.LeftoverRegionsError):
        new.writer()


# ----------------------------------------------------------------------------------------
# 4. backpressure and bounded memory
# ----------------------------------------------------------------------------------------
@pytest.fixture
def held_flushes(monkeypatch):
    """Flushes wait until the returned event is set (real flushes then run)."""
    gate = threading.Event()
    real = flush_mod.write_generation

    def held(*args, **kwargs):
        gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(flush_mod, "write_generation", held)
    yield gate
    gate.set()


def test_backpressure_blocks_then_times_out_without_writing(uri, held_flushes):
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_wal_entries=1, max_unflushed_memtables=2, backpressure_timeout=0.2)
    w.put(basic_rows([1]))  # sealed; its flush is held
    w.put(basic_rows([2]))  # sealed, queued
    assert wal_files(uri) == 2
    with pytest.raises(mq.BackpressureError, match="max_unflushed_memtables=2"):
        w.put(basic_rows([3]))
    assert wal_files(uri) == 2  # not written, not acknowledged
    done = threading.Event()

    def put() -> None:
        w.backpressure_timeout = None
        w.put(basic_rows([4]))
        done.set()

    th = threading.Thread(target=put)
    th.start()
    assert not done.wait(0.3)  # blocked while no flush finishes
    held_flushes.set()
    th.join(60)
    assert done.is_set()
    w.close()
    assert sorted(sql_rows(t)) == list(range(10))


def test_unflushed_memtables_stay_bounded(uri, held_flushes):
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_wal_entries=1, max_unflushed_memtables=3)
    seen = []

    def writer_loop() -> None:
        for i in range(20):
            w.put(basic_rows([100 + i]))
            seen.append(len(w._sealed))

    th = threading.Thread(target=writer_loop)
    th.start()
    th.join(0.5)
    assert th.is_alive()  # blocked by backpressure
    held_flushes.set()
    th.join(60)
    assert max(seen) <= 3
    w.close()
    assert len(sql_rows(t)) == 30


def wait_for(predicate, timeout: float = 300.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_flush_by_wal_entry_count(uri):
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_wal_entries=5)
    for i in range(12):
        w.put(basic_rows([100 + i]))
    assert wait_for(lambda: len(w.stats.flushed_generations) == 2)
    assert w.manifest().replay_after_wal_entry_position == 10
    w.close()


def test_flush_by_age(uri):
    t = mq.MemWalTable.initialize(uri)
    w = t.writer(max_memtable_age=0.2)
    w.put(basic_rows([100]))
    assert wait_for(lambda: w.stats.flushed_generations == [1])
    assert w.unflushed_rows == 0
    w.close()


def test_flush_due_counts_the_replayed_wal_tail(uri):
    """A writer that replays a WAL tail counts its entries and rows toward the flush
    thresholds: writers living one batch each still flush by size."""
    t = mq.MemWalTable.initialize(uri)
    first = t.writer(max_wal_entries=3)
    first.put(basic_rows([100]))
    first.put(basic_rows([101]))
    first.close(flush=False)
    second = t.writer(max_wal_entries=3)
    assert second.flush_due() is None  # two entries replayed: not due, left in the WAL
    assert second.manifest().flushed_generations == ()
    ids = t.to_table(consistency="latest").column("id").to_pylist()
    assert {100, 101} <= set(ids)
    second.put(basic_rows([102]))  # the third write: due
    assert second.flush_due() == 1
    assert second.manifest().replay_after_wal_entry_position == 3
    assert second.flush_due() is None  # nothing left
    second.close(flush=False)


def test_flush_due_ages_replayed_rows_from_their_entry(uri, monkeypatch):
    """Rows replayed from the WAL are as old as their entry, not as the replay."""
    from memwal_query.format import wal as wal_mod

    t = mq.MemWalTable.initialize(uri)
    fresh = t.writer()
    fresh.put(basic_rows([100]))
    fresh.close(flush=False)
    reopened = t.writer(max_memtable_age=60)
    assert reopened.flush_due() is None  # a second-old entry: not due
    past = time.time() - 120
    monkeypatch.setattr(wal_mod, "time", types.SimpleNamespace(time=lambda: past))
    reopened.put(basic_rows([101]))  # an entry written "two minutes ago"
    reopened.close(flush=False)
    monkeypatch.undo()
    last = t.writer(max_memtable_age=60)
    assert last.unflushed_rows == 2
    assert last.flush_due() == 1  # the oldest replayed entry is 120 s old
    last.close(flush=False)


def test_a_handed_off_writer_is_not_recovered_before_abandoned_after(uri):
    """``close(flush=False, handoff=True)``: the region waits for its next writer, so
    maintenance recovers it only after ``abandoned_after``; a plain close is recovered
    at the next pass."""
    from memwal_query.maintain.recover import recover_abandoned

    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(basic_rows([100]))
    w.close(flush=False, handoff=True)
    assert recover_abandoned(t.catalog, 300.0) == []  # its last beat is fresh
    (got,) = recover_abandoned(t.catalog, 0.0)  # silent longer than 0 s: gone
    assert got.region_id == w.region_id and got.generation == 1
    w = t.writer()
    w.put(basic_rows([101]))
    w.close(flush=False)
    assert [r.region_id for r in recover_abandoned(t.catalog, 300.0)] == [w.region_id]


def test_writer_option_validation(uri):
    t = mq.MemWalTable.initialize(uri)
    for bad in ({"max_unflushed_memtables": 0}, {"max_wal_entries": 0}, {"max_memtable_age": 0}):
        with pytest.raises(ValueError):
            t.writer(**bad)


# ----------------------------------------------------------------------------------------
# 5./6. multi-region writes and fenced writers of t.write
# ----------------------------------------------------------------------------------------
def bucket_table(tmp_path) -> tuple[str, list[int], list[int]]:
    """A 2-bucket table; returns keys of bucket A and of bucket B."""
    u = str(tmp_path / "mb")
    ds = lance.write_dataset(basic_rows(range(20)), u)
    t = mq.MemWalTable.initialize(u, region_spec=bucket_spec(ds, "id", 2))
    b = t.region_spec.evaluate(basic_rows(range(20)), t.catalog.lance_schema).column(0).to_pylist()
    return u, [k for k in range(20) if b[k] == 0], [k for k in range(20) if b[k] == 1]


def test_multi_region_write_says_which_regions_are_durable(tmp_path):
    u, in_a, in_b = bucket_table(tmp_path)
    t = mq.MemWalTable.open(u)
    t.write(basic_rows([in_a[0], in_b[0]], val=[1.0, 1.0]))
    region_b = t.catalog.region_id_for({"bucket": 1})
    intruder = mq.MemWalTable.open(u).writer(region_values={"bucket": 1})  # fences t's
    t.fence_retries = 0
    with pytest.raises(mq.WriteIncompleteError) as err:
        t.write(basic_rows([in_a[0], in_b[0]], val=[2.0, 2.0]))
    assert list(err.value.errors) == [region_b]
    assert isinstance(err.value.errors[region_b], mq.FencedError)
    assert list(err.value.written) == [t.catalog.region_id_for({"bucket": 0})]
    intruder.close()
    t.fence_retries = 5
    assert sorted(t.write(basic_rows([in_a[0], in_b[0]], val=[3.0, 3.0])).values()) == [1, 1]
    t.close()
    got = sql_rows(mq.MemWalTable.open(u))
    assert (got[in_a[0]]["val"], got[in_b[0]]["val"]) == (3.0, 3.0)


def test_single_region_failure_raises_its_own_error(tmp_path):
    u, in_a, _ = bucket_table(tmp_path)
    t = mq.MemWalTable.open(u)
    t.write(basic_rows([in_a[0]]))
    mq.MemWalTable.open(u).writer(region_values={"bucket": 0}).close()
    t.fence_retries = 0
    with pytest.raises(mq.FencedError):
        t.write(basic_rows([in_a[1]]))


def test_fenced_t_write_claims_again_and_the_later_write_wins(tmp_path):
    u, in_a, _ = bucket_table(tmp_path)
    t = mq.MemWalTable.open(u)
    k = in_a[0]
    t.write(basic_rows([k], val=[1.0]))
    other = mq.MemWalTable.open(u)
    other.write(basic_rows([k], val=[2.0]))  # fences t's writer
    t.write(basic_rows([k], val=[3.0]))  # claims again: replays 2.0, then writes 3.0
    t.delete(pa.table({"id": [in_a[1]]}))
    other.write(basic_rows([k], val=[4.0]))
    other.close()
    t.close()
    got = sql_rows(mq.MemWalTable.open(u))
    assert got[k]["val"] == 4.0 and in_a[1] not in got


@pytest.mark.slow
def test_interrupted_ingest_reports_durable_rows_and_converges(uri, tmp_path):
    import pyarrow.parquet as pq

    mq.MemWalTable.initialize(uri)
    n = 40_000
    f = str(tmp_path / "big.parquet")
    pq.write_table(basic_rows(range(n)), f)
    # A real process (not CliRunner): the test sends it SIGTERM half-way through.
    cmd = [sys.executable, "-m", "memwal_query", "ingest", uri, f, "--buffer-rows", "20"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: wal_files(uri) >= 3 or p.poll() is not None)
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "rows are durable" in err
    durable = int(err.split("interrupted: ")[1].split(" of ")[0].replace(",", ""))
    assert 0 < durable < n
    res = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    t = mq.MemWalTable.open(uri)
    assert t.count_rows() == n
    assert t.lookup([n - 1]).column("val").to_pylist() == [float(n - 1)]


def test_pylance_region_paths_unchanged(uri):
    """The default region's id is derived (same in every process), its layout standard."""
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    assert w.region_id == mq.region_id_for(1, {"bucket": 0})
    assert os.path.isdir(paths.region_dir(uri, w.region_id))
    w.close()


def test_partial_update_must_give_the_columns_the_spec_reads(tmp_path):
    from memwal_query.regions.spec import expression_spec

    u = str(tmp_path / "ns")
    ds = lance.write_dataset(basic_rows(range(4)), u)
    spec = expression_spec(ds, ["name"], "length(col0) % 2", "int64", field_id="r")
    with pytest.warns(mq.RegionSpecWarning):
        t = mq.MemWalTable.initialize(u, region_spec=spec)
    with pytest.raises(mq.SchemaError, match=r"\['name'\] that region spec 1 reads"):
        t.write(pa.table({"id": [1], "val": [5.0]}), partial=True)
    w = t.writer(region_values={"r": 0})
    with pytest.raises(mq.SchemaError, match="reads"):
        w.put(pa.table({"id": [1], "val": [5.0]}), partial=True)
    w.close()
    assert wal_files(u) == 0


def test_puts_that_arrive_while_a_wal_write_runs_share_the_next_entry(uri):
    """Group commit: while one put's WAL entry is being written, the puts that arrive
    meanwhile wait, then go into ONE next entry; each returns only once its entry is
    written, and every row is then visible."""
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    real = w._wal.write_encoded
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def held(position, data):
        calls.append(position)
        if len(calls) == 1:
            entered.set()
            assert release.wait(60)
        return real(position, data)

    w._wal.write_encoded = held
    done: list[int] = []

    def put(i: int) -> None:
        w.put(basic_rows([i], val=[100.0 + i]))
        done.append(i)

    first = threading.Thread(target=put, args=(1,))
    first.start()
    assert entered.wait(60)  # put 1 is writing its entry
    others = [threading.Thread(target=put, args=(i,)) for i in (2, 3, 4)]
    for th in others:
        th.start()
    deadline = time.monotonic() + 60
    while len(w._pending) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(w._pending) == 3 and done == []  # queued behind the write, not acknowledged
    release.set()
    for th in [first, *others]:
        th.join(60)
    assert sorted(done) == [1, 2, 3, 4] and calls == [1, 2]  # two entries for four puts
    entries = list(w._wal.replay(0, w.epoch))
    assert [sorted(e.table.column("id").to_pylist()) for e in entries] == [[1], [2, 3, 4]]
    got = sql_rows(mq.MemWalTable.open(uri))
    assert {i: got[i]["val"] for i in (1, 2, 3, 4)} == {i: 100.0 + i for i in (1, 2, 3, 4)}
    w.close()


@pytest.mark.parametrize("composite", [False, True], ids=["one-key", "composite"])
@pytest.mark.parametrize("sign", [0.0, -0.0], ids=["zero", "negative-zero"])
def test_partial_update_of_a_float_key_keeps_the_values_whatever_the_zeros_sign(
    tmp_path, composite, sign
):
    # The base holds the key -0.0 (as create() stores it); -0.0 and 0.0 are one key, so
    # an update of either keeps the columns it does not give. NaN is one key too.
    cols: dict = {"k": [-0.0, 1.0, float("nan")], "v": [10, 20, 30], "s": list("abc")}
    update: dict = {"k": [sign, 1.0, float("nan")], "s": list("ABC")}
    pk = ["k"]
    if composite:
        cols["k2"] = update["k2"] = [7, 7, 7]
        pk = ["k", "k2"]
    t = mq.MemWalTable.create(str(tmp_path / "t"), pa.table(cols), primary_key=pk)
    t.write(pa.table(update), partial=True)
    t.close()
    rows = t.to_table().to_pylist()
    got = {"nan" if r["k"] != r["k"] else r["k"]: (r["v"], r["s"]) for r in rows}
    assert len(rows) == 3 and got == {0.0: (10, "A"), 1.0: (20, "B"), "nan": (30, "C")}
