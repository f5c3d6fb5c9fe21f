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
from memwal_query.storage import paths

from helpers import PK, basic_rows


def tree(path):
    """Every file (with its bytes) and directory under ``path``."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = None
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
    from memwal_query.read.sources import GENERATION_CACHE

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
    assert table.catalog.region_ids() == []


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
    t2.maintenance.merge()
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
    t.maintenance.merge()
    got = {r["k"]: r["v"] for r in lance.dataset(uri).to_table().to_pylist()}
    assert got == want


HEALTH = HealthCheck.function_scoped_fixture
row = st.tuples(st.integers(-5, 5), st.one_of(st.none(), st.integers(-100, 100)))
batches = st.lists(st.lists(row, min_size=0, max_size=6), min_size=1, max_size=6)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=batches, deletes=st.lists(st.integers(-5, 5), max_size=4))
@pytest.mark.slow
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
    t.maintenance.merge()
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


# -- property test over key types, values and schema evolution ------------------------------
KEY_KINDS = {
    "int64": (pa.int64(), st.integers(-4, 4) | st.sampled_from([-(2**63), 2**63 - 1])),
    "float64": (
        pa.float64(),
        st.sampled_from([0.0, -0.0, math.nan, 1.5, -1.5, math.inf, -math.inf, 1e300, 5e-324]),
    ),
    "string": (
        pa.string(),
        st.sampled_from(["", "a", "ü" * 300, "x" * 5000, "\u0000z", "😀"]) | st.text(max_size=3),
    ),
    "binary": (pa.binary(), st.sampled_from([b"", b"\x00", b"\xff" * 40]) | st.binary(max_size=3)),
}


def norm(k):
    """The key identity the table uses: -0.0 is 0.0, every NaN is one key."""
    if isinstance(k, float):
        return "NaN" if k != k else (0.0 if k == 0 else k)
    return k


@st.composite
def workloads(draw):
    kind = draw(st.sampled_from(sorted(KEY_KINDS)))
    keys = KEY_KINDS[kind][1]
    values = st.one_of(st.none(), st.integers(-100, 100))
    batch = st.lists(st.tuples(keys, values), max_size=5)  # duplicates and empty batches
    return {
        "kind": kind,
        "base": draw(st.lists(keys, min_size=1, max_size=4, unique_by=norm)),
        "before": draw(st.lists(batch, max_size=3)),  # flushed before the new column
        "after": draw(st.lists(batch, max_size=3)),
        "deletes": draw(st.lists(keys, max_size=3)),
        "evolve": draw(st.booleans()),
        "null_key": draw(st.booleans()),
    }


@settings(
    max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(w=workloads())
@pytest.mark.slow
def test_property_keys_values_schema_evolution(tmp_path_factory, w):
    """Random puts/deletes over int, float (NaN, -0.0, inf), string (empty, very long,
    unicode, NUL) and binary keys, with duplicate keys in a batch, empty batches, NULL
    values, a NULL key (rejected, nothing changes) and a column added after the first
    flush (older generations read it as NULL): the view equals the model before and
    after merging."""
    key_type = KEY_KINDS[w["kind"]][0]
    uri = str(tmp_path_factory.mktemp("prop") / "t")
    schema = pa.schema([pa.field("k", key_type, False, PK), pa.field("v", pa.int64())])
    base = pa.table({"k": pa.array(w["base"], key_type), "v": [0] * len(w["base"])}, schema)
    lance.write_dataset(base, uri)
    model = {norm(k): {"v": 0, "extra": None} for k in w["base"]}
    t = mq.MemWalTable.initialize(uri)
    writer = t.writer()

    def put(batch, evolved):
        data = {"k": pa.array([k for k, _ in batch], key_type), "v": [v for _, v in batch]}
        if evolved:
            data["extra"] = [None if v is None else v * 10 for _, v in batch]
        writer.put(pa.table(data))
        for k, v in batch:  # duplicates in one batch: the last one wins
            model[norm(k)] = {"v": v, "extra": None if v is None or not evolved else v * 10}

    def view(table, writers):
        rows = table.to_table(writers=writers).to_pylist()
        keys = [norm(r["k"]) for r in rows]
        assert len(keys) == len(set(keys)), "duplicate key"
        return {norm(r["k"]): {"v": r["v"], "extra": r.get("extra")} for r in rows}

    for b in w["before"]:
        put(b, False)
    writer.flush()
    evolved = w["evolve"]
    if evolved:
        writer.close(flush=False)
        lance.dataset(uri).add_columns({"extra": "CAST(NULL AS BIGINT)"})
        t = mq.MemWalTable.open(uri)
        writer = t.writer(writer.region_id)
    for b in w["after"]:
        put(b, evolved)
    if w["null_key"]:
        before = tree(uri)
        bad = {"k": pa.array([w["base"][0], None], key_type), "v": [1, 2]}
        if evolved:
            bad["extra"] = [1, 2]
        with pytest.raises(mq.PrimaryKeyError):
            writer.put(pa.table(bad))
        assert tree(uri) == before
    if w["deletes"]:
        writer.delete(pa.table({"k": pa.array(w["deletes"], key_type)}))
        for k in w["deletes"]:
            model.pop(norm(k), None)
    if not evolved:
        model = {k: {"v": r["v"], "extra": None} for k, r in model.items()}
    assert view(t, [writer]) == model
    writer.close()
    t.maintenance.merge()
    assert view(mq.MemWalTable.open(uri), None) == model
    rows = lance.dataset(uri).to_table().to_pylist()
    merged = {norm(r["k"]): r["v"] for r in rows}
    assert merged == {k: r["v"] for k, r in model.items()}
    assert len(rows) == len(merged)  # one base row per key (-0.0 and 0.0 are one key)


def _merge_delete(tmp_path, key_type, base_key, delete_key, upsert_key=None):
    """Rows left after merging a generation that deletes ``delete_key`` (and upserts
    ``upsert_key``) over a base table holding ``base_key``."""
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", key_type, False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": pa.array([base_key], key_type), "v": [1]}, schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    if upsert_key is not None:
        w.put(pa.table({"k": pa.array([upsert_key], key_type), "v": [2]}, schema))
    w.delete(pa.table({"k": pa.array([delete_key], key_type)}))
    expected = t.to_table(writers=[w]).num_rows  # before the merge
    w.close()
    t.maintenance.merge()
    assert t.to_table().num_rows == expected


def test_merged_delete_of_zero_removes_negative_zero_base_key(tmp_path):
    _merge_delete(tmp_path, pa.float64(), -0.0, 0.0)


def test_merged_delete_of_int64_min(tmp_path):
    _merge_delete(tmp_path, pa.int64(), 0, -(2**63), upsert_key=5)


@pytest.mark.parametrize("base_key, new_key", [(-0.0, 0.0), (0.0, -0.0)])
def test_merged_upsert_of_a_zero_replaces_the_other_signed_zero(tmp_path, base_key, new_key):
    """Lance joins float keys by their bits: without the merger's twin delete, the base
    table would keep both zeros after merging an upsert of the other one."""
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", pa.float64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": [base_key, 1.0], "v": [1, 1]}, schema), uri)
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        w.put(pa.table({"k": [new_key], "v": [2]}, schema))
    t.maintenance.merge()
    rows = lance.dataset(uri).to_table().sort_by("k").to_pylist()
    assert [(r["k"], r["v"]) for r in rows] == [(0.0, 2), (1.0, 1)]  # one zero, newest


@pytest.mark.parametrize("with_upsert", [False, True])
def test_merged_delete_of_composite_keys_with_zeros(tmp_path, with_upsert):
    """Every sign combination of float zeros in a composite key is one key (deletes
    alone are joined by bits, deletes beside upserts become a predicate)."""
    uri = str(tmp_path / "t")
    schema = pa.schema(
        [
            pa.field("a", pa.float32(), False, PK),
            pa.field("b", pa.float64(), False, PK),
            pa.field("v", pa.int64()),
        ]
    )
    base = {"a": [-0.0, 0.0, -0.0, 2.0], "b": [0.0, -0.0, 5.0, 0.0], "v": [1, 2, 3, 4]}
    lance.write_dataset(pa.table(base, schema), uri)
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        if with_upsert:
            w.put(pa.table({"a": [7.0], "b": [7.0], "v": [9]}, schema))
        w.delete(pa.table({"a": [0.0, 0.0], "b": [0.0, 5.0]}, schema.remove(2)))
    t.maintenance.merge()
    rows = lance.dataset(uri).to_table().sort_by("a").to_pylist()
    expected = [(2.0, 0.0), (7.0, 7.0)] if with_upsert else [(2.0, 0.0)]
    assert [(r["a"], r["b"]) for r in rows] == expected
