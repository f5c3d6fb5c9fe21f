"""The merger's own ``Update`` commit on the bases it meets: evolved schemas, file
versions and column types, keys at their types' extremes, keys twice in the base,
other writers committing between its join and its commit, and a merger killed while
it writes.

``REWRITE_MIN_BASE_ROWS`` is set to 0 so a small base takes that path; every check
compares the plain Lance table (``lance.dataset(uri).to_table()``) and the MemWAL view
with a dict model of the newest row per key.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import os
import signal
import subprocess
import sys

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import MergeFailedError
from memwal_query.maintain import merger

from helpers import PK

ID_VAL = pa.schema(
    [pa.field("id", pa.int64(), nullable=False, metadata=PK), pa.field("val", pa.float64())]
)


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)


def _write(t, puts: pa.Table | None, deletes: pa.Table | None) -> str:
    """One flushed generation of the table's one region: ``puts`` then ``deletes``;
    returns the region id."""
    w = t.writer()
    if puts is not None:
        w.put(puts)
    if deletes is not None:
        w.delete(deletes)
    w.flush()
    w.close()
    return w.region_id


def _by_key(rows: pa.Table) -> dict:
    """``{id: row}``; every key once."""
    out: dict = {}
    for r in rows.to_pylist():
        assert r["id"] not in out, f"key {r['id']} twice"
        out[r["id"]] = r
    return out


def _merge_is_rewrite(t) -> None:
    """Merge, checking the batch went through the Update (two versions)."""
    before = lance.dataset(t.uri).version
    t.maintenance.merge()
    assert lance.dataset(t.uri).version == before + 2


def _id_val_table(uri: str, ids, **kw) -> mq.MemWalTable:
    ids = list(ids)
    rows = pa.table({"id": ids, "val": [float(i) for i in ids]}, schema=ID_VAL)
    lance.write_dataset(rows, uri, **kw)
    return mq.MemWalTable.initialize(uri)


def _id_val(ids, val: float) -> pa.Table:
    ids = list(ids)
    return pa.table({"id": ids, "val": [val] * len(ids)}, schema=ID_VAL)


@pytest.mark.parametrize("version", ["legacy", "2.0", "2.1"])
def test_rewrite_keeps_field_ids_of_an_evolved_schema(tmp_path, rewrite, version):
    """Columns added, dropped and renamed on the base (field ids 0, 2, 3, 4): the new
    fragments carry the dataset's field ids and file version, every column reads back."""
    uri = str(tmp_path / "base")
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata=PK),
            pa.field("a", pa.float64()),
            pa.field("b", pa.string()),
        ]
    )
    ids = list(range(20))
    rows = pa.table({"id": ids, "a": [float(i) for i in ids], "b": [f"b{i}" for i in ids]}, schema)
    lance.write_dataset(rows, uri, data_storage_version=version, max_rows_per_file=8)
    lance.dataset(uri).add_columns({"c": "a * 2"})
    lance.dataset(uri).drop_columns(["a"])
    lance.dataset(uri).alter_columns({"path": "b", "name": "bb"})
    lance.dataset(uri).add_columns({"d": "id + 1000"})
    t = mq.MemWalTable.initialize(uri)
    schema = lance.dataset(uri).schema
    model = _by_key(lance.dataset(uri).to_table())
    puts = pa.table(
        {"id": [1, 2, 50], "bb": ["x1", "x2", "x50"], "c": [0.5, 1.5, 2.5], "d": [7, 8, 9]}
    ).cast(schema)
    _write(t, puts, pa.table({"id": pa.array([3, 9], pa.int64())}))
    model.update(_by_key(puts))
    del model[3], model[9]
    _merge_is_rewrite(t)
    ds = lance.dataset(uri)
    assert _by_key(ds.to_table()) == model
    assert _by_key(t.to_table()) == model
    files = [df for f in ds.get_fragments() for df in f.data_files()]
    versions = {(df.file_major_version, df.file_minor_version) for df in files}
    assert len(versions) == 1, versions  # the new fragment's file version is the base's
    newest = ds.get_fragments()[-1].data_files()
    assert [df.fields for df in newest] == [[0, 2, 3, 4]]


def _typed_rows(schema: pa.Schema, ids: list[int], tag: str) -> pa.Table:
    utc = dt.timezone.utc
    return pa.table(
        {
            "id": ids,
            "st": [{"x": i, "y": f"{tag}{i}"} for i in ids],
            "li": [[i, i + 1] if i % 3 else None for i in ids],
            "ls": [f"{tag}ls{i}" for i in ids],
            "lb": [f"{tag}lb{i}".encode() for i in ids],
            "vec": [[float(i)] * 4 for i in ids],
            "nn": [i % 100 for i in ids],
            "ts": [dt.datetime(2020, 1, 1, tzinfo=utc) + dt.timedelta(seconds=i) for i in ids],
            "dec": [decimal.Decimal(f"{i}.1234") for i in ids],
            "dic": pa.array([f"{tag}d{i % 3}" for i in ids]).dictionary_encode(),
            "day": [dt.date(2020, 1, 1) + dt.timedelta(days=i) for i in ids],
        },
        schema=schema,
    )


@pytest.mark.parametrize("version", ["2.0", "2.1"])
def test_rewrite_writes_every_column_type_as_the_base_has_it(tmp_path, rewrite, version):
    """Struct, list, large string/binary, vector, non-null with field metadata,
    timestamp with a zone, decimal, dictionary and date columns, an int32 key: the base
    reads back as the model, its schema unchanged (metadata included)."""
    uri = str(tmp_path / "base")
    schema = pa.schema(
        [
            pa.field("id", pa.int32(), nullable=False, metadata=PK),
            pa.field("st", pa.struct([pa.field("x", pa.int64()), pa.field("y", pa.string())])),
            pa.field("li", pa.list_(pa.int32())),
            pa.field("ls", pa.large_string()),
            pa.field("lb", pa.large_binary()),
            pa.field("vec", pa.list_(pa.float32(), 4)),
            pa.field("nn", pa.int16(), nullable=False, metadata={"unit": "m"}),
            pa.field("ts", pa.timestamp("us", tz="Europe/Paris")),
            pa.field("dec", pa.decimal128(20, 4)),
            pa.field("dic", pa.dictionary(pa.int32(), pa.string())),
            pa.field("day", pa.date32()),
        ]
    )
    base = _typed_rows(schema, list(range(30)), "o")
    lance.write_dataset(base, uri, data_storage_version=version, max_rows_per_file=10)
    t = mq.MemWalTable.initialize(uri)
    before = lance.dataset(uri).schema
    model = _by_key(base)
    puts = _typed_rows(schema, [1, 5, 99, -7], "n")
    _write(t, puts, pa.table({"id": pa.array([2, 11], pa.int32())}))
    model.update(_by_key(puts))
    del model[2], model[11]
    _merge_is_rewrite(t)
    ds = lance.dataset(uri)
    assert ds.schema.equals(before, check_metadata=True)
    assert _by_key(ds.to_table()) == model
    assert _by_key(t.to_table()) == model


@pytest.mark.parametrize(
    "key_type", [pa.int64(), pa.int32(), pa.int16(), pa.int8(), pa.uint32(), pa.uint8()]
)
def test_rewrite_keys_at_the_extremes_of_their_type(tmp_path, rewrite, key_type):
    """The smallest and largest keys of the type (negative ones included), a batch at
    each end, one spanning the whole type where the bitmap may cover it, one of new keys
    only; every batch on fragments with deletion files from the one before."""
    info = pa.types
    if info.is_signed_integer(key_type):
        bits = key_type.bit_width
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        lo, hi = 0, 2**key_type.bit_width - 1
    schema = pa.schema(
        [pa.field("id", key_type, nullable=False, metadata=PK), pa.field("val", pa.float64())]
    )
    ids = sorted({lo, lo + 1, lo + 2, lo + 7, hi - 2, hi - 1, hi, (lo + hi) // 2})
    uri = str(tmp_path / "base")
    lance.write_dataset(
        pa.table({"id": ids, "val": [0.0] * len(ids)}, schema), uri, max_rows_per_file=3
    )
    t = mq.MemWalTable.initialize(uri)
    model = dict.fromkeys(ids, 0.0)

    def batch(puts, deletes, val):
        rows = pa.table({"id": puts, "val": [val] * len(puts)}, schema)
        _write(t, rows, pa.table({"id": pa.array(deletes, key_type)}) if deletes else None)
        model.update(dict.fromkeys(puts, val))
        for k in deletes:
            model.pop(k, None)
        _merge_is_rewrite(t)
        got = {r["id"]: r["val"] for r in _by_key(lance.dataset(uri).to_table()).values()}
        assert got == model

    batch([lo, lo + 1], [lo + 2], 1.0)
    batch([hi, hi - 1], [hi - 2], 2.0)
    if hi - lo < merger.REWRITE_MAX_KEY_SPAN:
        batch([lo, hi], [(lo + hi) // 2], 3.0)
    batch([lo + 3, lo + 4], [], 4.0)


def test_rewrite_leaves_a_key_twice_in_the_base_once(tmp_path, rewrite):
    """The primary key is not enforced: a base holding a key twice. Upserting or
    deleting it replaces both rows, so the key is once (or gone) afterwards."""
    uri = str(tmp_path / "base")
    ids = [*range(20), 3, 5, 5]
    rows = pa.table({"id": ids, "val": [float(i) for i in range(len(ids))]}, ID_VAL)
    lance.write_dataset(rows, uri, max_rows_per_file=8)
    t = mq.MemWalTable.initialize(uri)
    _write(t, _id_val([3, 1], -1.0), pa.table({"id": pa.array([5], pa.int64())}))
    _merge_is_rewrite(t)
    model = {i: float(i) for i in range(20)}
    model.update({3: -1.0, 1: -1.0})
    del model[5]
    got = {k: r["val"] for k, r in _by_key(lance.dataset(uri).to_table()).items()}
    assert got == model
    assert {k: r["val"] for k, r in _by_key(t.to_table()).items()} == model


def test_rewrite_is_not_used_with_stable_row_ids(tmp_path, rewrite):
    """A base with stable row ids keeps Lance's own upsert (one commit)."""
    t = _id_val_table(str(tmp_path / "base"), range(20), enable_stable_row_ids=True)
    assert not merger._rewrite_applies(t.catalog.dataset(), ["id"])
    _write(t, _id_val([1, 30], -1.0), None)
    before = lance.dataset(t.uri).version
    t.maintenance.merge()
    assert lance.dataset(t.uri).version == before + 1
    model = {i: float(i) for i in range(20)} | {1: -1.0, 30: -1.0}
    assert {k: r["val"] for k, r in _by_key(lance.dataset(t.uri).to_table()).items()} == model


def _other_writer(uri: str, what: str, model: dict) -> None:
    """A plain Lance commit by another writer; ``model`` follows it."""
    ds = lance.dataset(uri)
    if what == "delete a row of a fragment the batch changes":
        ds.delete("id = 3 OR id = 32")
        del model[3], model[32]
    elif what == "delete a row of another fragment":
        ds.delete("id = 80")
        del model[80]
    elif what == "compact":
        ds.optimize.compact_files(target_rows_per_fragment=1000)
    elif what == "append":
        ds.insert(_id_val([500], 5.0))
        model[500] = 5.0
    elif what == "update a row":
        ds.update({"val": "val + 1000"}, where="id = 5")
        model[5] = 1005.0
    elif what == "upsert a key the batch upserts":
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
            _id_val([30, 4], 77.0)
        )
        model[4] = 77.0  # 30: the batch's row is newer
    elif what == "add a column":
        ds.add_columns(pa.field("extra", pa.int64()))
    elif what == "rename a column":
        ds.alter_columns({"path": "val", "name": "value"})
    elif what == "index the key":
        ds.create_scalar_index("id", "BTREE")
    else:
        raise AssertionError(what)


@pytest.mark.parametrize(
    "what",
    [
        "delete a row of a fragment the batch changes",
        "delete a row of another fragment",
        "compact",
        "append",
        "update a row",
        "upsert a key the batch upserts",
        "add a column",
        "rename a column",
        "index the key",
    ],
)
def test_rewrite_with_another_commit_before_its_own(tmp_path, rewrite, monkeypatch, what):
    """Another writer commits between the merger's join and its Update: Lance rebases
    the Update or the merger re-plans it; either way the other commit's effect and the
    batch's are both in the base, every key once."""
    t = _id_val_table(str(tmp_path / "base"), range(100), max_rows_per_file=25)
    model = {i: float(i) for i in range(100)}
    region = _write(
        t, _id_val([1, 30, 60, 200], -1.0), pa.table({"id": pa.array([2, 31], pa.int64())})
    )
    model.update(dict.fromkeys([1, 30, 60, 200], -1.0))
    del model[2], model[31]
    joined = merger._delete_rows
    calls = []

    def other_commits_first(ds, addresses):
        calls.append(ds.version)
        if len(calls) == 1:
            _other_writer(t.uri, what, model)
        return joined(ds, addresses)

    monkeypatch.setattr(merger, "_delete_rows", other_commits_first)
    t.maintenance.merge()
    assert t.catalog.index().merged_generations() == {region: 1}
    rows = lance.dataset(t.uri).to_table()
    if what == "rename a column":
        rows = rows.rename_columns(["id", "val"])
    got = {k: r["val"] for k, r in _by_key(rows).items()}
    assert got == model
    if what != "rename a column":  # the MemWAL table's schema is the one it opened with
        assert {k: r["val"] for k, r in _by_key(t.to_table()).items()} == model


KILL_AT = {
    # after the new fragments are written, before the rows are marked deleted
    "write_fragments": (
        "import lance.fragment as lf\n"
        "real = lf.write_fragments\n"
        "def write(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "lf.write_fragments = write\n"
    ),
    # after the deletion files are written, before the Update is committed
    "commit": (
        "real = merger._delete_rows\n"
        "def delete(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "merger._delete_rows = delete\n"
    ),
}


@pytest.mark.parametrize("where", sorted(KILL_AT))
def test_merger_killed_before_its_update_commits(tmp_path, where):
    """A merger killed (SIGKILL) after writing new fragments, or deletion files, but
    before its Update: only unreferenced files are left; the base is as before, the view
    is the model, and the next merge leaves the base equal to the model."""
    t = _id_val_table(str(tmp_path / "base"), range(100), max_rows_per_file=25)
    model = {i: float(i) for i in range(100)}
    _write(t, _id_val([0, 1, 30, 200], -1.0), pa.table({"id": pa.array([2, 31], pa.int64())}))
    model.update(dict.fromkeys([0, 1, 30, 200], -1.0))
    del model[2], model[31]
    before = lance.dataset(t.uri)
    base_before = _by_key(before.to_table())
    script = (
        "import os, signal, sys\n"
        "import memwal_query as mq\n"
        "from memwal_query.maintain import merger\n"
        "merger.REWRITE_MIN_BASE_ROWS = 0\n"
        + KILL_AT[where]
        + "mq.MemWalTable.open(sys.argv[1]).maintenance.merge()\n"
        "print('not killed')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, t.uri],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    assert lance.dataset(t.uri).version == before.version
    assert _by_key(lance.dataset(t.uri).to_table()) == base_before
    t2 = mq.MemWalTable.open(t.uri)
    assert {k: r["val"] for k, r in _by_key(t2.to_table()).items()} == model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
        _merge_is_rewrite(t2)
    assert {k: r["val"] for k, r in _by_key(lance.dataset(t.uri).to_table()).items()} == model
    assert {k: r["val"] for k, r in _by_key(t2.to_table()).items()} == model


def test_rewrite_write_failure_is_typed_and_changes_nothing(tmp_path, rewrite, monkeypatch):
    """Writing the new fragments fails (the store refuses): the merge fails with the
    typed error naming the region, the base is unchanged, and a later merge succeeds."""
    t = _id_val_table(str(tmp_path / "base"), range(50), max_rows_per_file=25)
    _write(t, _id_val([1, 70], -1.0), pa.table({"id": pa.array([2], pa.int64())}))
    model = {i: float(i) for i in range(50)} | {1: -1.0, 70: -1.0}
    del model[2]
    version = lance.dataset(t.uri).version

    def refuse(*args, **kwargs):
        raise OSError("No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(lance.fragment, "write_fragments", refuse)
        with pytest.raises(MergeFailedError, match="No space left"):
            t.maintenance.merge()
    assert lance.dataset(t.uri).version == version
    assert t.catalog.index().merged_generations() == {}
    assert {k: r["val"] for k, r in _by_key(t.to_table()).items()} == model
    _merge_is_rewrite(t)
    assert {k: r["val"] for k, r in _by_key(lance.dataset(t.uri).to_table()).items()} == model


@pytest.mark.parametrize("deletes", [[], [3]])
def test_rewrite_after_a_lost_lock_does_not_apply_a_merged_batch_twice(
    tmp_path, rewrite, monkeypatch, deletes
):
    """A merger whose index lock was lost (a lease taken over after the holder stalled
    longer than its ttl) plans its Update, and meanwhile another merger merges the same
    batch. Lance rebases the Update over the other merger's commits when they touch none
    of its fragments (a batch of new keys only); the merger must see that its batch was
    merged meanwhile and leave no row of it twice, as Lance's ``merge_insert`` (which
    carries the progress in the same commit) refuses such a commit."""
    t = _id_val_table(str(tmp_path / "base"), range(100), max_rows_per_file=25)
    region = _write(
        t,
        _id_val([500, 501], 1.0),
        pa.table({"id": pa.array(deletes, pa.int64())}) if deletes else None,
    )
    model = {i: float(i) for i in range(100)} | {500: 1.0, 501: 1.0}
    for k in deletes:
        del model[k]
    held = merger.index_lock
    write = lance.fragment.write_fragments

    def stalled(*args, **kwargs):
        out = write(*args, **kwargs)
        monkeypatch.setattr(lance.fragment, "write_fragments", write)
        monkeypatch.setattr(merger, "index_lock", held)
        mq.MemWalTable.open(t.uri).maintenance.merge()  # the lease's new holder
        return out

    monkeypatch.setattr(merger, "index_lock", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(lance.fragment, "write_fragments", stalled)
    t.maintenance.merge()
    assert t.catalog.index().merged_generations() == {region: 1}
    got = {k: r["val"] for k, r in _by_key(lance.dataset(t.uri).to_table()).items()}
    assert got == model
    assert {k: r["val"] for k, r in _by_key(t.to_table()).items()} == model


@pytest.mark.parametrize(("high", "commits"), [(9, 2), (10, 1)])
def test_rewrite_key_span_bound_is_inclusive(tmp_path, rewrite, monkeypatch, high, commits):
    """Keys spanning exactly ``REWRITE_MAX_KEY_SPAN`` values go through the Update (two
    commits); one more value, through ``merge_insert`` (one commit); both give the
    model."""
    monkeypatch.setattr(merger, "REWRITE_MAX_KEY_SPAN", 10)
    t = _id_val_table(str(tmp_path / "base"), range(20))
    _write(t, _id_val([0, high], -1.0), None)
    before = lance.dataset(t.uri).version
    t.maintenance.merge()
    assert lance.dataset(t.uri).version == before + commits
    model = {i: float(i) for i in range(20)} | {0: -1.0, high: -1.0}
    assert {k: r["val"] for k, r in _by_key(lance.dataset(t.uri).to_table()).items()} == model


def test_rewrite_middle_and_final_versions_read_alike_by_pylance_memwal(tmp_path):
    """pylance's own MemWAL scanner and point lookups, given the region's unmerged
    generations, answer like memwal_query on the version between the two commits (a
    merger killed there) and after the merge."""
    from lance.mem_wal import LsmPointLookupPlanner, LsmScanner

    from helpers import kill_merger_at, native_snapshot

    t = _id_val_table(str(tmp_path / "base"), range(10), max_rows_per_file=4)
    region = _write(t, _id_val([1, 2, 50], 1.0), None)
    _write(t, _id_val([2, 60], 2.0), pa.table({"id": pa.array([3, 50], pa.int64())}))
    model = {k: r["val"] for k, r in _by_key(t.to_table()).items()}

    def native(t):
        snap = native_snapshot(t, region)
        base = lance.dataset(t.uri)
        got = {
            k: r["val"]
            for k, r in _by_key(LsmScanner.from_snapshots(base, [snap]).to_table()).items()
        }
        assert got == model
        planner = LsmPointLookupPlanner(base, [snap])
        for key in [1, 2, 3, 50, 60, 7]:
            found = planner.plan_lookup(pa.array([key], pa.int64())).to_table().to_pylist()
            assert [r["val"] for r in found] == ([model[key]] if key in model else [])

    p = kill_merger_at(t.uri, "merge.between_commits", REWRITE_MIN_BASE_ROWS=0)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    middle = mq.MemWalTable.open(t.uri)
    assert middle.catalog.index().merged_generations() == {}
    native(middle)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
        _merge_is_rewrite(middle)
    native(middle)
    assert {k: r["val"] for k, r in _by_key(middle.to_table()).items()} == model


def test_rewrite_then_search_and_index_catch_up_match_the_model(tmp_path, rewrite):
    """Full-text and vector search through memwal_query (base indexes plus generations)
    after the Update, after the indexes' catch-up, and after the next Update: each
    replaced row found with its new value, no deleted or replaced row found."""
    import numpy as np

    uri = str(tmp_path / "base")
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata=PK),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), 4)),
        ]
    )

    def rows(ids, tag, shift):
        ids = list(ids)
        return pa.table(
            {
                "id": ids,
                "text": [f"{tag} w{i}" for i in ids],
                "vec": [[float(i) + shift] * 4 for i in ids],
            },
            schema,
        )

    lance.write_dataset(rows(range(300), "old", 0.0), uri, max_rows_per_file=100)
    ds = lance.dataset(uri)
    ds.create_scalar_index("text", "INVERTED")
    ds.create_index("vec", "IVF_FLAT", num_partitions=2)
    t = mq.MemWalTable.initialize(uri, maintained_indexes=["text_idx", "vec_idx"])
    model = _by_key(rows(range(300), "old", 0.0))

    def check():
        for word in ["w5", "w7", "w151", "new", "w1000"]:
            got = t.fts_search("text", word, k=1000, columns=["id", "text"]).to_pylist()
            want = {k for k, r in model.items() if word in r["text"].split()}
            assert {r["id"] for r in got} == want, word
            assert all(r["text"] == model[r["id"]]["text"] for r in got)
        for q in [5.5, 7.0, 151.0, 1000.5]:
            got = t.vector_search("vec", np.full(4, q, np.float32), k=3, columns=["id"], nprobes=2)
            want = sorted(model, key=lambda k: (abs(model[k]["vec"][0] - q), k))[:3]
            assert got.column("id").to_pylist() == want, q

    for n, (puts, deletes) in enumerate([([5, 10, 150, 1000], [7, 151]), ([5, 11], [150])]):
        new = rows(puts, "new", 0.5 + n)
        region = _write(t, new, pa.table({"id": pa.array(deletes, pa.int64())}))
        model.update(_by_key(new))
        for k in deletes:
            del model[k]
        _merge_is_rewrite(t)
        check()
        assert t.maintenance.catch_up_indexes() == {
            "text_idx": {region: n + 1},
            "vec_idx": {region: n + 1},
        }
        check()
