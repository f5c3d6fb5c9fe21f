"""Hostile storage: every fault class corrupts a real table on disk and is
detected with a typed error naming the file, the table unchanged; ``fsck`` names it."""

import datetime as dt
import json
import os
import shutil

import lance
import pyarrow as pa
import pytest
from click.testing import CliRunner

import memwal_query as mq
from memwal_query.cli.commands import main as cli
from memwal_query.exceptions import (
    BloomFilterWarning,
    InvalidPathError,
    ManifestCorruptError,
    WalCorruptError,
)
from memwal_query.format import bloom
from memwal_query.format.manifest import HINT_FILE, RegionManifestStore
from memwal_query.format.wal import Wal
from memwal_query.maintain import fsck, merger
from memwal_query.read import sources
from memwal_query.storage import paths

from helpers import basic_rows, expr_table


def _state(uri: str) -> dict:
    """Every file under the table with its size and mtime: 'unchanged' means equal."""
    out = {}
    for root, _, files in os.walk(uri):
        for f in files:
            p = os.path.join(root, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def _six_entries(table, values=None) -> tuple[str, Wal]:
    """Six durable puts (six WAL entries) of key 1001 = 1.0 .. 6.0 (and key 1010 + i),
    closed without flush (the base table holds keys 0..99); region ``values`` (None:
    the table's one region)."""
    w = table.writer(region_values=values) if values else table.writer()
    for i in range(1, 7):
        w.put(basic_rows([1001, 1010 + i], val=[float(i), float(i)]))
    w.close(flush=False)
    rid = w.region_id
    return rid, Wal(table.catalog.io, paths.wal_dir(table.uri, rid), rid)


def _codes(findings) -> set:
    return {(f.severity, f.kind, f.path) for f in findings}


def _val(table, key):
    got = table.lookup(pa.table({"id": [key]}))
    return got.column("val").to_pylist()


# -- 1. WAL gap ---------------------------------------------------------------------------
def test_wal_gap_is_refused_then_repaired_with_accept_loss(table):
    rid, wal = _six_entries(table)
    assert table.maintenance.fsck().findings == []
    os.unlink(wal.path(3))
    before = _state(table.uri)
    with pytest.raises(WalCorruptError, match="entry 3 .* is missing") as e:
        table.writer(rid)
    assert wal.path(3) in str(e.value) and "--accept-loss" in str(e.value)
    assert _state(table.uri) == before  # not even claimed
    assert _codes(table.maintenance.fsck().findings) == {("error", "wal-gap", wal.path(3))}
    # Without --accept-loss nothing lossy happens.
    runner = CliRunner()
    res = runner.invoke(cli, ["repair", table.uri, "--region", rid])
    assert res.exit_code == 1 and "--accept-loss" in res.output
    assert _state(table.uri) == before
    res = runner.invoke(cli, ["repair", table.uri, "--region", rid, "--accept-loss"])
    assert res.exit_code == 0, res.output
    assert f"drop WAL entry {wal.path(3)}" in res.output
    assert table.maintenance.fsck().findings == []
    w = table.writer(rid)
    assert w.stats.replayed_entries == 6  # 1, 2, the empty filler, 4, 5, 6
    w.flush()
    w.close()
    assert _val(table, 1001) == [6.0]  # entries after the hole were kept
    assert _val(table, 1013) == [] and _val(table, 1012) == [2.0]  # only entry 3 was lost


# -- 2. WAL bit flips ---------------------------------------------------------------------
def test_wal_bit_flip_is_refused_with_the_table_unchanged(table):
    rid, wal = _six_entries(table)
    data = bytearray(open(wal.path(4), "rb").read())
    i = bytes(data).rindex((1014).to_bytes(8, "little"))  # key 1014 of entry 4
    data[i + 1] ^= 0x04  # 1014 -> 2038: well-formed Arrow, another key
    open(wal.path(4), "wb").write(bytes(data))
    before = _state(table.uri)
    with pytest.raises(WalCorruptError, match="checksum mismatch") as e:
        table.writer(rid)
    assert wal.path(4) in str(e.value)
    assert _state(table.uri) == before
    assert _codes(table.maintenance.fsck().findings) == {("error", "wal-entry", wal.path(4))}
    fsck.repair(table.catalog, rid, accept_loss=True)
    w = table.writer(rid)
    w.close()
    assert _val(table, 1014) == [] and _val(table, 2038) == [] and _val(table, 1001) == [6.0]


# -- 3. bloom filters ---------------------------------------------------------------------
def _flushed_generation(table, values=None, keys=range(1000, 1200)) -> tuple[str, str]:
    w = table.writer(region_values=values) if values else table.writer()
    w.put(basic_rows(keys, val=[7.0] * len(keys)))
    w.flush()
    w.close()
    m = table.catalog.region_manifest(w.region_id)
    return w.region_id, paths.generation_path(table.uri, w.region_id, m.flushed_generations[0].path)


def _clear_bit(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    i = next(i for i, b in enumerate(data) if b)
    data[i] &= data[i] - 1  # clear its lowest set bit
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "cleared-bit",
        "truncated",
        "huge",
        "cleared-bit-native",  # no bloom_filter.json (pylance's): exact check in fsck
        "truncated-native",  # no bloom_filter.json: the size check alone finds it
    ],
)
def test_bloom_damage_is_detected_and_lookups_stay_exact(table, damage):
    rid, gen = _flushed_generation(table)
    path = os.path.join(gen, bloom.BLOOM_FILE)
    keys = pa.table({"id": pa.array(range(1000, 1200), pa.int64())})
    if damage == "cleared-bit-native":
        os.unlink(os.path.join(gen, bloom.BLOOM_META_FILE))
        # clear a bit a key needs: the first word any key hits
        bf = bloom.BloomFilter.from_bytes(open(path, "rb").read())
        block, masks = bf._positions(bloom.hash_keys(keys))
        bf.words[block[0], 0] &= ~masks[0, 0]
        open(path, "wb").write(bf.to_bytes())
    elif damage == "cleared-bit":
        _clear_bit(path)
    elif damage.startswith("truncated"):
        if damage.endswith("native"):
            os.unlink(os.path.join(gen, bloom.BLOOM_META_FILE))
        os.truncate(path, os.path.getsize(path) - 32)
    else:  # 16 GiB sparse file: must be refused from its size, never read
        os.truncate(path, 16 << 30)
    (finding,) = table.maintenance.fsck().findings
    assert (finding.severity, finding.kind, finding.path) == ("error", "bloom", path)
    assert finding.repair.startswith("memwal repair")
    if damage != "cleared-bit-native":
        with pytest.warns(BloomFilterWarning, match=path):
            loaded = bloom.load(table.catalog.io, gen, 200)
        assert not loaded.trusted and loaded.might_contain_hashes(bloom.hash_keys(keys)).all()
        # Readers do not use it: lookups check keys exactly and stay equal to SQL.
        # (A pylance filter has no checksum to check: fsck finds it, see above.)
        t2 = mq.MemWalTable.open(table.uri)  # fresh caches
        with pytest.warns(BloomFilterWarning):
            got = t2.lookup(keys)
        expected = t2.to_table().filter(pa.compute.is_in(t2.to_table()["id"], keys["id"]))
        assert sorted(got.column("id").to_pylist()) == sorted(expected.column("id").to_pylist())
        assert got.num_rows == 200
    assert fsck.repair(table.catalog, rid) == [f"rebuild {path} from 200 keys"]
    assert table.maintenance.fsck().findings == []


# -- 4. manifests and layout ----------------------------------------------------------------
def _commit_raw(store: RegionManifestStore, **fields) -> str:
    latest = store.load_latest()
    msg = latest.replace(version=latest.version + 1).to_proto()
    for k, v in fields.items():
        setattr(msg, k, v)
    path = store.path(latest.version + 1)
    with open(path, "wb") as f:
        f.write(msg.SerializeToString())
    return path


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"current_generation": 1}, "current_generation 1 is not above flushed generation 1"),
        ({"writer_epoch": (1 << 64) - 2}, "writer_epoch .* beyond"),
    ],
)
def test_corrupt_manifest_is_a_typed_error_nothing_written(table, fields, match):
    w = table.writer()
    w.put(basic_rows([500]))
    w.flush()
    w.close()
    store = RegionManifestStore(table.catalog.io, table.uri, w.region_id)
    path = _commit_raw(store, **fields)
    before = _state(table.uri)
    for attempt in (
        lambda: table.writer(w.region_id),
        lambda: table.maintenance.gc(),
        table.maintenance.status,
    ):
        with pytest.raises(ManifestCorruptError, match=match) as e:
            attempt()
        assert path in str(e.value)
    assert _state(table.uri) == before
    assert ("error", "manifest", path) in _codes(table.maintenance.fsck().findings)


def test_version_hint_1e400_falls_back_to_listing_and_fsck_warns(table):
    w = table.writer()
    w.put(basic_rows([500]))
    w.close()
    store = RegionManifestStore(table.catalog.io, table.uri, w.region_id)
    hint = os.path.join(store.dir, HINT_FILE)
    open(hint, "w").write('{"version": 1e400}')
    assert store.latest_version() == 2  # claim + flush
    (f,) = table.maintenance.fsck().findings
    assert (f.severity, f.kind, f.path) == ("warning", "hint", hint)
    res = CliRunner().invoke(cli, ["fsck", table.uri])
    assert res.exit_code == 0 and hint in res.output  # a warning only
    fsck.repair(table.catalog, w.region_id)
    assert (
        json.loads(open(hint).read()) == {"version": 2} and table.maintenance.fsck().findings == []
    )


def test_mem_wal_as_a_file_is_an_invalid_path(base_uri):
    t = mq.MemWalTable.initialize(base_uri)
    shutil.rmtree(os.path.join(base_uri, "_mem_wal"), ignore_errors=True)
    open(os.path.join(base_uri, "_mem_wal"), "w").write("x")
    with pytest.raises(InvalidPathError, match="_mem_wal: is not a directory"):
        t.to_table()
    with pytest.raises(InvalidPathError):
        t.writer()
    (f,) = t.maintenance.fsck().findings
    assert (f.kind, f.path) == ("layout", os.path.join(base_uri, "_mem_wal"))
    res = CliRunner().invoke(cli, ["fsck", base_uri])
    assert res.exit_code == 1 and res.output.startswith("ERROR   layout")


def test_region_directory_linked_out_of_the_table(table, tmp_path):
    w = table.writer()
    w.put(basic_rows([500]))
    w.flush()
    w.close()
    region = paths.region_dir(table.uri, w.region_id)
    outside = tmp_path / "elsewhere"
    shutil.move(region, outside)
    os.symlink(outside, region)
    before = _state(str(tmp_path))
    for attempt in (
        lambda: table.writer(w.region_id),
        lambda: table.maintenance.gc(),
        table.to_table,
    ):
        with pytest.raises(InvalidPathError, match="leads out of the table"):
            attempt()
    assert _state(str(tmp_path)) == before
    assert ("error", "layout", region) in _codes(table.maintenance.fsck().findings)


# -- 5. GC validates before it changes --------------------------------------------------------
def test_gc_checks_everything_before_removing_base_versions(table):
    w = table.writer()
    for i in range(3):
        w.put(basic_rows([500 + i]))
        w.flush()
    w.close()
    table.maintenance.merge()
    versions = len(table.catalog.dataset().versions())
    store = RegionManifestStore(table.catalog.io, table.uri, w.region_id)
    path = _commit_raw(store, current_generation=2)  # below flushed generation 3
    before = _state(table.uri)
    with pytest.raises(ManifestCorruptError) as e:
        table.maintenance.gc(cleanup_older_than=dt.timedelta(0))
    assert path in str(e.value)
    assert _state(table.uri) == before and len(table.catalog.dataset().versions()) == versions


# -- 6. merger against a concurrent merger + GC -------------------------------------------------
def test_merger_replans_when_its_generation_was_merged_and_collected(table):
    w = table.writer()
    w.put(basic_rows([700, 701], val=[1.0, 1.0]))
    w.flush()
    w.put(basic_rows([700], val=[2.0]))
    w.flush()
    w.close()
    other = mq.MemWalTable.open(table.uri)
    real = merger.prepare_generation
    fired = []

    def prepare(t, region_id, gens, schema=None):
        if not fired:  # planned on the old version: another merger + GC land now
            fired.append(None)
            fired[0] = merger.merge(other.catalog, batch_rows=0)
            other.maintenance.gc(cleanup_older_than=dt.timedelta(0))
            sources.GENERATION_CACHE.clear()  # another process: nothing cached
        return real(t, region_id, gens, schema)

    merger.prepare_generation = prepare
    try:
        got = table.maintenance.merge(batch_rows=0)
    finally:
        merger.prepare_generation = real
    assert [r.generation for r in fired[0]] == [1, 2]
    assert got.merged == []  # re-planned: nothing left to merge
    rows = lance.dataset(table.uri).to_table().to_pydict()
    vals = dict(zip(rows["id"], rows["val"]))
    assert vals[700] == 2.0 and vals[701] == 1.0 and len(rows["id"]) == 102


# -- 7. read-only SQL from the CLI --------------------------------------------------------------
@pytest.mark.parametrize(
    "statement",
    [
        "COPY (SELECT * FROM t) TO '{out}' STORED AS CSV",
        "CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '{out}'",
        "SET datafusion.execution.batch_size = 1",
    ],
)
def test_cli_sql_is_read_only(table, tmp_path, statement):
    out = str(tmp_path / "out.csv")
    res = CliRunner().invoke(cli, ["sql", table.uri, statement.format(out=out)])
    assert res.exit_code == 1 and "ReadOnlySqlError" in res.output and "--allow-write" in res.output
    assert not os.path.exists(out)


def test_cli_sql_allow_write_runs_copy(table, tmp_path):
    out = str(tmp_path / "out.csv")
    q = f"COPY (SELECT id FROM t ORDER BY id LIMIT 3) TO '{out}' STORED AS CSV"
    res = CliRunner().invoke(cli, ["sql", table.uri, "--allow-write", q])
    assert res.exit_code == 0, res.output
    assert os.path.exists(out)


# -- fsck: one corrupt file per class, all named; a clean table reports nothing ------------
def test_fsck_names_one_corrupt_file_per_class(base_uri):
    table = expr_table(base_uri, "CASE WHEN col0 >= 1100 THEN 1 ELSE 0 END")
    rid, wal = _six_entries(table, {"r": 0})  # region A: unflushed WAL
    # region B: a flushed generation
    b_rid, gen = _flushed_generation(table, {"r": 1}, keys=range(1100, 1300))
    assert table.maintenance.fsck().findings == []
    res = CliRunner().invoke(cli, ["fsck", table.uri])
    assert res.exit_code == 0 and "no problems found" in res.output
    os.unlink(wal.path(2))  # WAL gap
    data = bytearray(open(wal.path(5), "rb").read())
    data[-20] ^= 0x10  # bit flip in entry 5's rows
    open(wal.path(5), "wb").write(bytes(data))
    bloom_path = os.path.join(gen, bloom.BLOOM_FILE)
    _clear_bit(bloom_path)
    store = RegionManifestStore(table.catalog.io, table.uri, b_rid)
    manifest_path = _commit_raw(store, writer_epoch=1 << 63)
    res = CliRunner().invoke(cli, ["fsck", table.uri, "--json"])
    assert res.exit_code == 1
    found = {(f["kind"], f["path"]) for f in json.loads(res.output)}
    assert {
        ("wal-gap", wal.path(2)),
        ("wal-entry", wal.path(5)),
        ("manifest", manifest_path),
    } <= found
    # the newest manifest of B is corrupt, so its generations cannot be listed; with it
    # removed, the bloom filter is named too
    os.unlink(manifest_path)
    assert ("error", "bloom", bloom_path) in _codes(table.maintenance.fsck().findings)


# -- 8. region expressions with unbounded cost --------------------------------------------------
@pytest.mark.parametrize(
    "sql",
    [
        "repeat(col0, 100000000)",
        "lpad(col0, 100000000, 'x')",
        "replace(col0, '', 'xxxxxxxx')",
        "sum(col0)",
        "row_number() OVER ()",
        "(SELECT max(id) FROM t)",
    ],
)
def test_region_expression_must_be_bounded_scalar(base_uri, sql):
    from memwal_query.regions.spec import expression_spec

    ds = lance.dataset(base_uri)
    before = _state(base_uri)
    with pytest.raises(mq.RegionSpecError, match="'expr'"):
        spec = expression_spec(ds.lance_schema, ["name"], sql, "utf8")
        mq.MemWalTable.initialize(base_uri, region_spec=spec)
    assert _state(base_uri) == before


def test_region_value_size_is_bounded(base_uri):
    from memwal_query.regions.spec import expression_spec

    ds = lance.dataset(base_uri)
    spec = expression_spec(ds.lance_schema, ["name"], "concat(col0, col0)", "utf8")
    with pytest.warns(mq.RegionSpecWarning):  # a non-key source column
        t = mq.MemWalTable.initialize(base_uri, region_spec=spec)
    t.write(basic_rows([2000], name=["x" * 100]))
    with pytest.raises(mq.RegionSpecError, match="2000-byte value"):
        t.write(basic_rows([2001], name=["x" * 1000]))
    t.close()
    assert t.lookup(pa.table({"id": [2000, 2001]})).column("id").to_pylist() == [2000]
