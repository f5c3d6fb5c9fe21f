"""Hostile input, corrupt files, schema evolution and property tests over keys/values."""

import math
import os
import shutil

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_query as mq
from memwal_query import paths

from helpers import PK, basic_rows


def tree(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def test_missing_generation_dir_is_a_typed_error(table):
    w = table.writer()
    w.put(basic_rows([1000]))
    w.flush()
    gen = w.manifest().flushed_generations[0]
    w.close(flush=False)
    from memwal_query.sources import GENERATION_CACHE

    GENERATION_CACHE.clear()
    shutil.rmtree(paths.generation_path(table.uri, w.region_id, gen.path))
    with pytest.raises(mq.GenerationGoneError) as e:
        table.to_table()
    assert gen.path in str(e.value)


def test_region_ids_must_be_uuids(table):
    for bad in ["../../etc", "not-a-uuid", "", "00000000-0000-0000-0000-00000000000G"]:
        with pytest.raises(mq.InvalidPathError):
            table.writer(bad)
    # stray directories under _mem_wal are ignored, not read
    os.makedirs(os.path.join(table.uri, "_mem_wal", "..evil"), exist_ok=True)
    assert table.region_ids() == []


def test_schema_evolution_old_generations_read_as_null(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(basic_rows([1, 10], val=[-1.0, 10.0]))
    w.flush()
    w.close()
    ds = lance.dataset(uri)
    ds.add_columns({"extra": "CAST(NULL AS BIGINT)"})
    t2 = mq.MemWalTable.open(uri)
    got = {r["id"]: r for r in t2.to_table().to_pylist()}
    assert got[10]["extra"] is None and got[1]["val"] == -1.0
    w2 = t2.writer(w.region_id)
    w2.put(pa.table({"id": [11], "val": [1.0], "name": ["x"], "extra": [7]}))
    got = {r["id"]: r for r in t2.to_table(writers=[w2]).to_pylist()}
    assert got[11]["extra"] == 7 and got[10]["extra"] is None
    w2.flush()
    t2.merge()
    assert {r["id"]: r["extra"] for r in lance.dataset(uri).to_table().to_pylist()}[11] == 7
    w2.close(flush=False)


@pytest.mark.parametrize(
    "key_type, values",
    [
        (pa.string(), ["", "a", "ü" * 300, "x" * 5000, "\u0000z"]),
        (pa.float64(), [0.0, 1.5, -2.25, 1e300]),
        (pa.binary(), [b"", b"\x00", b"\xff" * 40]),
        (pa.date32(), None),
        (pa.int32(), [-(2**31), 0, 2**31 - 1]),
    ],
)
def test_key_types_round_trip(tmp_path, key_type, values):
    import datetime as dt

    if values is None:
        values = [dt.date(1970, 1, 1), dt.date(2026, 11, 22), dt.date(1900, 5, 5)]
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", key_type, False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(
        pa.table({"k": pa.array(values, key_type), "v": [0] * len(values)}, schema=schema), uri
    )
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"k": pa.array(values[:2], key_type), "v": [1, 1]}))
    w.put(pa.table({"k": pa.array(values[:1], key_type), "v": [2]}))
    w.flush()
    w.delete(pa.table({"k": pa.array(values[-1:], key_type)}))
    got = {r["k"]: r["v"] for r in t.to_table(writers=[w]).to_pylist()}
    want = {v: 0 for v in values}
    want[values[0]] = 2
    want[values[1]] = 1
    del want[values[-1]]
    assert got == want
    w.close()
    t.merge()
    got = {r["k"]: r["v"] for r in lance.dataset(uri).to_table().to_pylist()}
    assert got == want


HEALTH = HealthCheck.function_scoped_fixture
row = st.tuples(st.integers(-5, 5), st.one_of(st.none(), st.integers(-100, 100)))
batches = st.lists(st.lists(row, min_size=0, max_size=6), min_size=1, max_size=6)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=batches, deletes=st.lists(st.integers(-5, 5), max_size=4))
def test_duplicate_keys_empty_batches_nullable_values(tmp_path_factory, batches, deletes):
    uri = str(tmp_path_factory.mktemp("p") / "t")
    schema = pa.schema([pa.field("k", pa.int64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": [100], "v": [1]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    model = {100: 1}
    w = t.writer()
    for b in batches:
        w.put(pa.table({"k": [k for k, _ in b], "v": [v for _, v in b]}, schema=schema))
        for k, v in b:
            model[k] = v  # duplicates in one batch: the last one wins
    w.delete(pa.table({"k": pa.array(deletes, pa.int64())}))
    for k in deletes:
        model.pop(k, None)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    got = {r["k"]: r["v"] for r in ctx.sql("SELECT * FROM t").to_arrow_table().to_pylist()}
    assert got == model
    w.flush()
    t.merge()
    assert {r["k"]: r["v"] for r in t.to_table().to_pylist()} == model
    w.close(flush=False)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bad=st.sampled_from(
        [
            {"k": [None], "v": [1]},
            {"k": ["x"], "v": [1]},
            {"v": [1]},
            {"k": [1], "v": [1], "zzz": [1]},
            {"k": [1.5], "v": [1]},
            {"k": [2**70], "v": [1]},
        ]
    )
)
def test_rejected_input_leaves_table_unchanged(tmp_path_factory, bad):
    uri = str(tmp_path_factory.mktemp("h") / "t")
    schema = pa.schema([pa.field("k", pa.int64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": [1], "v": [1]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"k": [2], "v": [2]}, schema=schema))
    before = tree(uri)
    with pytest.raises(mq.MemWalError):
        try:
            data = pa.table(bad)
        except (pa.ArrowInvalid, OverflowError) as e:
            raise mq.SchemaError(str(e)) from e
        w.put(data)
    assert tree(uri) == before
    w.close(flush=False)


def test_nan_and_negative_zero_float_keys(tmp_path):
    """-0.0 and 0.0 are one key; NaN is a key equal to itself (as Lance's merge treats it)."""
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", pa.float64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": [1.0], "v": [0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"k": [0.0, math.nan], "v": [1, 1]}, schema=schema))
    w.put(pa.table({"k": [-0.0, math.nan], "v": [2, 2]}, schema=schema))
    rows = t.to_table(writers=[w]).to_pylist()
    zeros = [r for r in rows if r["k"] == 0.0]
    nans = [r for r in rows if r["k"] != r["k"]]
    assert [r["v"] for r in zeros] == [2]
    assert [r["v"] for r in nans] == [2]
    w.close(flush=False)
