"""Reading a base whose fragments carry deletion files (what a merge leaves behind).

The reader asks Lance for the deleted rows too and drops them with its own mask
(:mod:`memwal_query.read.deletions`). Every answer here is compared with plain Lance's
own answer on the same table (its scan applies the deletion vectors itself): fragments
with and without deletion files, both deletion file formats (Arrow IPC up to 5,000
deleted rows in a fragment, a Roaring bitmap above), scattered and contiguous deletes,
a fragment mostly deleted, integer and string keys, filters Lance evaluates and filters
it cannot, newer sources on top, and a real merge. A deletion file that is missing or
damaged is a typed error naming it, never a longer or shorter answer.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query.exceptions import CorruptFileError, ObjectNotFoundError
from memwal_query.format.rowaddrs import _roaring32, roaring32_runs, roaring32_values
from memwal_query.read import deletions, provider

from helpers import PK, clear_read_caches

SIZES = [3_000, 20_000, 3_000, 3_000, 3_000]  # one fragment each
N = sum(SIZES)


def _schema(key_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", key_type, False, PK),
            pa.field("v", pa.int64()),
            pa.field("s", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), 4)),
        ]
    )


def _rows(ids: np.ndarray, schema: pa.Schema, v_offset: int = 0) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    text = pa.types.is_string(schema.field("id").type)
    keys = pa.array(ids.astype(str)) if text else pa.array(ids)
    vec = pa.FixedSizeListArray.from_arrays(
        pa.array(np.repeat(ids, 4).astype(np.float32) + v_offset), 4
    )
    return pa.table(
        [keys, pa.array(ids * 7 % 1000 + v_offset), pa.array([f"s{i % 97}" for i in ids]), vec],
        schema=schema,
    )


def _key(i: int, text: bool) -> str:
    return f"'{i}'" if text else str(i)


def _build_base(tmp_path, key_type: pa.DataType) -> str:
    """Five fragments (ids 0..31,999 in order): no deletions; a third deleted at random
    in a 20,000-row fragment (a bitmap file); a few scattered (an Arrow file); 70%
    deleted; a contiguous run deleted."""
    schema = _schema(key_type)
    uri = str(tmp_path / "t")
    start = 0
    for size in SIZES:
        lance.write_dataset(
            _rows(np.arange(start, start + size), schema), uri, mode="append" if start else "create"
        )
        start += size
    ds = lance.dataset(uri)
    rng = np.random.default_rng(5)
    gone = np.concatenate(
        [
            rng.choice(np.arange(3_000, 23_000), 6_700, replace=False),
            np.arange(23_000, 26_000, 17),
            rng.choice(np.arange(26_000, 29_000), 2_100, replace=False),
            np.arange(29_500, 30_000),
        ]
    )
    text = pa.types.is_string(key_type)
    keys = pa.array(gone.astype(str)) if text else pa.array(gone)
    ds.merge_insert("id").when_matched_delete().execute(pa.table({"id": keys}))
    kinds = [f.metadata.deletion_file for f in lance.dataset(uri).get_fragments()]
    assert kinds[0] is None
    assert {k.file_type for k in kinds[1:]} == {"bitmap", "array"}  # both formats under test
    return uri


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """``bases(tmp_path, key_type=int64)``: the URI of a copy, in ``tmp_path``, of the
    table :func:`_build_base` makes (built once per key type for the module; each test
    changes only its own copy)."""
    built: dict[str, str] = {}

    def copy(tmp_path, key_type: pa.DataType | None = None) -> str:
        key_type = pa.int64() if key_type is None else key_type
        name = str(key_type)
        if name not in built:
            built[name] = _build_base(tmp_path_factory.mktemp(f"base-{name}"), key_type)
        uri = str(tmp_path / "t")
        shutil.copytree(built[name], uri)
        return uri

    return copy


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([(c, "ascending") for c in table.column_names if c != "vec"])


def _spy(monkeypatch) -> list[bool]:
    """Record what each base scan decided (whether it read the deleted rows)."""
    seen: list[bool] = []
    decide = deletions.reads_deleted

    def spy(fragments, *args):
        seen.append(decide(fragments, *args))
        return seen[-1]

    monkeypatch.setattr(deletions, "reads_deleted", spy)
    return seen


QUERIES = [
    "SELECT * FROM {t}",
    "SELECT id, s FROM {t}",
    "SELECT count(*) AS n, sum(v) AS v FROM {t}",
    "SELECT count(*) AS n FROM {t}",
    "SELECT count(*) AS n FROM {t} WHERE v < 500",
    "SELECT id, v FROM {t} WHERE v < 100",
    "SELECT id FROM {t} WHERE s LIKE 's1%' AND v >= 500",
    "SELECT id, v FROM {t} WHERE id IN ({keys})",
    "SELECT id, vec FROM {t} WHERE v = 3",  # a vector column: Lance's own path
    "SELECT s, count(*) AS n FROM {t} GROUP BY s",
]


def _compare(ctx: datafusion.SessionContext, text: bool) -> None:
    """Every query over ``t`` (ours) equals the same query over ``plain`` (Lance's rows)."""
    keys = ", ".join(_key(i, text) for i in [0, 3_001, 3_002, 23_017, 26_500, 29_600, 31_999])
    for q in QUERIES:
        got = ctx.sql(q.format(t="t", keys=keys)).to_arrow_table()
        want = ctx.sql(q.format(t="plain", keys=keys)).to_arrow_table()
        assert got.num_rows == want.num_rows, q
        assert _sorted(got).equals(_sorted(want)), q


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_base_with_deletion_files_reads_as_plain_lance(bases, tmp_path, monkeypatch, key_type):
    """No newer source: the full read, DataFusion queries with and without filters, and
    the count equal plain Lance's answers on the same table; the scans read the deleted
    rows and dropped them."""
    uri = bases(tmp_path, key_type)
    text = pa.types.is_string(key_type)
    seen = _spy(monkeypatch)
    t = mq.MemWalTable.initialize(uri)
    plain = lance.dataset(uri).to_table()
    assert plain.num_rows == N - 6_700 - 177 - 2_100 - 500
    got = t.to_table()
    assert seen and all(seen)
    assert got.num_rows == plain.num_rows
    assert _sorted(got).equals(_sorted(plain))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    ctx.from_arrow(plain, name="plain")
    _compare(ctx, text)
    assert t.count_rows() == plain.num_rows
    low = pc.field("v") < 100
    assert _sorted(t.to_table(filter=low)).equals(_sorted(plain.filter(low)))


def test_the_deleted_rows_would_be_read_without_the_mask(bases, tmp_path, monkeypatch):
    """The scans really hold the deleted rows (the mask is what drops them): without it
    the answer is longer by exactly the deleted rows."""
    uri = bases(tmp_path)
    t = mq.MemWalTable.initialize(uri)
    monkeypatch.setattr(deletions, "deleted_rows", lambda batch: None)
    assert t.to_table().num_rows == N
    monkeypatch.setattr(deletions, "READ_DELETED_ROWS", False)  # Lance's own path
    assert _sorted(t.to_table()).equals(_sorted(lance.dataset(uri).to_table()))


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_newer_sources_over_deletion_files(bases, tmp_path, monkeypatch, key_type):
    """Upserts and deletes in a flushed generation and in the MemTable, over base rows
    with and without deletion files (deleted keys written again, overwritten rows in
    every fragment): ours equals plain Lance applying the same changes to a copy
    (``merge_insert``, then a delete). Then a real merge: ours equals plain Lance reading
    the merged table, and the model."""
    uri = bases(tmp_path, key_type)
    text = pa.types.is_string(key_type)
    schema = _schema(key_type)
    copy = str(tmp_path / "plain")
    lance.write_dataset(lance.dataset(uri).to_table(), copy)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    rng = np.random.default_rng(11)
    first = np.unique(rng.choice(N + 1_000, 4_000, replace=False))  # some new keys too
    second = np.concatenate([np.arange(29_400, 29_700), np.arange(3_000, 3_050)])
    dead = np.unique(rng.choice(N, 900, replace=False))

    def key_table(ids):
        return pa.table({"id": _rows(ids, schema).column("id")})

    w.put(_rows(first, schema, 10_000))
    w.delete(key_table(dead))
    w.flush()
    w.put(_rows(second, schema, 20_000))
    plain = lance.dataset(copy)
    for rows in (_rows(first, schema, 10_000), _rows(second, schema, 20_000)):
        plain.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
            rows
        )
    # the generation's deletes came before the second puts, which may write them again
    lance.dataset(copy).merge_insert("id").when_matched_delete().execute(
        key_table(np.setdiff1d(dead, second))
    )
    want = lance.dataset(copy).to_table()
    seen = _spy(monkeypatch)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    ctx.from_arrow(want, name="plain")
    _compare(ctx, text)
    assert any(seen)
    got = t.provider(writers=[w]).to_table()
    assert _sorted(got.select(want.column_names)).equals(_sorted(want))
    assert t.provider(writers=[w]).count_rows() == want.num_rows
    w.close()  # flushes the MemTable

    t.maintenance.merge()
    merged = lance.dataset(uri)
    assert sum(f.metadata.deletion_file is not None for f in merged.get_fragments()) >= 4
    clear_read_caches()
    t = mq.MemWalTable.open(uri)
    got = t.to_table()
    assert _sorted(got).equals(_sorted(merged.to_table()))
    assert _sorted(got).equals(_sorted(want))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    ctx.from_arrow(want, name="plain")
    _compare(ctx, text)


@pytest.mark.parametrize(
    ("predicate", "masked"),
    [
        ("id % 2000 < 1500", False),  # a range per fragment: 2 ranges, Lance's path
        ("id % 10 <> 0", True),  # 90% at random: a range per kept row, masked
        ("id >= 300 AND id < 310", False),  # one short run: Lance's path
    ],
)
def test_the_runs_of_deleted_rows_choose_the_path(tmp_path, monkeypatch, predicate, masked):
    """Range deletes leave few runs of deleted rows, which Lance's ranges read cheaply:
    the scan leaves them to Lance; scattered deletes (however many) are read and
    masked. Same answer either way."""
    schema = _schema(pa.int64())
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(4_000), schema), uri, max_rows_per_file=2_000)
    lance.dataset(uri).delete(predicate)
    seen = _spy(monkeypatch)
    t = mq.MemWalTable.initialize(uri)
    got = t.to_table()
    assert seen and all(s is masked for s in seen)
    assert _sorted(got).equals(_sorted(lance.dataset(uri).to_table()))
    frags = lance.dataset(uri).get_fragments()
    share = sum(f.num_deletions for f in frags) / sum(f.physical_rows for f in frags)
    assert deletions.reads_deleted(frags) is (share <= 0.5)  # without the files: the share


def test_unreadable_deletion_file_leaves_the_scan_to_lance(bases, tmp_path, monkeypatch):
    """A deletion file the run count cannot read leaves the scan to Lance (which reads
    it, or reports it), never a guess."""
    uri = bases(tmp_path)
    frags = lance.dataset(uri).get_fragments()

    def read(path):
        raise OSError(f"{path}: unreachable")

    def files(path):
        with open(os.path.join(uri, path), "rb") as f:
            return f.read()

    monkeypatch.setattr(deletions, "_RUNS", type(deletions._RUNS)(16))
    assert not deletions.reads_deleted(frags, read)
    assert not deletions.reads_deleted(frags, read)  # a failure is not remembered
    assert deletions.reads_deleted(frags, files)
    assert deletions.reads_deleted(frags, read)  # the runs read are


def _with_runs(chunks: list[list[tuple[int, int]]]) -> bytes:
    """A portable Roaring bitmap with only run containers: per 65536-value chunk (key i)
    its runs as (start, length)."""
    n = len(chunks)
    out = [struct.pack("<I", 12347 | (n - 1) << 16), bytes([0xFF]) * ((n + 7) // 8)]
    for key, runs in enumerate(chunks):
        out.append(struct.pack("<HH", key, sum(length for _, length in runs) - 1))
    if n >= 4:
        out.append(b"\0" * 4 * n)  # offsets (not used to read in order)
    for runs in chunks:
        out.append(struct.pack("<H", len(runs)))
        for start, length in runs:
            out.append(struct.pack("<HH", start, length - 1))
    return b"".join(out)


def test_roaring_runs_and_values():
    """Values and runs of portable Roaring bitmaps: array and bitmap containers (as
    written by the blocklist encoder) and run containers (built by hand)."""
    rng = np.random.default_rng(4)
    cases = [
        np.array([1, 2, 3, 10, 11, 65_535], dtype=np.uint32),
        np.sort(rng.choice(1 << 20, 200_000, replace=False)).astype(np.uint32),
        np.arange(5, 70_000, dtype=np.uint32),  # crosses a chunk: counted once per chunk
    ]
    for values in cases:
        starts = np.count_nonzero(np.diff(values.astype(np.int64)) != 1) + 1
        chunks = len(np.unique(values >> 16))
        got_values, got_runs = roaring32_runs(_roaring32(values))
        assert got_values == len(values)
        assert starts <= got_runs <= starts + chunks - 1
        assert np.array_equal(roaring32_values(_roaring32(values)), values)
    runs = _with_runs([[(0, 10), (100, 5)], [(7, 1)]])
    assert roaring32_runs(runs) == (16, 3)
    want = [*range(10), *range(100, 105), 65_536 + 7]
    assert roaring32_values(runs).tolist() == want
    many = _with_runs([[(0, 3)]] * 5)  # five containers: offsets present
    assert roaring32_runs(many) == (15, 5)
    assert roaring32_values(many).tolist() == [k << 16 | i for k in range(5) for i in range(3)]
    for bad in [b"", b"\x00" * 12, _roaring32(cases[1])[:-100], _with_runs([[(0, 3)]])[:-2]]:
        with pytest.raises(ValueError):
            roaring32_runs(bad)
        with pytest.raises(ValueError):
            roaring32_values(bad)


@pytest.mark.parametrize("kind", ["bitmap", "array"])
@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated"])
def test_a_bad_deletion_file_is_a_typed_error_naming_it(bases, tmp_path, kind, damage):
    """A deletion file that is missing, garbage or truncated: every read (full read,
    filtered SQL, filtered count) raises a typed error naming that file, never an
    answer."""
    uri = bases(tmp_path)
    t = mq.MemWalTable.initialize(uri)
    fragment = next(
        f
        for f in lance.dataset(uri).get_fragments()
        if f.metadata.deletion_file is not None and f.metadata.deletion_file.file_type == kind
    )
    name = fragment.deletion_file()
    path = os.path.join(uri, name)
    assert glob.glob(path)
    if damage == "missing":
        os.remove(path)
    elif damage == "garbage":
        with open(path, "wb") as f:
            f.write(b"not a deletion file" * 4)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    clear_read_caches()
    expected = ObjectNotFoundError if damage == "missing" else CorruptFileError
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    reads = [
        lambda: t.to_table(),
        lambda: t.to_table(filter=pc.field("v") < 100),
        lambda: t.to_table(columns=["id", "vec"], filter=pc.field("v") == 3),
    ]
    for read in reads:
        with pytest.raises(expected) as err:
            read()
        assert name in str(err.value)
    with pytest.raises(Exception, match=name.replace(".", r"\.")):  # DataFusion wraps it
        ctx.sql("SELECT count(*) FROM t WHERE v < 500").to_arrow_table()


def test_reads_deleted_counts_only_fragments_with_deletion_files(tmp_path):
    """The share is of the fragments with deletion files: a clean fragment next to a
    mostly deleted one does not dilute it."""
    schema = _schema(pa.int64())
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(10_000), schema), uri, max_rows_per_file=5_000)
    assert not deletions.reads_deleted(lance.dataset(uri).get_fragments())
    lance.dataset(uri).delete("id < 5000 AND id % 10 <> 0")
    assert not deletions.reads_deleted(lance.dataset(uri).get_fragments())
    lance.dataset(uri).delete("id >= 5000 AND id % 10 = 0")  # a lightly deleted one too
    frags = lance.dataset(uri).get_fragments()
    assert [f.num_deletions for f in frags] == [4_500, 500]
    assert deletions.reads_deleted(frags)  # 5,000 of 10,000
    assert not deletions.reads_deleted(frags[:1])
    assert provider.ROWID_COLUMN == deletions.ROWID_COLUMN


def test_a_plan_lance_refuses_with_deleted_rows_keeps_lances_filter(bases, tmp_path, monkeypatch):
    """Should Lance refuse a filtered plan with deleted rows, the scan asks again without
    them (Lance's own deletion path, its filter and indexes), never falling back to
    reading every row and filtering in pyarrow; same answer."""
    uri = bases(tmp_path)
    t = mq.MemWalTable.initialize(uri)
    real = lance.LanceDataset.scanner
    asked: list[tuple[bool, bool]] = []

    def scanner(self, *args, **kwargs):
        deleted = bool(kwargs.get("include_deleted_rows"))
        filtered = kwargs.get("filter") is not None
        asked.append((deleted, filtered))
        if deleted and filtered:
            raise ValueError("with_deleted_rows is not supported here (an input plan)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "scanner", scanner)
    low, columns = pc.field("v") < 100, ["id", "v", "s"]  # narrow columns: deleted rows read
    got = t.to_table(columns=columns, filter=low)
    want = lance.dataset(uri).to_table(columns=columns, filter=low)
    assert _sorted(got).equals(_sorted(want))
    assert (True, True) in asked and (False, True) in asked
    assert all(filtered for _, filtered in asked)  # no unfiltered scan: Lance filtered


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_stable_row_ids_with_deletion_files(tmp_path, key_type):
    """A base with stable row ids (its ``_rowid`` no longer its address after a
    compaction) and deletion files, newer keys on top: Lance matches the blocklist
    against row ids and marks deleted rows by a null one; same answer as the model."""
    schema = _schema(key_type)
    uri = str(tmp_path / "t")
    lance.write_dataset(
        _rows(np.arange(6_000), schema), uri, max_rows_per_file=1_000, enable_stable_row_ids=True
    )
    lance.dataset(uri).delete("v < 300")  # ~30% of each fragment, then compacted
    lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=2_000)
    lance.dataset(uri).delete("v >= 990")  # new deletion files on the compacted fragments
    ds = lance.dataset(uri)
    x = ds.to_table(columns=["id"], with_row_id=True, with_row_address=True)
    assert x.column("_rowid") != x.column("_rowaddr")
    assert all(f.num_deletions for f in ds.get_fragments())
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(_rows(np.arange(5_000, 7_000), schema, 20_000))
    w.flush()
    w.close()
    base = ds.to_table(columns=["id", "v"])
    want = dict(zip(base.column("id").to_pylist(), base.column("v").to_pylist()))
    ids = _rows(np.arange(5_000, 7_000), schema, 20_000)
    want.update(zip(ids.column("id").to_pylist(), ids.column("v").to_pylist()))
    got = t.to_table(columns=["id", "v"])
    assert got.num_rows == len(want)
    assert dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist())) == want
    sql = datafusion.SessionContext()
    sql.register_table("t", t.provider())
    n = sql.sql("SELECT count(*) AS n, sum(v) AS v FROM t").to_arrow_table().to_pylist()[0]
    assert n == {"n": len(want), "v": sum(want.values())}
    assert t.count_rows() == len(want)


def _record_scans(monkeypatch) -> list[dict]:
    """Record the options of every Lance scan of a dataset (the real scan runs)."""
    real = lance.LanceDataset.scanner
    asked: list[dict] = []

    def scanner(self, *args, **kwargs):
        asked.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "scanner", scanner)
    return asked


def _two_fragments(tmp_path, schema: pa.Schema, stable: bool) -> str:
    """A table of ids 0..19,999 in two fragments (with stable row ids or not)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(
        _rows(np.arange(20_000), schema),
        uri,
        max_rows_per_file=10_000,
        enable_stable_row_ids=stable,
    )
    return uri


@pytest.mark.parametrize("stable", [False, True], ids=["addresses", "stable-row-ids"])
def test_blocklisted_rows_over_deletion_files(tmp_path, monkeypatch, stable):
    """String keys, a few of them newer (under the share that masks by row id): Lance
    drops the overwritten base rows by its blocklist inside the same scan that reads the
    deleted rows. Deleted keys written again come back once, with their new values;
    overwritten rows in fragments with deletion files are dropped; the answer equals
    plain Lance applying the same upserts to a copy, and the model."""
    schema = _schema(pa.string())
    uri = _two_fragments(tmp_path, schema, stable)
    lance.dataset(uri).delete("v % 3 = 0")  # scattered: a third of every fragment
    if stable:  # row ids no longer addresses, then new deletion files
        lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=20_000)
        lance.dataset(uri).delete("v % 5 = 1")  # scattered too
    copy = str(tmp_path / "plain")
    lance.write_dataset(lance.dataset(uri).to_table(), copy)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    ids = np.unique(np.random.default_rng(3).choice(20_000, 300, replace=False))
    new = _rows(ids, schema, 50_000)  # about a third of them deleted in the base
    w.put(new)
    lance.dataset(copy).merge_insert(
        "id"
    ).when_matched_update_all().when_not_matched_insert_all().execute(new)
    want = lance.dataset(copy).to_table()
    for flushed in (False, True):
        if flushed:
            w.flush()
        clear_read_caches()
        asked = _record_scans(monkeypatch)
        got = t.provider(writers=[w]).to_table()
        assert any(
            a.get("row_addr_blocklist") is not None and a.get("include_deleted_rows") for a in asked
        ), "the blocklist and the deleted rows in one scan"
        monkeypatch.undo()
        assert got.num_rows == want.num_rows
        assert _sorted(got).equals(_sorted(want))
        ctx = datafusion.SessionContext()
        ctx.register_table("t", t.provider(writers=[w]))
        ctx.from_arrow(want, name="plain")
        _compare(ctx, text=True)
        assert t.provider(writers=[w]).count_rows() == want.num_rows
    w.close()


@pytest.mark.parametrize("stable", [False, True], ids=["addresses", "stable-row-ids"])
def test_indexed_filters_over_deletion_files(tmp_path, monkeypatch, stable):
    """Scalar indexes (BTREE, BITMAP) built before the deletes, a fragment appended after
    them (not indexed): filters Lance answers from the indexes, read with the deleted
    rows and masked, equal plain Lance's answers on the same table."""
    schema = _schema(pa.int64())
    uri = _two_fragments(tmp_path, schema, stable)
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("v", "BTREE")
    ds.create_scalar_index("s", "BITMAP")
    lance.write_dataset(_rows(np.arange(20_000, 25_000), schema), uri, mode="append")
    lance.dataset(uri).delete("id % 3 = 0 OR (id >= 5000 AND id < 6000)")
    if stable:
        lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=8_000)
        lance.dataset(uri).delete("id % 7 = 0")
    assert all(f.num_deletions for f in lance.dataset(uri).get_fragments())
    t = mq.MemWalTable.initialize(uri)
    plain = lance.dataset(uri).to_table()
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    ctx.from_arrow(plain, name="plain")
    asked = _record_scans(monkeypatch)
    for where in [
        "id = 3",  # deleted
        "id = 4",
        "id IN (3, 4, 5001, 6001, 20001, 20003, 24999)",
        "id >= 4990 AND id < 6010",
        "v = 7",
        "s = 's5'",
        "s IN ('s1', 's2') AND v < 300",
        "v = 7 OR s = 's3'",
        "id > 19990",  # the fragment appended after the indexes
    ]:
        for q in [
            "SELECT id, v, s FROM {t} WHERE " + where,
            "SELECT count(*) AS n FROM {t} WHERE " + where,
        ]:
            got = ctx.sql(q.format(t="t")).to_arrow_table()
            want = ctx.sql(q.format(t="plain")).to_arrow_table()
            assert _sorted(got).equals(_sorted(want)), q
    assert any(a.get("include_deleted_rows") and a.get("filter") is not None for a in asked)


def test_limits_over_deletion_files(bases, tmp_path):
    """LIMIT and OFFSET through DataFusion, DuckDB and Polars over fragments with deletion
    files: never a shorter answer (no limit reaches a scan before the deleted rows are
    dropped), the same rows as plain Lance's."""
    import duckdb
    import polars as pl

    uri = bases(tmp_path)
    t = mq.MemWalTable.initialize(uri)
    plain = lance.dataset(uri).to_table()
    n = plain.num_rows
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    ctx.from_arrow(plain, name="plain")
    for q in [
        "SELECT count(*) AS n FROM (SELECT id FROM {t} LIMIT " + str(n - 5) + ")",
        "SELECT count(*) AS n FROM (SELECT id FROM {t} WHERE v < 500 LIMIT 9000)",
        "SELECT id FROM {t} ORDER BY id LIMIT 20 OFFSET 3000",
        "SELECT id FROM {t} WHERE v < 500 ORDER BY id LIMIT 20 OFFSET 9000",
    ]:
        got = ctx.sql(q.format(t="t")).to_arrow_table()
        assert got.equals(ctx.sql(q.format(t="plain")).to_arrow_table()), q
    ds = t.provider()
    con = duckdb.connect()
    con.register("ds", ds)
    con.register("plain", plain)
    for q in [
        "SELECT count(*) FROM (SELECT * FROM {t} LIMIT " + str(n - 5) + ")",
        "SELECT count(*) FROM (SELECT * FROM {t} WHERE v < 500 LIMIT 9000)",
        "SELECT id FROM {t} ORDER BY id LIMIT 20 OFFSET 3000",
    ]:
        assert con.sql(q.format(t="ds")).fetchall() == con.sql(q.format(t="plain")).fetchall(), q
    lazy = pl.scan_pyarrow_dataset(ds)
    assert lazy.head(n - 5).collect().height == n - 5
    assert lazy.filter(pl.col("v") < 500).head(9_000).collect().height == 9_000
    assert lazy.select(pl.len()).collect().item() == n


class _FailingGets:
    """A fault plan: every GET of a path containing ``marker`` answers ``kind`` while
    ``on`` (nothing else is faulted)."""

    def __init__(self, marker: str, kind: str) -> None:
        self.marker, self.kind, self.on = marker, kind, False

    def __call__(self, method: str, path: str):
        if self.on and method == "GET" and self.marker in path:
            return (self.kind, "before")
        return None


@pytest.mark.parametrize(
    ("fault", "filtered"),
    [
        ("503", False),
        pytest.param("drop", True, marks=pytest.mark.slow),
    ],  # ~5 s each, waiting on Lance retrying the reads
)
def test_an_unreachable_deletion_file_is_a_storage_error(tmp_path, store_pool, fault, filtered):
    """The store fails every read of the deletion files (503 SlowDown past the client's
    retries, or dropped connections): a :class:`StorageError` naming the object, never a
    :class:`CorruptFileError` (the file is intact; the read may be run again)."""
    pytest.importorskip("moto")
    import uuid

    from faultproxy import FaultProxy

    from memwal_query.exceptions import StorageError

    server = store_pool.get("s3")
    plan = _FailingGets("_deletions", fault)
    with FaultProxy(server.upstream, plan=plan) as proxy:
        options = server.storage_options(
            endpoint=proxy.endpoint,
            timeout="2s",
            connect_timeout="2s",
            client_max_retries="1",
            client_retry_timeout="2",
        )
        uri = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}/t"
        schema = _schema(pa.int64())
        lance.write_dataset(
            _rows(np.arange(6_000), schema),
            uri,
            max_rows_per_file=3_000,
            storage_options=options,
        )
        lance.dataset(uri, storage_options=options).delete("v % 3 = 0")
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        want = lance.dataset(uri, storage_options=options).to_table()
        clear_read_caches()
        plan.on = True
        with pytest.raises(StorageError) as err:
            t.to_table(filter=pc.field("v") < 100) if filtered else t.to_table()
        assert "_deletions/" in str(err.value)
        assert not isinstance(err.value, CorruptFileError)
        plan.on = False
        assert _sorted(t.to_table()).equals(_sorted(want))  # the same read, run again


def test_a_filter_that_fails_on_deleted_values_is_not_evaluated_on_them(tmp_path, monkeypatch):
    """Deleted rows hold values a filter cannot evaluate (a division by their zero): the
    filter is never evaluated on them, so the answer is plain Lance's (which never reads
    them), through the pyarrow API and Polars, wherever the bad values are (here in the
    last fragment, read after the first batches were returned); simple comparisons are
    still read with the deleted rows."""
    import polars as pl

    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "t")

    def rows(start: int, stop: int, zero_when_deleted: bool) -> pa.Table:
        ids = np.arange(start, stop)
        v = ids % 100 + 1
        if zero_when_deleted:
            v = np.where(ids % 5 == 0, 0, v)
        return pa.table([pa.array(ids), pa.array(v)], schema=schema)

    lance.write_dataset(rows(0, 150_000, False), uri, max_rows_per_file=50_000)
    lance.write_dataset(rows(150_000, 151_000, True), uri, mode="append")
    lance.dataset(uri).delete("id % 5 = 0")  # scattered: read with the deleted rows
    t = mq.MemWalTable.initialize(uri)
    plain = lance.dataset(uri).to_table()
    for expr in [
        pc.divide(pc.scalar(100), pc.field("v")) > pc.scalar(3),
        pc.divide_checked(pc.scalar(100), pc.field("v")) == pc.scalar(4),
        (pc.field("v") < 90) & (pc.divide(pc.scalar(100), pc.field("v")) > pc.scalar(3)),
    ]:
        want = lance.dataset(uri).to_table(filter=expr)
        assert _sorted(t.to_table(filter=expr)).equals(_sorted(want)), str(expr)
    div = (100 // pl.col("v")) > 3
    got = pl.scan_pyarrow_dataset(t.provider()).filter(div).select(pl.len()).collect().item()
    assert got == pl.from_arrow(plain).filter(div).height
    asked = _record_scans(monkeypatch)
    low = pc.field("v") < 30
    assert _sorted(t.to_table(filter=low)).equals(_sorted(plain.filter(low)))
    assert any(a.get("include_deleted_rows") and a.get("filter") is not None for a in asked)


class _SlowDeletionGets:
    """A fault plan injecting no fault: every GET of a deletion file waits ``delay``
    seconds (an object store's round trip), counting how many wait at once."""

    def __init__(self, delay: float) -> None:
        import threading

        self.delay, self.waiting, self.most, self.gets = delay, 0, 0, 0
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str):
        import time

        if method != "GET" or "_deletions/" not in path:
            return None
        with self._lock:
            self.gets += 1
            self.waiting += 1
            self.most = max(self.most, self.waiting)
        time.sleep(self.delay)
        with self._lock:
            self.waiting -= 1
        return None


def test_a_cold_scan_reads_the_deletion_files_it_needs_concurrently(store_pool, monkeypatch):
    """On an object store (the S3 emulator, each deletion-file GET held 0.1 s), a cold
    full read reads every deletion file its choice needs concurrently; a key lookup
    through a scalar index, a filter never evaluated on deleted rows, and fragments whose
    metadata decides read none. Every answer equals plain Lance's."""
    pytest.importorskip("moto")
    import threading
    import uuid

    from faultproxy import FaultProxy

    server = store_pool.get("s3")
    plan = _SlowDeletionGets(0.1)
    reads: list[str] = []
    at_once = {"now": 0, "most": 0}
    lock = threading.Lock()
    read_file = provider._BaseFragment._read_table_file

    def counted(self, path: str) -> bytes:
        with lock:
            reads.append(path)
            at_once["now"] += 1
            at_once["most"] = max(at_once["most"], at_once["now"])
        try:
            return read_file(self, path)
        finally:
            with lock:
                at_once["now"] -= 1

    monkeypatch.setattr(provider._BaseFragment, "_read_table_file", counted)
    with FaultProxy(server.upstream, plan=plan) as proxy:
        options = server.storage_options(endpoint=proxy.endpoint)
        uri = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}/t"
        schema = _schema(pa.int64())
        lance.write_dataset(
            _rows(np.arange(24_000), schema), uri, max_rows_per_file=2_000, storage_options=options
        )
        base = lance.dataset(uri, storage_options=options)
        base.create_scalar_index("id", "BTREE")
        base.delete("v % 3 = 0")  # a third of every fragment, one row at a time
        base = lance.dataset(uri, storage_options=options)
        files = [f.deletion_file() for f in base.get_fragments()]
        assert len(files) == 12 and all(files)
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        plain = lance.dataset(uri, storage_options=options)

        def cold(**kwargs) -> pa.Table:
            clear_read_caches()
            reads.clear()
            at_once["most"] = 0
            return _sorted(t.to_table(**kwargs))

        narrow = ["id", "v"]  # no vector column: filtered scans may read deleted rows

        def lance_reads(**kwargs) -> pa.Table:
            return _sorted(plain.to_table(columns=narrow, **kwargs))

        point = pc.field("id").isin([7, 701, 23_999]) | (pc.field("id") == 5_000)
        assert cold(columns=narrow, filter=point).equals(lance_reads(filter=point))
        assert reads == []  # through the index: no deletion file read by the reader
        failing = pc.divide(pc.field("v"), pc.field("v")) > 0  # arithmetic: Lance's path
        assert cold(columns=narrow, filter=failing).equals(lance_reads(filter=failing))
        assert reads == []
        assert cold(filter=pc.field("v") < 10).equals(
            _sorted(plain.to_table(filter=pc.field("v") < 10))
        )
        assert reads == []  # a vector column: Lance's path (late materialization)
        assert cold().equals(_sorted(plain.to_table()))
        assert sorted(reads) == sorted(files)  # each once
        assert at_once["most"] >= 2  # concurrently
        assert plan.most >= 2
        assert cold(columns=narrow, filter=pc.field("v") < 10).equals(
            lance_reads(filter=pc.field("v") < 10)
        )
        assert sorted(reads) == sorted(files)
        reads.clear()
        assert _sorted(t.to_table()).equals(_sorted(plain.to_table()))
        assert reads == []  # warm: the runs are cached


def test_the_metadata_decides_without_reading_deletion_files(tmp_path, monkeypatch):
    """Sparse deletes (at most one run per deleted row: Lance's ranges are cheap) stay on
    Lance's path, and fragments so small that one range costs more than their rows read
    the deleted rows, both without reading a deletion file; in between, the files are
    read."""
    read: list[str] = []

    def reader(path: str) -> bytes:
        read.append(path)
        raise OSError("not read in this test")

    class Frag:
        def __init__(self, rows: int, deleted: int, n: int) -> None:
            self.physical_rows, self.num_deletions, self.n = rows, deleted, n

        def deletion_file(self) -> str:
            return f"_deletions/{self.n}-1-2.bin"

    monkeypatch.setattr(deletions, "_RUNS", type(deletions._RUNS)(16))
    sparse = [Frag(100_000, 1_000, i) for i in range(3)]  # 1%: 32 * 1000 <= 1000 + 49500
    assert not deletions.reads_deleted(sparse, reader, "t")
    tiny = [Frag(20, 5, i) for i in range(3)]  # one run at least: 32 > 5 + 15 / 2
    assert deletions.reads_deleted(tiny, reader, "t")
    assert read == []
    between = [Frag(100_000, 10_000, i) for i in range(3)]
    assert not deletions.reads_deleted(between, reader, "t")  # unreadable: Lance's path
    assert len(read) == 3


def test_row_id_mask_of_flags_answers_runs_and_scattered_values_alike():
    """``RowIdMask.from_flags`` answers a batch of consecutive addresses (a scan's, by a
    slice of the flags) as it answers any other values: runs inside, across the end of
    and beyond a fragment's flags, across two fragments, descending, scattered."""
    from memwal_query.format.rowaddrs import RowIdMask

    rng = np.random.default_rng(9)
    flags = {f: rng.random(5_000) < 0.3 for f in (0, 2, 3)}
    mask = RowIdMask.from_flags(flags)
    members = np.concatenate(
        [
            (np.uint64(f) << np.uint64(32)) + np.flatnonzero(v).astype(np.uint64)
            for f, v in flags.items()
        ]
    )
    reference = RowIdMask(np.sort(members))

    def addr(f: int, lo) -> np.ndarray:
        return (np.uint64(f) << np.uint64(32)) + np.asarray(lo, dtype=np.uint64)

    cases = [
        addr(0, np.arange(0, 4_096)),
        addr(2, np.arange(4_990, 5_000)),
        addr(2, np.arange(4_990, 5_010)),  # past the end of the flags
        addr(1, np.arange(0, 100)),  # a fragment without flags
        addr(3, np.arange(100, 0, -1)),  # descending
        np.concatenate([addr(0, np.arange(4_995, 5_000)), addr(2, np.arange(0, 5))]),
        addr(3, rng.integers(0, 6_000, 1_000)),
        addr(3, [7]),
        addr(3, []),
    ]
    for values in cases:
        assert np.array_equal(mask.contains(values), reference.contains(values))
