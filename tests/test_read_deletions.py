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
import struct

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import memwal_query as mq
from memwal_query.exceptions import CorruptFileError, ObjectNotFoundError
from memwal_query.format.rowaddrs import _roaring32, roaring32_runs
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


def _base(tmp_path, key_type: pa.DataType | None = None) -> str:
    """Five fragments (ids 0..31,999 in order): no deletions; a third deleted at random
    in a 20,000-row fragment (a bitmap file); a few scattered (an Arrow file); 70%
    deleted; a contiguous run deleted."""
    key_type = pa.int64() if key_type is None else key_type
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
def test_base_with_deletion_files_reads_as_plain_lance(tmp_path, monkeypatch, key_type):
    """No newer source: the full read, DataFusion queries with and without filters, and
    the count equal plain Lance's answers on the same table; the scans read the deleted
    rows and dropped them."""
    uri = _base(tmp_path, key_type)
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


def test_the_deleted_rows_would_be_read_without_the_mask(tmp_path, monkeypatch):
    """The scans really hold the deleted rows (the mask is what drops them): without it
    the answer is longer by exactly the deleted rows."""
    uri = _base(tmp_path)
    t = mq.MemWalTable.initialize(uri)
    monkeypatch.setattr(deletions, "deleted_rows", lambda batch: None)
    assert t.to_table().num_rows == N
    monkeypatch.setattr(deletions, "READ_DELETED_ROWS", False)  # Lance's own path
    assert _sorted(t.to_table()).equals(_sorted(lance.dataset(uri).to_table()))


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_newer_sources_over_deletion_files(tmp_path, monkeypatch, key_type):
    """Upserts and deletes in a flushed generation and in the MemTable, over base rows
    with and without deletion files (deleted keys written again, overwritten rows in
    every fragment): ours equals plain Lance applying the same changes to a copy
    (``merge_insert``, then a delete). Then a real merge: ours equals plain Lance reading
    the merged table, and the model."""
    uri = _base(tmp_path, key_type)
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


def test_unreadable_deletion_file_leaves_the_scan_to_lance(tmp_path, monkeypatch):
    """A deletion file the run count cannot read leaves the scan to Lance (which reads
    it, or reports it), never a guess."""
    uri = _base(tmp_path)
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


def test_roaring_runs():
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
    assert roaring32_runs(_with_runs([[(0, 10), (100, 5)], [(7, 1)]])) == (16, 3)
    many = _with_runs([[(0, 3)]] * 5)  # five containers: offsets present
    assert roaring32_runs(many) == (15, 5)
    for bad in [b"", b"\x00" * 12, _roaring32(cases[1])[:-100], _with_runs([[(0, 3)]])[:-2]]:
        with pytest.raises(ValueError):
            roaring32_runs(bad)


@pytest.mark.parametrize("kind", ["bitmap", "array"])
@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated"])
def test_a_bad_deletion_file_is_a_typed_error_naming_it(tmp_path, kind, damage):
    """A deletion file that is missing, garbage or truncated: every read (full read,
    filtered SQL, filtered count) raises a typed error naming that file, never an
    answer."""
    uri = _base(tmp_path)
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


def test_a_plan_lance_refuses_with_deleted_rows_keeps_lances_filter(tmp_path, monkeypatch):
    """Should Lance refuse a filtered plan with deleted rows, the scan asks again without
    them (Lance's own deletion path, its filter and indexes), never falling back to
    reading every row and filtering in pyarrow; same answer."""
    uri = _base(tmp_path)
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
