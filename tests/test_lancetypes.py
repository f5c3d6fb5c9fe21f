"""The rules for what Lance filters and indexes (format/lancetypes.py) match the installed
pylance."""

from __future__ import annotations

import datetime as dt
import decimal

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memwal_query.format.lancetypes import btree_indexable, lance_filterable

UTC = dt.timezone.utc
CASES = {
    "int8": (pa.int8(), [1, 2]),
    "int64": (pa.int64(), [1, 2]),
    "uint32": (pa.uint32(), [1, 2]),
    "uint64": (pa.uint64(), [1, 2]),
    "float32": (pa.float32(), [1.5, 2.5]),
    "float64": (pa.float64(), [1.5, 2.5]),
    "string": (pa.string(), ["a", "b"]),
    "large_string": (pa.large_string(), ["a", "b"]),
    "binary": (pa.binary(), [b"a", b"b"]),
    "large_binary": (pa.large_binary(), [b"a", b"b"]),
    "fixed_size_binary": (pa.binary(2), [b"aa", b"bb"]),
    "bool": (pa.bool_(), [True, False]),
    "date32": (pa.date32(), [dt.date(2020, 1, 1), dt.date(2020, 1, 2)]),
    "date64": (pa.date64(), [dt.date(2020, 1, 1), dt.date(2020, 1, 2)]),
    "decimal128": (pa.decimal128(10, 2), [decimal.Decimal("1.10"), decimal.Decimal("2.20")]),
    "decimal256": (pa.decimal256(40, 2), [decimal.Decimal("1.10"), decimal.Decimal("2.20")]),
    "ts_ms": (pa.timestamp("ms"), [dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 2)]),
    "ts_us_utc": (
        pa.timestamp("us", tz="UTC"),
        [dt.datetime(2020, 1, 1, tzinfo=UTC), dt.datetime(2020, 1, 2, tzinfo=UTC)],
    ),
    "ts_ns": (pa.timestamp("ns"), [dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 2)]),
    "time64": (pa.time64("us"), [dt.time(1), dt.time(2)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_lance(tmp_path, name):
    t, values = CASES[name]
    ds = lance.write_dataset(pa.table({"k": pa.array(values, t)}), str(tmp_path / name))
    filters = [
        pc.field("k") == pa.scalar(values[0], t),
        pc.field("k").isin(pa.array(values[:1], t)),
    ]
    for expr in filters:
        try:
            accepted = ds.to_table(filter=expr).num_rows == 1
        except Exception:  # noqa: BLE001 - refused by Lance's Substrait conversion
            accepted = False
        assert accepted == lance_filterable(t), (name, str(expr))


BTREE_CASES = {
    **CASES,
    "time32": (pa.time32("s"), [1, 2]),
    "duration": (pa.duration("us"), [1, 2]),
    "list": (pa.list_(pa.int64()), [[1], [2]]),
    "struct": (pa.struct([("x", pa.int64())]), [{"x": 1}, {"x": 2}]),
}


@pytest.mark.parametrize("name", sorted(BTREE_CASES))
def test_btree_rule_matches_lance(tmp_path, name):
    """``btree_indexable`` is what Lance builds a BTREE over (a generation's key index)."""
    t, values = BTREE_CASES[name]
    ds = lance.write_dataset(pa.table({"k": pa.array(values, t)}), str(tmp_path / name))
    try:
        ds.create_scalar_index("k", "BTREE", name="k_idx")
        built = [d.index_type for d in ds.describe_indices()] == ["BTree"]
    except Exception:  # noqa: BLE001 - refused by Lance
        built = False
    assert built == btree_indexable(t), name
