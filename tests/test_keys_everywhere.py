"""Every primary-key kind on every read path: SQL, lookup, search, merge + GC.

Found by a randomized run over key kinds against a Python model keyed by the normalized
key (NaN == NaN, -0.0 == 0.0):

- a lookup never found a NaN key in a flushed generation (its key index compared keys
  with Arrow's ``equal``, NaN != NaN), so it answered from an older source (a stale
  value, or a deleted row); vector/full-text search kept such stale base rows too;
- the generation key index hashed keys with the bloom hash, which is a null flag only
  for most key types (floats, timestamps, dates, decimals, uint64, large strings...): one
  hash run for the whole generation, probed by a Python scan per key (a 2,000-key
  lookup in a 20k-row timestamp generation took 131 s instead of 5 ms);
- ``WHERE k IN (false, true)`` on a boolean key (DataFusion hands the simplified filter
  over as a plain ``pa.BooleanScalar``) failed in Lance's scanner.
"""

import datetime as dt
import math
import random
import shutil

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK


def _norm(v):
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if v == 0.0:
            return 0.0
    return v


def _rows(table: pa.Table, key_cols: list[str]) -> dict:
    cols = []
    for c in key_cols:
        col = table.column(c)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.int64())
        cols.append([_norm(v) for v in col.to_pylist()])
    out = {}
    for j, v in enumerate(table.column("v").to_pylist()):
        key = tuple(c[j] for c in cols)
        assert key not in out, f"key {key} twice"
        out[key] = v
    return out


def _float_table(tmp_path, values):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", pa.float64(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": values, "v": [0] * len(values)}, schema=schema), uri)
    return mq.MemWalTable.initialize(uri), schema


def test_lookup_finds_nan_key_in_flushed_generations(tmp_path):
    t, schema = _float_table(tmp_path, [1.0, math.nan])
    w = t.writer()
    w.put(pa.table({"k": [math.nan, 2.0], "v": [1, 1]}, schema=schema))
    w.flush()
    assert t.lookup(pa.array([math.nan]), writers=[w]).column("v").to_pylist() == [1]
    w.put(pa.table({"k": [math.nan], "v": [2]}, schema=schema))
    w.flush()
    got = t.lookup(pa.array([2.0, math.nan, 1.0]), writers=[w])
    assert got.column("v").to_pylist() == [1, 2, 0]
    w.delete(pa.table({"k": [math.nan]}))
    w.flush()
    assert t.lookup(pa.array([math.nan]), writers=[w]).num_rows == 0
    t.maintenance.merge()
    assert t.lookup(pa.array([math.nan]), writers=[w]).num_rows == 0
    w.close()


def test_lookup_finds_base_row_written_with_negative_zero(tmp_path):
    t, schema = _float_table(tmp_path, [-0.0, math.nan, 1.0])
    assert t.lookup(pa.array([0.0])).column("v").to_pylist() == [0]
    assert t.lookup(pa.array([1.0, -0.0, math.nan])).column("v").to_pylist() == [0, 0, 0]
    uri = str(tmp_path / "c")
    schema = pa.schema(
        [pa.field("f", pa.float64(), False, PK), pa.field("s", pa.string(), False, PK)]
        + [pa.field("v", pa.int64())]
    )
    lance.write_dataset(pa.table({"f": [-0.0], "s": ["a"], "v": [7]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    assert t.lookup(pa.table({"f": [0.0], "s": ["a"]})).column("v").to_pylist() == [7]


def test_lookup_finds_composite_nan_key_in_generations(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema(
        [
            pa.field("f", pa.float64(), False, PK),
            pa.field("d", pa.date32(), False, PK),
            pa.field("v", pa.int64()),
        ]
    )
    day = dt.date(2020, 1, 1)
    lance.write_dataset(pa.table({"f": [math.nan], "d": [day], "v": [0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"f": [math.nan, -0.0], "d": [day, day], "v": [1, 1]}, schema=schema))
    w.flush()
    probe = pa.table({"f": [0.0, math.nan], "d": pa.array([day, day], pa.date32())})
    assert t.lookup(probe, writers=[w]).column("v").to_pylist() == [1, 1]
    w.close()


def test_generation_lookup_is_indexed_for_keys_without_a_native_hash(tmp_path, monkeypatch):
    """The generation's key index hashes timestamp keys by value: one hash per key, so a
    probe compares one candidate (with the bloom hash, a null flag only, every key
    shared one hash and each probe scanned the whole generation: ~5 s here)."""
    from memwal_query.search.keys import _KeyIndex

    built: list[_KeyIndex] = []
    init = _KeyIndex.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(_KeyIndex, "__init__", spy)
    uri = str(tmp_path / "t")
    ts = pa.timestamp("us")
    schema = pa.schema([pa.field("k", ts, False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": pa.array([0], ts), "v": [0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    n = 4000
    keys = pa.array(np.arange(1, n + 1, dtype=np.int64)).cast(ts)
    w.put(pa.table({"k": keys, "v": np.arange(n)}, schema=schema))
    w.flush()
    probe = keys.take(pa.array(np.arange(0, n, 10)))
    got = t.lookup(probe, writers=[w])
    assert got.column("v").to_pylist() == list(range(0, n, 10))
    (index,) = [i for i in built if i.num_keys == n]  # the generation's key index
    assert len(np.unique(index.hashes)) == n
    w.close()


def test_vector_search_drops_base_row_of_nan_key_updated_in_generation(tmp_path):
    uri = str(tmp_path / "t")
    dim = 4
    schema = pa.schema(
        [
            pa.field("k", pa.float64(), False, PK),
            pa.field("v", pa.int64()),
            pa.field("vec", pa.list_(pa.float32(), dim)),
        ]
    )

    def rows(keys, v, vecs):
        flat = pa.array(np.asarray(vecs, np.float32).reshape(-1))
        vec = pa.FixedSizeListArray.from_arrays(flat, dim)
        return pa.table({"k": keys, "v": v, "vec": vec}, schema=schema)

    lance.write_dataset(rows([math.nan, 1.0], [0, 0], [[0, 0, 0, 0], [9, 9, 9, 9]]), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(rows([math.nan], [1], [[5, 5, 5, 5]]))
    w.flush()
    got = t.vector_search("vec", np.zeros(dim, np.float32), k=5, writers=[w])
    assert _rows(got, ["k"]) == {(1.0,): 0, ("NaN",): 1}
    w.close()


def test_sql_filter_simplified_to_a_constant(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", pa.bool_(), False, PK), pa.field("v", pa.int64())])
    lance.write_dataset(pa.table({"k": [True], "v": [0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=mq.RegionSpec.bucket(0, 2))
    t.write(pa.table({"k": [False], "v": [1]}, schema=schema))
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong", writers=t.writers())
    got = ctx.sql("SELECT v FROM t WHERE k IN (false, true) ORDER BY v").to_pydict()
    assert got == {"v": [0, 1]}
    t.close()


def test_identity_region_of_nan_accepts_nan_rows(tmp_path):
    t, schema = _float_table(tmp_path, [1.0])
    uri = t.uri
    shutil.rmtree(uri)
    lance.write_dataset(pa.table({"k": [1.0], "v": [0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=mq.RegionSpec.identity(0, field_id="k"))
    t.write(pa.table({"k": [math.nan], "v": [1]}, schema=schema))
    t.delete(pa.table({"k": [math.nan]}))  # routed to the NaN region's writer
    assert t.to_table().column("v").to_pylist() == [0]
    t.close()
    w = t.writer(region_values={"k": math.nan})
    w.put(pa.table({"k": [math.nan], "v": [2]}, schema=schema))
    with pytest.raises(mq.WrongRegionError):
        w.put(pa.table({"k": [2.0], "v": [2]}, schema=schema))
    assert _rows(t.to_table(writers=[w]), ["k"]) == {(1.0,): 0, ("NaN",): 2}
    w.close()


# A short randomized run per key kind: puts, deletes, flushes, merges and GC through
# two or three bucket regions, every read path compared with a Python model.
KINDS = {
    "float64": ([pa.float64()], [(x,) for x in [0.0, -0.0, math.nan, math.inf, -math.inf, 1.5]]),
    "float_date": (
        [pa.float64(), pa.date32()],
        [(f, dt.date(2020, 1, d)) for f in [0.0, -0.0, math.nan, 2.5] for d in (1, 2)],
    ),
    "bool": ([pa.bool_()], [(True,), (False,)]),
    "ts_ns_utc": ([pa.timestamp("ns", tz="UTC")], [(x,) for x in [0, 1, -1, 1_000_000_001]]),
    "uint64": ([pa.uint64()], [(x,) for x in [0, 2**63, 2**64 - 1, 2**63 - 1]]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_ops_every_read_path(tmp_path, kind):
    types, pool = KINDS[kind]
    rnd = random.Random(kind)
    names = [f"k{i}" for i in range(len(types))]
    fields = [pa.field(n, ty, False, PK) for n, ty in zip(names, types)]
    schema = pa.schema([*fields, pa.field("v", pa.int64())])

    def key_cols(keys):
        return {
            n: pa.array([k[i] for k in keys], ty) for i, (n, ty) in enumerate(zip(names, types))
        }

    def nkey(k):
        return tuple(_rows(pa.table({**key_cols([k]), "v": [0]}), names))[0]

    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({**key_cols(pool[:1]), "v": [0]}, schema=schema), uri)
    model = {nkey(pool[0]): 0}
    t = mq.MemWalTable.initialize(uri, region_spec=mq.RegionSpec.bucket(0, 3))

    def check():
        ctx = datafusion.SessionContext()
        mq.register(ctx, "t", t, consistency="strong", writers=t.writers())
        assert _rows(ctx.sql("SELECT * FROM t").to_arrow_table(), names) == model
        assert ctx.sql("SELECT count(*) FROM t").to_pydict()["count(*)"] == [len(model)]
        keys = rnd.sample(pool, min(4, len(pool)))
        probe = pa.table(key_cols(keys))
        got = t.lookup(probe if len(names) > 1 else probe.column(0), writers=t.writers())
        want = {nkey(k) for k in keys}
        assert _rows(got, names) == {k: v for k, v in model.items() if k in want}

    for op in range(60):
        r = rnd.random()
        if r < 0.5:
            keys = [rnd.choice(pool) for _ in range(rnd.randint(1, 3))]
            t.write(pa.table({**key_cols(keys), "v": [op] * len(keys)}, schema=schema))
            model.update({nkey(k): op for k in keys})
        elif r < 0.65:
            keys = [rnd.choice(pool) for _ in range(rnd.randint(1, 2))]
            t.delete(pa.table(key_cols(keys)))
            for k in keys:
                model.pop(nkey(k), None)
        elif r < 0.75:
            t.flush()
        elif r < 0.8:
            t.maintenance.merge()
        else:
            check()
    t.flush()
    t.maintenance.merge()
    t.maintenance.gc()
    check()
    t.close()
    assert _rows(lance.dataset(uri).to_table(), names) == model
