"""The newest row per key across regions' flushed generations and MemTables (the
DataFusion provider's newer sources) equals a model of the rule: highest ``_gen``, then
the higher region rank; a MemTable row beats every flushed generation of its own
region. Random puts and deletes through two regions that may hold any key (an older
table's manual regions), some flushed, some in MemTables: ``count(*)``, a filtered count,
the rows by SQL and key-pinned reads (``id = k``, ``id IN (...)``) after every step,
with the writers' MemTables and without them.
"""

from __future__ import annotations

import uuid

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format.schema import TOMBSTONE
from memwal_query.read import newer
from memwal_query.write.writer import RegionWriter

from helpers import basic_rows, clear_read_caches


def _sql(t: mq.MemWalTable, sql: str, writers) -> pa.Table:
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong", writers=writers)
    return ctx.sql(sql).to_arrow_table()


@pytest.mark.parametrize("seed", [3, 11])
def test_newest_across_regions_generations_and_memtables_equals_the_model(tmp_path, seed):
    clear_read_caches()
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(30)), uri)
    t = mq.MemWalTable.initialize(uri)
    writers = [
        RegionWriter(t.catalog, str(uuid.uuid4()), region_values={"bucket": 0}, region_spec_id=1)
        for _ in range(2)
    ]
    rank = {w.region_id: i for i, w in enumerate(sorted(writers, key=lambda w: w.region_id))}
    gen = {w.region_id: 1 for w in writers}
    dirty = {w.region_id: False for w in writers}
    # per region, per key: (generation, value or None for a delete)
    last: dict[str, dict[int, tuple[int, float | None]]] = {w.region_id: {} for w in writers}
    rng = np.random.default_rng(seed)

    def model() -> dict[int, float]:
        out = {k: float(k) for k in range(30)}
        for k in range(60):
            best = None
            for r, keys in last.items():
                if k in keys:
                    g, v = keys[k]
                    if best is None or (g, rank[r]) > best[0]:
                        best = ((g, rank[r]), v)
            if best is not None:
                if best[1] is None:
                    out.pop(k, None)
                else:
                    out[k] = best[1]
        return out

    for step in range(20):
        w = writers[int(rng.integers(0, 2))]
        r = w.region_id
        keys = sorted({int(k) for k in rng.integers(0, 60, 12)})
        vals = [float(step * 1000 + k) for k in keys]
        w.put(basic_rows(keys, vals, [f"s{step}"] * len(keys)))
        last[r].update({k: (gen[r], v) for k, v in zip(keys, vals, strict=True)})
        gone = sorted({int(k) for k in rng.integers(0, 60, 4)} - set(keys))
        if gone:
            w.delete(pa.table({"id": pa.array(gone, pa.int64())}))
            last[r].update({k: (gen[r], None) for k in gone})
        dirty[r] = True
        for x in writers:  # flush some regions: generations and MemTables mixed
            if dirty[x.region_id] and rng.random() < 0.4:
                x.flush()
                gen[x.region_id] += 1
                dirty[x.region_id] = False
        want = model()
        got = _sql(t, "SELECT id, val FROM t ORDER BY id", writers)
        assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == want
        n = _sql(t, "SELECT count(*) AS n FROM t", writers)["n"][0].as_py()
        assert n == len(want)
        n = _sql(t, "SELECT count(*) AS n FROM t WHERE val >= 5000", writers)["n"][0].as_py()
        assert n == sum(1 for v in want.values() if v >= 5000)
        assert t.count_rows(writers=writers) == len(want)
        # key-pinned reads (only the pinned keys' rows of each source): the same rule
        pinned = sorted({int(k) for k in rng.integers(0, 62, 9)})
        listed = ", ".join(map(str, pinned))
        got = _sql(t, f"SELECT id, val FROM t WHERE id IN ({listed})", writers)
        assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == {
            k: v for k, v in want.items() if k in pinned
        }
        k = pinned[0]
        got = _sql(t, f"SELECT id, val FROM t WHERE id = {k}", writers)
        assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == {
            x: v for x, v in want.items() if x == k
        }
        # the tombstone flags known without reading are those of the newest rows
        provider = t.provider(consistency="strong", writers=writers)
        ctx = datafusion.SessionContext()
        ctx.register_table("t", provider)
        ctx.sql("SELECT count(*) FROM t").to_arrow_table()
        v = newer.newer_view(provider.last_plan, t.schema, t.primary_key)
        read = v.columns([TOMBSTONE]).take(pa.array(v.winners)).column(0)
        assert v.tombstones is not None
        assert v.tombstones.tolist() == read.fill_null(False).to_pylist()
