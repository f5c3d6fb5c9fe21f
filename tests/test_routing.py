"""Region specs end to end: routing, wrong-region rejection, pruning in reads."""

import datetime as dt
import os
import struct
import subprocess
import sys

import datafusion
import lance
import mmh3
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq

from helpers import PK


def tree(path: str) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def bucket_of(v: int, n: int) -> int:
    return abs(mmh3.hash(struct.pack("<q", v), 0)) % n


@pytest.fixture
def bucket_table(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema(
        [pa.field("user_id", pa.int64(), False, PK), pa.field("amount", pa.float64())]
    )
    lance.write_dataset(pa.table({"user_id": [1], "amount": [1.0]}, schema=schema), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "user_id", 10)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    yield t
    t.close(flush=False)


def test_write_routes_rows_to_one_writer_per_region(bucket_table):
    t = bucket_table
    ids = list(range(1000))
    written = t.write(pa.table({"user_id": ids, "amount": [float(i) for i in ids]}))
    assert len(written) == 10 and sum(written.values()) == 1000
    for w in t.writers():
        (bucket,) = w.region_values.values()
        for m in w.memtables():
            keys = m.to_table().column("user_id").to_pylist()
            assert all(bucket_of(k, 10) == bucket for k in keys)
    # the region id is a function of the region value
    assert t.catalog.region_id_for({"bucket": 3}) == mq.region_id_for(1, {"bucket": 3})
    assert t.catalog.region_id_for({"bucket": 3}) != t.catalog.region_id_for({"bucket": 4})
    t.flush()
    got = t.to_table().sort_by("user_id")
    assert got.column("user_id").to_pylist() == ids
    # values recorded in the manifests (pylance's region field entries)
    for rid in t.catalog.region_ids():
        spec_id, values = t.catalog.region_values(rid)
        assert spec_id == 1 and 0 <= values["bucket"] < 10


def test_wrong_region_is_rejected_and_changes_nothing(bucket_table):
    t = bucket_table
    w = t.writer(region_values={"bucket": bucket_of(123, 10)})
    w.put(pa.table({"user_id": [123], "amount": [1.0]}))
    other = next(k for k in range(1000) if bucket_of(k, 10) != bucket_of(123, 10))
    with pytest.raises(mq.WrongRegionError) as e:
        w.put(pa.table({"user_id": [123, other], "amount": [1.0, 2.0]}))
    assert str(other) in str(e.value)
    assert w.memtables()[0].num_rows == 1
    before = tree(t.uri)
    with pytest.raises(mq.WrongRegionError):  # deletes are checked the same way
        w.delete(pa.table({"user_id": [other]}))
    with pytest.raises(mq.WrongRegionError):
        w.put(pa.table({"user_id": [other], "amount": [2.0]}))
    assert tree(t.uri) == before  # nothing on disk changed either
    assert w.memtables()[0].num_rows == 1
    w.close(flush=False)


GOOD_IDS = list(range(100, 120))  # rows of many regions, written along with the bad one


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"user_id": GOOD_IDS, "amount": [1.0] * 20, "extra": [1] * 20}, mq.SchemaError),
        ({"amount": [1.0] * 20}, mq.PrimaryKeyError),
        ({"user_id": pa.array([*GOOD_IDS, None], pa.int64())}, mq.PrimaryKeyError),
        ({"user_id": [*map(str, GOOD_IDS), "x"]}, mq.SchemaError),
        ({"user_id": GOOD_IDS, "amount": ["1.5"] * 19 + ["x"]}, mq.SchemaError),
        (
            {
                "user_id": pa.array(GOOD_IDS, pa.int32()),
                "amount": pa.array([1.5] * 20, pa.float32()),
            },
            None,
        ),
    ],
)
def test_routed_bad_input_changes_nothing(bucket_table, bad, error):
    """t.write checks the whole batch before it claims a region or writes a byte."""
    t = bucket_table
    t.write(pa.table({"user_id": [5], "amount": [1.0]}))
    before = tree(t.uri)
    if error is None:  # control: a valid batch of other types does create regions
        t.write(pa.table(bad))
        assert tree(t.uri) != before and len(t.catalog.region_ids()) > 1
        return
    with pytest.raises(error):
        t.write(pa.table(bad))
    assert tree(t.uri) == before and len(t.catalog.region_ids()) == 1


def test_two_writers_for_one_value_share_the_region(bucket_table):
    t = bucket_table
    a = t.writer(region_values={"bucket": 2})
    b = t.writer(region_values={"bucket": 2})  # fences a
    assert a.region_id == b.region_id and b.epoch == a.epoch + 1
    assert len(t.catalog.region_ids()) == 1
    b.close()
    key = next(k for k in range(1000) if bucket_of(k, 10) == 2)
    with pytest.raises(mq.FencedError):  # b claimed after a: the put is not acknowledged
        a.put(pa.table({"user_id": [key], "amount": [1.0]}))
    with pytest.raises(mq.FencedError):
        a.flush()  # the epoch check before a manifest update
    # The entry a wrote before noticing stays in the WAL and is replayed (in doubt, not lost).
    c = t.writer(region_values={"bucket": 2})
    assert c.stats.replayed_rows == 1
    c.close(flush=False)


def test_pruning_spec_example(bucket_table):
    """bucket(user_id, 10) with user_id = 123 reads only region bucket(123)."""
    t = bucket_table
    t.write(pa.table({"user_id": list(range(200)), "amount": [1.0] * 200}))
    t.flush()
    p = t.provider()
    ctx = datafusion.SessionContext()
    ctx.register_table("e", p)
    got = ctx.sql("SELECT * FROM e WHERE user_id = 123").to_arrow_table()
    assert got.column("user_id").to_pylist() == [123]
    plan = p.last_plan
    assert [r.values for r in plan.regions] == [{"bucket": bucket_of(123, 10)}]
    assert len(plan.pruned) == 9
    assert "pruned region" in p.explain()
    ctx.sql("SELECT * FROM e WHERE user_id IN (1, 2)").to_arrow_table()
    assert {r.values["bucket"] for r in p.last_plan.regions} == {bucket_of(1, 10), bucket_of(2, 10)}
    ctx.sql("SELECT * FROM e WHERE amount > 0").to_arrow_table()
    assert p.last_plan.pruned == []


def test_time_range_pruning_with_year_transform(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("ts", pa.timestamp("us"))])
    base = pa.table({"id": [0], "ts": [dt.datetime(2026, 1, 1)]}, schema=schema)
    lance.write_dataset(base, uri)
    ls = lance.dataset(uri).lance_schema
    spec = mq.RegionSpec(1, [mq.RegionField("year", [ls.field("ts").id()], "year")])
    with pytest.warns(mq.RegionSpecWarning, match="outside the primary key"):  # ts not in key
        t = mq.MemWalTable.initialize(uri, region_spec=spec)
    rows = pa.table(
        {
            "id": [1, 2, 3],
            "ts": [dt.datetime(2024, 5, 1), dt.datetime(2025, 5, 1), dt.datetime(2026, 5, 1)],
        },
        schema=schema,
    )
    t.write(rows)
    t.flush()
    p = t.provider()
    got = p.to_table(
        filter=pc.field("ts") >= pa.scalar(dt.datetime(2025, 6, 1), pa.timestamp("us"))
    )
    assert sorted(got.column("id").to_pylist()) == [0, 3]
    # 2025 may still hold rows after June: only 2024 is pruned
    assert sorted(r.values["year"] for r in p.last_plan.regions) == [2025, 2026]
    p.to_table(filter=pc.field("ts") < pa.scalar(dt.datetime(2024, 12, 31), pa.timestamp("us")))
    assert sorted(r.values["year"] for r in p.last_plan.regions) == [2024]
    t.close(flush=False)


def test_spec_validation(tmp_path):
    with pytest.raises(mq.RegionSpecError):
        mq.RegionField("b", [0], "bucket")  # no num_buckets
    with pytest.raises(mq.RegionSpecError):
        mq.RegionField("b", [0], "nope")
    with pytest.raises(mq.RegionSpecError):
        mq.RegionField("b", [0], "bucket", expression="col0", parameters={"num_buckets": "2"})
    with pytest.raises(mq.RegionSpecError):
        mq.RegionField("t", [0], "truncate", parameters={"width": "-1"})
    uri = str(tmp_path / "t")
    lance.write_dataset(
        pa.table(
            {"id": pa.array([1], pa.int64())},
            schema=pa.schema([pa.field("id", pa.int64(), False, PK)]),
        ),
        uri,
    )
    bad = mq.RegionSpec(1, [mq.RegionField("b", [42], "identity")])
    with pytest.raises(mq.RegionSpecError, match="42"):
        mq.MemWalTable.initialize(uri, region_spec=bad)


ROUTE_SCRIPT = """
import sys, pyarrow as pa, memwal_query as mq
t = mq.MemWalTable.open(sys.argv[1])
ids = list(range(int(sys.argv[2]), int(sys.argv[2]) + 200))
try:
    t.write(pa.table({"user_id": ids, "amount": [1.0] * len(ids)}))
    t.close(flush=False)
except mq.FencedError:
    pass  # another process claimed one of its regions meanwhile: that is fine here
except mq.WriteIncompleteError as e:
    # the same, in some of the regions of the write (each region's rows are atomic)
    if not all(isinstance(x, mq.FencedError) for x in e.errors.values()):
        raise
print("done", flush=True)
"""


@pytest.mark.slow
def test_concurrent_routing_processes_create_one_region_per_value(bucket_table):
    """Processes routing rows of the same values at once never create two regions for one."""
    t = bucket_table
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ROUTE_SCRIPT, t.uri, str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for start in (0, 1000, 2000)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and "done" in out
    regions = t.catalog.region_ids()
    assert len(regions) == 10  # 600 keys over 10 buckets: one region per bucket value
    values = sorted(t.catalog.region_values(r)[1]["bucket"] for r in regions)
    assert values == list(range(10))
    for r in regions:
        m = t.catalog.region_manifest(r)
        assert m.writer_epoch >= 1 and m.region_spec_id == 1
