"""The primary-key BTREE index of a flushed generation, per key type.

Lance builds a BTREE over one column of any scalar type (integers, floats, booleans,
strings, binaries, decimals, temporal types) and over one column only. A flush builds
``__memwal_pk`` on a single-column key and one ``__memwal_pk_{i}`` per column of a
composite key; each test asserts which indexes exist on the generation, that Lance
answers a key filter with them, that lookups by that key type are right, and whether
pylance's native MemWAL reader reads the generation (see docs/compatibility.md).
"""

from __future__ import annotations

import decimal

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from lance.mem_wal import LsmPointLookupPlanner, LsmScanner
from test_native_compat import snapshot

import memwal_query as mq
from memwal_query.storage import paths

from helpers import PK


def _value(t: pa.DataType, i: int):
    if pa.types.is_boolean(t):
        return bool(i % 2)
    if pa.types.is_fixed_size_binary(t):
        return b"%03d" % i
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return b"k\x00%d" % i  # a zero byte inside the key
    if pa.types.is_decimal(t):
        return decimal.Decimal(i) / 4
    if pa.types.is_string(t):
        return f"s{i}"
    return i


# name: (key types, expected {index name: [column]} on the generation)
CASES = {
    "binary": ([pa.binary()], {"__memwal_pk": ["k0"]}),
    "large_binary": ([pa.large_binary()], {"__memwal_pk": ["k0"]}),
    "fixed_size_binary": ([pa.binary(3)], {"__memwal_pk": ["k0"]}),
    "decimal128": ([pa.decimal128(12, 2)], {"__memwal_pk": ["k0"]}),
    "boolean": ([pa.bool_()], {"__memwal_pk": ["k0"]}),
    "composite": (
        [pa.int64(), pa.string()],
        {"__memwal_pk_0": ["k0"], "__memwal_pk_1": ["k1"]},
    ),
    "composite_binary_decimal": (
        [pa.binary(), pa.decimal128(12, 2)],
        {"__memwal_pk_0": ["k0"], "__memwal_pk_1": ["k1"]},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flushed_generation_has_the_key_index(tmp_path, name):
    types, want_indexes = CASES[name]
    composite = len(types) > 1
    n = 2 if types == [pa.bool_()] else 12  # a boolean key has two values
    keys = [f"k{j}" for j in range(len(types))]
    schema = pa.schema(
        [pa.field(k, t, False, PK) for k, t in zip(keys, types)] + [pa.field("v", pa.int64())]
    )

    def rows(ids, v) -> pa.Table:
        cols = {k: pa.array([_value(t, i) for i in ids], t) for k, t in zip(keys, types)}
        cols["v"] = pa.array([v] * len(ids), pa.int64())
        return pa.table(cols, schema=schema)

    uri = str(tmp_path / "t")
    lance.write_dataset(rows(range(n), 0), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    overwritten, new, deleted = [1], ([n, n + 1] if n > 2 else []), ([3] if n > 2 else [0])
    w.put(rows(overwritten + new, 1))
    w.delete(rows(deleted, 0).select(keys))
    w.flush()
    w.close()
    model = {i: 0 for i in range(n)} | {i: 1 for i in overwritten + new}
    for i in deleted:
        del model[i]

    gen = t.catalog.region_manifest(w.region_id).flushed_generations[-1]
    gen_ds = lance.dataset(paths.generation_path(t.uri, w.region_id, gen.path))
    got_indexes = {
        d.name: list(d.field_names) for d in gen_ds.describe_indices() if d.index_type == "BTree"
    }
    assert got_indexes == want_indexes
    # Lance answers a key filter with them (a composite key: the intersection)
    probe = rows([1], 1)
    expr = pc.field(keys[0]) == probe.column(keys[0])[0]
    for k in keys[1:]:
        expr = expr & (pc.field(k) == probe.column(k)[0])
    if not pa.types.is_large_binary(types[0]):  # Lance refuses large_binary filters
        scan = gen_ds.scanner(filter=expr, columns=["v"])
        assert "ScalarIndexQuery" in scan.explain_plan(True)
        assert scan.to_table().column("v").to_pylist() == [1]
    else:  # the SQL form reaches the index
        scan = gen_ds.scanner(filter="k0 = X'6B0031'", columns=["v"])
        assert "ScalarIndexQuery" in scan.explain_plan(True)
        assert scan.to_table().column("v").to_pylist() == [1]

    # lookups by this key type (generation, base, deleted, absent)
    asked = sorted(set(range(n + 3)))
    found = t.lookup(rows(asked, 0).select(keys))
    got = {
        r[keys[0]] if not composite else tuple(r[k] for k in keys): r["v"]
        for r in found.to_pylist()
    }
    want = {
        (_value(types[0], i) if not composite else tuple(_value(tt, i) for tt in types)): v
        for i, v in model.items()
    }
    assert got == want

    # pylance's native reader: single-column keys read the same; a composite key's
    # generation lacks the native `_pk_index/` files (pylance's own encoding of the key
    # tuple), which its scanner requires: documented in docs/compatibility.md.
    snap = snapshot(t, w.region_id)
    if composite:
        with pytest.raises(OSError, match="_pk_index"):
            LsmScanner.from_snapshots(lance.dataset(uri), [snap]).to_table()
        return
    native = LsmScanner.from_snapshots(lance.dataset(uri), [snap]).to_table()
    order = [(c, "ascending") for c in schema.names]
    ours = t.to_table().sort_by(order)
    assert native.select(schema.names).cast(ours.schema).sort_by(order).equals(ours)
    planner = LsmPointLookupPlanner(lance.dataset(uri), [snap])
    for i in [*overwritten, *new, *deleted]:
        hit = planner.plan_lookup(pa.array([_value(types[0], i)], types[0])).to_table()
        assert hit.column("v").to_pylist() == ([model[i]] if i in model else [])
