"""Region specs: transforms against hand-computed values, spec requirements, pruning.

Expected hashes are computed independently with ``mmh3`` over hand-packed bytes (or are
literals: Iceberg's published test vectors), never with memwal_query's own hashing.
"""

from __future__ import annotations

import datetime as dt
import decimal
import struct

import lance
import mmh3
import numpy as np
import pyarrow as pa
import pytest
from lance.mem_wal import ShardingField, ShardingSpec, evaluate_sharding_spec

from memwal_query.exceptions import RegionSpecError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.regions.spec import (
    RegionField,
    RegionSpec,
    arrow_type_from_name,
    arrow_type_name,
    bucket_spec,
    bucket_values,
    expression_spec,
    field_id_of,
    identity_spec,
    multi_bucket_spec,
    murmur3_hash,
    murmur3_multi_hash,
    temporal_spec,
    truncate_spec,
)

INT_TYPES = [
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
]
UTC = dt.timezone.utc


def h64(v: int) -> int:
    """Reference murmur3 of an integer: its 8-byte little-endian int64."""
    return mmh3.hash(struct.pack("<q", v), 0)


def ref_bucket(h: int | None, n: int) -> int | None:
    return None if h is None else abs(h) % n


def ref_multi(values: list, n: int | None = None) -> int | None:
    """Reference murmur3_multi: non-NULL values as 4-byte LE length + bytes."""
    data = b""
    present = False
    for v in values:
        if v is None:
            continue
        present = True
        b = struct.pack("<q", v) if isinstance(v, int) else v.encode() if isinstance(v, str) else v
        data += struct.pack("<I", len(b)) + b
    if not present:
        return None
    h = mmh3.hash(data, 0)
    return h if n is None else abs(h) % n


def minimal_be(v: int) -> bytes:
    """Java BigInteger.toByteArray: minimal big-endian two's complement."""
    n = 1
    while True:
        try:
            return v.to_bytes(n, "big", signed=True)
        except OverflowError:
            n += 1


def col(values, type_=None) -> pa.RecordBatch:
    return pa.record_batch({"c": pa.array(values, type_)})


def one(field: RegionField, values, type_=None) -> list:
    """Evaluate a one-source field over one column (schema None: field id 0 = column 0)."""
    return RegionSpec(1, [field]).evaluate(col(values, type_)).column(0).to_pylist()


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """A Lance dataset with many column types; its ``lance_schema`` gives field ids."""
    table = pa.table(
        {
            "user_id": pa.array([1, 123, -5, None], pa.int64()),
            "small": pa.array([1, 123, -5, None], pa.int32()),
            "name": pa.array(["ab", "abcd", "héllo", None]),
            "ts": pa.array([0, 10**15, -(10**12), None], pa.timestamp("us", tz="UTC")),
            "day": pa.array([0, 19723, -1, None], pa.date32()),
            "s": pa.array([{"x": 1}, {"x": 2}, None, {"x": None}], pa.struct([("x", pa.int64())])),
            "f": pa.array([0.5, 1.0, -0.0, None], pa.float64()),
        }
    )
    return lance.write_dataset(table, str(tmp_path_factory.mktemp("rs") / "t")), table


# -- murmur3 / bucket hashing ------------------------------------------------------------
def test_murmur3_int64_matches_mmh3_random_and_edges():
    rng = np.random.default_rng(7)
    edges = [0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32, 2**63 - 1, -(2**63), 123]
    values = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64), edges])
    got = murmur3_hash(pa.array(values, pa.int64())).to_pylist()
    assert got == [mmh3.hash(struct.pack("<q", int(v)), 0, signed=True) for v in values]


def test_murmur3_strings_binary_match_mmh3_all_lengths_and_slices():
    rng = np.random.default_rng(3)
    strings = [
        "".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, int(rng.integers(0, 40))))
        for _ in range(600)
    ]
    strings += ["", "a", "ab", "abc", "abcd", "x" * 63, "y" * 64, "z" * 65, "w" * 3000]
    want = [mmh3.hash(s.encode(), 0) for s in strings]
    for t in (pa.string(), pa.large_string(), pa.string_view()):
        assert murmur3_hash(pa.array(strings, t)).to_pylist() == want
    sliced = pa.array(strings).slice(11, 300)
    assert murmur3_hash(sliced).to_pylist() == want[11:311]
    blobs = [s.encode() for s in strings]
    for t in (pa.binary(), pa.large_binary()):
        assert murmur3_hash(pa.array(blobs, t)).to_pylist() == want
    assert murmur3_hash(pa.array([b"ab", b"cd"], pa.binary(2))).to_pylist() == [
        mmh3.hash(b"ab"),
        mmh3.hash(b"cd"),
    ]


def test_murmur3_iceberg_test_vectors():
    # Apache Iceberg spec, "Appendix B: 32-bit Hash Requirements" (literal expected values).
    cases = [
        (pa.array([34], pa.int32()), 2017239379),
        (pa.array([34], pa.int64()), 2017239379),
        (pa.array([decimal.Decimal("14.20")], pa.decimal128(9, 2)), -500754589),
        (pa.array([dt.date(2017, 11, 16)], pa.date32()), -653330422),
        (pa.array([dt.time(22, 31, 8)], pa.time64("us")), -662762989),
        (pa.array([dt.datetime(2017, 11, 16, 22, 31, 8)], pa.timestamp("us")), -2047944441),
        (
            pa.array(
                [dt.datetime(2017, 11, 16, 14, 31, 8, tzinfo=dt.timezone(dt.timedelta(hours=-8)))],
                pa.timestamp("us", tz="UTC"),
            ),
            -2047944441,
        ),
        (pa.array(["iceberg"]), 1210000089),
        (pa.array([bytes([0, 1, 2, 3])], pa.binary()), -188683207),
        (pa.array([1.0], pa.float32()), -142385009),
        (pa.array([1.0], pa.float64()), -142385009),
    ]
    for arr, want in cases:
        assert murmur3_hash(arr).to_pylist() == [want], arr.type


def test_bucket_literal_values():
    f = RegionField.bucket("b", 0, 10)
    # abs(murmur3(<q v>)) % 10, hand-computed: 123 -> 823512154, -123 -> -471378254
    assert one(f, [123, -123, 0, 5, 7], pa.int64()) == [4, 4, 6, 3, 9]
    assert one(RegionField.bucket("b", 0, 1000), [-123], pa.int64()) == [254]
    assert one(f, ["iceberg", "", "abcd"]) == [9, 0, 8]


def test_bucket_is_abs_mod_in_int64_for_negative_hashes():
    values = list(range(-200, 200))
    got = one(RegionField.bucket("b", 0, 97), values, pa.int64())
    assert got == [abs(h64(v)) % 97 for v in values]
    assert any(h64(v) < 0 for v in values)
    # abs(INT32_MIN) is 2**31 (computed in 64 bits), not an overflow
    import memwal_query.regions.spec as rs

    hashes = np.array([-(2**31), -1, 2**31 - 1], np.int64).astype(np.uint32)
    out = rs._buckets(hashes, np.ones(3, bool), 7).to_pylist()
    assert out == [2**31 % 7, 1, (2**31 - 1) % 7]


@pytest.mark.parametrize("t", INT_TYPES)
def test_bucket_type_promotion_resistant_integers(t):
    values = [0, 1, 5, 100, 127]
    if not pa.types.is_unsigned_integer(t):
        values += [-1, -128]
    got = one(RegionField.bucket("b", 0, 16), values, t)
    assert got == [ref_bucket(h64(v), 16) for v in values]


def test_bucket_uint64_above_int64_max_wraps():
    assert one(RegionField.bucket("b", 0, 16), [2**64 - 1, 2**63], pa.uint64()) == [
        ref_bucket(h64(-1), 16),
        ref_bucket(h64(-(2**63)), 16),
    ]


def test_bucket_temporal_and_other_types_hash_canonical_units():
    f = RegionField.bucket("b", 0, 1000)
    days = [0, 19723, -1]
    want = [ref_bucket(h64(d), 1000) for d in days]
    assert one(f, days, pa.date32()) == want
    assert one(f, [d * 86_400_000 for d in days], pa.date64()) == want
    micros = [0, 1_500_000_000_000_000, -1_000_000]
    want = [ref_bucket(h64(u), 1000) for u in micros]
    assert one(f, [u // 10**6 for u in micros], pa.timestamp("s")) == want
    assert one(f, [u // 1000 for u in micros], pa.timestamp("ms")) == want
    assert one(f, micros, pa.timestamp("us", tz="Europe/Paris")) == want
    assert one(f, [u * 1000 + 999 for u in micros], pa.timestamp("ns")) == want  # floored
    assert one(f, [True, False], pa.bool_()) == one(f, [1, 0], pa.int8())
    assert one(f, [1.0, -0.0, float("nan")], pa.float32()) == [
        ref_bucket(mmh3.hash(struct.pack("<d", 1.0)), 1000),
        ref_bucket(mmh3.hash(struct.pack("<d", 0.0)), 1000),
        ref_bucket(mmh3.hash(struct.pack("<q", 0x7FF8000000000000)), 1000),
    ]
    decs = [decimal.Decimal(x) for x in ("0", "-1", "1.27", "1.28", "-1.28", "-1.29", "1e20")]
    got = one(f, decs, pa.decimal128(38, 2))
    unscaled = [int(d.scaleb(2)) for d in decs]
    assert got == [ref_bucket(mmh3.hash(minimal_be(u)), 1000) for u in unscaled]
    assert one(f, decs[:4], pa.decimal128(10, 2)) == got[:4]  # precision-independent
    assert one(f, decs[:3], pa.decimal256(40, 2)) == got[:3]


def test_bucket_nulls_and_unsupported_types():
    assert one(RegionField.bucket("b", 0, 10), [None, 123, None], pa.int64()) == [None, 4, None]
    assert one(RegionField.bucket("b", 0, 4), [None, None]) == [None, None]
    with pytest.raises(RegionSpecError, match="'b'.*cannot hash"):
        one(RegionField.bucket("b", 0, 4), [[1]], pa.list_(pa.int64()))


def test_bucket_values_and_dictionary_and_chunked():
    arr = pa.array(["a", "b", "a", None]).dictionary_encode()
    assert bucket_values(arr, 10).to_pylist() == [0, abs(mmh3.hash(b"b")) % 10, 0, None]
    chunked = pa.chunked_array([[1, 2], [3]], pa.int64())
    assert bucket_values(chunked, 10).to_pylist() == [abs(h64(v)) % 10 for v in (1, 2, 3)]


# -- multi_bucket ---------------------------------------------------------------------
def test_multi_bucket_hand_computed_and_null_handling():
    a = pa.array([1, None, None, 5, -7], pa.int64())
    b = pa.array(["x", "yy", None, None, "héllo"])
    spec = RegionSpec(1, [RegionField.multi_bucket("m", [0, 1], 100)])
    got = spec.evaluate(pa.record_batch({"a": a, "b": b})).column("m").to_pylist()
    want = [ref_multi([x, y], 100) for x, y in zip(a.to_pylist(), b.to_pylist())]
    assert got == want
    assert got[2] is None  # all inputs NULL
    assert got[1] == ref_multi(["yy"], 100)  # NULLs are skipped
    assert murmur3_multi_hash([a, b]).to_pylist() == [
        ref_multi([x, y]) for x, y in zip(a.to_pylist(), b.to_pylist())
    ]


def test_multi_bucket_type_promotion_and_random_against_reference():
    rng = np.random.default_rng(5)
    n = 500
    ints = [None if rng.random() < 0.2 else int(rng.integers(-(2**62), 2**62)) for _ in range(n)]
    strs = [
        None if rng.random() < 0.2 else "".join(chr(int(c)) for c in rng.integers(32, 500, 30))
        for _ in range(n)
    ]
    blobs = [None if rng.random() < 0.3 else rng.bytes(int(rng.integers(0, 90))) for _ in range(n)]
    got = murmur3_multi_hash([pa.array(ints, pa.int64()), pa.array(strs), pa.array(blobs)])
    assert got.to_pylist() == [ref_multi(list(r)) for r in zip(ints, strs, blobs)]
    small = [0, 1, -3, 100]
    for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64()):
        got = murmur3_multi_hash([pa.array(small, t), pa.array(small, pa.uint8() if False else t)])
        assert got.to_pylist() == [ref_multi([v, v]) for v in small]


# -- date parts, truncate, identity -----------------------------------------------------
def test_temporal_transforms_hand_computed():
    stamps = [dt.datetime(2024, 3, 4, 5, 6, 7), dt.datetime(1969, 12, 31, 23, 59, 59), None]
    expect = {"year": [2024, 1969, None], "month": [3, 12, None], "day": [4, 31, None]}
    expect["hour"] = [5, 23, None]
    for unit, want in expect.items():
        f = RegionField.temporal("p", 0, unit)
        for t in ("s", "ms", "us", "ns"):
            assert one(f, stamps, pa.timestamp(t)) == want, (unit, t)
    dates = [dt.date(2024, 2, 29), dt.date(1900, 1, 1), None]
    assert one(RegionField.temporal("p", 0, "year"), dates, pa.date32()) == [2024, 1900, None]
    assert one(RegionField.temporal("p", 0, "month"), dates, pa.date64()) == [2, 1, None]
    assert one(RegionField.temporal("p", 0, "day"), dates, pa.date32()) == [29, 1, None]
    assert one(RegionField.temporal("p", 0, "hour"), dates, pa.date32()) == [0, 0, None]
    out = RegionSpec(1, [RegionField.temporal("p", 0, "year")]).evaluate(col(dates, pa.date32()))
    assert out.schema.field("p").type == pa.int32()


def test_temporal_timezone_uses_utc_value():
    # 2024-01-01 02:00 in Tokyo is 2023-12-31 17:00 UTC
    tokyo = dt.timezone(dt.timedelta(hours=9))
    v = [dt.datetime(2024, 1, 1, 2, 0, tzinfo=tokyo)]
    t = pa.timestamp("us", tz="Asia/Tokyo")
    assert one(RegionField.temporal("p", 0, "year"), v, t) == [2023]
    assert one(RegionField.temporal("p", 0, "day"), v, t) == [31]
    assert one(RegionField.temporal("p", 0, "hour"), v, t) == [17]
    with pytest.raises(RegionSpecError, match="'p'.*date or timestamp"):
        one(RegionField.temporal("p", 0, "year"), [1], pa.int64())


def test_truncate_integers_floor_semantics_and_types():
    f = RegionField.truncate("t", 0, 10)
    values = [0, 1, 9, 10, -1, -10, -11, None]
    want = [0, 0, 0, 10, -10, -10, -20, None]  # Iceberg truncate(10, v)
    for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64()):
        out = RegionSpec(1, [f]).evaluate(col(values, t)).column(0)
        promoted = pa.int32() if t in (pa.int8(), pa.int16()) else t  # as Iceberg
        assert out.type == promoted and out.to_pylist() == want
    assert one(f, [0, 9, 255, None], pa.uint8()) == [0, 0, 250, None]
    assert one(f, [2**64 - 1], pa.uint64()) == [2**64 - 6]
    assert one(RegionField.truncate("t", 0, 1000), [-5], pa.int64()) == [-1000]
    assert one(RegionField.truncate("t", 0, 3), [-128], pa.int8()) == [-129]
    with pytest.raises(RegionSpecError, match="'t'.*does not fit in int32"):
        one(RegionField.truncate("t", 0, 3), [-(2**31)], pa.int32())
    with pytest.raises(RegionSpecError, match="'t'.*not defined for floating-point"):
        one(f, [1.5], pa.float64())


def test_truncate_strings_and_binary():
    f = RegionField.truncate("t", 0, 3)
    assert one(f, ["héllo wörld", "ab", "", None]) == ["hél", "ab", "", None]
    assert one(f, ["日本語テキスト"], pa.large_string()) == ["日本語"]
    assert one(f, [b"\x00\x01\x02\x03", b"x", None], pa.binary()) == [b"\x00\x01\x02", b"x", None]


def test_identity_keeps_type_or_casts_to_declared_type():
    out = RegionSpec(1, [RegionField.identity("i", 0)]).evaluate(col([1, None], pa.int16()))
    assert out.column(0).type == pa.int16() and out.column(0).to_pylist() == [1, None]
    for t in INT_TYPES:
        out = RegionSpec(1, [RegionField.identity("i", 0, "int64")]).evaluate(col([5], t))
        assert out.column(0).type == pa.int64() and out.column(0).to_pylist() == [5]
    with pytest.raises(RegionSpecError, match="'i'.*cannot cast"):
        RegionSpec(1, [RegionField.identity("i", 0, "int8")]).evaluate(col([1000], pa.int64()))


# -- spec requirements ----------------------------------------------------------------
def test_deterministic_and_stateless_across_calls_and_batches():
    spec = RegionSpec(
        1,
        [
            RegionField.bucket("b", 0, 8),
            RegionField.truncate("t", 1, 2),
            RegionField.from_expression("e", [0], "col0 * 2 + 1", "int64"),
        ],
    )
    data = pa.record_batch(
        {"a": pa.array(range(100), pa.int64()), "s": [f"s{i}" for i in range(100)]}
    )
    first = spec.evaluate(data)
    assert spec.evaluate(data).equals(first)
    parts = [spec.evaluate(data.slice(i, 10)) for i in range(0, 100, 10)]
    assert pa.Table.from_batches(parts).combine_chunks().to_batches()[0].equals(first)
    table = pa.Table.from_batches([data.slice(0, 40), data.slice(40)])
    assert spec.evaluate(table).equals(first)


def test_result_columns_named_by_field_id_with_declared_types():
    spec = RegionSpec(
        1,
        [
            RegionField.bucket("bucket", 0, 4),
            RegionField.identity("same", 0),
            RegionField.identity("wide", 0, "int64"),
            RegionField.from_expression("e", [1], "upper(col0)", "utf8"),
            RegionField.from_expression("l", [1], "length(col0)", "int16"),
        ],
    )
    out = spec.evaluate(pa.record_batch({"a": pa.array([1], pa.int32()), "s": ["x"]}))
    assert out.schema.names == ["bucket", "same", "wide", "e", "l"]
    assert out.schema.types == [pa.int32(), pa.int32(), pa.int64(), pa.string(), pa.int16()]


def test_column_removal_resistance(ds):
    dataset, _ = ds
    schema = dataset.lance_schema
    uid = field_id_of(schema, "user_id")
    name = field_id_of(schema, "name")
    spec = RegionSpec(
        1,
        [
            RegionField.bucket("gone", 999, 4),  # field id not in the schema
            RegionField.identity("ident", uid),
            RegionField.multi_bucket("m", [uid, 999, name], 50),
            RegionField.from_expression("e", [999], "coalesce(col0, 7)", "int64"),
        ],
    )
    batch = pa.record_batch({"name": ["ab", None]})  # user_id column absent from the batch
    out = spec.evaluate(batch, schema)
    assert out.column("gone").to_pylist() == [None, None]
    assert out.column("ident").to_pylist() == [None, None]
    assert out.column("ident").type == pa.int64()  # the schema still knows its type
    assert out.column("m").to_pylist() == [ref_multi(["ab"], 50), None]
    assert out.column("e").to_pylist() == [7, 7]


def test_schema_variants_resolve_field_ids(ds):
    dataset, table = ds
    ls = dataset.lance_schema
    x_id = field_id_of(ls, "s.x")
    assert field_id_of(ls, "user_id") == 0
    spec = RegionSpec(
        1, [RegionField.identity("x", x_id), RegionField.bucket("b", field_id_of(ls, "name"), 7)]
    )
    want = spec.evaluate(table, ls)
    assert want.column("x").to_pylist() == [1, 2, None, None]  # parent NULL -> NULL
    # LanceDataset, pa.Schema with lance:field_id metadata, and without (Lance numbering)
    assert spec.evaluate(table, dataset).equals(want)
    fields = [
        pa.field(f.name, f.type, metadata={"lance:field_id": str(field_id_of(ls, f.name))})
        for f in table.schema
    ]
    assert spec.evaluate(table, pa.schema(fields)).column("b").equals(want.column("b"))
    assert spec.evaluate(table, table.schema).equals(want)
    # None: field id = top-level column position
    by_pos = RegionSpec(1, [RegionField.bucket("b", 2, 7)]).evaluate(table)
    assert by_pos.column("b").equals(want.column("b"))


def test_helpers_resolve_column_names(ds):
    dataset, table = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "user_id", 10)
    assert spec.fields == [
        RegionField("bucket", [0], "bucket", None, "int32", {"num_buckets": "10"})
    ]
    got = spec.evaluate(table, ls).column("bucket").to_pylist()
    assert got == [ref_bucket(h64(1), 10), 4, ref_bucket(h64(-5), 10), None]
    ident = identity_spec(ls, "name")
    assert ident.fields[0].field_id == "name" and ident.fields[0].result_type == "string"
    assert identity_spec(ls, "ts").fields[0].result_type == ""  # tz timestamp: source type
    expr = expression_spec(ls, ["user_id", "name"], "concat(col1, '-', col0)", "utf8")
    assert expr.fields[0].field_id == "expr"
    assert expr.evaluate(table, ls).column(0).to_pylist() == ["ab-1", "abcd-123", "héllo--5", "-"]
    multi = multi_bucket_spec(ls, ["user_id", "name"], 8)
    assert multi.evaluate(table, ls).column(0).to_pylist()[0] == ref_multi([1, "ab"], 8)
    assert truncate_spec(ls, "small", 100).evaluate(table, ls).column(0).to_pylist() == [
        0,
        100,
        -100,
        None,
    ]
    assert temporal_spec(ls, "day", "year").evaluate(table, ls).column(0).to_pylist() == [
        1970,
        2024,
        1969,
        None,
    ]
    assert spec.source_columns(ls) == {"bucket": ["user_id"]}
    with pytest.raises(RegionSpecError, match="'nope'"):
        bucket_spec(ls, "nope", 4)


# -- expressions ----------------------------------------------------------------------
def test_expression_via_datafusion_type_promotion_and_order():
    f = RegionField.from_expression("e", [0], "col0 % 4", "int32")
    for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint32()):
        out = RegionSpec(1, [f]).evaluate(col([5, 6, None, 7], t)).column(0)
        assert out.type == pa.int32() and out.to_pylist() == [1, 2, None, 3]
    n = 50_000  # several DataFusion batches: row order must be preserved
    values = np.arange(n, dtype=np.int64)[::-1].copy()
    got = RegionSpec(1, [f]).evaluate(col(values)).column(0).to_numpy()
    assert (got == values % 4).all()
    up = RegionField.from_expression("u", [0], "upper(col0)", "string")
    assert one(up, ["ab", None, "é"]) == ["AB", None, "É"]
    assert one(up, [], pa.string()) == []
    two = RegionField.from_expression("c", [0, 1], "col0 + col1", "int64")
    batch = pa.record_batch({"a": pa.array([1, 2], pa.int8()), "b": pa.array([10, None])})
    assert RegionSpec(1, [two]).evaluate(batch).column(0).to_pylist() == [11, None]


def test_expression_errors_raise_region_spec_error():
    # unknown functions and statements are refused when the field is built
    with pytest.raises(RegionSpecError, match="'e'.*'no_such_fn'"):
        RegionField.from_expression("e", [0], "no_such_fn(col0)", "int32")
    with pytest.raises(RegionSpecError, match="'e'"):
        RegionField.from_expression("e", [0], "col0) FROM t; SELECT (1", "int32")
    bad = RegionField.from_expression("e", [0], "upper(col0, col0, col0)", "int32")
    with pytest.raises(RegionSpecError, match="'e'.*cannot evaluate"):
        one(bad, [1])
    with pytest.raises(RegionSpecError, match="'e'.*cast"):
        one(RegionField.from_expression("e", [0], "col0 * 1000", "int8"), [1000])


# -- validation and protobuf -----------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(field_id="", source_ids=[0], transform="identity"), "non-empty"),
        (dict(field_id="f", source_ids=[0]), "exactly one of"),
        (dict(field_id="f", source_ids=[0], transform="identity", expression="col0"), "exactly"),
        (dict(field_id="f", source_ids=[0], transform="nope"), "unknown transform"),
        (dict(field_id="f", source_ids=[0, 1], transform="bucket"), "exactly one source"),
        (dict(field_id="f", source_ids=[], transform="identity"), "exactly one source"),
        (dict(field_id="f", source_ids=[], transform="multi_bucket"), "needs source"),
        (dict(field_id="f", source_ids=[0], transform="bucket"), "missing parameter"),
        (
            dict(field_id="f", source_ids=[0], transform="bucket", parameters={"num_buckets": "0"}),
            "positive",
        ),
        (
            dict(field_id="f", source_ids=[0], transform="bucket", parameters={"num_buckets": "x"}),
            "positive",
        ),
        (
            dict(
                field_id="f",
                source_ids=[0, 1],
                transform="multi_bucket",
                parameters={"num_buckets": "-3"},
            ),
            "positive",
        ),
        (
            dict(field_id="f", source_ids=[0], transform="truncate", parameters={"width": "1.5"}),
            "width",
        ),
        (dict(field_id="f", source_ids=[0], transform="truncate"), "width"),
        (dict(field_id="f", source_ids=[0], transform="year", result_type="int64"), "int32"),
        (dict(field_id="f", source_ids=[0], transform="identity", result_type="nope"), "type"),
        (dict(field_id="f", source_ids=[0], expression="col0"), "result_type"),
        (dict(field_id="f", source_ids=[], expression="1", result_type="int32"), "source"),
        (
            dict(field_id="f", source_ids=[0], expression="random()", result_type="float64"),
            "random",
        ),
        (dict(field_id="f", source_ids=[0], expression="now()", result_type="int64"), "now"),
        (dict(field_id="f", source_ids=[-1], transform="identity"), "source field id"),
        (dict(field_id="f", source_ids=["a"], transform="identity"), "source field id"),
    ],
)
def test_invalid_fields_raise_naming_the_field(kwargs, match):
    with pytest.raises(RegionSpecError, match=match) as e:
        RegionField(**kwargs)
    if kwargs["field_id"]:
        assert "'f'" in str(e.value)


def test_invalid_specs():
    f = RegionField.identity("a", 0)
    with pytest.raises(RegionSpecError, match="positive"):
        RegionSpec(0, [f])
    with pytest.raises(RegionSpecError, match="no field"):
        RegionSpec(1, [])
    with pytest.raises(RegionSpecError, match="duplicate.*'a'"):
        RegionSpec(1, [f, RegionField.bucket("a", 1, 3)])
    with pytest.raises(RegionSpecError, match="not a RegionField"):
        RegionSpec(1, [{"field_id": "a"}])


def test_proto_round_trip():
    spec = RegionSpec(
        7,
        [
            RegionField.bucket("b", 3, 16),
            RegionField.from_expression("e", [1, 2], "col0 || col1", "utf8"),
            RegionField.truncate("t", 4, 5),
        ],
    )
    msg = spec.to_proto()
    assert isinstance(msg, pb.RegionSpec)
    assert msg.fields[0].HasField("transform") and not msg.fields[0].HasField("expression")
    assert msg.fields[1].HasField("expression") and not msg.fields[1].HasField("transform")
    back = RegionSpec.from_proto(pb.RegionSpec.FromString(msg.SerializeToString()))
    assert back == spec
    broken = pb.RegionSpec(spec_id=1, fields=[pb.RegionField(field_id="x", source_ids=[0])])
    with pytest.raises(RegionSpecError, match="'x'"):
        RegionSpec.from_proto(broken)


def test_arrow_type_names():
    cases = {
        "int32": pa.int32(),
        "Int64": pa.int64(),
        "utf8": pa.string(),
        "Utf8": pa.string(),
        "string": pa.string(),
        "LargeUtf8": pa.large_string(),
        "date32": pa.date32(),
        "date32[day]": pa.date32(),
        "float": pa.float32(),
        "double": pa.float64(),
        "bigint": pa.int64(),
        "timestamp[us]": pa.timestamp("us"),
        "timestamp[ms, tz=America/New_York]": pa.timestamp("ms", tz="America/New_York"),
        'Timestamp(Microsecond, Some("UTC"))': pa.timestamp("us", tz="UTC"),
        "Timestamp(Nanosecond, None)": pa.timestamp("ns"),
        "decimal128(10, 2)": pa.decimal128(10, 2),
        "Decimal256(50, 3)": pa.decimal256(50, 3),
        "fixed_size_binary[16]": pa.binary(16),
        "time64[us]": pa.time64("us"),
    }
    for name, t in cases.items():
        assert arrow_type_from_name(name) == t, name
    for t in set(cases.values()) | {pa.uint8(), pa.float16(), pa.bool_(), pa.large_binary()}:
        assert arrow_type_from_name(arrow_type_name(t)) == t
    with pytest.raises(RegionSpecError):
        arrow_type_from_name("int33")


# -- pruning --------------------------------------------------------------------------
def test_pruning_spec_example_bucket_user_id_eq_123(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "user_id", 10)
    matching = [b for b in range(10) if spec.may_match({"bucket": b}, [("user_id", "=", 123)], ls)]
    assert matching == [abs(h64(123)) % 10] == [4]
    # the bucket of the value as evaluate() computes it
    assert spec.evaluate(pa.table({"user_id": [123]}), ls).column(0).to_pylist() == [4]
    assert spec.project([("user_id", "=", 123)], ls) == [("bucket", "in", [4])]
    ins = [("user_id", "in", [123, 1, None])]
    assert [b for b in range(10) if spec.may_match({"bucket": b}, ins, ls)] == sorted(
        {4, abs(h64(1)) % 10}
    )
    assert not spec.may_match({"bucket": 4}, [("user_id", "in", [])], ls)


def test_pruning_bucket_converts_literals_to_the_column_type(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "small", 10)  # int32 column: same buckets as int64 by design
    assert spec.project([("small", "=", 123)], ls) == [("bucket", "in", [4])]
    assert spec.project([("small", "=", 123.0)], ls) == [("bucket", "in", [4])]
    assert spec.project([("small", "=", 12.5)], ls) == []  # no lossless int: no pruning
    assert spec.project([("small", "=", "123")], ls) == []
    fspec = bucket_spec(ls, "f", 10)  # float column: an int literal hashes as the double
    want = abs(mmh3.hash(struct.pack("<d", 1.0))) % 10
    assert fspec.project([("f", "=", 1)], ls) == [("bucket", "in", [want])]
    assert spec.project([("small", ">", 5), ("small", "!=", 4)], ls) == []  # ranges: nothing


def test_pruning_unknown_things_never_prune(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "user_id", 10)
    for preds in (
        [("other", "=", 1)],
        [("user_id", "like", 1)],
        [("user_id", "!=", 123)],
        [("user_id", "=", None)],
        [("user_id", "in", "not a list")],
        ["garbage"],
    ):
        assert all(spec.may_match({"bucket": b}, preds, ls) for b in range(10)), preds
    assert spec.may_match({"bucket": None}, [("user_id", "=", 123)], ls)  # NULL region
    assert spec.may_match({}, [("user_id", "=", 123)], ls)  # value unknown
    assert spec.may_match({"bucket": 0}, [("user_id", "=", 123)], None)  # no schema


def test_pruning_identity_exact_and_ranges(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    spec = identity_spec(ls, "user_id")

    def ok(v, preds):
        return spec.may_match({"user_id": v}, preds, ls)

    assert ok(5, [("user_id", "=", 5)]) and not ok(6, [("user_id", "=", 5)])
    assert ok(5, [("user_id", "in", [1, 5])]) and not ok(2, [("user_id", "in", [1, 5])])
    assert ok(5, [("user_id", ">=", 5)]) and not ok(5, [("user_id", ">", 5)])
    assert ok(5, [("user_id", "<=", 5)]) and not ok(5, [("user_id", "<", 5)])
    assert not ok(9, [("user_id", ">", 1), ("user_id", "<", 9)])
    assert ok(5, [("user_id", "<", 5.5)])  # 5.5 is no int64: ignored, never a wrong prune
    sspec = identity_spec(ls, "name")
    assert not sspec.may_match({"name": "b"}, [("name", "<", "abc")], ls)
    assert sspec.may_match({"name": "ab"}, [("name", "<", "abc")], ls)


def test_pruning_monotone_year_and_truncate(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    year = temporal_spec(ls, "ts", "year", field_id="y")
    lo = dt.datetime(2023, 6, 1, tzinfo=UTC)
    hi = dt.datetime(2024, 2, 1, tzinfo=UTC)
    preds = [("ts", ">=", lo), ("ts", "<", hi)]
    assert [y for y in range(2020, 2027) if year.may_match({"y": y}, preds, ls)] == [2023, 2024]
    assert year.project([("ts", "=", hi)], ls) == [("y", "in", [2024])]
    days = temporal_spec(ls, "day", "year", field_id="y")
    assert not days.may_match({"y": 2023}, [("day", ">", dt.date(2024, 1, 1))], ls)
    assert days.may_match({"y": 2024}, [("day", ">", dt.date(2024, 1, 1))], ls)
    trunc = truncate_spec(ls, "user_id", 100, field_id="t")
    preds = [("user_id", ">", 150), ("user_id", "<=", 420)]
    got = [t for t in range(-200, 700, 100) if trunc.may_match({"t": t}, preds, ls)]
    assert got == [100, 200, 300, 400]
    assert trunc.project([("user_id", "=", -1)], ls) == [("t", "in", [-100])]
    strunc = truncate_spec(ls, "name", 2, field_id="t")
    assert not strunc.may_match({"t": "ab"}, [("name", ">=", "ac")], ls)
    assert strunc.may_match({"t": "ac"}, [("name", ">=", "acz")], ls)
    assert not strunc.may_match({"t": "ad"}, [("name", "<", "acz")], ls)


def test_pruning_month_day_hour_only_within_one_period(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    month = temporal_spec(ls, "ts", "month", field_id="m")
    same_year = [
        ("ts", ">=", dt.datetime(2024, 3, 10, tzinfo=UTC)),
        ("ts", "<=", dt.datetime(2024, 5, 2, tzinfo=UTC)),
    ]
    assert [m for m in range(1, 13) if month.may_match({"m": m}, same_year, ls)] == [3, 4, 5]
    across = [
        ("ts", ">=", dt.datetime(2023, 11, 1, tzinfo=UTC)),
        ("ts", "<", dt.datetime(2024, 2, 1, tzinfo=UTC)),
    ]
    assert all(month.may_match({"m": m}, across, ls) for m in range(1, 13))  # cyclic
    assert all(month.may_match({"m": m}, same_year[:1], ls) for m in range(1, 13))
    hour = temporal_spec(ls, "ts", "hour", field_id="h")
    eq = [("ts", "=", dt.datetime(2024, 1, 1, 7, 30, tzinfo=UTC))]
    assert [h for h in range(24) if hour.may_match({"h": h}, eq, ls)] == [7]


def test_pruning_multi_bucket_and_expression_need_all_equalities(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    multi = multi_bucket_spec(ls, ["user_id", "name"], 8)
    both = [("user_id", "=", 123), ("name", "in", ["ab", "abcd"])]
    want = sorted({ref_multi([123, "ab"], 8), ref_multi([123, "abcd"], 8)})
    assert [b for b in range(8) if multi.may_match({"bucket": b}, both, ls)] == want
    only_one = [("user_id", "=", 123)]
    assert all(multi.may_match({"bucket": b}, only_one, ls) for b in range(8))
    expr = expression_spec(ls, ["user_id"], "col0 % 4", "int32")
    assert [v for v in range(4) if expr.may_match({"expr": v}, [("user_id", "=", 7)], ls)] == [3]
    assert all(expr.may_match({"expr": v}, [("user_id", ">", 7)], ls) for v in range(4))


def test_pruner_reuse_matches_may_match(ds):
    dataset, _ = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "user_id", 16)
    preds = [("user_id", "in", [1, 2, 3])]
    check = spec.pruner(preds, ls)
    assert [check({"bucket": b}) for b in range(16)] == [
        spec.may_match({"bucket": b}, preds, ls) for b in range(16)
    ]


# -- pylance's native evaluate_sharding_spec --------------------------------------------
def native_bucket(batch: pa.RecordBatch, schema, source_id: int, n: int) -> list:
    spec = ShardingSpec(
        1,
        [ShardingField("bucket", [source_id], "bucket", None, "int32", {"num_buckets": str(n)})],
    )
    return evaluate_sharding_spec(batch, spec, schema).column(0).to_pylist()


def test_agreement_with_pylance_native_bucket(tmp_path):
    rng = np.random.default_rng(11)
    n = 2000
    ints = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
    words = [
        "".join("abcdefgh"[int(i)] for i in rng.integers(0, 8, 4 * int(k)))
        for k in rng.integers(0, 5, n)
    ]
    table = pa.table(
        {
            "i64": pa.array(ints),
            "u64": pa.array(ints.view(np.uint64)),
            "f64": pa.array(rng.normal(size=n)),
            "ts": pa.array(ints // 1000, pa.timestamp("us")),
            "s4": pa.array(words),  # UTF-8 lengths that are multiples of 4
            "i32": pa.array(ints.astype(np.int32)),
        }
    )
    dataset = lance.write_dataset(table, str(tmp_path / "native"))
    ls = dataset.lance_schema
    batch = table.to_batches()[0]
    for name in ("i64", "u64", "f64", "ts", "s4"):
        fid = field_id_of(ls, name)
        native = native_bucket(batch, ls, fid, 1000)
        ours = bucket_spec(ls, name, 1000).evaluate(batch, ls).column(0).to_pylist()
        hashes = murmur3_hash(table.column(name)).to_pylist()
        # native = (h & 0x7fffffff) % N over the same hash; agrees with abs(h) % N when h >= 0
        assert native == [(h & 0x7FFFFFFF) % 1000 for h in hashes], name
        agree = [o == nv for o, nv in zip(ours, native)]
        assert all(a for a, h in zip(agree, hashes) if h >= 0), name
        assert not all(agree), name  # negative hashes do differ
    # int32 columns: native hashes 4 bytes, so only the int64 reading is type-promotion safe
    i32 = field_id_of(ls, "i32")
    native = native_bucket(batch, ls, i32, 1000)
    four_byte = [
        (mmh3.hash(struct.pack("<i", int(v))) & 0x7FFFFFFF) % 1000 for v in table["i32"].to_pylist()
    ]
    assert native == four_byte
    ours = bucket_spec(ls, "i32", 1000).evaluate(batch, ls).column(0).to_pylist()
    assert ours == [abs(h64(int(v))) % 1000 for v in table["i32"].to_pylist()]
    # identity agrees exactly
    native_id = evaluate_sharding_spec(
        batch, ShardingSpec(1, [ShardingField("x", [0], "identity", None, "", {})]), ls
    )
    ours_id = identity_spec(ls, "i64", field_id="x").evaluate(batch, ls)
    assert ours_id.column("x").equals(native_id.column("x"))


def test_pruning_literal_conveniences_and_lossy_identity_cast():
    schema = pa.schema([pa.field("ts", pa.timestamp("us", tz="UTC")), pa.field("x", pa.float64())])
    year = RegionSpec(1, [RegionField.temporal("y", 0, "year")])
    # a naive datetime on a time-zoned column is UTC; a date is its midnight
    assert year.project([("ts", ">=", dt.datetime(2024, 1, 1))], schema) == [("y", ">=", 2024)]
    assert year.project([("ts", "<", dt.date(2024, 1, 1))], schema) == [("y", "<=", 2024)]
    narrow = RegionSpec(1, [RegionField.identity("i", 1, "float32")])
    (pred,) = narrow.project([("x", "<", 0.1)], schema)
    assert pred[:2] == ("i", "<=")  # float32(0.1) > 0.1: a strict bound would prune wrongly
    assert narrow.may_match({"i": float(np.float32(0.1))}, [("x", "<", 0.1)], schema)


def test_pruning_accepts_numpy_region_values_and_spec_pickles_without_cache(ds):
    import pickle

    dataset, _ = ds
    ls = dataset.lance_schema
    spec = bucket_spec(ls, "user_id", 10)
    assert spec.may_match({"bucket": np.int32(4)}, [("user_id", "=", 123)], ls)
    assert not spec.may_match({"bucket": np.int64(5)}, [("user_id", "=", 123)], ls)
    back = pickle.loads(pickle.dumps(spec))  # the cached projection holds a LanceSchema
    assert back == spec and not back.may_match({"bucket": 5}, [("user_id", "=", 123)], ls)


def test_volatile_guard_ignores_string_literals_and_empty_inputs():
    f = RegionField(
        "f", [0], expression="CASE WHEN col0 = 'now()' THEN 1 ELSE 0 END", result_type="int32"
    )
    assert one(f, ["now()", "x"]) == [1, 0]
    with pytest.raises(RegionSpecError, match="current_date"):
        RegionField("f", [0], expression="col0 + current_date", result_type="date32")
    spec = RegionSpec(1, [RegionField.bucket("b", 0, 4), RegionField.multi_bucket("m", [0, 1], 4)])
    empty = pa.Table.from_batches([], schema=pa.schema([("a", pa.int64()), ("s", pa.string())]))
    out = spec.evaluate(empty)
    assert out.num_rows == 0 and out.schema.types == [pa.int32(), pa.int32()]


def test_the_views_pruner_equals_may_match(ds):
    """read.view's per-query pruner and spec.may_match (projections kept, a set lookup
    for = / IN on int or str region values) answer as satisfies_all of the projected
    predicates for every region value, including values of other types than the
    predicate's (compare() decides there)."""
    from types import SimpleNamespace

    from memwal_query.read.view import _Pruner
    from memwal_query.regions.predicates import satisfies_all

    dataset, _ = ds
    ls = dataset.lance_schema
    specs = {
        0: bucket_spec(ls, "user_id", 16),
        1: identity_spec(ls, "name"),
        2: expression_spec(ls, ["user_id"], "col0 % 4", "int32"),
    }
    table = SimpleNamespace(spec_for=specs.get, lance_schema=ls)
    region_values = {
        0: [{"bucket": b} for b in range(16)] + [{"bucket": None}, {"bucket": "3"}, {}],
        1: [{"name": v} for v in ["ab", "abcd", "zz", None, 7, b"ab"]],
        2: [{"expr": v} for v in [0, 1, 2, 3, 3.0, None, True]],
    }
    cases = [
        [("user_id", "=", 123)],
        [("user_id", "in", [1, 2, 3])],
        [("user_id", "in", [])],
        [("user_id", ">", 7)],
        [("name", "=", "ab")],
        [("name", "in", ["ab", "zz"])],
        [("name", "=", 5)],
        [("user_id", "=", 7), ("name", "=", "abcd")],
    ]
    for preds in cases:
        prune = _Pruner(table, preds)  # type: ignore[arg-type]
        for spec_id, values in region_values.items():
            for v in values:
                # the rule itself: satisfies_all of the projection (compare() per value)
                want = satisfies_all(v, specs[spec_id].project(preds, ls))
                assert specs[spec_id].may_match(v, preds, ls) == want, (preds, spec_id, v)
                assert prune((spec_id, v)) == want, (preds, spec_id, v)
                assert prune((spec_id, v)) == want  # the kept projection too
    assert _Pruner(table, cases[0])((9, {"x": 1}))  # a spec the index does not know
