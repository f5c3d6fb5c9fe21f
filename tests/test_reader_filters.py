"""Pushed-down filters: every type, meta columns, NaN; same answer as plain DataFusion.

Each table has rows in all three sources (base table, a flushed generation, a live
MemTable), keys overwritten across sources, and a deleted key. The reference is the same
SQL over the deduplicated rows registered as a plain in-memory DataFusion table.
"""

from __future__ import annotations

import datetime as dt

import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq

from helpers import PK

NAN = float("nan")
INF = float("inf")


def _lsm(tmp_path, schema: pa.Schema, base: dict, gen: dict, mem: dict, deleted=()):
    """Base rows, one flushed generation, a live MemTable; returns (table, writer)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table(base, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table(gen, schema=schema))
    w.flush()
    w.put(pa.table(mem, schema=schema))
    if deleted:
        w.delete(pa.table({"id": pa.array(list(deleted), schema.field("id").type)}))
    return t, w


def _contexts(t, w, **kw):
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w], **kw))
    ref = datafusion.SessionContext()
    ref.from_arrow(ctx.sql("SELECT * FROM t").to_arrow_table(), name="t")
    return ctx, ref


def _ids(ctx, where: str) -> list:
    sql = f"SELECT id FROM t WHERE {where} ORDER BY id"
    return ctx.sql(sql).to_arrow_table().column("id").to_pylist()


def _filter_state(provider, expr):
    """Run a filtered scan; return the analysed filter of that query."""
    frags = provider.get_fragments(expr)
    for frag in frags:
        frag.scanner(provider.schema, filter=expr).to_table()
    return frags[0].state.filter


# -- R1: types Lance's Substrait conversion refuses ------------------------------------
ID = pa.field("id", pa.int64(), False, PK)
T0, T1, T2 = (dt.datetime(2024, 1, d) for d in (1, 2, 3))
TYPE_CASES = [
    # (column type, base values, generation values, memtable values, filters)
    (pa.uint64(), [1, 2, 3, 4], [2, 1], [3, 9], ["v = 1", "v > 1", "v IN (1, 9)"]),
    (pa.uint32(), [1, 2, 3, 4], [2, 1], [3, 9], ["v = 1", "v <= 2"]),
    (pa.large_string(), ["a", "b", "c", "d"], ["b", "a"], ["c", "z"], ["v = 'a'", "v > 'b'"]),
    (pa.large_binary(), [b"a", b"b", b"c", b"d"], [b"b", b"a"], [b"c", b"z"], ["v = X'61'"]),
    (pa.timestamp("ns"), [T0, T1, T2, T0], [T1, T0], [T2, T2], ["v > TIMESTAMP '2024-01-01'"]),
    (
        pa.dictionary(pa.int32(), pa.string()),
        ["a", "b", "c", "d"],
        ["b", "a"],
        ["c", "z"],
        ["v = 'a'"],
    ),
]


@pytest.mark.parametrize("vtype,base,gen,mem,filters", TYPE_CASES, ids=lambda x: str(x))
def test_filters_on_types_lance_cannot_push(tmp_path, vtype, base, gen, mem, filters):
    schema = pa.schema([ID, pa.field("v", vtype)])

    def col(values):
        if pa.types.is_dictionary(vtype):
            return pa.array(values).dictionary_encode().cast(vtype)
        return pa.array(values, vtype)

    t, w = _lsm(
        tmp_path,
        schema,
        {"id": [1, 2, 3, 4], "v": col(base)},
        {"id": [1, 2], "v": col(gen)},  # 1 and 2 swap values: newest version decides
        {"id": [3, 5], "v": col(mem)},
        deleted=[4],
    )
    ctx, ref = _contexts(t, w)
    for where in filters:
        assert _ids(ctx, where) == _ids(ref, where), where
    assert _ids(ctx, filters[0])  # not vacuous
    w.close(flush=False)


def test_time64_column_does_not_break_other_filters(tmp_path):
    schema = pa.schema([ID, pa.field("tm", pa.time64("us")), pa.field("x", pa.int64())])
    tm = [dt.time(1)] * 3
    t, w = _lsm(
        tmp_path,
        schema,
        {"id": [1, 2, 3], "tm": tm, "x": [1, 2, 3]},
        {"id": [1], "tm": tm[:1], "x": [20]},
        {"id": [2], "tm": tm[:1], "x": [30]},
    )
    ctx, ref = _contexts(t, w)
    for where in ["id = 1", "x > 2", "x < 3"]:
        assert _ids(ctx, where) == _ids(ref, where), where
    assert _ids(ctx, "x > 2") == [1, 2, 3]
    w.close(flush=False)


def test_fallback_keeps_newest_version_semantics_and_fast_path_stays(tmp_path):
    schema = pa.schema([ID, pa.field("u", pa.uint64()), pa.field("x", pa.int64())])
    t, w = _lsm(
        tmp_path,
        schema,
        {"id": [1, 2, 3], "u": pa.array([1, 2, 1], pa.uint64()), "x": [1, 2, 3]},
        {"id": [1], "u": pa.array([2], pa.uint64()), "x": [0]},  # base matched, newest not
        {"id": [2], "u": pa.array([1], pa.uint64()), "x": [9]},  # base did not, newest does
    )
    p = t.provider(writers=[w])
    assert sorted(p.to_table(filter=pc.field("u") == 1).column("id").to_pylist()) == [2, 3]
    assert sorted(p.to_table(filter=pc.field("x") > 2).column("id").to_pylist()) == [2, 3]
    # Lance refused the uint64 filter and pyarrow filtered; an int64 filter stays in Lance
    assert _filter_state(p, pc.field("u") == pa.scalar(1, pa.uint64())).lance is False
    assert _filter_state(p, pc.field("x") > 2).lance is True
    w.close(flush=False)


# -- R2: filters on _gen / _rowaddr ------------------------------------------------------
def test_filters_on_meta_columns(tmp_path):
    schema = pa.schema([ID, pa.field("x", pa.int64())])
    t, w = _lsm(
        tmp_path,
        schema,
        {"id": [1, 2, 3, 4], "x": [1, 1, 1, 1]},
        {"id": [1], "x": [5]},
        {"id": [3, 6], "x": [9, 9]},
    )
    ctx, ref = _contexts(t, w, meta_columns=True)
    for where in [
        "_gen = 0",
        "_gen > 0",
        "_gen = 2",
        "_rowaddr = 0",
        "_rowaddr > 0 AND _gen = 0",
        "_gen = 0 AND x > 0",
        "_gen = 1 OR x = 9",
    ]:
        assert _ids(ctx, where) == _ids(ref, where), where
    assert _ids(ctx, "_gen = 0") == [2, 4]
    assert _ids(ctx, "_gen > 0") == [1, 3, 6]
    # _gen is constant 0 in the base table: its filter still runs in Lance
    assert _filter_state(t.provider(writers=[w], meta_columns=True), pc.field("_gen") == 0).lance
    w.close(flush=False)


# -- R3: NaN (and -0.0, inf, NULL) -------------------------------------------------------
FLOAT_FILTERS = [
    "f > 2",
    "f >= 2",
    "f < 2",
    "f <= 2",
    "f = 1",
    "f != 1",
    "f = 'NaN'",
    "f != 'NaN'",
    "f > 'NaN'",
    "f >= 'inf'",
    "f < 'inf'",
    "f = 0",
    "f < 0",
    "NOT (f > 2)",
    "f BETWEEN 0 AND 5",
    "f IN (0.0, 1.0)",
    # IN lists of 4+ values: DataFusion's hash lookup tells -0.0 from 0.0 (shorter lists
    # become ORs of =, which do not), Lance (base rows) does not: every source follows =.
    # Expected: positions in VALUES.
    ("f IN (0.0, 1.0, 2.0, 3.0, 'NaN')", [0, 1, 2, 3, 4]),
    ("f NOT IN (0.0, 1.0, 2.0, 3.0)", [0, 5, 6]),
    "f = g",
    "f > g",
    "f <= g",
    "f IS NULL",
    "f > 2 OR g = 1",
]
VALUES = [NAN, -0.0, 0.0, 1.0, 3.0, INF, -INF, None]


@pytest.mark.parametrize("extra", [None, pa.uint64()], ids=["lance-filter", "pyarrow-filter"])
def test_float_filters_agree_with_datafusion_in_every_source(tmp_path, extra):
    """Every float value in every source; with a uint64 column Lance refuses the filter."""
    fields = [ID, pa.field("f", pa.float64()), pa.field("g", pa.float64())]
    if extra is not None:
        fields.append(pa.field("u", extra))
    schema = pa.schema(fields)
    n = len(VALUES)
    # No -0.0 facing +0.0 in f and g: Lance orders -0.0 below +0.0 between two columns
    # (total order), DataFusion 55 and pyarrow do not (documented, not emulated).
    g = [NAN, 1.0, 0.0, 3.0, 1.0, INF, NAN, 1.0]

    def rows(offset):
        out = {"id": [offset + i for i in range(n)], "f": VALUES, "g": g}
        if extra is not None:
            out["u"] = pa.array(range(n), extra)
        return out

    # ids 0..7 only in the base, 100.. only in the generation, 200.. only in the MemTable
    t, w = _lsm(tmp_path, schema, rows(0), rows(100), rows(200))
    ctx, ref = _contexts(t, w)
    for where in FLOAT_FILTERS:
        where, positions = where if isinstance(where, tuple) else (where, None)
        got = _ids(ctx, where)
        if positions is None:
            assert got == _ids(ref, where), where
        else:
            assert got == [o + i for o in (0, 100, 200) for i in positions], where
        # and the same answer whichever source a row lives in
        assert [i for i in got if i < 100] == [i - 100 for i in got if 100 <= i < 200], where
        assert [i for i in got if i < 100] == [i - 200 for i in got if i >= 200], where
    assert _ids(ctx, "f > 2") == [0, 4, 5, 100, 104, 105, 200, 204, 205]  # NaN > 2
    w.close(flush=False)


def test_decode_round_trips_pushed_expressions():
    from memwal_query.read import exprtree

    exprs = [
        pc.field("a") > pa.scalar(2, pa.uint64()),
        (pc.field("s") == "x") | pc.field("f").is_null(nan_is_null=True),
        pc.field("f").isin([1.0, 2.0]) & ~pc.field("b"),
        pc.field("t") < pa.scalar(dt.datetime(2024, 1, 1), pa.timestamp("ns")),
        pc.field("x").cast(pa.float32()) >= 1.5,
    ]
    for e in exprs:
        node = exprtree.decode(e)
        assert node is not None, e
        assert exprtree.encode(node).equals(e), e
    assert exprtree.fields_of(exprtree.decode(exprs[1])) == {"s", "f"}


def test_sql_text_filter_on_a_table_read_is_a_typed_error_naming_it(tmp_path):
    # Lance's to_table takes SQL text; a table read takes an Expression and says so
    # (searches take both), instead of pyarrow's error deep inside the scan.
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    t, w = _lsm(
        tmp_path, schema, {"id": [1, 2], "x": [1, 2]}, {"id": [2], "x": [7]}, {"id": [1], "x": [5]}
    )
    for read in (t.to_table, t.provider(writers=[w]).to_table):
        with pytest.raises(mq.SchemaError, match=r"filter 'x = 7'.*pc\.field"):
            read(filter="x = 7")
    assert t.to_table(filter=pc.field("x") == 7)["id"].to_pylist() == [2]
