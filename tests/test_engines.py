"""DuckDB and Polars query a MemWalDataset as DataFusion does: the same answers.

Every query runs through DataFusion, DuckDB (``con.register``) and Polars
(``pl.scan_pyarrow_dataset`` + ``pl.SQLContext``) on a table whose rows live in the base
table, a flushed generation and a writer's MemTable, with deletes and a vector column,
and is compared with a plain-Python model of the newest row per key. Each engine must
also push its filter and projection into the dataset (recorded by a subclass that only
watches the calls), so the non-key filter case (base ``x=10``, newer ``x=0``: ``x > 5``
returns nothing for that key) is answered by our dedup-before-filter, not by the engine
filtering a complete view afterwards.
"""

from __future__ import annotations

import datafusion
import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.read.provider import MemWalDataset

from helpers import PK

duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")

DIM = 4
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("x", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)


def rows(ids, x, tag) -> pa.Table:
    ids = list(ids)
    return pa.table(
        {
            "id": ids,
            "x": list(x),
            "name": [f"{tag}{i}" for i in ids],
            "vec": [[float(i), float(v), 0.5, -1.0] for i, v in zip(ids, x)],
        },
        schema=SCHEMA,
    )


class Watched(MemWalDataset):
    """A MemWalDataset that records the projection and filter each engine pushes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.filters: list = []  # every filter a query was planned with
        self.projections: list = []  # columns asked of ``scanner`` (DuckDB, Polars)

    def get_fragments(self, filter=None):  # DataFusion calls this, and so does scanner()
        self.filters.append(filter)
        return super().get_fragments(filter)

    def scanner(self, columns=None, filter=None, **kwargs):
        self.projections.append(columns)
        return super().scanner(columns=columns, filter=filter, **kwargs)


@pytest.fixture(scope="module")
def lsm(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("engines") / "t")
    lance.write_dataset(rows(range(100), [10] * 100, "b"), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 4)  # 4 regions
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = {r["id"]: r for r in rows(range(100), [10] * 100, "b").to_pylist()}

    def apply(put=None, delete=()):
        for r in put.to_pylist() if put is not None else []:
            model[r["id"]] = r
        for k in delete:
            model.pop(k, None)

    # flushed generation: key 1 drops below the filter, keys 100..109 new, 2 and 3 deleted
    g1 = rows([1, *range(100, 110)], [0] + [20] * 10, "g")
    t.write(g1)
    t.delete(pa.table({"id": pa.array([2, 3], pa.int64())}))
    apply(g1, [2, 3])
    t.flush()
    # MemTables: key 4 drops, key 100 drops, key 5 rises (x=10 -> 30), key 1 deleted
    m = rows([4, 100, 5], [0, 0, 30], "m")
    t.write(m)
    t.delete(pa.table({"id": pa.array([1, 6], pa.int64())}))
    apply(m, [1, 6])
    yield t, model
    t.close(flush=False)


def run_datafusion(ds, sql):
    ctx = datafusion.SessionContext()
    ctx.register_table("t", ds)
    return ctx.sql(sql).to_arrow_table()


def run_duckdb(ds, sql):
    con = duckdb.connect()
    con.register("t", ds)
    return con.sql(sql).to_arrow_table()


def run_polars(ds, sql):
    return pl.SQLContext(t=pl.scan_pyarrow_dataset(ds)).execute(sql).collect().to_arrow()


ENGINES = {"datafusion": run_datafusion, "duckdb": run_duckdb, "polars": run_polars}


def model_rows(model, cond, cols):
    return [{c: r[c] for c in cols} for k, r in sorted(model.items()) if cond(r)]


def as_rows(table: pa.Table) -> list[dict]:
    out = []
    for r in table.to_pylist():  # DuckDB's sum is a decimal, its vectors tuples
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()})
    return out


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_nonkey_filter_after_dedup(lsm, engine):
    t, model = lsm
    ds = Watched(t.catalog, writers=t.writers())
    got = ENGINES[engine](ds, "SELECT id, name FROM t WHERE x > 5 ORDER BY id")
    want = model_rows(model, lambda r: r["x"] > 5, ["id", "name"])
    assert as_rows(got) == want
    ids = {r["id"] for r in want}
    assert not ids & {1, 2, 3, 4, 6, 100} and {5, 7, 101} <= ids
    # the filter and the projection reached the dataset (no unfiltered full read)
    assert ds.filters and all(f is not None and "x" in str(f) for f in ds.filters)
    if engine != "datafusion":
        assert ds.projections and all(set(c) <= {"id", "name", "x"} for c in ds.projections)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_same_answers(lsm, engine):
    t, model = lsm
    queries = {
        "SELECT count(*) AS n, sum(x) AS s FROM t": [
            {"n": len(model), "s": sum(r["x"] for r in model.values())}
        ],
        "SELECT id, x, vec FROM t WHERE id IN (1, 2, 4, 5, 100, 105, 50) ORDER BY id": (
            model_rows(model, lambda r: r["id"] in (1, 2, 4, 5, 100, 105, 50), ["id", "x", "vec"])
        ),
        "SELECT id, vec FROM t WHERE name LIKE 'm%' ORDER BY id": model_rows(
            model, lambda r: r["name"].startswith("m"), ["id", "vec"]
        ),
        "SELECT id FROM t WHERE x = 0 OR x >= 30 ORDER BY id": model_rows(
            model, lambda r: r["x"] == 0 or r["x"] >= 30, ["id"]
        ),
    }
    for sql, want in queries.items():
        ds = Watched(t.catalog, writers=t.writers())
        got = as_rows(ENGINES[engine](ds, sql))
        assert got == want, (engine, sql)
        if "WHERE" in sql and "LIKE" not in sql:  # DataFusion keeps LIKE to itself
            assert ds.filters and all(f is not None for f in ds.filters), (engine, sql)


def test_engines_agree_on_full_view(lsm):
    t, model = lsm
    answers = {
        name: as_rows(run(Watched(t.catalog, writers=t.writers()), "SELECT * FROM t ORDER BY id"))
        for name, run in ENGINES.items()
    }
    assert answers["datafusion"] == answers["duckdb"] == answers["polars"]
    assert answers["datafusion"] == [model[k] for k in sorted(model)]
