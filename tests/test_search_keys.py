"""Point lookup in the base table is exact for every primary-key type (real tables).

Keys were written into the base filter as SQL literals: a nanosecond timestamp lost its
nanoseconds (wrong or missing rows), decimal and inf/NaN keys failed.
"""

import datetime as dt
import decimal

import lance
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK

UTC = dt.timezone.utc

CASES = [
    ("ts_ns", [pa.timestamp("ns")], [(1_000_000_001,), (1_000_000_002,), (1_000_000_000,)]),
    ("ts_ns_utc", [pa.timestamp("ns", tz="UTC")], [(1_000_000_001,), (1_000_000_002,)]),
    (
        "ts_kolkata",
        [pa.timestamp("us", tz="Asia/Kolkata")],
        [(dt.datetime(2024, 1, 1, tzinfo=UTC),), (dt.datetime(2024, 1, 2, tzinfo=UTC),)],
    ),
    (
        "decimal",
        [pa.decimal128(10, 2)],
        [(decimal.Decimal("1.10"),), (decimal.Decimal("2.00"),), (decimal.Decimal("-0.5"),)],
    ),
    ("float_inf_nan", [pa.float64()], [(float("inf"),), (float("nan"),), (1.5,)]),
    ("time64", [pa.time64("us")], [(dt.time(1, 2, 3),), (dt.time(4, 5, 6),)]),
    ("date64", [pa.date64()], [(dt.date(2020, 1, 1),), (dt.date(2020, 1, 2),)]),
    ("large_string", [pa.large_string()], [("a",), ("b'",)]),
    ("string_quotes", [pa.string()], [("a'b",), ("c\\",)]),
    ("uint64", [pa.uint64()], [(2**63 + 5,), (1,)]),
    (
        "composite",
        [pa.string(), pa.timestamp("ns"), pa.decimal128(5, 1)],
        [
            ("a", 1, decimal.Decimal("1.0")),
            ("a", 2, decimal.Decimal("1.0")),
            ("b", 1, decimal.Decimal("2.0")),
        ],
    ),
]


@pytest.mark.parametrize("name,types,rows", CASES, ids=[c[0] for c in CASES])
def test_base_lookup_is_exact_for_every_key_type(tmp_path, name, types, rows):
    uri = str(tmp_path / "base")
    names = [f"k{i}" for i in range(len(types))]
    fields = [pa.field(n, t, nullable=False, metadata=PK) for n, t in zip(names, types)]
    schema = pa.schema([*fields, pa.field("v", pa.int64())])
    cols = {n: pa.array([r[i] for r in rows], t) for i, (n, t) in enumerate(zip(names, types))}
    cols["v"] = pa.array(range(len(rows)), pa.int64())
    data = pa.table(cols, schema=schema)
    lance.write_dataset(data, uri)
    t = mq.MemWalTable.initialize(uri)
    for probe in ([0], list(range(len(rows))), [len(rows) - 1, 0]):
        keys = data.take(probe).select(names)
        arg = keys if len(names) > 1 else keys.column(0)
        assert t.lookup(arg).column("v").to_pylist() == probe
