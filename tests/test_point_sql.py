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
    assert pointview.pinned_keys([("id", "in", [3, 1, 3])], schema, pk).to_pylist() == [1, 3]
    assert pointview.pinned_keys([("id", "in", [3, None])], schema, pk).to_pylist() == [3]
    both = [("id", "in", [1, 2, 3]), ("c", "=", 1), ("id", "=", 2)]
    assert pointview.pinned_keys(both, schema, pk).to_pylist() == [2]
    assert pointview.pinned_keys([("id", "=", 1), ("id", "=", 2)], schema, pk).to_pylist() == []
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
    assert pointview.pinned_keys([("id", "=", 1)], schema, ["id", "c"]) is None
    text = pa.schema([pa.field("id", pa.string(), False, PK)])
    assert pointview.pinned_keys([("id", "=", "a")], text, pk) is None


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
