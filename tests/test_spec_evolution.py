"""Region spec evolution: ``MemWalTable.set_region_spec`` on real tables.

The rule under test (``memwal_query.maintain.specs``): regions of an older spec are
fenced, flushed, sealed and merged before any writer of the new spec writes, so a key
is never unmerged in two regions, and the newest row of every key is right through
every reader (to_table, SQL, lookup, vector and full-text search).
"""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query import RegionSpecError, SpecChangedError
from memwal_query.catalog import SPEC_READY_KEY
from memwal_query.format import index as mwindex
from memwal_query.format.schema import storage_schema, with_tombstone
from memwal_query.format.wal import Wal
from memwal_query.read import view
from memwal_query.regions.spec import bucket_spec, expression_spec
from memwal_query.storage import paths
from memwal_query.write.writer import RegionWriter

from helpers import BASIC_SCHEMA, basic_rows


def _table(tmp_path, buckets: int = 2, n: int = 200) -> mq.MemWalTable:
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(basic_rows(range(n)), uri)
    return mq.MemWalTable.initialize(uri, region_spec=bucket_spec(ds, "id", buckets))


def _spec2(t: mq.MemWalTable, buckets: int = 5) -> mq.RegionSpec:
    return bucket_spec(t.catalog.lance_schema, "id", buckets, spec_id=2)


def _view(t: mq.MemWalTable, consistency: str = "strong") -> dict[int, tuple[float, str]]:
    got = t.to_table(consistency=consistency, writers=[]).to_pydict()
    return {i: (v, n) for i, v, n in zip(got["id"], got["val"], got["name"])}


def _regions_by_spec(t: mq.MemWalTable) -> dict[int, list]:
    out: dict[int, list] = {}
    for rid in t.catalog.region_ids():
        m = t.catalog.region_manifest(rid)
        out.setdefault(m.region_spec_id, []).append(m)
    return out


def test_spec_change_under_continuous_writes_matches_model(tmp_path):
    """Two table objects (two "processes") write, delete, flush and merge while the spec
    changes from 2 to 5 buckets; the object that did not change the spec keeps routing
    by the old one until its fenced writers tell it. Every step is checked against a
    model of the expected rows."""
    t = _table(tmp_path)
    other = mq.MemWalTable.open(t.uri)  # learns of the new spec only through its writers
    model = {i: (float(i), f"n{i}") for i in range(200)}
    rng = np.random.default_rng(23)
    step = [0]

    def upsert(tbl, ids):
        step[0] += 1
        ids = sorted(set(int(i) for i in ids))
        val = [step[0] * 1000.0 + i for i in ids]
        tbl.write(basic_rows(ids, val=val, name=[f"s{step[0]}"] * len(ids)))
        model.update({i: (v, f"s{step[0]}") for i, v in zip(ids, val)})

    def delete(tbl, ids):
        ids = sorted(set(int(i) for i in ids))
        tbl.delete(pa.table({"id": pa.array(ids, pa.int64())}))
        for i in ids:
            model.pop(i, None)

    def check():
        # "latest": manifests + every region's acknowledged WAL entries (two objects
        # fence each other's writers, so their MemTables are not the ones to read)
        assert _view(t, "latest") == model

    def round_(i):
        tbl = (t, other)[i % 2]
        upsert(tbl, rng.integers(0, 320, 25))
        delete(tbl, rng.choice(sorted(model), 4, replace=False))
        if i % 3 == 0:
            tbl.flush()
        if i % 4 == 1:
            tbl.maintenance.merge()
        check()

    for i in range(5):
        round_(i)
    old_keys = sorted(k for k in model if k >= 200)  # written under spec 1
    upsert(other, old_keys[:10])  # unflushed in other's writers of spec-1 regions
    t.maintenance.set_region_spec(_spec2(t))
    check()
    # keys written under spec 1 are updated and deleted under spec 2, by both objects
    upsert(other, old_keys[:20])
    delete(t, old_keys[20:30])
    upsert(t, old_keys[30:40] + list(range(320, 330)))
    check()
    for i in range(5, 10):
        round_(i)
    t.flush()
    other.flush()
    by_spec = _regions_by_spec(t)
    assert set(by_spec) == {1, 2} and len(by_spec[1]) == 2 and len(by_spec[2]) == 5
    merged = t.catalog.index().merged_generations()
    for m in by_spec[1]:  # sealed, and every generation merged
        assert m.sealed
        last = max((g.generation for g in m.flushed_generations), default=0)
        assert merged.get(m.region_id, 0) == last
    assert t.catalog.index().details.writer_config_defaults[SPEC_READY_KEY] == "2"
    # every reader, from a fresh object (another process)
    fresh = mq.MemWalTable.open(t.uri)
    assert _view(fresh) == model
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", t.uri)
    got = ctx.sql("SELECT id, val, name FROM t ORDER BY id").to_arrow_table().to_pydict()
    assert got["id"] == sorted(model)
    assert [(v, n) for v, n in zip(got["val"], got["name"])] == [model[i] for i in got["id"]]
    probe = old_keys[:40] + [0, 1, 2, 325, 999]
    got = fresh.lookup(probe).to_pydict()
    assert got["id"] == [k for k in probe if k in model]
    assert [model[i][0] for i in got["id"]] == got["val"]
    # the change feed, applied in its row order to the initial rows, gives the model
    feed = fresh.changes().table.to_pydict()
    replayed = {i: (float(i), f"n{i}") for i in range(200)}
    for i, v, n, kind in zip(feed["id"], feed["val"], feed["name"], feed["_change_type"]):
        if kind == "delete":
            replayed.pop(i, None)
        else:
            replayed[i] = (v, n)
    assert replayed == model
    t.maintenance.merge()
    assert _view(mq.MemWalTable.open(t.uri)) == model
    t.close()
    other.close()


def test_reroute_and_stale_claims_after_a_spec_change(tmp_path):
    """A writer routed by the old spec refuses rows (SpecChangedError) whether it learns
    of the change before claiming (index re-read) or only after (its claim raced the
    change): the check after the claim; the region is then sealed by the change."""
    t = _table(tmp_path)
    stale = mq.MemWalTable.open(t.uri)
    values = {"bucket": 0}
    old_region = stale.catalog.region_id_for(values)
    t.write(basic_rows([1, 2, 3, 4], val=[7.0] * 4))
    # the change is committed (a crash before it completed is simulated: no seal yet)
    spec2 = _spec2(t)
    before = t.catalog.dataset().version
    mwindex.update_details(t.catalog.io, t.uri, lambda d: d.region_specs.append(spec2.to_proto()))
    assert stale.region_spec.spec_id == 1  # stale's cached index
    with pytest.raises(SpecChangedError) as e:
        stale.writer(region_values=values, spec_id=1)
    assert (e.value.expected, e.value.current) == (1, 2)
    stale_index = stale.catalog._index
    stale.catalog._index = mwindex.read_index_at(t.catalog.io, t.uri, before)  # the index before
    with pytest.raises(SpecChangedError):  # claimed, then re-read the index: refused
        RegionWriter(stale.catalog, old_region, region_values=values, region_spec_id=1)
    stale.catalog._index = stale_index
    assert not stale.catalog.region_manifest(old_region).sealed
    # the first writer of the new spec completes the change, then writes
    t2 = mq.MemWalTable.open(t.uri)
    assert t2.catalog.spec_change_pending
    t2.write(basic_rows([1, 50], val=[8.0, 8.0]))
    assert not t2.catalog.spec_change_pending
    assert stale.catalog.region_manifest(old_region).sealed
    # t's own (fenced) writer of a spec-1 region: write() routes again by spec 2
    t.write(basic_rows([2, 3], val=[9.0, 9.0]))
    t.flush()
    t2.flush()
    got = _view(mq.MemWalTable.open(t.uri))
    assert [got[i][0] for i in (1, 2, 3, 4, 50)] == [8.0, 9.0, 9.0, 7.0, 8.0]
    # a sealed region takes no claim; its WAL tail is not read even by "latest"
    with pytest.raises(mq.FencedError):
        t.writer(old_region).close()
    # a WAL entry a fenced writer wrote after the drain (never acknowledged)
    sealed = stale.catalog.region_manifest(old_region)
    wal = Wal(t.catalog.io, paths.wal_dir(t.uri, old_region), old_region)
    row = with_tombstone(basic_rows([777]), False).cast(storage_schema(t.schema))
    # (t's fenced put of [2, 3] above left one too: it was routed again)
    assert max(wal.positions()) > sealed.replay_after_wal_entry_position
    # (of a generation above the flushed ones: its writer had a MemTable flushing)
    wal.append(max(wal.positions()) + 1, row, sealed.writer_epoch - 2, sealed.current_generation)
    assert 777 not in _view(mq.MemWalTable.open(t.uri), "latest")
    assert 777 not in t.changes(consistency="latest").table.column("id").to_pylist()
    st = t.maintenance.status().to_dict()["regions"][old_region]
    assert st["sealed"] and st["region_spec_id"] == 1 and st["unflushed_rows"] == 0
    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    flushed = CliRunner().invoke(main, ["drain", t.uri])  # skips the sealed region
    assert flushed.exit_code == 0, flushed.output
    assert (
        t.maintenance.fsck().findings == []
    )  # fsck: a sealed region's stray entries are no damage
    t.maintenance.merge()
    t.maintenance.gc()  # with sealed regions (and their stray entries): the answer stays
    assert _view(mq.MemWalTable.open(t.uri), "latest") == got
    assert _view(mq.MemWalTable.open(t.uri), "latest") == got
    t.close()
    t2.close()


def test_pruning_uses_each_regions_own_spec(tmp_path):
    """While old-spec regions are unmerged (change committed, not completed), a key
    predicate prunes them by THEIR spec, and new-spec regions by theirs."""
    t = _table(tmp_path, buckets=4)
    t.write(basic_rows(range(300, 340)))
    t.flush()
    spec2 = _spec2(t, 3)
    mwindex.update_details(t.catalog.io, t.uri, lambda d: d.region_specs.append(spec2.to_proto()))
    t.catalog.refresh_index()
    plan = view.resolve(t.catalog, "strong", [], [("id", "=", 305)])
    old = {r.region_id for r in plan.regions}
    assert len(old) == 1 and len(plan.pruned) == 3  # 1 of the 4 spec-1 regions read
    bucket = (
        t.catalog.spec_for(1)
        .evaluate(basic_rows([305]), t.catalog.lance_schema)
        .column("bucket")[0]
    )
    assert old == {mq.region_id_for(1, {"bucket": bucket.as_py()})}
    assert t.lookup([305]).to_pydict()["val"] == [305.0]


def test_spec_change_with_vector_and_fulltext_search(tmp_path):
    """Keys rewritten under the new spec: search returns their newest version only."""
    dim = 4
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, {"lance-schema:unenforced-primary-key": "true"}),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), dim)),
        ]
    )

    def rows(ids, word, offset):
        ids = list(ids)
        vecs = np.array([[i + offset] * dim for i in ids], np.float32).reshape(-1)
        return pa.table(
            {
                "id": ids,
                "text": [f"{word} w{i}" for i in ids],
                "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs), dim),
            },
            schema=schema,
        )

    uri = str(tmp_path / "s")
    ds = lance.write_dataset(rows(range(100), "base", 0.0), uri)
    ds.create_scalar_index("text", "INVERTED", name="text_idx")
    spec = expression_spec(ds, ["id"], "col0 % 2", "int64", field_id="r")
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    t.write(rows(range(10, 20), "apple", 0.25))
    t.flush()
    t.write(rows(range(15, 25), "apple", 0.25))  # unflushed when the spec changes
    calls: list[tuple[int, int]] = []
    t.maintenance.set_region_spec(
        expression_spec(ds, ["id"], "col0 % 3", "int64", 2, field_id="r"),
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(1, 2), (2, 2)]  # the two regions of spec 1
    t.write(rows(range(18, 22), "cherry", 0.5))  # old-spec keys, new regions
    t.delete(pa.table({"id": [10, 11]}))
    near = t.vector_search("vec", np.full(dim, 20.5, np.float32), k=3)
    assert sorted(near["id"].to_pylist()) == [19, 20, 21]
    assert near["text"].to_pylist()[0] in ("cherry w20", "cherry w21")
    apple = t.fts_search("text", "apple", k=50)
    assert sorted(apple["id"].to_pylist()) == [12, 13, 14, 15, 16, 17, 22, 23, 24]
    cherry = t.fts_search("text", "cherry", k=50)
    assert sorted(cherry["id"].to_pylist()) == [18, 19, 20, 21]
    t.close()


def test_bad_spec_is_refused_with_the_index_unchanged(tmp_path):
    t = _table(tmp_path)
    version = t.catalog.dataset().version
    with pytest.raises(RegionSpecError, match="never reused"):
        t.maintenance.set_region_spec(
            bucket_spec(t.catalog.lance_schema, "id", 8)
        )  # spec id 1 again
    with pytest.raises(RegionSpecError, match="unknown field"):
        t.maintenance.set_region_spec(mq.RegionSpec(2, [mq.RegionField("b", [999], "identity")]))
    with pytest.raises(RegionSpecError, match="RegionSpec"):
        t.maintenance.set_region_spec("bucket(id, 8)")  # type: ignore[arg-type]
    assert t.catalog.dataset().version == version
    assert [s.spec_id for s in t.catalog.index().details.region_specs] == [1]
    t.write(basic_rows([1]))  # the table still works with its spec
    t.close()


def test_cli_spec_set_and_show(tmp_path):
    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    t = _table(tmp_path)
    t.write(basic_rows([300, 301], val=[1.0, 1.0]))
    t.close()  # flushed, not merged
    run = CliRunner().invoke(main, ["spec", "set", t.uri, "--bucket", "id:4"])
    assert run.exit_code == 0, run.output
    assert "spec 2" in run.output
    shown = CliRunner().invoke(main, ["spec", "show", t.uri])
    assert shown.exit_code == 0, shown.output
    assert "2 (current)" in shown.output and "bucket" in shown.output
    bad = CliRunner().invoke(main, ["spec", "set", t.uri, "--bucket", "nope:4"])
    assert bad.exit_code != 0
    t2 = mq.MemWalTable.open(t.uri)
    assert t2.region_spec.spec_id == 2 and not t2.catalog.spec_change_pending
    assert _view(t2)[301] == (1.0, "n301")
    assert BASIC_SCHEMA.names == t2.schema.names


def test_pylance_reads_after_a_spec_change_and_its_writer_refuses(tmp_path):
    """A table pylance initialized (unsharded): after our spec change pylance reads the
    index (both specs) and the native scanner gives our rows; pylance 14's native
    writer refuses tables with several specs (its limitation, documented)."""
    from lance.mem_wal import LsmScanner, ShardSnapshot

    uri = str(tmp_path / "n")
    schema = pa.schema([BASIC_SCHEMA.field("id"), pa.field("v", pa.float64())])
    lance.write_dataset(pa.table({"id": range(5), "v": [0.0] * 5}, schema=schema), uri)
    lance.dataset(uri).initialize_mem_wal(unsharded=True)
    t = mq.MemWalTable.open(uri)
    t.write(pa.table({"id": [1, 20], "v": [1.0, 20.0]}))
    old = t.catalog.region_ids()[0]
    t.maintenance.set_region_spec(bucket_spec(t.catalog.lance_schema, "id", 2, spec_id=2))
    t.write(pa.table({"id": [1, 30], "v": [11.0, 30.0]}))
    t.close()
    ours = dict(zip(*t.to_table().to_pydict().values()))
    assert ours == {0: 0.0, 1: 11.0, 2: 0.0, 3: 0.0, 4: 0.0, 20: 20.0, 30: 30.0}
    details = lance.dataset(uri).mem_wal_index_details()
    assert [s["spec_id"] for s in details["sharding_specs"]] == [1, 2]
    merged = t.catalog.index().merged_generations()
    snaps = []
    for rid in t.catalog.region_ids():
        m = t.catalog.region_manifest(rid)
        snap = ShardSnapshot(rid).with_current_generation(m.current_generation)
        for g in m.flushed_generations:
            if g.generation > merged.get(rid, 0):
                snap = snap.with_sstable(g.generation, g.path)
        snaps.append(snap)
    native = LsmScanner.from_snapshots(lance.dataset(uri), snaps).to_table().to_pydict()
    assert dict(zip(native["id"], native["v"])) == ours
    with pytest.raises(OSError, match="sharding spec"):
        lance.dataset(uri).mem_wal_writer(old)


def test_spec_change_while_another_thread_keeps_writing(tmp_path):
    """A writer thread (its own table object) upserts and deletes without pause while
    the spec changes: every acknowledged write is there, the last one per key wins, and
    the thread never sees an error (its rows are routed again)."""
    import threading

    t = _table(tmp_path)
    writer_table = mq.MemWalTable.open(t.uri)
    expected: dict[int, tuple[float, str] | None] = {}
    done = threading.Event()
    progress = threading.Semaphore(0)
    errors: list[BaseException] = []

    def loop():
        version = 0
        try:
            while not done.is_set() or version < 12:
                version += 1
                ids = [1000 + (version * 7 + j) % 60 for j in range(15)]
                ids = sorted(set(ids))
                if version % 5 == 0:
                    writer_table.delete(pa.table({"id": pa.array(ids[:3], pa.int64())}))
                    expected.update({i: None for i in ids[:3]})
                else:
                    vals = [version + i / 10000 for i in ids]
                    writer_table.write(basic_rows(ids, val=vals, name=[f"v{version}"] * len(ids)))
                    expected.update({i: (v, f"v{version}") for i, v in zip(ids, vals)})
                progress.release()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            progress.release()

    thread = threading.Thread(target=loop)
    thread.start()
    for _ in range(4):
        progress.acquire()
    t.maintenance.set_region_spec(_spec2(t, 4))
    done.set()
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    writer_table.close()
    # then keys written under both specs are updated once more, by the new spec
    again = sorted(expected)[::2]
    t.write(basic_rows(again, val=[-1.0] * len(again), name=["last"] * len(again)))
    t.close()
    expected.update({i: (-1.0, "last") for i in again})
    got = _view(mq.MemWalTable.open(t.uri))
    want = {i: (float(i), f"n{i}") for i in range(200)}
    want.update({i: v for i, v in expected.items() if v is not None})
    for i, v in expected.items():
        if v is None:
            want.pop(i, None)
    assert got == want
    by_spec = _regions_by_spec(t)
    assert all(m.sealed for m in by_spec[1]) and by_spec[2]


def test_spec_change_on_a_pylance_table_without_a_recorded_spec(tmp_path):
    """``initialize_mem_wal()`` records no spec (one region by default here) and
    pylance's writer creates regions of spec 0: the change records the default spec as
    1, refuses id 1 for the new one, and drains pylance's region like any other."""
    import uuid

    uri = str(tmp_path / "p")
    schema = pa.schema([BASIC_SCHEMA.field("id"), pa.field("v", pa.float64())])
    lance.write_dataset(pa.table({"id": range(10), "v": [0.0] * 10}, schema=schema), uri)
    ds = lance.dataset(uri)
    ds.initialize_mem_wal()
    shard = str(uuid.uuid4())
    with ds.mem_wal_writer(shard) as w:
        w.put(pa.table({"id": [1, 2, 30], "v": [1.0, 2.0, 30.0]}, schema=schema))
    t = mq.MemWalTable.open(uri)
    assert t.catalog.region_manifest(shard).region_spec_id == 0
    with pytest.raises(RegionSpecError, match="spec_id=2"):
        t.maintenance.set_region_spec(bucket_spec(t.catalog.lance_schema, "id", 2, spec_id=1))
    t.maintenance.set_region_spec(bucket_spec(t.catalog.lance_schema, "id", 2, spec_id=2))
    t.write(pa.table({"id": [2, 40], "v": [22.0, 40.0]}))
    t.close()
    got = t.to_table().to_pydict()
    want = {i: 0.0 for i in range(10)} | {1: 1.0, 2: 22.0, 30: 30.0, 40: 40.0}
    assert dict(zip(got["id"], got["v"])) == want
    assert sorted(t.catalog.region_specs) == [1, 2] and t.catalog.region_manifest(shard).sealed
