import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_query as mq
from memwal_query.storage.io import LocalFileIO

from helpers import PK, basic_rows, expr_table


def test_filter_applies_to_newest_version_only(tmp_path):
    """base id=1 x=10, generation 1 id=1 x=0: WHERE x > 5 returns nothing."""
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": [1], "x": [10]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    with t.writer() as w:
        w.put(pa.table({"id": [1], "x": [0]}))
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t, consistency="strong")
    assert ctx.sql("SELECT * FROM t WHERE x > 5").to_arrow_table().num_rows == 0
    assert ctx.sql("SELECT * FROM t WHERE x < 5").to_arrow_table().to_pydict() == {
        "id": [1],
        "x": [0],
    }
    # and the reverse: the old value does not match, the new one does
    with t.writer(w.region_id) as w:
        w.put(pa.table({"id": [1], "x": [50]}))
    assert ctx.sql("SELECT id FROM t WHERE x > 5").to_arrow_table().column(0).to_pylist() == [1]


def test_meta_columns_and_projection(table):
    w = table.writer()
    w.put(basic_rows([1, 500]))
    w.flush()
    w.put(basic_rows([1], val=[-1.0]))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w], meta_columns=True))
    got = ctx.sql("SELECT id, val, _gen FROM t WHERE id IN (1, 2, 500) ORDER BY id")
    assert got.to_arrow_table().to_pydict() == {
        "id": [1, 2, 500],
        "val": [-1.0, 2.0, 500.0],
        "_gen": [2, 0, 1],
    }
    ctx.register_table("plain", table.provider(writers=[w]))
    assert ctx.sql("SELECT * FROM plain").schema().names == ["id", "val", "name"]
    assert ctx.sql("SELECT count(*) AS n FROM plain").to_arrow_table().column(0)[0].as_py() == 101
    w.close()


def test_aggregation_and_join(table):
    w = table.writer()
    w.put(basic_rows([1, 2], val=[100.0, 200.0], name=["a", "a"]))
    w.delete(pa.table({"id": [3]}))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w]))
    ctx.from_pydict({"name": ["a", "n5"], "label": ["A", "five"]}, name="labels")
    got = ctx.sql(
        "SELECT l.label, sum(t.val) AS s FROM t JOIN labels l ON t.name = l.name "
        "GROUP BY l.label ORDER BY l.label"
    ).to_arrow_table()
    assert got.to_pydict() == {"label": ["A", "five"], "s": [300.0, 5.0]}
    total = ctx.sql("SELECT sum(val) FROM t").to_arrow_table().column(0)[0].as_py()
    assert total == sum(range(100)) - 1 - 2 - 3 + 300
    w.close(flush=False)


def test_limit(table):
    w = table.writer()
    w.put(basic_rows(range(1000, 1100)))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table.provider(writers=[w]))
    assert ctx.sql("SELECT * FROM t LIMIT 7").to_arrow_table().num_rows == 7
    w.close(flush=False)


def test_unknown_path_and_corrupt_manifest(table, tmp_path):
    with pytest.raises(mq.TableNotFoundError) as e:
        mq.MemWalTable.open(str(tmp_path / "nope"))
    assert "nope" in str(e.value)
    w = table.writer()
    w.put(basic_rows([1]))
    w.flush()
    store_path = w._store.path(w.manifest().version)
    w.close(flush=False)
    LocalFileIO().write(store_path, b"\x08\x01garbage")
    with pytest.raises(mq.ManifestCorruptError) as e:
        table.to_table()
    assert store_path in str(e.value)


def test_merged_generation_still_listed_gives_no_duplicates(table):
    w = table.writer()
    w.put(basic_rows([1, 1000], val=[-1.0, 1000.0]))
    w.flush()
    w.close()
    expected = table.to_table().sort_by("id")
    table.maintenance.merge()
    # The generation is merged but still listed in the region manifest (no GC yet).
    assert table.catalog.region_manifest(w.region_id).flushed_generations
    assert table.to_table().sort_by("id").equals(expected)


# -- differential test against a dict model -------------------------------------------
N_REGIONS = 3
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "delete", "flush", "reopen"]),
        st.lists(st.integers(0, 40), min_size=0, max_size=6),
        st.integers(-1000, 1000),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
@pytest.mark.slow
def test_differential_against_model(tmp_path_factory, ops):
    uri = str(tmp_path_factory.mktemp("diff") / "t")
    lance.write_dataset(basic_rows(range(0, 40, 3)), uri)
    t = expr_table(uri, f"col0 % {N_REGIONS}")
    model = {k: (float(k), f"n{k}") for k in range(0, 40, 3)}
    writers = [t.writer(region_values={"r": r}) for r in range(N_REGIONS)]
    for op, keys, value in ops:
        by_region: dict[int, list[int]] = {}
        for k in keys:
            by_region.setdefault(k % N_REGIONS, []).append(k)
        if op == "put":
            for r, ks in by_region.items():
                writers[r].put(basic_rows(ks, val=[float(value)] * len(ks), name=["v"] * len(ks)))
                for k in ks:
                    model[k] = (float(value), "v")
        elif op == "delete":
            for r, ks in by_region.items():
                writers[r].delete(pa.table({"id": pa.array(ks, pa.int64())}))
                for k in ks:
                    model.pop(k, None)
        elif op == "flush":
            writers[value % N_REGIONS].flush()
        else:  # a new writer takes over the region (recovery from the WAL)
            r = value % N_REGIONS
            writers[r].close(flush=False)
            writers[r] = t.writer(writers[r].region_id)

    def view(tbl: pa.Table) -> dict:
        rows = tbl.to_pylist()
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)), "duplicate keys"
        return {r["id"]: (r["val"], r["name"]) for r in rows}

    ctx = datafusion.SessionContext()
    ctx.register_table("w", t.provider(writers=writers))
    assert view(ctx.sql("SELECT * FROM w").to_arrow_table()) == model
    expected = {k: v for k, v in model.items() if v[0] is not None and v[0] > 10}
    assert view(ctx.sql("SELECT * FROM w WHERE val > 10").to_arrow_table()) == expected
    total = ctx.sql("SELECT count(*), sum(val) FROM w").to_arrow_table().to_pylist()[0]
    assert total["count(*)"] == len(model)
    # Without the writers: only flushed data; equal to the model once all flushed.
    for w in writers:
        w.flush()
    assert view(t.to_table()) == model
    t.maintenance.refresh_snapshots()
    assert view(t.to_table(consistency="eventual")) == model
    assert view(t.to_table(filter=pc.field("val") > 10)) == expected
    t.maintenance.merge()
    assert view(t.to_table()) == model
    for w in writers:
        w.close(flush=False)


# -- differential test: region spec, both consistency modes, any subset of writers -------
N_BUCKETS = 3
region_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "delete", "flush", "flush", "reopen", "snapshot"]),
        st.lists(st.integers(0, 60), min_size=0, max_size=8),
        st.integers(-1000, 1000),
    ),
    min_size=1,
    max_size=20,
)


def _apply(state: dict, ops: list) -> dict:
    out = dict(state)
    for op, keys, value in ops:
        for k in keys:
            if op == "put":
                out[k] = (float(value), f"v{value % 7}")
            else:
                out.pop(k, None)
    return out


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=region_ops,
    with_writers=st.sets(st.integers(0, N_BUCKETS - 1)),
    probe=st.lists(st.integers(0, 60), min_size=1, max_size=6),
)
@pytest.mark.slow
def test_differential_regions_modes_and_writer_subsets(tmp_path_factory, ops, with_writers, probe):
    """Random puts/deletes/flushes/merges/snapshots over bucket(id, 3) regions; every
    query in both modes, with all, none or some writers handed in, equals the model:
    a region with its writer shows everything written; without, strong shows what is
    flushed, eventual what the last snapshot listed (or merged since)."""
    uri = str(tmp_path_factory.mktemp("regions") / "t")
    base_ids = list(range(0, 60, 4))
    lance.write_dataset(basic_rows(base_ids), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", N_BUCKETS)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    ids = pa.table({"id": pa.array(range(61), pa.int64())})
    buckets = spec.evaluate(ids, t.catalog.lance_schema).column(0).to_pylist()
    base = [{k: (float(k), f"n{k}") for k in base_ids if buckets[k] == b} for b in range(3)]
    gens: list[list[list]] = [[] for _ in range(N_BUCKETS)]  # ops of each flushed generation
    pending: list[list] = [[] for _ in range(N_BUCKETS)]  # ops in the MemTable / WAL
    merged = [0] * N_BUCKETS  # generations merged (count)
    snap: list[int] | None = None  # generations listed by the last snapshot (count)
    writers = [t.writer(region_values={"bucket": b}) for b in range(N_BUCKETS)]
    for op, keys, value in ops:
        if op in ("put", "delete"):
            for b in range(N_BUCKETS):
                ks = [k for k in keys if buckets[k] == b]
                if not ks:
                    continue
                if op == "put":
                    n = len(ks)
                    writers[b].put(basic_rows(ks, [float(value)] * n, [f"v{value % 7}"] * n))
                else:
                    writers[b].delete(pa.table({"id": pa.array(ks, pa.int64())}))
                pending[b].append((op, ks, value))
        elif op == "flush":
            b = value % N_BUCKETS
            if writers[b].flush() is not None:
                gens[b].append(pending[b])
                pending[b] = []
            if value % 3 == 0:  # merge every region's flushed generations
                t.maintenance.merge()
                merged = [len(g) for g in gens]
        elif op == "reopen":  # a new writer replays the region's WAL
            b = value % N_BUCKETS
            writers[b].close(flush=False)
            writers[b] = t.writer(region_values={"bucket": b})
        else:
            t.maintenance.refresh_snapshots()
            snap = [len(g) for g in gens]

    def expected(mode: str, handed: set[int]) -> dict:
        out: dict = {}
        for b in range(N_BUCKETS):
            if b in handed:
                upto = len(gens[b])
            elif mode == "strong" or snap is None:
                upto = len(gens[b])
            else:
                upto = max(snap[b], merged[b])
            state = base[b]
            for g in gens[b][:upto]:
                state = _apply(state, g)
            if b in handed:
                state = _apply(state, pending[b])
            out.update(state)
        return out

    def view(tbl: pa.Table) -> dict:
        rows = tbl.to_pylist()
        assert len(rows) == len({r["id"] for r in rows}), "duplicate keys"
        return {r["id"]: (r["val"], r["name"]) for r in rows}

    in_list = ", ".join(str(k) for k in probe)
    for mode in ("strong", "eventual"):
        for handed in ({0, 1, 2}, set(), with_writers):
            model = expected(mode, handed)
            ctx = datafusion.SessionContext()
            provider = t.provider(mode, [writers[b] for b in sorted(handed)])
            ctx.register_table("t", provider)
            where = f"{mode} writers={sorted(handed)}"
            assert view(ctx.sql("SELECT * FROM t").to_arrow_table()) == model, where
            got = view(ctx.sql("SELECT * FROM t WHERE val > 10 AND name <> 'v3'").to_arrow_table())
            want = {k: v for k, v in model.items() if v[0] > 10 and v[1] != "v3"}
            assert got == want, where
            got = view(ctx.sql(f"SELECT * FROM t WHERE id IN ({in_list})").to_arrow_table())
            assert got == {k: v for k, v in model.items() if k in probe}, where
            assert len(provider.last_plan.pruned) + len(provider.last_plan.regions) <= 3
            k = probe[0]
            got = view(ctx.sql(f"SELECT * FROM t WHERE id = {k}").to_arrow_table())
            assert got == ({k: model[k]} if k in model else {}), where
            assert all(r.values == {"bucket": buckets[k]} for r in provider.last_plan.regions)
            agg = ctx.sql("SELECT count(*) AS n, sum(val) AS s FROM t").to_arrow_table()
            assert agg.column("n")[0].as_py() == len(model), where
            if model:
                assert agg.column("s")[0].as_py() == pytest.approx(
                    sum(v[0] for v in model.values())
                )
    for w in writers:
        w.close(flush=False)
