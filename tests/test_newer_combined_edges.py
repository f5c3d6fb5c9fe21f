"""The combined newer view kept between reads, at its edges: region layouts other than
buckets (one region per key, ranges of keys, an expression), one region flushed while
another's MemTable changes, merges between reads, a writer's MemTables read in the
same process beside another reader's WAL tails, a table deleted and made again at the
same URI, two tables read in turn, and readers in threads sharing the caches. Every
answer is checked against a model (the newest row of each key) and against a reader
that starts with every cache empty.
"""

from __future__ import annotations

import shutil
import threading

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.regions.spec import expression_spec, identity_spec, truncate_spec

from helpers import basic_rows, clear_read_caches


def _spec(kind: str, ds: lance.LanceDataset) -> mq.RegionSpec | None:
    if kind == "identity":
        return identity_spec(ds.lance_schema, "id")
    if kind == "truncate":
        return truncate_spec(ds.lance_schema, "id", 40)
    if kind == "expression":
        return expression_spec(ds.lance_schema, ["id"], "col0 % 3", "int64", field_id="m")
    if kind == "unsharded":
        return None
    return mq.bucket_spec(ds.lance_schema, "id", 3)


def _make(uri: str, kind: str, base: range = range(60)) -> mq.MemWalTable:
    lance.write_dataset(basic_rows(base), uri)
    ds = lance.dataset(uri)
    spec = _spec(kind, ds)
    if spec is None:
        mq.MemWalTable.initialize(uri)
    else:
        mq.MemWalTable.initialize(uri, region_spec=spec)
    w = mq.MemWalTable.open(uri)
    w.configure_writers(max_memtable_age=1e9)
    return w


def _answer(t: mq.MemWalTable, **kw) -> dict[int, float]:
    got = t.to_table(consistency="latest", **kw)
    return dict(zip(got["id"].to_pylist(), got["val"].to_pylist(), strict=True))


def _sql(t: mq.MemWalTable) -> dict[int, float]:
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(consistency="latest"))
    got = ctx.sql("SELECT id, val FROM t").to_arrow_table()
    return dict(zip(got["id"].to_pylist(), got["val"].to_pylist(), strict=True))


@pytest.mark.parametrize(
    "kind",
    [pytest.param("identity", marks=pytest.mark.slow), "truncate", "expression", "unsharded"],
)
def test_live_reader_follows_writes_flushes_and_merges_in_any_layout(tmp_path, kind):
    clear_read_caches()
    uri = str(tmp_path / "t")
    w = _make(uri, kind)
    r = mq.MemWalTable.open(uri)  # another reader: WAL tails and generations
    rng = np.random.default_rng(11)
    model = {k: float(k) for k in range(60)}
    for step in range(7):
        keys = sorted({int(k) for k in rng.integers(0, 90, 12)})
        vals = [step * 1000.0 + k for k in keys]
        w.write(basic_rows(keys, vals))
        model.update(zip(keys, vals, strict=True))
        gone = sorted({int(k) for k in rng.integers(0, 90, 4)} - set(keys))
        if gone:
            w.delete(pa.table({"id": pa.array(gone, pa.int64())}))
            for k in gone:
                model.pop(k, None)
        writers = w._routed.writers()
        if step % 2 == 1 and writers:
            writers[int(rng.integers(0, len(writers)))].flush()  # one region only
        if step == 4:
            w.close(flush=True)
            r.maintenance.maintain()  # merged into the base between two reads
            w = mq.MemWalTable.open(uri)
            w.configure_writers(max_memtable_age=1e9)
        # the same keys written again with the same count of rows: other values
        again = keys[: max(1, len(keys) // 2)]
        w.write(basic_rows(again, [v + 0.5 for v in (model[k] for k in again)]))
        model.update({k: model[k] + 0.5 for k in again})
        for _ in range(2):  # a second read of unchanged sources (the kept view)
            assert _answer(r) == model, step
            assert r.count_rows(consistency="latest") == len(model)
            assert _answer(w) == model, step  # the writer's own MemTables
            assert _sql(r) == model
    w.close(flush=False)
    clear_read_caches()
    assert _answer(mq.MemWalTable.open(uri)) == model


def test_a_key_in_a_generation_of_one_region_and_the_memtable_of_another(tmp_path):
    """Keys deleted in one region's MemTable while the same keys of another region sit
    in generations: only each region's own rows decide its keys."""
    clear_read_caches()
    uri = str(tmp_path / "t")
    w = _make(uri, "truncate", range(0))
    w.write(basic_rows(range(0, 80), [1.0] * 80))  # regions [0,40) and [40,80)
    w.flush()
    r = mq.MemWalTable.open(uri)
    model = dict.fromkeys(range(80), 1.0)
    assert _answer(r) == model
    w.write(basic_rows(range(40, 60), [2.0] * 20))  # the second region's MemTable
    model.update(dict.fromkeys(range(40, 60), 2.0))
    assert _answer(r) == model
    w.delete(pa.table({"id": pa.array(range(0, 10), pa.int64())}))  # first region's
    for k in range(10):
        del model[k]
    assert _answer(r) == model
    assert r.count_rows(consistency="latest") == len(model)
    w._routed.writers()[0].flush()  # one region flushed, the other's MemTable unchanged
    assert _answer(r) == model
    w.write(basic_rows([5, 45], [3.0, 3.0]))
    model.update({5: 3.0, 45: 3.0})
    assert _answer(r) == model
    w.close(flush=False)


def test_a_table_made_again_at_the_same_uri_is_read_as_the_new_one(tmp_path):
    """One region (the same region id in every unsharded table), the same generation
    numbers, the same row counts: a reader opened on the new table reads only its rows."""
    clear_read_caches()
    uri = str(tmp_path / "t")
    answers = []
    for turn in range(2):
        w = _make(uri, "unsharded", range(20))
        w.write(basic_rows(range(10, 30), [100.0 * (turn + 1) + k for k in range(10, 30)]))
        w.flush()
        w.write(basic_rows(range(0, 5), [-1.0 * (turn + 1)] * 5))
        w.delete(pa.table({"id": pa.array([25], pa.int64())}))
        r = mq.MemWalTable.open(uri)
        model = {k: float(k) for k in range(20)}
        model.update({k: 100.0 * (turn + 1) + k for k in range(10, 30)})
        model.update(dict.fromkeys(range(5), -1.0 * (turn + 1)))
        del model[25]
        answers.append(_answer(r))
        assert answers[-1] == model, turn
        assert _answer(w) == model, turn
        assert r.count_rows(consistency="latest") == len(model)
        w.close(flush=False)
        shutil.rmtree(uri)
    assert answers[0] != answers[1]


def test_two_tables_read_in_turn_keep_their_own_views(tmp_path):
    clear_read_caches()
    ws, rs, models = [], [], []
    for i in range(2):
        uri = str(tmp_path / f"t{i}")
        w = _make(uri, "unsharded", range(30))
        w.write(basic_rows(range(20, 40), [float(i * 1000 + k) for k in range(20, 40)]))
        w.flush()
        w.write(basic_rows(range(0, 10), [float(i * 1000 - k) for k in range(10)]))
        model = {k: float(k) for k in range(30)}
        model.update({k: float(i * 1000 + k) for k in range(20, 40)})
        model.update({k: float(i * 1000 - k) for k in range(10)})
        ws.append(w)
        rs.append(mq.MemWalTable.open(uri))
        models.append(model)
    for _ in range(3):
        for i in (0, 1):
            assert _answer(rs[i]) == models[i]
            assert _answer(ws[i]) == models[i]
    for w in ws:
        w.close(flush=False)


def test_readers_in_threads_share_the_kept_views(tmp_path):
    """Readers of two tables in threads, while one table's writer adds rows: every
    answer is one the model held at some point (a prefix of the writes), never a mix
    or a missing key."""
    clear_read_caches()
    tables = []
    for i in range(2):
        uri = str(tmp_path / f"t{i}")
        w = _make(uri, "truncate", range(0))
        w.write(basic_rows(range(0, 120), [float(i)] * 120))
        w.flush()
        w.write(basic_rows(range(0, 120, 3), [float(i) + 0.5] * 40))
        tables.append((uri, w))
    # the states table 0 goes through: the value of key 0..119 after each round
    states = [{k: (0.5 if k % 3 == 0 else 0.0) for k in range(120)}]
    rounds = 8
    for n in range(rounds):
        s = dict(states[-1])
        s.update({k: 10.0 + n for k in range(n * 10, n * 10 + 10)})
        states.append(s)
    ok = [tuple(sorted(s.items())) for s in states]
    want1 = {k: (1.5 if k % 3 == 0 else 1.0) for k in range(120)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def read(uri: str, check) -> None:
        t = mq.MemWalTable.open(uri)
        try:
            while not stop.is_set():
                check(_answer(t))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            stop.set()

    def check0(got: dict[int, float]) -> None:
        assert tuple(sorted(got.items())) in ok

    def check1(got: dict[int, float]) -> None:
        assert got == want1

    threads = [
        threading.Thread(target=read, args=(tables[0][0], check0)),
        threading.Thread(target=read, args=(tables[0][0], check0)),
        threading.Thread(target=read, args=(tables[1][0], check1)),
    ]
    for th in threads:
        th.start()
    w0 = tables[0][1]
    try:
        for n in range(rounds):
            w0.write(basic_rows(range(n * 10, n * 10 + 10), [10.0 + n] * 10))
            if n % 4 == 3:
                w0._routed.writers()[n % len(w0._routed.writers())].flush()
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[0]
    assert tuple(sorted(_answer(mq.MemWalTable.open(tables[0][0])).items())) == ok[-1]
    for _, w in tables:
        w.close(flush=False)


WRITER = """
import sys, json
import numpy as np, pyarrow as pa
import memwal_query as mq
from helpers import basic_rows
w = mq.MemWalTable.open(sys.argv[1])
w.configure_writers(max_memtable_age=1e9)
for line in sys.stdin:
    op = json.loads(line)
    if op["do"] == "write":
        w.write(basic_rows(op["keys"], op["vals"]))
    elif op["do"] == "delete":
        w.delete(pa.table({"id": pa.array(op["keys"], pa.int64())}))
    elif op["do"] == "flush":
        ws = w._routed.writers()
        if ws:
            ws[op["which"] % len(ws)].flush()
    elif op["do"] == "merge":
        w.close(flush=True)
        w.maintenance.maintain()
        w = mq.MemWalTable.open(sys.argv[1])
        w.configure_writers(max_memtable_age=1e9)
    print("ok", flush=True)
w.close(flush=False)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bucket", "truncate"])
def test_a_reader_follows_a_writer_process(tmp_path, kind):
    """The writer in another process (the reader's MemTables are its WAL tails): after
    each acknowledged step the reader, keeping its caches, answers as the model."""
    import json
    import os
    import subprocess
    import sys

    clear_read_caches()
    uri = str(tmp_path / "t")
    _make(uri, kind).close(flush=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None
    r = mq.MemWalTable.open(uri)
    rng = np.random.default_rng(5)
    model = {k: float(k) for k in range(60)}

    def do(**op) -> None:
        child.stdin.write(json.dumps(op) + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"

    try:
        for step in range(14):
            keys = sorted({int(k) for k in rng.integers(0, 100, 10)})
            vals = [step * 100.0 + k for k in keys]
            do(do="write", keys=keys, vals=vals)
            model.update(zip(keys, vals, strict=True))
            if step % 3 == 2:
                gone = sorted({int(k) for k in rng.integers(0, 100, 3)})
                do(do="delete", keys=gone)
                for k in gone:
                    model.pop(k, None)
            if step % 2:
                do(do="flush", which=int(rng.integers(0, 8)))
            if step == 9:
                do(do="merge")
            assert _answer(r) == model, step
            assert r.count_rows(consistency="latest") == len(model), step
            assert _answer(r) == model, step  # unchanged sources: the kept view
    finally:
        child.stdin.close()
        child.wait(timeout=60)


@pytest.mark.parametrize("kind", ["unsharded", "bucket"])
def test_keys_at_the_ends_of_int64(tmp_path, kind):
    """Keys at both ends of int64 in generations and MemTables (the own-region flags
    over the MemTable keys' range, and keys outside it)."""
    clear_read_caches()
    uri = str(tmp_path / "t")
    lo, hi = -(2**63), 2**63 - 1
    w = _make(uri, kind, range(0))
    ends = [lo, lo + 1, lo + 7, -1, 0, 1, hi - 7, hi - 1, hi]
    w.write(basic_rows(ends, [1.0] * len(ends)))
    w.flush()
    r = mq.MemWalTable.open(uri)
    model = dict.fromkeys(ends, 1.0)
    for keys, v in (([lo, lo + 7], 2.0), ([hi, hi - 7], 3.0), ([lo + 1, hi - 1, 0], 4.0)):
        w.write(basic_rows(keys, [v] * len(keys)))
        model.update(dict.fromkeys(keys, v))
        assert _answer(r) == model
        assert _answer(r) == model
    w.delete(pa.table({"id": pa.array([lo, hi, -1], pa.int64())}))
    for k in (lo, hi, -1):
        del model[k]
    assert _answer(r) == model
    assert r.count_rows(consistency="latest") == len(model)
    w.close(flush=False)


@pytest.mark.parametrize("to", ["bucket", "truncate"])
def test_keys_move_regions_under_a_live_reader(tmp_path, to):
    """A reader keeps its views while the region spec changes (old regions sealed and
    merged, keys written again to other regions, flushed there): each of its answers
    is the model's."""
    clear_read_caches()
    uri = str(tmp_path / "t")
    w = _make(uri, "bucket")
    r = mq.MemWalTable.open(uri)
    model = {k: float(k) for k in range(60)}
    w.write(basic_rows(range(30, 90), [1.0] * 60))
    w._routed.writers()[0].flush()
    w.delete(pa.table({"id": pa.array([31, 32], pa.int64())}))
    model.update(dict.fromkeys(range(30, 90), 1.0))
    del model[31], model[32]
    assert _answer(r) == model
    ds = lance.dataset(uri)
    spec = (
        mq.bucket_spec(ds.lance_schema, "id", 5, spec_id=2)
        if to == "bucket"
        else truncate_spec(ds.lance_schema, "id", 25, spec_id=2)
    )
    w.maintenance.set_region_spec(spec)
    assert _answer(r) == model
    for n, keys in enumerate((range(25, 45), range(40, 70), [31, 5, 89])):
        w.write(basic_rows(keys, [10.0 + n] * len(keys)))
        model.update(dict.fromkeys(keys, 10.0 + n))
        assert _answer(r) == model, n
        w._routed.writers()[n % len(w._routed.writers())].flush()
        assert _answer(r) == model, n
        assert _answer(w) == model, n
    w.delete(pa.table({"id": pa.array([40, 41], pa.int64())}))
    del model[40], model[41]
    assert _answer(r) == model
    assert r.count_rows(consistency="latest") == len(model)
    w.close(flush=False)
    clear_read_caches()
    assert _answer(mq.MemWalTable.open(uri)) == model
