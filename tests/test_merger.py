import datetime as dt
import os
import subprocess
import sys
import textwrap
import uuid

import lance
import pyarrow as pa
import pytest
from lance.mem_wal import CompactedSsTable

import memwal_query as mq
from memwal_query.format import index as mwindex
from memwal_query.storage import paths

from helpers import basic_rows, expr_table


def view(t, **kw):
    rows = t.to_table(**kw).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    return {r["id"]: (r["val"], r["name"]) for r in rows}


def base_view(t):
    return {r["id"]: (r["val"], r["name"]) for r in lance.dataset(t.uri).to_table().to_pylist()}


def make_generations(t, n=4):
    w = t.writer()
    model = {k: (float(k), f"n{k}") for k in range(100)}
    for g in range(n):
        ks = list(range(g * 7, g * 7 + 10)) + [150 + g]
        w.put(basic_rows(ks, val=[float(g * 1000 + k) for k in ks], name=["g"] * len(ks)))
        w.put(basic_rows([ks[0]], val=[-1.0], name=["last"]))  # last write wins within gen
        dels = [g * 7 + 20, 150 + g - 1] if g else [g * 7 + 20]
        w.delete(pa.table({"id": pa.array(dels, pa.int64())}))
        for k in ks:
            model[k] = (float(g * 1000 + k), "g")
        model[ks[0]] = (-1.0, "last")
        for k in dels:
            model.pop(k, None)
        w.flush()
    w.close()
    return w.region_id, model


def test_merge_in_order_equals_model(table):
    region, model = make_generations(table)
    assert view(table) == model
    assert table.maintenance.merge(max_generations=1).by_region() == {region: [1]}
    assert view(table) == model  # reading during a partial merge
    assert table.maintenance.merge().by_region() == {region: [2, 3, 4]}
    assert table.maintenance.merge().merged == []
    assert view(table) == model
    assert base_view(table) == model  # the base table alone now holds everything
    assert table.catalog.index().merged_generations() == {region: 4}


def test_gc_rules(table):
    region, model = make_generations(table, n=3)
    m = table.catalog.region_manifest(region)
    gen_dirs = [paths.generation_path(table.uri, region, g.path) for g in m.flushed_generations]
    # Nothing merged: nothing may go.
    assert table.maintenance.gc(dry_run=True) == []
    table.maintenance.merge(max_generations=2)
    # Merged, but older base versions (time travel) still need the generations.
    assert table.maintenance.gc() == []
    assert all(os.path.isdir(d) for d in gen_dirs)
    removed = table.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))
    assert gen_dirs[0] in removed and gen_dirs[1] in removed
    assert gen_dirs[2] not in removed and os.path.isdir(gen_dirs[2])  # not merged yet
    assert not os.path.exists(gen_dirs[0])
    assert any(p.endswith(".arrow") for p in removed)
    assert view(table) == model
    table.maintenance.merge()
    table.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))
    assert not os.path.exists(gen_dirs[2])
    assert view(table) == model
    # A writer drops garbage-collected generations from the manifest at its next flush.
    w = table.writer(region)
    w.put(basic_rows([999]))
    w.flush()
    assert [g.generation for g in w.manifest().flushed_generations] == [4]
    w.close()


def test_gc_keeps_generation_until_indexes_caught_up(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(300)), uri)
    lance.dataset(uri).create_scalar_index("name", "BTREE", name="name_idx")
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["name_idx"])
    w = t.writer()
    w.put(basic_rows([1, 500], name=["x", "y"]))
    w.flush()
    w.close()
    t.maintenance.merge()
    t.maintenance.refresh_snapshots()
    t.catalog.dataset().cleanup_old_versions(older_than=dt.timedelta(seconds=0))
    # Record "caught up to generation 0" for the region: GC must keep generation 1.
    rid_bytes = paths.region_id_to_bytes(w.region_id)

    def behind(d):
        e = d.index_catchup.add(index_name="name_idx")
        e.caught_up_generations.add(region_id=mwindex.pb.UUID(uuid=rid_bytes), generation=0)

    from memwal_query.maintain.catchup import record_progress

    d = mwindex.pb.MemWalIndexDetails()
    behind(d)
    record_progress(t.catalog.io, t.uri, d)
    assert t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0)) == []
    progress = t.maintenance.catch_up_indexes()
    assert progress == {"name_idx": {w.region_id: 1}}
    assert t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0))


def test_orphan_generation_dir_of_failed_flush_is_collected(table):
    w = table.writer()
    w.put(basic_rows([1]))
    w.flush()
    orphan = os.path.join(paths.region_dir(table.uri, w.region_id), "deadbeef_gen_1")
    os.makedirs(orphan)
    in_flight = os.path.join(paths.region_dir(table.uri, w.region_id), "cafebabe_gen_2")
    os.makedirs(in_flight)
    removed = table.maintenance.gc()
    assert orphan in removed and in_flight not in removed
    w.close(flush=False)


def test_details_update_keeps_concurrent_merge_progress(table):
    """A commit from outside the index lock between read and commit is repaired."""
    rid = str(uuid.uuid4())
    schema = lance.dataset(table.uri).schema

    def mutate(d):
        if d.num_regions == 0:
            ds = lance.dataset(table.uri)
            (
                ds.merge_insert("id")
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .mark_sstables_as_compacted([CompactedSsTable(rid, 3)])
                .conflict_retries(0)
                .execute(basic_rows([1]).cast(schema))
            )
        d.num_regions = 42

    mwindex.update_details(table.catalog.io, table.uri, mutate)
    idx = table.catalog.index()
    assert idx.merged_generations() == {rid: 3}
    assert idx.details.num_regions == 42


def test_snapshots_switch_to_external_file(base_uri):
    table = expr_table(base_uri, "col0 % 150")
    writers = []
    for r in range(150):
        w = table.writer(region_values={"r": r})
        writers.append(w)
    w0 = writers[0]
    w0.put(basic_rows([5100]))
    w0.flush()
    table.maintenance.refresh_snapshots()
    idx = table.catalog.refresh_index()
    assert idx.details.num_regions == 150
    assert not idx.details.HasField("inline_snapshots")
    assert os.path.exists(os.path.join(table.uri, "_indices", idx.uuid, "index.lance"))
    assert 5100 in view(table, consistency="eventual")
    for w in writers[:3]:
        w.close(flush=False)
    idx_small = None
    del idx_small


# -- Appendix 2 with real processes ----------------------------------------------------
MERGER = textwrap.dedent(
    """
    import os, sys
    import memwal_query as mq
    t = mq.MemWalTable.open(sys.argv[1])
    report = t.maintenance.merge(
        regions=[sys.argv[2]], max_generations=int(sys.argv[3]), batch_rows=0
    )
    print([(m.region_id, m.generation) for m in report.merged], flush=True)
    """
)


def run_merger(uri, region, n, crash_at=None):
    env = dict(os.environ)
    if crash_at:
        env["MEMWAL_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, "-c", MERGER, uri, region, str(n)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_appendix2_racing_mergers(table):
    region, model = make_generations(table, n=4)
    procs = [run_merger(table.uri, region, 99) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    merged = [eval(o[0].strip()) for o in outs]  # noqa: S307 - our own output
    gens = sorted(g for m in merged for _, g in m)
    assert gens == [1, 2, 3, 4]  # each generation merged exactly once, none skipped
    assert table.catalog.index().merged_generations() == {region: 4}
    assert base_view(table) == model
    # Progress never went backwards across the base table's history.
    history = []
    for v in lance.dataset(table.uri).versions():
        idx = mwindex.read_index(table.catalog.io, lance.dataset(table.uri, version=v["version"]))
        history.append(0 if idx is None else idx.merged_generations().get(region, 0))
    assert history == sorted(history)


@pytest.mark.slow
def test_appendix2_crash_after_commit(table):
    region, model = make_generations(table, n=3)
    p = run_merger(table.uri, region, 99, crash_at="merge.after_commit")
    p.communicate(timeout=120)
    assert p.returncode != 0  # killed right after committing generation 1
    assert table.catalog.index().merged_generations() == {region: 1}
    assert view(table) == model
    p = run_merger(table.uri, region, 99)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert [g for _, g in eval(out.strip())] == [2, 3]  # noqa: S307 - skips generation 1
    assert base_view(table) == model


def test_killed_before_commit_leaves_table_correct(table):
    region, model = make_generations(table, n=2)
    p = run_merger(table.uri, region, 99, crash_at="merge.before_commit")
    p.communicate(timeout=120)
    assert p.returncode != 0
    assert table.catalog.index().merged_generations() == {}
    assert view(table) == model
    assert table.maintenance.merge().by_region() == {region: [1, 2]}
    assert base_view(table) == model


def test_status(table):
    region, _ = make_generations(table, n=2)
    table.maintenance.merge(max_generations=1)
    w = table.writer(region)
    w.put(basic_rows([77777]))
    s = table.maintenance.status().to_dict()
    r = s["regions"][region]
    assert r["flushed_generations"] == [1, 2]
    assert r["merged_generation"] == 1
    assert r["current_generation"] == 3
    assert r["unflushed_rows"] == 1
    assert r["writer_epoch"] == 2
    w.close(flush=False)


def test_merge_of_an_unknown_region_is_an_error_naming_it(table):
    """A well-formed id of no region, or a malformed one, is a typed error; nothing is
    merged (also for the regions named beside it)."""
    known = table.catalog.region_ids()
    before = table.catalog.index().merged_generations()
    unknown = str(uuid.uuid4())
    with pytest.raises(mq.RegionNotFoundError, match=unknown):
        table.maintenance.merge(regions=[*known, unknown])
    with pytest.raises(mq.InvalidPathError):
        table.maintenance.merge(regions=["../nope"])
    assert table.catalog.index().merged_generations() == before


def test_large_generation_merges_into_a_key_indexed_base_with_vectors(tmp_path):
    """A 150k-row generation with a vector column merges (Lance's index join ran out of
    its memory pool here: the merger must take the scan join for large generations)."""
    import numpy as np

    from helpers import pk_schema

    dim = 32
    schema = pk_schema(pa.field("val", pa.float64()), pa.field("vec", pa.list_(pa.float32(), dim)))
    rng = np.random.default_rng(7)

    def rows(ids):
        flat = pa.array(rng.random(len(ids) * dim, dtype=np.float32))
        vec = pa.FixedSizeListArray.from_arrays(flat, dim)
        return pa.table({"id": ids, "val": ids.astype(np.float64), "vec": vec}, schema=schema)

    uri = str(tmp_path / "t")
    lance.write_dataset(rows(np.arange(100_000)), uri)
    t = mq.MemWalTable.initialize(uri)  # creates the BTREE index on the key
    assert len(lance.dataset(uri).describe_indices()) >= 2  # + __lance_mem_wal
    updates = np.arange(50_000, 200_000)
    with t.writer(max_memtable_rows=10**9, max_memtable_bytes=1 << 40) as w:
        w.put(rows(updates))  # upserts only: with deletes Lance never joins by index
        w.flush()
    assert [m.generation for m in t.maintenance.merge().merged] == [1]
    base = lance.dataset(uri).to_table(columns=["id", "val"])
    assert base.num_rows == 200_000
    ids = base.column("id").to_numpy()
    assert len(np.unique(ids)) == len(ids)
    assert pa.compute.sum(base.column("val")).as_py() == float(np.arange(200_000).sum())


@pytest.mark.parametrize("batch_rows, commits", [(None, 1), (0, 4), ("two", 3)])
def test_consecutive_generations_merge_in_one_commit(table, batch_rows, commits):
    """Generations 1..4 (upserts, deletes, last write wins) merged in one commit, one
    per generation, or up to a row budget: the same base table and progress."""
    region, model = make_generations(table)
    gens = table.catalog.region_manifest(region).flushed_generations
    assert all(g.physical_rows for g in gens)
    if batch_rows == "two":  # exactly generations 1 and 2 fit
        batch_rows = gens[0].physical_rows + gens[1].physical_rows
    before = lance.dataset(table.uri).version
    merged = table.maintenance.merge(batch_rows=batch_rows)
    assert merged.by_region() == {region: [1, 2, 3, 4]}
    assert lance.dataset(table.uri).version == before + commits
    assert table.catalog.index().merged_generations() == {region: 4}
    assert base_view(table) == model
    assert view(table) == model
    assert table.maintenance.merge().merged == []


# region r holds keys 20r..20r+19 and 1000+10r..1000+10r+9
REGIONS_SQL = "CASE WHEN col0 >= 1000 THEN (col0 - 1000) / 10 ELSE col0 / 20 END"


def _regions_with_generations(table, n_regions=3, n_gens=2):
    """Regions (``REGIONS_SQL``), each with upserts, a delete and a last-write-wins key
    per generation."""
    model = {k: (float(k), f"n{k}") for k in range(100)}
    regions = []
    for r in range(n_regions):
        w = table.writer(region_values={"r": r})
        regions.append(w.region_id)
        for g in range(n_gens):
            ks = [r * 20 + g, r * 20 + 10 + g, 1000 + r * 10 + g]  # disjoint per region
            w.put(basic_rows(ks, val=[float(g)] * 3, name=[f"r{r}g{g}"] * 3))
            w.put(basic_rows([ks[0]], val=[-1.0], name=["last"]))
            w.delete(pa.table({"id": pa.array([r * 20 + 5], pa.int64())}))
            for k in ks:
                model[k] = (float(g), f"r{r}g{g}")
            model[ks[0]] = (-1.0, "last")
            model.pop(r * 20 + 5, None)
            w.flush()
        w.close()
    return regions, model


def test_regions_merge_together_in_one_commit(base_uri):
    """A key lives in one region: several regions' generations share a commit that
    carries every region's progress marker."""
    table = expr_table(base_uri, REGIONS_SQL)
    regions, model = _regions_with_generations(table)
    before = lance.dataset(table.uri).version
    merged = table.maintenance.merge()
    assert merged.by_region() == {r: [1, 2] for r in regions}
    assert lance.dataset(table.uri).version == before + 1
    assert table.catalog.index().merged_generations() == {r: 2 for r in regions}
    assert base_view(table) == model
    assert view(table) == model
    assert table.maintenance.merge().merged == []


def test_regions_merge_together_within_limits(base_uri):
    table = expr_table(base_uri, REGIONS_SQL)
    regions, model = _regions_with_generations(table)
    gen_rows = table.catalog.region_manifest(regions[0]).flushed_generations[0].physical_rows
    before = lance.dataset(table.uri).version
    # max_generations applies per region: generation 1 of every region, in one commit
    assert table.maintenance.merge(max_generations=1).by_region() == {r: [1] for r in regions}
    assert lance.dataset(table.uri).version == before + 1
    assert view(table) == model
    # a row budget of two generations: regions two by two (2 commits for 3 regions)
    table.maintenance.merge(batch_rows=2 * gen_rows)
    assert lance.dataset(table.uri).version == before + 3
    assert table.catalog.index().merged_generations() == {r: 2 for r in regions}
    assert base_view(table) == model
