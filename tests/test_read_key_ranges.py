"""Keys of any range or type through the deduplication: every reader equals a model.

Integer keys whose range is far wider than the row count (negative values, values
beyond 32 bits, the int64 and uint64 limits) are deduplicated by a sort, not a dense
table; strings and composite keys by a hash aggregation. Rounds of upserts and deletes
of the same keys again and again are flushed into generations of several regions
(some left in the writer's MemTable); after each round the full read (``to_table``),
SQL (``SELECT *``, ``count(*)``, a filter), ``count_rows``, a reader in another table
object (another process: flushed generations only, read cold) and ``lookup`` of every
key ever used and of unknown ones equal the dict model.
"""

from __future__ import annotations

import os
import warnings

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import keyfile, rowfile
from memwal_query.read import dedup
from memwal_query.storage import paths

from helpers import PK, clear_read_caches

I64 = np.iinfo(np.int64)
U64 = np.iinfo(np.uint64)


def _pool(kind: str, rng: np.random.Generator) -> list:
    """Distinct key values (Python objects) of one kind."""
    if kind == "int64-extremes":
        edges = [int(I64.min), int(I64.min) + 1, -(2**40), -5, 0, 2**32 + 7, 2**62, int(I64.max)]
        wide = rng.integers(I64.min, I64.max, 40, endpoint=True, dtype=np.int64).tolist()
        return sorted(set(edges + wide))
    if kind == "int64-wide":  # a range a packed (offset, row) sort handles
        return sorted(set(rng.integers(-(2**40), 2**40, 48, dtype=np.int64).tolist()))
    if kind == "uint64-high":
        edges = [0, 1, 2**32, 2**63 - 1, 2**63, int(U64.max) - 1, int(U64.max)]
        wide = rng.integers(0, U64.max, 40, endpoint=True, dtype=np.uint64).tolist()
        return sorted(set(edges + wide))
    if kind == "string":
        return sorted({f"k{int(x)}" for x in rng.integers(-(10**12), 10**12, 48)} | {"", "é"})
    if kind == "composite":
        return sorted({(int(a), f"s{int(b)}") for a, b in rng.integers(-(2**62), 2**62, (48, 2))})
    raise AssertionError(kind)


def _schema(kind: str) -> pa.Schema:
    key = {"uint64-high": pa.uint64(), "string": pa.string()}.get(kind, pa.int64())
    fields = [pa.field("id", key, False, PK)]
    if kind == "composite":
        fields.append(pa.field("name", pa.string(), False, PK))
    return pa.schema([*fields, pa.field("v", pa.int64())])


def _pk(kind: str) -> list[str]:
    return ["id", "name"] if kind == "composite" else ["id"]


def _rows(kind: str, schema: pa.Schema, keys: list, vals: list) -> pa.Table:
    if kind == "composite":
        data = {"id": [k[0] for k in keys], "name": [k[1] for k in keys], "v": vals}
    else:
        data = {"id": keys, "v": vals}
    return pa.table(data, schema=schema)


def _key_table(kind: str, schema: pa.Schema, keys: list) -> pa.Table:
    return _rows(kind, schema, keys, [0] * len(keys)).select(_pk(kind))


def _as_model(kind: str, table: pa.Table) -> dict:
    d = table.to_pydict()
    keys = list(zip(d["id"], d["name"])) if kind == "composite" else d["id"]
    assert len(set(keys)) == len(keys), "a key twice"
    return dict(zip(keys, d["v"]))


@pytest.mark.parametrize(
    "kind", ["int64-extremes", "int64-wide", "uint64-high", "string", "composite"]
)
def test_readers_equal_the_model_whatever_the_key_range(tmp_path, kind):
    rng = np.random.default_rng(11)
    schema = _schema(kind)
    pool = _pool(kind, rng)
    uri = str(tmp_path / "t")
    base_keys = pool[::2]
    lance.write_dataset(_rows(kind, schema, base_keys, list(range(len(base_keys)))), uri)
    spec = None
    if kind != "composite":
        spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 3)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = dict(zip(base_keys, range(len(base_keys))))
    version = 1000
    for step in range(6):
        ups = [pool[i] for i in rng.choice(len(pool), 20, replace=False)]
        vals = list(range(version, version + len(ups)))
        version += 100
        t.write(_rows(kind, schema, ups, vals))
        model.update(zip(ups, vals))
        gone = [pool[i] for i in rng.choice(len(pool), 6, replace=False)]
        t.delete(_key_table(kind, schema, gone))
        for k in gone:
            model.pop(k, None)
        if step % 3 != 2:  # every third round stays in the MemTable
            t.flush()
        _check(t, kind, schema, model, pool)
    t.flush()
    clear_read_caches()
    other = mq.MemWalTable.open(uri)  # no writers: the flushed generations, read cold
    assert other.count_rows() == len(model)
    assert _as_model(kind, other.to_table()) == model
    t.close()


def _check(t: mq.MemWalTable, kind: str, schema: pa.Schema, model: dict, pool: list) -> None:
    assert _as_model(kind, t.to_table()) == model
    assert t.count_rows() == len(model)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong", writers=t.writers())
    assert _as_model(kind, ctx.sql("SELECT * FROM t").to_arrow_table()) == model
    n = ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().column("n")[0].as_py()
    assert n == len(model)
    high = ctx.sql("SELECT * FROM t WHERE v >= 1000").to_arrow_table()
    assert _as_model(kind, high) == {k: v for k, v in model.items() if v >= 1000}
    unknown = {"string": ["nope"], "composite": [(1, "nope")]}.get(kind, [12345])
    probe = pool + [u for u in unknown if u not in model]
    found = t.lookup(_key_table(kind, schema, probe))
    assert _as_model(kind, found) == model


@pytest.mark.parametrize(
    "low, high",
    [(0, 50), (0, 10**9), (-(2**40), 2**40), (int(I64.min), int(I64.max)), (-5, 5)],
)
def test_int_runs_are_the_last_and_first_row_of_each_key(low, high):
    """The dense, packed-sort and argsort paths find each key's last and first row."""
    rng = np.random.default_rng(5)
    for n in (1, 7, 3000):
        pool = rng.integers(low, high, max(1, n // 3), endpoint=True, dtype=np.int64)
        ints = rng.choice(pool, n)
        last, first = dedup.int_runs(ints)
        want_last: dict[int, int] = {}
        want_first: dict[int, int] = {}
        for i, v in enumerate(ints.tolist()):
            want_last[v] = i
            want_first.setdefault(v, i)
        order = sorted(want_last)
        assert ints[last].tolist() == order
        assert last.tolist() == [want_last[v] for v in order]
        assert first.tolist() == [want_first[v] for v in order]


def _flushed_table(tmp_path) -> tuple[mq.MemWalTable, list[str], dict]:
    """A table with four flushed generations (keys overwritten and deleted across them)
    in two regions: (table, generation directories, model)."""
    schema = _schema("int64-wide")
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows("int64-wide", schema, list(range(0, 400, 2)), [0] * 200), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = dict.fromkeys(range(0, 400, 2), 0)
    for step in range(2):
        keys = list(range(step * 50, 300 + step * 50, 3))
        t.write(_rows("int64-wide", schema, keys, [step + 1] * len(keys)))
        model.update(dict.fromkeys(keys, step + 1))
        gone = list(range(step, 400, 17))
        t.delete(_key_table("int64-wide", schema, gone))
        for k in gone:
            model.pop(k, None)
        t.flush()
    gens = [
        paths.generation_path(t.uri, r, g.path)
        for r in t.catalog.region_ids()
        for g in t.catalog.region_manifest(r).flushed_generations
    ]
    return t, gens, model


def test_the_keys_sidecar_equals_the_lance_tables_keys(tmp_path):
    t, gens, _ = _flushed_table(tmp_path)
    assert len(gens) == 4
    for uri in gens:
        keys = keyfile.read(t.catalog.io, uri)
        assert keys is not None
        want = lance.dataset(uri).to_table(columns=["id", "_tombstone"], with_row_address=True)
        assert keys.equals(want.cast(keys.schema))
    t.close()


def test_a_missing_or_damaged_keys_sidecar_reads_the_rows(tmp_path):
    """Every reader answers the same without the keys sidecars (one missing, one with
    a flipped bit: a warning naming it, one truncated), and without the rows sidecar
    either (the Lance table)."""
    t, gens, model = _flushed_table(tmp_path)
    t.close()
    for uri in gens:  # the region keys files would stand in for the keys sidecars
        os.remove(os.path.join(uri, keyfile.REGION_KEYS_FILE))
    os.remove(os.path.join(gens[0], keyfile.KEYS_FILE))
    path = os.path.join(gens[1], keyfile.KEYS_FILE)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    path = os.path.join(gens[2], keyfile.KEYS_FILE)
    open(path, "wb").write(open(path, "rb").read()[:100])
    os.remove(os.path.join(gens[3], keyfile.KEYS_FILE))
    os.remove(os.path.join(gens[3], rowfile.ROWS_FILE))
    clear_read_caches()
    schema = _schema("int64-wide")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        other = mq.MemWalTable.open(t.uri)
        assert other.count_rows() == len(model)
        assert _as_model("int64-wide", other.to_table()) == model
        found = other.lookup(_key_table("int64-wide", schema, list(range(-5, 420))))
        assert _as_model("int64-wide", found) == model
    damaged = [str(w.message) for w in seen if keyfile.KEYS_FILE in str(w.message)]
    assert any("CRC" in m for m in damaged) and len(damaged) >= 2
