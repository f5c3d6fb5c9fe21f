"""Every deviation of the region transforms from memwal-spec.md, fixed or
decided, with the test that pins it (docs/compatibility.md, "Region transforms")."""

import datetime as dt
import decimal
import struct
import uuid

import lance
import mmh3
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query.regions import TRANSFORM_CLASSES, RegionField, RegionSpec, bind_transform
from memwal_query.regions.spec import (
    bucket_values,
    expression_spec,
    murmur3_hash,
    murmur3_multi_hash,
    temporal_spec,
    truncate_spec,
)

from helpers import pk_schema

D = decimal.Decimal


def one(f: RegionField, values, typ=None) -> list:
    return f.evaluate([pa.array(values, typ)]).to_pylist()


# -- the registry ---------------------------------------------------------------------
def test_registry_maps_every_proto_transform_name_to_its_class():
    assert set(TRANSFORM_CLASSES) == set(mq.regions.TRANSFORMS)
    for name, cls in TRANSFORM_CLASSES.items():
        assert cls.name == name
    bucket = bind_transform("bucket", "b", 1, {"num_buckets": "4"}, None)
    assert bucket.can_transform(pa.uuid()) and not bucket.can_transform(pa.list_(pa.int8()))
    assert bucket.result_type(pa.string()) == pa.int32()
    trunc = bind_transform("truncate", "t", 1, {"width": "10"}, None)
    assert trunc.result_type(pa.int8()) == pa.int32()
    assert trunc.result_type(pa.decimal128(9, 2)) == pa.decimal128(9, 2)
    assert trunc.can_transform(pa.decimal128(9, 2)) and not trunc.can_transform(pa.float64())
    hour = bind_transform("hour", "h", 1, {}, None)
    assert hour.can_transform(pa.time64("us")) and not hour.can_transform(pa.int64())
    assert not bind_transform("year", "y", 1, {}, None).can_transform(pa.time32("s"))
    with pytest.raises(mq.RegionSpecError, match="unknown transform 'void'"):
        bind_transform("void", "v", 1, {}, None)


# -- truncate ------------------------------------------------------------------------------
def test_truncate_negative_integers_follow_iceberg_not_sql_modulo():
    """The spec's ``col0 - (col0 % W)`` in SQL gives truncate(-1, 10) = 0 (DataFusion's %
    keeps the dividend's sign); the transform follows Iceberg (positive remainder): -10.
    A user who wants the transform's value from an expression writes the second one."""
    values = pa.array([-1, -10, -11, 9, None], pa.int64())
    transform = RegionField.truncate("t", 0, 10).evaluate([values]).to_pylist()
    assert transform == [-10, -10, -20, 0, None]
    schema = pa.schema([pa.field("v", pa.int64())])
    batch = pa.record_batch([values], schema=schema)
    spec_text = expression_spec(schema, ["v"], "col0 - (col0 % 10)", "int64")
    assert spec_text.evaluate(batch, schema).column(0).to_pylist() == [0, -10, -10, 0, None]
    matching = expression_spec(schema, ["v"], "col0 - (((col0 % 10) + 10) % 10)", "int64")
    assert matching.evaluate(batch, schema).column(0).to_pylist() == transform


def test_truncate_decimals_at_the_column_scale():
    f = RegionField.truncate("t", 0, 50)
    # Iceberg's spec example: truncate(50, 10.65) = 10.50 for a decimal(9, 2)
    values = ["10.65", "-0.01", None, "-10.65", "0.49", "0.50"]
    want = [D("10.50"), D("-0.50"), None, D("-11.00"), D("0.00"), D("0.50")]
    for t in (pa.decimal32(9, 2), pa.decimal64(9, 2), pa.decimal128(9, 2), pa.decimal256(40, 2)):
        arr = pa.array([None if v is None else D(v) for v in values], t)
        out = f.evaluate([arr.slice(0)])
        assert out.type == t and out.to_pylist() == want
        assert f.evaluate([arr.slice(3)]).to_pylist() == want[3:]  # sliced input
    big = [-(2**100), 2**100 + 7, -(10**37) + 1]  # every 64-bit limb matters
    out = one(f, [D(v) for v in big], pa.decimal128(38, 0))
    assert out == [D(v - v % 50) for v in big]  # Python's % is Iceberg's positive remainder
    with pytest.raises(mq.RegionSpecError, match="'t'.*-9.99 does not fit in decimal128"):
        one(f, [D("-9.99")], pa.decimal128(3, 2))  # -10.00 needs a 4th digit


def test_truncate_of_a_decimal_key_routes_and_prunes_in_a_real_table(tmp_path):
    uri = str(tmp_path / "t")
    schema = pk_schema(pa.field("v", pa.int64()), key_type=pa.decimal128(8, 2))
    ds = lance.write_dataset(pa.table({"id": [D("1.00")], "v": [1]}, schema), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=truncate_spec(ds.lance_schema, "id", 100))
    try:
        keys = [D("0.50"), D("1.99"), D("-0.01"), D("2.00"), D("2.50")]
        t.write(pa.table({"id": keys, "v": list(range(5))}, schema))
        t.flush()
        values = sorted(t.catalog.region_values(r)[1]["id_trunc"] for r in t.catalog.region_ids())
        assert values == [D("-1.00"), D("0.00"), D("1.00"), D("2.00")]
        p = t.provider()
        got = p.to_table(filter=pc.field("id") == pa.scalar(D("2.50"), pa.decimal128(8, 2)))
        assert got.column("v").to_pylist() == [4]
        assert [r.values for r in p.last_plan.regions] == [{"id_trunc": D("2.00")}]
    finally:
        t.close(flush=False)


def test_truncate_of_int8_is_promoted_like_iceberg_in_a_real_table(tmp_path):
    uri = str(tmp_path / "t")
    schema = pk_schema(pa.field("v", pa.int64()), key_type=pa.int8())
    ds = lance.write_dataset(pa.table({"id": [1], "v": [1]}, schema), uri)
    spec = truncate_spec(ds.lance_schema, "id", 3)
    assert spec.fields[0].result_type == "int32"
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    try:
        t.write(pa.table({"id": [-128, 127], "v": [1, 2]}, schema))  # -128 -> -129
        values = sorted(t.catalog.region_values(r)[1]["id_trunc"] for r in t.catalog.region_ids())
        assert values == [-129, 126]
        assert t.to_table().sort_by("id").column("id").to_pylist() == [-128, 1, 127]
    finally:
        t.close(flush=False)


# -- time columns, uuid ---------------------------------------------------------------------
def test_time_columns_are_accepted_by_identity_bucket_and_hour(tmp_path):
    for typ in (pa.time32("s"), pa.time64("us")):
        uri = str(tmp_path / str(typ).replace("[", "_").rstrip("]"))
        schema = pk_schema(pa.field("at", typ))
        ds = lance.write_dataset(pa.table({"id": [0], "at": [dt.time(0, 0)]}, schema), uri)
        spec = temporal_spec(ds.lance_schema, "at", "hour")
        with pytest.warns(mq.RegionSpecWarning):
            t = mq.MemWalTable.initialize(uri, region_spec=spec)
        try:
            times = [dt.time(1, 5), dt.time(13, 0), dt.time(13, 59, 59), dt.time(23, 1)]
            t.write(pa.table({"id": [1, 2, 3, 4], "at": times}, schema))
            t.flush()
            hours = sorted(t.catalog.region_values(r)[1]["at_hour"] for r in t.catalog.region_ids())
            assert hours == [1, 13, 23]
            p = t.provider()
            got = p.to_table(filter=pc.field("at") >= pa.scalar(dt.time(13, 30), typ))
            assert sorted(got.column("id").to_pylist()) == [3, 4]
            # hour of a time is monotone: the 01:00 region is pruned by a lower bound
            assert sorted(r.values["at_hour"] for r in p.last_plan.regions) == [13, 23]
        finally:
            t.close(flush=False)
    # Iceberg's bucket hash of a time: microseconds since midnight as a long
    assert murmur3_hash(pa.array([dt.time(22, 31, 8)], pa.time32("s"))).to_pylist() == [-662762989]
    f = RegionField.identity("i", 0)
    assert one(f, [dt.time(1, 2)], pa.time64("ns")) == [dt.time(1, 2)]


def test_bucket_of_arrow_uuid_hashes_like_iceberg():
    value = uuid.UUID("f79c3e09-677c-4bbd-a479-3f349cb785e7")
    arr = pa.array([value.bytes, None], pa.uuid())
    assert murmur3_hash(arr).to_pylist() == [1488055340, None]  # Iceberg spec, Appendix B
    assert bucket_values(arr, 16).to_pylist() == [1488055340 % 16, None]
    same = pa.array([value.bytes], pa.binary(16))
    assert bucket_values(same, 7).to_pylist() == bucket_values(arr.slice(0, 1), 7).to_pylist()


# -- time zones -----------------------------------------------------------------------------
def test_date_parts_of_zoned_timestamps_use_utc_and_the_expression_gives_local():
    """Decided: the transforms use the UTC instant (as Iceberg's timestamptz transforms),
    so a region never depends on a time zone. DataFusion's own ``date_part`` uses the
    column's zone: a region expression gives that reading."""
    ny = pa.timestamp("us", tz="America/New_York")
    instant = dt.datetime(2024, 1, 1, 2, 30, tzinfo=dt.timezone.utc)  # Dec 31, 21:30 in NY
    schema = pa.schema([pa.field("ts", ny)])
    batch = pa.record_batch([pa.array([instant, None], ny)], schema=schema)
    for unit, utc in (("year", 2024), ("month", 1), ("day", 1), ("hour", 2)):
        ours = temporal_spec(schema, "ts", unit).evaluate(batch, schema).column(0)
        assert ours.to_pylist() == [utc, None]
    local = {"year": 2023, "month": 12, "day": 31, "hour": 21}
    for unit, want in local.items():
        expr = expression_spec(schema, ["ts"], f"date_part('{unit}', col0)", "int32")
        assert expr.evaluate(batch, schema).column(0).to_pylist() == [want, None]


# -- multi_bucket byte layout -----------------------------------------------------------------
def test_multi_bucket_byte_layout_worked_example():
    """docs/compatibility.md: (int64 5, string 'ab') hashes the 18 bytes
    08000000 0500000000000000 02000000 6162; NULL inputs are skipped (spec: "NULL fields
    are ignored during hashing; returns NULL only if all inputs are NULL")."""
    ints = pa.array([5, 5, None], pa.int64())
    strs = pa.array(["ab", None, None])
    layout = struct.pack("<I", 8) + struct.pack("<q", 5) + struct.pack("<I", 2) + b"ab"
    assert layout.hex() == "080000000500000000000000020000006162"
    got = murmur3_multi_hash([ints, strs]).to_pylist()
    first = mmh3.hash(layout, 0)
    assert got == [first, mmh3.hash(layout[:12], 0), None]
    assert (first, abs(first) % 16) == (-1772030088, 8)
    f = RegionField.multi_bucket("b", [0, 1], 16)
    assert f.evaluate([ints, strs]).to_pylist() == [8, 3, None]
    # int32(5) hashes as int64(5) (type-promotion resistant), (NULL, 5) like (5, NULL)
    as_int32 = f.evaluate([pa.array([5], pa.int32()), pa.array(["ab"])]).to_pylist()
    assert as_int32 == [8]
    assert f.evaluate([pa.array([None], pa.int64()), pa.array([5], pa.int64())]).to_pylist() == [3]


def test_spec_example_bucket_123_of_10_is_4_not_3():
    """memwal-spec.md ("Region Pruning") says bucket(123, 10) = 3; its own formula,
    abs(murmur3(123)) % 10 with 123 hashed as Iceberg's 8-byte long, gives 4. No reading
    gives 3 (4-byte int: 2, the string '123': 5): we keep the formula."""
    h = mmh3.hash(struct.pack("<q", 123), 0)
    assert (h, abs(h) % 10) == (823512154, 4)
    for t in (pa.int8(), pa.int32(), pa.int64(), pa.uint16()):
        assert bucket_values(pa.array([123], t), 10).to_pylist() == [4]
    assert abs(mmh3.hash(struct.pack("<i", 123), 0)) % 10 == 2
    assert abs(mmh3.hash(b"123", 0)) % 10 == 5
    spec = RegionSpec(1, [RegionField.bucket("bucket", 0, 10)])
    schema = pa.schema([pa.field("user_id", pa.int64())])
    assert spec.may_match({"bucket": 4}, [("user_id", "=", 123)], schema)
    assert not spec.may_match({"bucket": 3}, [("user_id", "=", 123)], schema)
