"""Point lookup in MemTables through their key index, against brute-force models.

The index (``memkeys._MemKeyIndex``) is built per MemTable by batch identity; the
batches appended since it was last extended are scanned until lookups have scanned them
``memkeys.EXTEND_AFTER_SCANS`` times over, then indexed. Candidates found by key hash
are compared exactly and the last write of a key wins (a tombstone means "not found").
The model tests run with every appended batch indexed at once, never, and the default.
"""

from __future__ import annotations

import datetime as dt
import decimal
import gc
import math
import types

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format.schema import TOMBSTONE
from memwal_query.search import caches, memkeys, pointlookup
from memwal_query.search import keys as search_keys
from memwal_query.write.memtable import MemTable

from helpers import PK


def _init(tmp_path, schema: pa.Schema, base: pa.Table) -> mq.MemWalTable:
    uri = str(tmp_path / "base")
    lance.write_dataset(base, uri, schema=schema)
    return mq.MemWalTable.initialize(uri)


def _expected(model: dict, keys: list) -> list:
    """Found (key, value) pairs in the order of the keys' first occurrence."""
    seen, out = set(), []
    for k in keys:
        if k in seen:
            continue
        seen.add(k)
        if k in model:
            out.append((k, model[k]))
    return out


def _mem_index_of(t: mq.MemWalTable, region_id: str) -> memkeys._MemKeyIndex:
    (idx,) = [
        v
        for k, v in caches.MEMTABLE_KEY_INDEXES._items.items()
        if k[0] == t.uri and k[1] == region_id
    ]
    return idx


# every appended batch indexed at the next lookup, never (always scanned), the default
EXTEND_POLICIES = pytest.mark.parametrize(
    "extend_after",
    [1, 10**9, memkeys.EXTEND_AFTER_SCANS],
    ids=["index", "scan", "default"],
    indirect=True,
)


@pytest.fixture
def extend_after(request, monkeypatch):
    monkeypatch.setattr(memkeys, "EXTEND_AFTER_SCANS", request.param)
    return request.param


# ----------------------------------------------------------------------------------------
# Through real writers
# ----------------------------------------------------------------------------------------
@EXTEND_POLICIES
def test_int_keys_updates_deletes_many_batches_vs_model(tmp_path, extend_after):
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    base = pa.table({"id": np.arange(200), "v": -np.arange(200)}, schema=schema)
    t = _init(tmp_path, schema, base)
    model = {i: -i for i in range(200)}
    rng = np.random.default_rng(11)
    w = t.writer()
    try:
        for step in range(150):
            ks = rng.integers(0, 400, rng.integers(1, 20)).tolist()
            if rng.random() < 0.3:
                w.delete(pa.table({"id": pa.array(ks, pa.int64())}))
                for k in ks:
                    model.pop(k, None)
            else:
                vs = [step * 1000 + i for i in range(len(ks))]  # duplicates: last wins
                w.put(pa.table({"id": ks, "v": vs}, schema=schema))
                model.update(zip(ks, vs))
            if step % 7 == 0:  # lookups while the MemTable grows: incremental index
                probe = rng.integers(-5, 410, 9).tolist()
                got = t.lookup(probe, writers=[w])
                assert list(zip(got["id"].to_pylist(), got["v"].to_pylist())) == _expected(
                    model, probe
                )
                k = int(rng.integers(0, 400))
                got = t.lookup(pa.array([k], pa.int64()), writers=[w])
                assert got.to_pylist() == [{"id": k, "v": v} for _, v in _expected(model, [k])]
        # many keys at once (with repeats), and the same answers as a full read
        probe = np.concatenate([np.arange(-5, 420), rng.integers(0, 400, 300)])
        got = t.lookup(probe, writers=[w])
        assert list(zip(got["id"].to_pylist(), got["v"].to_pylist())) == _expected(
            model, probe.tolist()
        )
        scan = t.to_table(writers=[w])
        assert dict(zip(scan["id"].to_pylist(), scan["v"].to_pylist())) == model
        idx = _mem_index_of(t, w.region_id)
        rows = sum(m.num_rows for m in w.memtables())
        assert len(idx.runs) <= 2 * math.log2(rows) + 2  # runs are merged as they grow
    finally:
        w.close(flush=False)


@EXTEND_POLICIES
def test_composite_and_string_keys_vs_model(tmp_path, extend_after):
    schema = pa.schema(
        [
            pa.field("a", pa.int32(), False, PK),
            pa.field("b", pa.string(), False, PK),
            pa.field("v", pa.int64()),
        ]
    )
    words = ["", "x", "y", "héllo", "a'b", "long" * 30, "\u00ff\u0100"]
    base = pa.table({"a": [0, 1], "b": ["x", ""], "v": [1, 2]}, schema=schema)
    t = _init(tmp_path, schema, base)
    model = {(0, "x"): 1, (1, ""): 2}
    rng = np.random.default_rng(5)
    w = t.writer()
    try:
        for step in range(80):
            n = int(rng.integers(1, 8))
            a = rng.integers(0, 6, n).tolist()
            b = [words[i] for i in rng.integers(0, len(words), n)]
            if rng.random() < 0.3:
                w.delete(pa.table({"a": pa.array(a, pa.int32()), "b": b}))
                for k in zip(a, b):
                    model.pop(k, None)
            else:
                vs = [step * 100 + i for i in range(n)]
                w.put(pa.table({"a": a, "b": b, "v": vs}, schema=schema))
                model.update(zip(zip(a, b), vs))
            if step % 5 == 0:
                pa_ = rng.integers(0, 7, 6).tolist()
                pb = [words[i] for i in rng.integers(0, len(words), 6)]
                got = t.lookup(pa.table({"a": pa.array(pa_, pa.int32()), "b": pb}), writers=[w])
                found = [((r["a"], r["b"]), r["v"]) for r in got.to_pylist()]
                assert found == _expected(model, list(zip(pa_, pb)))
        keys = [(a, b) for a in range(7) for b in words]
        got = t.lookup(
            pa.table({"a": pa.array([k[0] for k in keys], pa.int32()), "b": [k[1] for k in keys]}),
            writers=[w],
        )
        assert [((r["a"], r["b"]), r["v"]) for r in got.to_pylist()] == _expected(model, keys)
    finally:
        w.close(flush=False)


UTC = dt.timezone.utc
KEY_TYPES = {
    "float64": (pa.float64(), [0.5, -1.0, float("inf"), float("nan"), 1e300, 2.25]),
    "timestamp_ns": (pa.timestamp("ns"), [1, 2, 1_000_000_001, -5, 7]),
    "timestamp_tz": (
        pa.timestamp("us", tz="UTC"),
        [dt.datetime(2024, 1, d, tzinfo=UTC) for d in range(1, 7)],
    ),
    "decimal": (pa.decimal128(10, 2), [decimal.Decimal(x) for x in ["1.10", "-0.5", "2", "3.33"]]),
    "uint64": (pa.uint64(), [2**63 + 5, 1, 2**64 - 1, 0]),
    "int16": (pa.int16(), [-3, 0, 7, 300]),
    "date32": (pa.date32(), [dt.date(2020, 1, d) for d in range(1, 6)]),
    "large_string": (pa.large_string(), ["a", "b'", "", "ccc"]),
    "fixed_binary": (pa.binary(3), [b"abc", b"\x00\x00\x00", b"xyz"]),
}


@pytest.mark.parametrize("name", list(KEY_TYPES))
def test_other_key_types_vs_model(tmp_path, name):
    key_type, values = KEY_TYPES[name]
    schema = pa.schema([pa.field("k", key_type, False, PK), pa.field("v", pa.int64())])
    base = pa.table({"k": pa.array(values[:1], key_type), "v": [-1]}, schema=schema)
    t = _init(tmp_path, schema, base)
    # the index spreads these keys over distinct hashes (not one bucket)
    h = search_keys._index_hashes(pa.table({"k": pa.array(values, key_type)}))
    assert len(set(h.tolist())) == len(values)

    canon = pa.array(values, key_type).to_pylist()  # as lookup results show them

    def index_of(x) -> int:  # NaN is one key
        if isinstance(x, float) and math.isnan(x):
            return next(i for i, c in enumerate(canon) if isinstance(c, float) and math.isnan(c))
        return canon.index(x)

    model = {0: -1}  # value index -> v
    rng = np.random.default_rng(3)
    w = t.writer()
    try:
        for step in range(30):
            pick = rng.integers(0, len(values), int(rng.integers(1, 4))).tolist()
            keys = pa.array([values[i] for i in pick], key_type)
            if rng.random() < 0.3:
                w.delete(pa.table({"k": keys}))
                for i in pick:
                    model.pop(i, None)
            else:
                vs = [step * 10 + j for j in range(len(pick))]
                w.put(pa.table({"k": keys, "v": vs}, schema=schema))
                model.update(zip(pick, vs))
            got = t.lookup(pa.array(values, key_type), writers=[w])
            found = {index_of(k): v for k, v in zip(got["k"].to_pylist(), got["v"].to_pylist())}
            assert found == model
    finally:
        w.close(flush=False)


@EXTEND_POLICIES
def test_hash_collisions_are_resolved_exactly(tmp_path, monkeypatch, extend_after):
    """With only 4 distinct hashes every lookup sees many candidates; keys still match."""
    real = search_keys.hash_keys
    for module in (search_keys, pointlookup):
        monkeypatch.setattr(module, "hash_keys", lambda keys: real(keys) % np.uint64(4))
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    t = _init(tmp_path, schema, pa.table({"id": [0], "v": [0]}, schema=schema))
    model = {0: 0}
    rng = np.random.default_rng(8)
    w = t.writer()
    try:
        for step in range(40):
            ks = rng.integers(0, 60, 5).tolist()
            if step % 4 == 3:
                w.delete(pa.table({"id": pa.array(ks, pa.int64())}))
                for k in ks:
                    model.pop(k, None)
            else:
                w.put(pa.table({"id": ks, "v": [step] * 5}, schema=schema))
                model.update(dict.fromkeys(ks, step))
            probe = list(range(-2, 62))
            got = t.lookup(probe, writers=[w])
            assert list(zip(got["id"].to_pylist(), got["v"].to_pylist())) == _expected(model, probe)
            k = int(rng.integers(0, 60))
            got = t.lookup([k], writers=[w])
            assert list(zip(got["id"].to_pylist(), got["v"].to_pylist())) == _expected(model, [k])
    finally:
        w.close(flush=False)


# ----------------------------------------------------------------------------------------
# MemTable objects directly: adopt reordering, old snapshots, replaced MemTables
# ----------------------------------------------------------------------------------------
MT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("v", pa.int64()),
        pa.field(TOMBSTONE, pa.bool_(), False),
    ]
)
KEY_SCHEMA = pa.schema([MT_SCHEMA.field("id")])


def _mt_rows(ids, vs, tomb=False) -> pa.Table:
    return pa.table(
        {"id": ids, "v": [None] * len(ids) if tomb else vs, TOMBSTONE: [tomb] * len(ids)},
        schema=MT_SCHEMA,
    )


def _via_index(uri: str, snap, keys: list[int]) -> dict:
    """{key: v or "deleted"} of the newest row of each key in a snapshot (the index)."""
    probe = pa.Table.from_arrays([pa.array(keys, pa.int64())], schema=KEY_SCHEMA)
    stub = types.SimpleNamespace(uri=uri)
    found = memkeys._memtable_lookup(
        stub, snap, probe, search_keys._index_hashes(probe), ["id", "v"]
    )
    if found is None:
        return {}
    rows, p = found
    out = {}
    for i, r in zip(p.tolist(), rows.to_pylist()):
        out[keys[i]] = "deleted" if r[TOMBSTONE] else r["v"]
    return out


def _brute(snap, keys: list[int]) -> dict:
    out = {}
    for r in snap.to_table().to_pylist():  # write order: last wins
        if r["id"] in keys:
            out[r["id"]] = "deleted" if r[TOMBSTONE] else r["v"]
    return out


def test_adopt_inserts_before_unsynced_rows():
    uri = "mem://adopt"
    mt = MemTable("r1", 1, MT_SCHEMA)
    mt.append(_mt_rows([1, 2], [10, 20]), wal_position=None)  # not in the WAL yet
    assert _via_index(uri, mt.snapshot(), [1, 2, 3]) == {1: 10, 2: 20}
    mt.adopt(_mt_rows([2, 3], [200, 300]), wal_position=5)  # goes before the unsynced rows
    snap = mt.snapshot()
    assert _via_index(uri, snap, [1, 2, 3]) == _brute(snap, [1, 2, 3]) == {1: 10, 2: 20, 3: 300}
    mt.append(_mt_rows([3], None, tomb=True), wal_position=None)
    snap = mt.snapshot()
    assert _via_index(uri, snap, [1, 2, 3]) == {1: 10, 2: 20, 3: "deleted"}


@EXTEND_POLICIES
def test_random_appends_adopts_and_old_snapshots_vs_brute_force(extend_after):
    uri = "mem://random"
    rng = np.random.default_rng(21)
    mt = MemTable("r2", 4, MT_SCHEMA)
    snaps = []
    pos = 0
    for step in range(120):
        ks = rng.integers(0, 50, int(rng.integers(1, 6))).tolist()
        tomb = bool(rng.random() < 0.25)
        rows = _mt_rows(ks, [step * 10 + i for i in range(len(ks))], tomb=tomb)
        op = rng.random()
        if op < 0.5:
            mt.append(rows, wal_position=None)
        elif op < 0.7:
            pos += 1
            mt.adopt(rows, wal_position=pos)
        elif op < 0.8:
            mt.begin_sync()
            pos += 1
            mt.append(rows, wal_position=pos)
            mt.end_sync(pos if rng.random() < 0.7 else None)
        else:
            pos += 1
            mt.append(rows, wal_position=pos)
        snaps.append(mt.snapshot())
        probe = sorted(set(rng.integers(-2, 52, 8).tolist()))
        # the newest snapshot, then an older one (index ahead of it, or reordered since)
        for snap in (snaps[-1], snaps[int(rng.integers(0, len(snaps)))], snaps[-1]):
            assert _via_index(uri, snap, probe) == _brute(snap, probe)
    snap = snaps[-1]
    everything = list(range(-2, 52))
    assert _via_index(uri, snap, everything) == _brute(snap, everything)


def test_growing_memtable_is_scanned_then_indexed():
    """Rows appended since the index was last extended are scanned by a lookup, not
    indexed, until lookups have scanned them EXTEND_AFTER_SCANS times over; then they
    are indexed, and the next rows are scanned again. Answers equal brute force."""
    uri = "mem://scanned"
    mt = MemTable("r5", 1, MT_SCHEMA)
    mt.append(_mt_rows(list(range(100)), list(range(100))), wal_position=1)
    key = (uri, "r5", 1, ("id",))
    for i in range(memkeys.EXTEND_AFTER_SCANS - 1):
        snap = mt.snapshot()
        assert _via_index(uri, snap, [3, 50, 200]) == _brute(snap, [3, 50, 200])
        idx = caches.MEMTABLE_KEY_INDEXES.get(key)
        assert idx.offsets[-1] == 0 and idx.scanned == 100 * (i + 1)  # scanned only
    assert _via_index(uri, mt.snapshot(), [3]) == {3: 3}
    assert idx.offsets[-1] == 100 and idx.scanned == 0  # indexed after enough scans
    mt.append(_mt_rows([3, 7], [30, 70]), wal_position=2)  # newer rows of indexed keys
    mt.append(_mt_rows([7], None, tomb=True), wal_position=3)
    snap = mt.snapshot()
    assert (
        _via_index(uri, snap, [3, 7, 9]) == _brute(snap, [3, 7, 9]) == {3: 30, 7: "deleted", 9: 9}
    )
    assert idx.offsets[-1] == 100 and idx.scanned == 3  # the new rows were scanned


@pytest.mark.slow
def test_replaced_memtable_of_same_generation_is_reindexed():
    """A new MemTable object (same table, region, generation) never reuses the index,
    even when its batches get the ids of the previous one's."""
    uri = "mem://replaced"
    for i in range(30):
        mt = MemTable("r3", 2, MT_SCHEMA)
        mt.append(_mt_rows([1, 2, 3], [i, i + 1, i + 2]), wal_position=i)
        snap = mt.snapshot()
        assert _via_index(uri, snap, [1, 2, 3]) == {1: i, 2: i + 1, 3: i + 2}
        del mt, snap
        gc.collect()


def test_memtable_rows_beyond_gather_limit():
    """Many found rows are taken from the concatenated batches (not sliced one by one)."""
    uri = "mem://many"
    mt = MemTable("r4", 1, MT_SCHEMA)
    for b in range(10):
        ids = list(range(b * 10, b * 10 + 10))
        mt.append(_mt_rows(ids, [b * 1000 + i for i in ids]), wal_position=b)
    mt.append(_mt_rows(list(range(0, 100, 3)), None, tomb=True), wal_position=11)
    snap = mt.snapshot()
    keys = list(range(-5, 105))
    assert _via_index(uri, snap, keys) == _brute(snap, keys)
    assert len(_brute(snap, keys)) > memkeys._MEM_KEYS_GATHER


# ----------------------------------------------------------------------------------------
# Small-input fast paths give the kernels' answers
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows_keys,probe",
    [
        ({"k": [1, 2, 3, 2]}, {"k": [2, 9, 1]}),
        ({"k": ["a", "", "b", "a"]}, {"k": ["a", "c", ""]}),
        ({"k": [b"\x00", b"x"]}, {"k": [b"x", b"\x00", b""]}),
        ({"a": [1, 1, 2], "b": ["x", "y", "x"]}, {"a": [1, 2, 2], "b": ["y", "x", "y"]}),
    ],
)
def test_match_keys_small_path_equals_kernels(monkeypatch, rows_keys, probe):
    left, right = pa.table(rows_keys), pa.table(probe)
    r, p = search_keys._match_keys(left, right)
    monkeypatch.setattr(search_keys, "_SMALL_MATCH", 0)
    r2, p2 = search_keys._match_keys(left, right)
    assert sorted(zip(r.tolist(), p.tolist())) == sorted(zip(r2.tolist(), p2.tolist()))
    assert r.dtype == r2.dtype == np.int64


def test_concurrent_lookups_while_writing(tmp_path):
    """Readers share one index while the writer appends; each key's answer is one of
    the values it had (the index never mixes up rows), and the end state is exact."""
    import threading

    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    t = _init(tmp_path, schema, pa.table({"id": [0], "v": [0]}, schema=schema))
    w = t.writer()
    history: dict[int, set] = {0: {0}}
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                k = int(rng.integers(0, 30))
                got = t.lookup([k], writers=[w]).to_pylist()
                assert len(got) <= 1
                if got:
                    assert got[0]["v"] in history[k]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    for k in range(30):
        history.setdefault(k, set())
    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    model = {0: 0}
    try:
        for step in range(60):
            ks = [int(x) for x in np.random.default_rng(step).integers(0, 30, 3)]
            vs = [step * 10 + i for i in range(3)]
            for k, v in zip(ks, vs):
                history[k].add(v)
            w.put(pa.table({"id": ks, "v": vs}, schema=schema))
            model.update(zip(ks, vs))
    finally:
        stop.set()
        for th in threads:
            th.join()
    try:
        assert not errors, errors[0]
        got = t.lookup(list(range(30)), writers=[w])
        assert dict(zip(got["id"].to_pylist(), got["v"].to_pylist())) == model
    finally:
        w.close(flush=False)
