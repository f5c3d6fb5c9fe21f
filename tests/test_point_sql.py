"""Key-pinned reads: a filter pinning the primary key (``id = k``, ``id IN (...)``) reads
the newer sources for those keys only (their generations' key index files, MemTable
and WAL tail rows), with the answer of a model and of the full view: deletes, keys in
several generations and regions, absent keys, NULL literals, literal casts and other
predicates; a damaged or missing key index file is read around (same answer)."""

from __future__ import annotations

import os
import warnings

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query.format import keyfile
from memwal_query.format.rowfile import seal
from memwal_query.format.schema import TOMBSTONE
from memwal_query.read import newer, pointview
from memwal_query.storage import paths

from helpers import PK, clear_read_caches, damage_file

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64()), pa.field("c", pa.int32())]
)
KEYS = 260  # keys drawn from [-5, KEYS): some never written, some deleted


def _rows(keys, v: int) -> pa.Table:
    keys = np.asarray(keys, np.int64)
    return pa.table(
        {"id": keys, "v": np.full(len(keys), v, np.int64), "c": (keys % 5).astype(np.int32)},
        schema=SCHEMA,
    )


def _build(tmp_path, seed: int, regions: int = 3) -> tuple[mq.MemWalTable, dict]:
    """A base, random upserts and deletes over several flushed generations (some keys
    written twice in a generation, some deleted and written again), then unflushed
    writes and deletes on top; the model: key -> (v, c)."""
    rng = np.random.default_rng(seed)
    uri = str(tmp_path / "t")
    base = np.arange(0, 200, 2)
    lance.write_dataset(_rows(base, 0), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = {int(k): (0, int(k) % 5) for k in base}

    def put(keys, v):
        t.write(_rows(keys, v))
        model.update({int(k): (v, int(k) % 5) for k in keys})

    def delete(keys):
        t.delete(pa.table({"id": pa.array(keys, pa.int64())}))
        for k in keys:
            model.pop(int(k), None)

    v = 0
    for _ in range(int(rng.integers(3, 6))):
        v += 1
        keys = rng.choice(KEYS, int(rng.integers(10, 60)), replace=False)
        put(keys, v)
        v += 1
        put(keys[::3], v)  # a second version in the same generation
        delete(rng.choice(KEYS, int(rng.integers(1, 15)), replace=False))
        v += 1
        put(rng.choice(KEYS, 5, replace=False), v)
        t.flush()
    v += 1
    put(rng.choice(KEYS, 20, replace=False), v)  # unflushed: MemTable (WAL tail elsewhere)
    delete(rng.choice(KEYS, 5, replace=False))
    return t, model


def _sql(ctx: datafusion.SessionContext, where: str) -> dict:
    got = ctx.sql(f"SELECT id, v, c FROM t WHERE {where}").to_arrow_table().to_pydict()
    out = {k: (v, c) for k, v, c in zip(got["id"], got["v"], got["c"])}
    assert len(out) == len(got["id"]), "a key twice"
    return out


def _unpushed(monkeypatch, ctx: datafusion.SessionContext, where: str) -> dict:
    """:func:`_sql` through the full view (no key-pinned read)."""
    with monkeypatch.context() as m:
        m.setattr(pointview, "POINT_KEYS_MAX", 0)
        return _sql(ctx, where)


def _queries(rng: np.random.Generator, model: dict) -> list[tuple[str, set[int], object]]:
    """(SQL condition, pinned keys, residual row predicate on (v, c)) triples."""
    live = sorted(model)
    out = []
    for _ in range(6):
        n = int(rng.integers(1, 12))
        keys = {int(k) for k in rng.integers(-5, KEYS + 5, n)} | {
            int(k) for k in rng.choice(live, 2, replace=False)
        }
        listed = ", ".join(map(str, sorted(keys)))
        out.append((f"id IN ({listed})", keys, None))
        out.append((f"id IN ({listed}) AND c <> 2", keys, lambda v, c: c != 2))
        k = sorted(keys)[0]
        out.append((f"id = {k}", {k}, None))
        out.append((f"{k} = id AND v >= 1", {k}, lambda v, c: v >= 1))
        both = sorted(keys)[: max(1, len(keys) // 2)]
        out.append((f"id IN ({listed}) AND id IN ({', '.join(map(str, both))})", set(both), None))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_pinned_queries_match_the_model_and_the_full_view(tmp_path, seed, monkeypatch):
    t, model = _build(tmp_path, seed)
    rng = np.random.default_rng(100 + seed)
    reader = mq.MemWalTable.open(t.uri)  # another table object: the WAL tail
    for table in (t, reader):
        ctx = datafusion.SessionContext()
        ctx.register_table("t", table.provider())
        for where, keys, residual in _queries(rng, model):
            want = {
                k: row
                for k, row in model.items()
                if k in keys and (residual is None or residual(*row))
            }
            assert _sql(ctx, where) == want, where
            assert _unpushed(monkeypatch, ctx, where) == want, where
        keys = sorted(rng.choice(KEYS, 8, replace=False).tolist())
        got = table.to_table(filter=pc.field("id").isin(keys)).to_pydict()
        assert dict(zip(got["id"], zip(got["v"], got["c"]))) == {
            k: model[k] for k in keys if k in model
        }
    t.close()


def test_literals_nulls_and_casts_answer_as_the_full_view(tmp_path, monkeypatch):
    t, model = _build(tmp_path, 7)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    k = sorted(model)[3]
    for where in (
        f"id = {k}.0",
        f"id = '{k}'",
        f"id IN ({k}, NULL)",
        "id = NULL",
        f"id IN ({k}) AND id = {k + 1}",
        f"id = {k} OR c = 1",
        f"id = {2**63 - 1}",
        f"id IN ({k}, -1, -9223372036854775808)",
    ):
        want = _unpushed(monkeypatch, ctx, where)
        assert _sql(ctx, where) == want, where
    assert _sql(ctx, f"id IN ({k}, NULL)") == {k: model[k]}
    t.close()


def test_pinned_keys_are_read_from_the_pinned_generations_only(tmp_path, monkeypatch):
    """The pushdown is taken: no full view is built, and only generations holding a
    pinned key have rows read; without it the full view is built."""
    t, model = _build(tmp_path, 3)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    full: list[int] = []
    real_view = newer.newer_view
    monkeypatch.setattr(newer, "newer_view", lambda *a, **k: full.append(1) or real_view(*a, **k))
    read: list[str] = []
    real_read = pointview.read_generation

    def counting(ref, *a, **k):
        read.append(ref.uri)
        return real_read(ref, *a, **k)

    monkeypatch.setattr(pointview, "read_generation", counting)
    k = sorted(model)[5]
    assert _sql(ctx, f"id = {k}") == {k: model[k]}
    assert full == []
    holding = set()
    for r in t.catalog.region_ids():
        for g in t.catalog.region_manifest(r).flushed_generations:
            uri = paths.generation_path(t.uri, r, g.path)
            index = keyfile.read_index(t.catalog.io, uri, None)
            assert index is not None  # the flush wrote one
            if k in set(index.keys.tolist()):
                holding.add(uri)
    assert set(read) <= holding
    read.clear()
    assert _sql(ctx, "id = -3") == {}  # in no source: no generation row read
    assert read == [] and full == []
    assert _unpushed(monkeypatch, ctx, f"id = {k}") == {k: model[k]}
    assert full  # the full view
    t.close()


def _index_files(t: mq.MemWalTable) -> list[str]:
    out = []
    for r in t.catalog.region_ids():
        for g in t.catalog.region_manifest(r).flushed_generations:
            path = os.path.join(paths.generation_path(t.uri, r, g.path), keyfile.KEY_INDEX_FILE)
            assert os.path.exists(path)
            out.append(path)
    return out


@pytest.mark.parametrize("damage", ["flipped", "missing", "replaced"])
def test_damaged_or_missing_key_index_reads_the_generation_keys(tmp_path, damage):
    t, model = _build(tmp_path, 5)
    t.flush()
    files = _index_files(t)
    for path in files[1:]:  # "replaced": another generation's (it names its generation)
        damage_file(path, damage, donor=files[0])
    if damage != "replaced":
        damage_file(files[0], damage)
    clear_read_caches()
    reader = mq.MemWalTable.open(t.uri)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", reader.provider())
    keys = sorted(model)[::7] + [-2, KEYS + 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _sql(ctx, f"id IN ({', '.join(map(str, keys))})")
    assert got == {k: model[k] for k in keys if k in model}
    named = [w for w in caught if keyfile.KEY_INDEX_FILE in str(w.message)]
    assert bool(named) == (damage != "missing")
    t.close()


def test_a_key_index_listing_rows_of_other_keys_is_a_typed_error(tmp_path):
    """A well-formed key index whose rows do not hold its keys is named, never read
    as a shorter or different answer."""
    t, model = _build(tmp_path, 6)
    t.flush()
    path = _index_files(t)[0]
    gen_dir = os.path.basename(os.path.dirname(path))
    index = keyfile.decode_index(open(path, "rb").read(), path, gen_dir, None)
    assert len(index.keys) >= 2
    lying = pa.table(
        {
            keyfile.INDEX_KEY: index.keys,
            keyfile.INDEX_ROW: np.roll(index.rows, 1),  # each key pointing at another's row
            TOMBSTONE: index.tombstone,
        }
    ).replace_schema_metadata(
        {b"memwal.rows": str(index.num_rows).encode(), b"memwal.generation": gen_dir.encode()}
    )
    open(path, "wb").write(seal(lying, b"MWX1"))
    clear_read_caches()
    ctx = datafusion.SessionContext()
    ctx.register_table("t", mq.MemWalTable.open(t.uri).provider())
    with pytest.raises(Exception, match="CorruptFileError.*memwal_key_index.bin.*other keys"):
        _sql(ctx, f"id = {int(index.keys[0])}")
    t.close()


def test_pinned_keys_of_a_filter():
    schema = SCHEMA
    pk = ["id"]

    def ids(preds):
        return pointview.pinned_keys(preds, schema, pk).column("id").to_pylist()

    assert ids([("id", "in", [3, 1, 3])]) == [1, 3]
    assert ids([("id", "in", [3, None])]) == [3]
    assert ids([("id", "in", [1, 2, 3]), ("c", "=", 1), ("id", "=", 2)]) == [2]
    assert ids([("id", "=", 1), ("id", "=", 2)]) == []
    for no in (
        [("id", "=", 5.0)],
        [("id", "=", "5")],
        [("id", "=", True)],
        [("id", "<", 5)],
        [("c", "=", 5)],
        [("id", "=", 2**64)],
        [("id", "in", list(range(pointview.POINT_KEYS_MAX + 1)))],
    ):
        assert pointview.pinned_keys(no, schema, pk) is None, no
    assert pointview.pinned_keys([("id", "=", 1)], schema, ["id", "c"]) is None  # c unpinned
    got = pointview.pinned_keys([("id", "in", [2, 1]), ("c", "=", 4)], schema, ["id", "c"])
    assert got.to_pydict() == {"id": [1, 2], "c": [4, 4]}
    assert got.schema.field("c").type == pa.int32()
    for t in (pa.string(), pa.large_string()):
        text = pa.schema([pa.field("id", t, False, PK)])
        got = pointview.pinned_keys([("id", "in", ["b", "a", None])], text, pk)
        assert got.column("id").to_pylist() == ["a", "b"] and got.schema.field(0).type == t
        assert pointview.pinned_keys([("id", "=", 1)], text, pk) is None
    either = (pc.field("id") == 1) & (pc.field("c") == 2) | (pc.field("c") == 3) & (
        pc.field("id") == 4
    )
    got = pointview.pinned_keys_of(either & (pc.field("v") > 0), schema, ["id", "c"])
    assert sorted(zip(*got.to_pydict().values())) == [(1, 2), (4, 3)]
    half = (pc.field("id") == 1) & (pc.field("c") == 2) | (pc.field("id") == 4)
    assert pointview.pinned_keys_of(half, schema, ["id", "c"]) is None  # c free in one
    binary = pa.schema([pa.field("id", pa.binary(), False, PK)])
    assert pointview.pinned_keys([("id", "=", b"a")], binary, pk) is None
    pair = ["id", "c"]
    many = [("id", "in", list(range(40))), ("c", "in", list(range(30)))]
    assert pointview.pinned_keys(many, schema, pair) is None  # 1,200 combinations


def test_narrow_integer_key_and_meta_columns_are_pinned(tmp_path, monkeypatch):
    """An int32 key is pinned too; ``_gen`` and ``_rowaddr`` of the pinned rows are
    the full view's."""
    schema = pa.schema([pa.field("id", pa.int32(), False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "t")
    lance.write_dataset(
        pa.table({"id": pa.array(range(300), pa.int32()), "v": [0] * 300}, schema=schema), uri
    )
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    rng = np.random.default_rng(2)
    for g in range(3):
        ids = rng.choice(400, 80, replace=False)
        t.write(pa.table({"id": pa.array(ids, pa.int32()), "v": [g + 1] * 80}, schema=schema))
        t.flush()
    t.write(pa.table({"id": pa.array([1, 2, 350], pa.int32()), "v": [9, 9, 9]}, schema=schema))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(meta_columns=True))
    full: list[int] = []
    real_view = newer.newer_view
    monkeypatch.setattr(newer, "newer_view", lambda *a, **k: full.append(1) or real_view(*a, **k))
    keys = ", ".join(map(str, sorted(set(rng.choice(400, 12).tolist()) | {1, 350, 999})))
    for where in (f"id IN ({keys})", f"id IN ({keys}) AND _gen > 0"):
        sql = f"SELECT id, v, _gen, _rowaddr FROM t WHERE {where} ORDER BY id"
        got = ctx.sql(sql).to_arrow_table()
        assert full == []
        with monkeypatch.context() as m:
            m.setattr(pointview, "POINT_KEYS_MAX", 0)
            assert ctx.sql(sql).to_arrow_table().equals(got)
        assert full
        full.clear()
    t.close()


# -- string and composite keys ---------------------------------------------------------
# A model key n (an int, as above) is the string key "k{n}", or the composite key
# (a, b) = (n mod 7, "s{n div 7}").
def _kind_schema(kind: str) -> pa.Schema:
    if kind == "str":
        keys = [pa.field("id", pa.string(), False, PK)]
    else:
        keys = [pa.field("a", pa.int64(), False, PK), pa.field("b", pa.string(), False, PK)]
    return pa.schema([*keys, pa.field("v", pa.int64()), pa.field("c", pa.int32())])


def _kind_keys(kind: str, keys) -> dict:
    keys = [int(k) for k in keys]
    if kind == "str":
        return {"id": [f"k{k}" for k in keys]}
    return {"a": [k % 7 for k in keys], "b": [f"s{k // 7}" for k in keys]}


def _kind_rows(kind: str, keys, v: int) -> pa.Table:
    cols = _kind_keys(kind, keys)
    n = len(keys)
    c = (np.asarray(keys, np.int64) % 5).astype(np.int32)
    return pa.table({**cols, "v": np.full(n, v, np.int64), "c": c}, schema=_kind_schema(kind))


def _kind_build(tmp_path, seed: int, kind: str) -> tuple[mq.MemWalTable, dict]:
    """:func:`_build` with string or composite keys."""
    rng = np.random.default_rng(seed)
    uri = str(tmp_path / "t")
    lance.write_dataset(_kind_rows(kind, np.arange(0, 200, 2), 0), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id" if kind == "str" else "b", 3)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = {int(k): (0, int(k) % 5) for k in range(0, 200, 2)}
    names = list(t.primary_key)

    def put(keys, v):
        t.write(_kind_rows(kind, keys, v))
        model.update({int(k): (v, int(k) % 5) for k in keys})

    def delete(keys):
        t.delete(_kind_rows(kind, keys, 0).select(names))
        for k in keys:
            model.pop(int(k), None)

    v = 0
    for _ in range(int(rng.integers(3, 5))):
        v += 1
        keys = rng.choice(KEYS, int(rng.integers(10, 60)), replace=False)
        put(keys, v)
        v += 1
        put(keys[::3], v)
        delete(rng.choice(KEYS, int(rng.integers(1, 15)), replace=False))
        t.flush()
    v += 1
    put(rng.choice(KEYS, 20, replace=False), v)
    delete(rng.choice(KEYS, 5, replace=False))
    return t, model


def _kind_sql(ctx, kind: str, where: str) -> dict:
    cols = "id" if kind == "str" else "a, b"
    got = ctx.sql(f"SELECT {cols}, v, c FROM t WHERE {where}").to_arrow_table().to_pydict()
    if kind == "str":
        ns = [int(s[1:]) for s in got["id"]]
    else:
        ns = [7 * int(b[1:]) + a for a, b in zip(got["a"], got["b"])]
    out = {n: (v, c) for n, v, c in zip(ns, got["v"], got["c"])}
    assert len(out) == len(ns), "a key twice"
    return out


def _kind_queries(rng, model: dict, kind: str) -> list[tuple[str, set[int], object]]:
    """(SQL condition, the model keys it pins, residual predicate) triples."""
    live = sorted(model)
    out = []
    for _ in range(5):
        picked = {int(k) for k in rng.integers(-5, KEYS + 5, int(rng.integers(1, 8)))}
        picked |= {int(k) for k in rng.choice(live, 2, replace=False)}
        k = sorted(picked)[0]
        if kind == "str":
            listed = ", ".join(f"'k{n}'" for n in sorted(picked))
            out.append((f"id IN ({listed})", picked, None))
            out.append((f"id IN ({listed}, NULL) AND c <> 2", picked, lambda v, c: c != 2))
            out.append((f"id = 'k{k}'", {k}, None))
            out.append((f"'k{k}' = id AND v >= 1", {k}, lambda v, c: v >= 1))
        else:
            a_s = sorted({n % 7 for n in picked})
            b_s = sorted({n // 7 for n in picked})
            product = {7 * b + a for a in a_s for b in b_s}
            in_a = ", ".join(map(str, a_s))
            in_b = ", ".join(f"'s{b}'" for b in b_s)
            out.append((f"a IN ({in_a}) AND b IN ({in_b})", product, None))
            out.append(
                (f"b IN ({in_b}) AND c <> 2 AND a IN ({in_a})", product, lambda v, c: c != 2)
            )
            out.append((f"a = {k % 7} AND b = 's{k // 7}'", {k}, None))
            out.append((f"'s{k // 7}' = b AND {k % 7} = a AND v >= 1", {k}, lambda v, c: v >= 1))
            j = sorted(picked)[-1]  # whole keys by OR: their union (not every combination)
            either = f"(a = {k % 7} AND b = 's{k // 7}') OR (b = 's{j // 7}' AND a = {j % 7})"
            out.append((either, {k, j}, None))
            out.append((f"({either}) AND c <> 2", {k, j}, lambda v, c: c != 2))
    return out


def _kind_unpushed(monkeypatch, ctx, kind: str, where: str) -> dict:
    with monkeypatch.context() as m:
        m.setattr(pointview, "POINT_KEYS_MAX", 0)
        return _kind_sql(ctx, kind, where)


@pytest.mark.parametrize("kind", ["str", "pair"])
@pytest.mark.parametrize("seed", range(2))
def test_string_and_composite_keys_match_the_model_and_the_full_view(
    tmp_path, seed, kind, monkeypatch
):
    t, model = _kind_build(tmp_path, seed, kind)
    rng = np.random.default_rng(200 + seed)
    full: list[int] = []
    real_view = newer.newer_view
    monkeypatch.setattr(newer, "newer_view", lambda *a, **k: full.append(1) or real_view(*a, **k))
    reader = mq.MemWalTable.open(t.uri)  # another table object: the WAL tail
    for table in (t, reader):
        ctx = datafusion.SessionContext()
        ctx.register_table("t", table.provider())
        for where, keys, residual in _kind_queries(rng, model, kind):
            want = {
                k: row
                for k, row in model.items()
                if k in keys and (residual is None or residual(*row))
            }
            assert _kind_sql(ctx, kind, where) == want, where
            if "NULL" not in where:  # DataFusion may hand an IN with NULL as an OR
                assert full == [], where  # the key-pinned view, not the full one
            assert _kind_unpushed(monkeypatch, ctx, kind, where) == want, where
            full.clear()
    # not pinned (a key column left free, a cast): the full view, the same answer
    if kind == "pair":
        k = sorted(model)[1]
        where = f"a = {k % 7} AND c = {k % 5}"
        got = _kind_sql(ctx, kind, where)
        assert full
        assert got == {n: r for n, r in model.items() if n % 7 == k % 7 and r[1] == k % 5}
    t.close()


_ODD_CONDITIONS = {
    "str": [
        ("id = 'k4 '", True),  # trailing space: another key
        ("id = 'K4'", True),  # no case folding
        ("id = ''", True),
        ("id = '\u2603' OR id = 'k4'", True),
        ("id IN ('k4', 'k4', 'k6', 'k4')", True),
        ("id = 'k4' AND NOT (id = 'k4')", True),
        ("id IN ('k4', 'k6') AND id NOT IN ('k4')", True),
        ("(id = 'k4' AND v >= 1) OR id = 'k6'", True),
        ("(id = 'k4' OR c = 1) AND id = 'k6'", True),
        ("NOT (id != 'k4' AND id != 'k6')", True),
        ("id = arrow_cast('k4', 'LargeUtf8')", True),
        ("id = arrow_cast('k4', 'Dictionary(Int32, Utf8)')", True),
        ("arrow_cast(id, 'LargeUtf8') = 'k4'", True),  # DataFusion drops the cast
        ("id = 'k4' OR v = 3", False),
        ("NOT (id = 'k4' OR id = 'k6') AND v > 3", False),
        ("(id = 'k4') IS NOT FALSE", False),
    ],
    "pair": [
        ("a = 4 AND b IN ('s0', 's1', 's2', 's0')", True),
        ("(a = 4 AND b = 's0') OR a = 2", False),  # a disjunct pins part of the key
        ("(a = 4 AND b = 's0') OR b = 's2'", False),
        ("(a = 4 AND b = 's0') OR c = 1", False),
        ("(a = 4 AND b = 's0') OR (a = 1 AND c = 1)", False),
        ("(a = 4 AND b = 's0') OR (a = 1 AND b <> 's1')", False),
        ("NOT ((a = 4 AND b = 's0') OR (a = 1 AND b = 's1')) AND v > 3", False),
        ("(a = 4 AND b = 's0') OR (a IN (1, 2) AND b IN ('s1', 's2'))", True),
        ("((a = 4 AND b = 's0') OR (a = 1 AND b = 's1')) AND NOT (a = 4)", True),
        ("(a = 4 AND b = 's0' AND v > 100) OR (a = 1 AND b = 's1')", True),
        ("(a = 4 AND b = 's0') OR (a = 1 AND b = 's1' AND b = 's2')", True),
        ("a = '4' AND b = 's0'", True),  # DataFusion casts the literal
        ("a = 4.0 AND b = 's0'", False),  # ... and here the column
        ("a = 99999999999999999999 AND b = 's0'", False),
        (
            "a IN (0, 1, 2, 3, 4, 5, 6) AND b IN ({})".format(  # 7 x 200 > 1,024 keys
                ", ".join(f"'s{i}'" for i in range(200))
            ),
            False,
        ),
    ],
}


@pytest.mark.parametrize("kind", ["str", "pair"])
def test_odd_conditions_answer_as_the_full_view(tmp_path, kind, monkeypatch):
    """Conditions at the edge of what pins the key (partial keys in a disjunct, key and
    non-key columns mixed, negations, duplicates, casts, near-miss strings, too many
    keys): the key-pinned read is taken exactly when listed, and every answer is the
    full view's."""
    t, _ = _kind_build(tmp_path, 1, kind)
    full: list[int] = []
    real_view = newer.newer_view
    monkeypatch.setattr(newer, "newer_view", lambda *a, **k: full.append(1) or real_view(*a, **k))
    for table in (t, mq.MemWalTable.open(t.uri)):  # the second one reads the WAL tail
        ctx = datafusion.SessionContext()
        ctx.register_table("t", table.provider())
        for where, pinned in _ODD_CONDITIONS[kind]:
            full.clear()
            got = _kind_sql(ctx, kind, where)
            assert (not full) == pinned, where
            assert got == _kind_unpushed(monkeypatch, ctx, kind, where), where
    t.close()


@pytest.mark.parametrize("kind", ["str", "pair"])
def test_string_and_composite_keys_as_of_a_version(tmp_path, kind, monkeypatch):
    """A time-travel read pins the keys on that version's view."""
    t, model = _kind_build(tmp_path, 4, kind)
    t.flush()
    t.maintenance.merge()
    version = lance.dataset(t.uri).version
    old = dict(model)
    keys = sorted(model)[:6] + [KEYS + 2]
    t.write(_kind_rows(kind, keys[:3], 77))
    t.delete(_kind_rows(kind, keys[3:5], 0).select(list(t.primary_key)))
    t.flush()
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(as_of=version))
    if kind == "str":
        where = "id IN ({})".format(", ".join(f"'k{n}'" for n in keys))
        want = {n: old[n] for n in keys if n in old}
    else:
        where = f"a = {keys[0] % 7} AND b = 's{keys[0] // 7}'"
        want = {n: old[n] for n in keys[:1] if n in old}
    assert _kind_sql(ctx, kind, where) == want
    assert _kind_unpushed(monkeypatch, ctx, kind, where) == want
    t.close()


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_string_keys_with_damaged_keys_files_read_the_generation_keys(tmp_path, damage):
    """String keys are found through the region keys files and keys sidecars: damaged
    or missing, the generations' own keys are read (same answer)."""
    t, model = _kind_build(tmp_path, 5, "str")
    t.flush()
    for r in t.catalog.region_ids():
        for g in t.catalog.region_manifest(r).flushed_generations:
            gen = paths.generation_path(t.uri, r, g.path)
            for name in (keyfile.REGION_KEYS_FILE, keyfile.KEYS_FILE):
                if os.path.exists(os.path.join(gen, name)):
                    damage_file(os.path.join(gen, name), damage)
    clear_read_caches()
    ctx = datafusion.SessionContext()
    ctx.register_table("t", mq.MemWalTable.open(t.uri).provider())
    keys = sorted(model)[::7] + [-2, KEYS + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _kind_sql(ctx, "str", "id IN ({})".format(", ".join(f"'k{n}'" for n in keys)))
    assert got == {k: model[k] for k in keys if k in model}
    t.close()


# -- the Spark source --------------------------------------------------------------------
def _spark_reader_rows(uri: str, filters: list, push: bool = True) -> list[dict]:
    from memwal_query.spark import source

    ds = source.MemWalDataSource({"path": uri, "push_filters": str(push).lower()})
    reader = ds.reader(ds.schema())
    if push:
        assert list(reader.pushFilters(filters)) == []  # every filter kept by the source
    return [r for p in reader.partitions() for b in reader.read(p) for r in b.to_pylist()]


@pytest.mark.parametrize("kind", ["int", "str", "pair"])
def test_spark_reader_pinned_filters_read_the_key_pinned_view(tmp_path, kind, monkeypatch):
    """Pushed ``EqualTo``/``In`` filters pinning the key are answered from the
    key-pinned view, with the rows of the full read."""
    pytest.importorskip("pyspark")
    from pyspark.sql.datasource import EqualTo, GreaterThan, In

    from memwal_query.spark import source

    if not source._FILTERS:
        pytest.skip("PySpark without the filter pushdown API")
    if kind == "int":
        t, model = _build(tmp_path, 8)
    else:
        t, model = _kind_build(tmp_path, 8, kind)
    calls: list[int] = []
    real = pointview.point_view
    monkeypatch.setattr(pointview, "point_view", lambda *a, **k: calls.append(1) or real(*a, **k))
    everything = _spark_reader_rows(t.uri, [], push=False)
    assert calls == []
    picked = sorted(model)[::9][:6] + [-3, KEYS + 3]
    enc = _kind_keys(kind, picked) if kind == "str" else {}
    if kind == "int":
        cases = [
            ([In(("id",), tuple(picked))], set(picked)),
            ([EqualTo(("id",), picked[1]), GreaterThan(("v",), 0)], {picked[1]}),
        ]
    elif kind == "str":
        cases = [
            ([In(("id",), tuple(enc["id"]))], set(picked)),
            ([EqualTo(("id",), enc["id"][2]), GreaterThan(("v",), 0)], {picked[2]}),
        ]
    else:
        k = picked[0]
        cases = [([EqualTo(("a",), k % 7), EqualTo(("b",), f"s{k // 7}")], {k})]
    for filters, keys in cases:
        calls.clear()
        got = _spark_reader_rows(t.uri, filters)
        assert calls, filters
        positive = any(type(f) is GreaterThan for f in filters)  # and v > 0
        want = [
            r for r in everything if _model_key(kind, r) in keys and (not positive or r["v"] > 0)
        ]
        assert sorted(got, key=str) == sorted(want, key=str)
        assert {_model_key(kind, r) for r in got} == {
            n for n in keys if n in model and (not positive or model[n][0] > 0)
        }
    calls.clear()
    _spark_reader_rows(t.uri, [GreaterThan(("v",), 3)])  # not pinned: the full view
    assert calls == []
    t.close()


def _model_key(kind: str, row: dict) -> int:
    if kind == "int":
        return row["id"]
    if kind == "str":
        return int(row["id"][1:])
    return 7 * int(row["b"][1:]) + row["a"]


@pytest.mark.parametrize("kind", ["str", "pair"])
def test_spark_reader_odd_key_filters_answer_as_the_full_read(tmp_path, kind, monkeypatch):
    """Pushed filters at the edge of pinning (contradicting or intersecting key
    filters, a negated key filter, near-miss strings, a key column left free, too many
    keys; filters the source returns to Spark pin nothing): the rows of the full read
    with the kept filters applied, the key-pinned view taken exactly when listed."""
    pytest.importorskip("pyspark")
    from pyspark.sql.datasource import EqualNullSafe, EqualTo, In, LessThan, Not

    from memwal_query.spark import source

    if not source._FILTERS:
        pytest.skip("PySpark without the filter pushdown API")
    t, _ = _kind_build(tmp_path, 8, kind)
    calls: list[int] = []
    real = pointview.point_view
    monkeypatch.setattr(pointview, "point_view", lambda *a, **k: calls.append(1) or real(*a, **k))
    everything = _spark_reader_rows(t.uri, [], push=False)

    def keeps(f, row) -> bool:
        if type(f) is Not:
            return not keeps(f.child, row)
        v = row[f.attribute[0]]
        if type(f) is In:
            return v in f.value
        return v < f.value if type(f) is LessThan else v == f.value

    if kind == "str":
        cases = [
            ([In(("id",), ("k4", "k4", "k6", "k8")), Not(EqualTo(("id",), "k4"))], True),
            ([In(("id",), ("k4", "k6")), In(("id",), ("k6", "k8"))], True),
            ([EqualTo(("id",), "k4 ")], True),
            ([EqualTo(("id",), "")], True),
            ([Not(In(("id",), ("k4",))), EqualTo(("id",), "k4")], True),
            ([EqualTo(("id",), 4)], False),  # returned to Spark
            ([EqualNullSafe(("id",), "k4")], False),  # returned to Spark
            ([In(("id",), ("k4", None))], False),  # returned to Spark
        ]
    else:
        cases = [
            ([In(("a",), (4, 1, 1)), In(("b",), ("s0", "s1")), EqualTo(("a",), 1)], True),
            ([EqualTo(("a",), 4), EqualTo(("b",), "s0"), LessThan(("v",), 3)], True),
            ([EqualTo(("a",), 4)], False),
            ([EqualTo(("a",), 4), In(("b",), tuple(f"s{i}" for i in range(2000)))], False),
            ([EqualTo(("a",), True), EqualTo(("b",), "s0")], False),
        ]
    for filters, pinned in cases:
        calls.clear()
        ds = source.MemWalDataSource({"path": t.uri, "push_filters": "true"})
        reader = ds.reader(ds.schema())
        back = list(reader.pushFilters(filters))
        got = [r for p in reader.partitions() for b in reader.read(p) for r in b.to_pylist()]
        kept = [f for f in filters if not any(f is g for g in back)]
        want = [r for r in everything if all(keeps(f, r) for f in kept)]
        assert sorted(got, key=str) == sorted(want, key=str), filters
        assert bool(calls) == pinned, filters
    t.close()


@pytest.mark.slow
def test_spark_pushed_key_filters_take_the_key_pinned_view(spark, spark_fault_dir, tmp_path):
    """Real local Spark: ``.filter(col("id") == k)`` and ``isin`` on a pushdown reader
    answer as the full read, and a worker reads the key-pinned view (it disarms the
    point ``read.key_pinned``); a filter not pinning the key leaves it armed."""
    from pyspark.sql.functions import col

    from memwal_query.spark import source

    if not source._FILTERS:
        pytest.skip("PySpark without the filter pushdown API")
    t, model = _kind_build(tmp_path, 9, "str")
    point = os.path.join(spark_fault_dir, source.KEY_PINNED_POINT)
    pushed = spark.read.format("memwal").option("push_filters", "true").load(t.uri)
    full = {r["id"]: r.asDict() for r in spark.read.format("memwal").load(t.uri).collect()}
    picked = [f"k{n}" for n in sorted(model)[::11][:5]] + ["k-3"]
    try:
        for df, keys in (
            (pushed.filter(col("id") == picked[0]), picked[:1]),
            (pushed.filter(col("id").isin(picked)), picked),
        ):
            open(point, "w").close()
            got = {r["id"]: r.asDict() for r in df.collect()}
            assert not os.path.exists(point)  # a worker read the key-pinned view
            assert got == {k: full[k] for k in keys if k in full}
        open(point, "w").close()
        got = pushed.filter(col("v") > 2).collect()
        assert os.path.exists(point)  # no key pinned: the full view
        assert {r["id"] for r in got} == {k for k, r in full.items() if r["v"] > 2}
    finally:
        if os.path.exists(point):
            os.unlink(point)
    t.close()


@pytest.mark.parametrize("kind", ["int", "str", "pair"])
def test_pinned_keys_after_keys_move_regions(tmp_path, kind, monkeypatch):
    """A new region spec moves the keys to other regions (the old ones drained into
    the base); pinned reads of keys rewritten since answer as the model and the full
    view."""
    if kind == "int":
        t, model = _build(tmp_path, 10)
    else:
        t, model = _kind_build(tmp_path, 10, kind)
    column = {"int": "id", "str": "id", "pair": "b"}[kind]
    spec = mq.bucket_spec(lance.dataset(t.uri).lance_schema, column, 5, spec_id=2)
    t.maintenance.set_region_spec(spec)
    rng = np.random.default_rng(10)
    for v in (50, 51):
        keys = rng.choice(KEYS, 30, replace=False)
        t.write(_rows(keys, v) if kind == "int" else _kind_rows(kind, keys, v))
        model.update({int(k): (v, int(k) % 5) for k in keys})
        t.flush()
    gone = [int(k) for k in rng.choice(sorted(model), 4, replace=False)]
    if kind == "int":
        t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
    else:
        t.delete(_kind_rows(kind, gone, 0).select(list(t.primary_key)))
    for k in gone:
        model.pop(k, None)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    for where, keys, residual in _kind_queries(rng, model, "str" if kind == "int" else kind):
        if kind == "int":  # the string conditions of the same keys, as integers
            where = where.replace("'k", "").replace("'", "")
        want = {k: r for k, r in model.items() if k in keys and (residual is None or residual(*r))}
        if kind == "int":
            assert _sql(ctx, where) == want, where
            assert _unpushed(monkeypatch, ctx, where) == want, where
        else:
            assert _kind_sql(ctx, kind, where) == want, where
            assert _kind_unpushed(monkeypatch, ctx, kind, where) == want, where
    t.close()
