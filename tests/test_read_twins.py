"""A reader kept open across merges scans the fragments a merge gave deletion files as
their clean twins (the same data files, seen earlier without a deletion file), filtered
or not, and drops the deleted rows itself
(:class:`memwal_query.read.deletions.CleanFragments`).

Every answer is compared with plain Lance reading the same rows (its scan applies the
deletion vectors itself): integer and string keys, filters on narrow and wide
columns, DataFusion SQL, newer sources on top, two merges in a row; a twin whose data
files differ is never used; a deletion file that cannot be decoded leaves the fragment
to Lance, which reports it.
"""

from __future__ import annotations

import os

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_read_deletions import _schema

import memwal_query as mq
from memwal_query.exceptions import CorruptFileError
from memwal_query.format.rowaddrs import RowIdMask
from memwal_query.read import basecache, deletions, provider

FRAGMENT_ROWS = 5_000
BASE_ROWS = 4 * FRAGMENT_ROWS

FILTERS = [
    pc.field("v") < 300,
    (pc.field("v") >= 500) & pc.starts_with(pc.field("s"), "s1"),
    pc.field("s").isin(["s3", "s40", "s77"]),
    (pc.field("v") < 50) | (pc.field("v") > 950),
]

QUERIES = [
    "SELECT * FROM {t}",
    "SELECT id, v FROM {t} WHERE v < 100",
    "SELECT count(*) AS n, sum(v) AS v FROM {t} WHERE v >= 900",
    "SELECT id, vec FROM {t} WHERE v BETWEEN 10 AND 30",  # a wide column: late materialized
    "SELECT s, count(*) AS n FROM {t} WHERE s LIKE 's2%' GROUP BY s",
]


def _rows(ids: np.ndarray, schema: pa.Schema, offset: int = 0) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    text = pa.types.is_string(schema.field("id").type)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids + offset, 4), pa.float32()), 4)
    return pa.table(
        [
            pa.array(ids.astype(str)) if text else pa.array(ids),
            pa.array((ids * 7 + offset) % 1000),
            pa.array([f"s{(i + offset) % 97}" for i in ids.tolist()]),
            vec,
        ],
        schema=schema,
    )


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([(c, "ascending") for c in table.column_names if c != "vec"])


def _base(tmp_path, key_type: pa.DataType) -> tuple[str, str]:
    """A base of four fragments, and a plain Lance copy of it (the reference)."""
    schema = _schema(key_type)
    rows = _rows(np.arange(BASE_ROWS), schema)
    uri, plain = str(tmp_path / "t"), str(tmp_path / "plain")
    for path in (uri, plain):
        lance.write_dataset(rows, path, max_rows_per_file=FRAGMENT_ROWS)
    return uri, plain


def _twin_scans_spy(monkeypatch) -> set[int]:
    """Record the fragments the filtered base scans read as twins."""
    seen: set[int] = set()
    scans = provider._split_scans

    def spy(scan, fragments, with_deleted, twins):
        seen.update(twins)
        return scans(scan, fragments, with_deleted, twins)

    monkeypatch.setattr(provider, "_split_scans", spy)
    return seen


def _round(t, plain: str, schema: pa.Schema, seed: int, flush: bool = True):
    """Random upserts (some new keys) and deletes over every fragment, written and
    flushed through ``t``, and applied to the plain copy the same way."""
    rng = np.random.default_rng(seed)
    ups = np.unique(rng.choice(BASE_ROWS + 2_000, 7_000, replace=False))
    dead = np.unique(rng.choice(BASE_ROWS, 1_500, replace=False))
    rows = _rows(ups, schema, offset=seed)
    keys = pa.table({"id": _rows(dead, schema).column("id")})
    w = t.writer()
    w.put(rows)
    w.delete(keys)
    if flush:
        w.close()
    ds = lance.dataset(plain)
    ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(rows)
    lance.dataset(plain).merge_insert("id").when_matched_delete().execute(keys)
    return w


def _check(reader, plain: str, text: bool) -> None:
    want = lance.dataset(plain)
    got = reader.to_table()  # unfiltered: the twins' plain scan, their deleted rows dropped
    assert _sorted(got).equals(_sorted(want.to_table()))
    got = reader.to_table(columns=["s", "v"])
    assert _sorted(got).equals(_sorted(want.to_table(columns=["s", "v"])))
    for flt in FILTERS:
        got = reader.to_table(filter=flt)
        assert _sorted(got).equals(_sorted(want.to_table(filter=flt))), str(flt)
    got = reader.to_table(columns=["id", "vec"], filter=pc.field("v") < 40)
    assert _sorted(got).equals(_sorted(want.to_table(columns=["id", "vec"], filter="v < 40")))
    ctx = datafusion.SessionContext()
    ctx.register_table("t", reader.provider())
    ctx.from_arrow(want.to_table(), name="plain")
    for q in QUERIES:
        got = ctx.sql(q.format(t="t")).to_arrow_table()
        expected = ctx.sql(q.format(t="plain")).to_arrow_table()
        assert _sorted(got).equals(_sorted(expected)), q
    assert reader.count_rows() == want.count_rows()
    assert text in (True, False)


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_a_reader_kept_across_merges_reads_clean_twins(tmp_path, monkeypatch, key_type):
    """A reader that read the base before two merges: its filtered reads after each scan
    every fragment with a deletion file as its clean twin and equal plain Lance's, also
    with unmerged rows on top; without the deleted rows' mask the answer would be
    longer (the twins really hold the deleted rows)."""
    uri, plain = _base(tmp_path, key_type)
    schema = _schema(key_type)
    text = pa.types.is_string(key_type)
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table(filter=FILTERS[0])  # the fragments are seen clean
    seen = _twin_scans_spy(monkeypatch)
    # every fragment scanned (none from memory: test_read_basecache.py covers both)
    monkeypatch.setattr(basecache, "usable", lambda base: False)
    for seed in (1, 2):
        _round(t, plain, schema, seed)
        t.maintenance.merge()
        dirty = [f for f in lance.dataset(uri).get_fragments() if f.num_deletions]
        assert len(dirty) >= 4
        _check(reader, plain, text)
        # every fragment with a deletion file was seen clean (the base's four, then also
        # what the first merge wrote)
        assert seen == {f.fragment_id for f in dirty}
        seen.clear()
    # unmerged rows on top (a flushed generation and the writer's MemTable)
    _round(t, plain, schema, 3)
    w = _round(t, plain, schema, 4, flush=False)
    _check(reader, plain, text)
    assert seen
    w.close()

    # the mask is what drops the deleted rows of the twins
    t.maintenance.merge()
    flt = pc.field("v") < 300
    want = lance.dataset(plain).to_table(filter=flt)
    assert _sorted(reader.to_table(filter=flt)).equals(_sorted(want))
    monkeypatch.setattr(RowIdMask, "from_flags", classmethod(lambda cls, flags: cls(np.zeros(0))))
    assert reader.to_table(filter=flt).num_rows > want.num_rows


def test_a_reader_opened_after_the_merge_has_no_twins(tmp_path, monkeypatch):
    """A process that never saw the fragments clean reads them as before (its deleted
    rows too, or Lance's own path), with the same answer."""
    uri, plain = _base(tmp_path, pa.int64())
    t = mq.MemWalTable.initialize(uri)
    _round(t, plain, _schema(pa.int64()), 1)
    t.maintenance.merge()
    deletions.TWINS.clear()
    seen = _twin_scans_spy(monkeypatch)
    reader = mq.MemWalTable.open(uri)
    _check(reader, plain, False)
    assert not seen


def test_a_twin_with_other_data_files_is_never_used(tmp_path):
    """A fragment id seen clean, then met with other data files (a table made anew at
    the URI): no twin, and the stale one is forgotten."""
    twins = deletions.CleanFragments()
    schema = _schema(pa.int64())
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    lance.write_dataset(_rows(np.arange(100), schema), one)
    lance.write_dataset(_rows(np.arange(100), schema), two)
    first = lance.dataset(one)
    twins.note("t", first.version, first.get_fragments)
    (fragment,) = first.get_fragments()
    assert twins.twin("t", fragment) is not None
    (other,) = lance.dataset(two).get_fragments()
    assert other.fragment_id == fragment.fragment_id
    assert twins.twin("t", other) is None
    assert twins.twin("t", fragment) is None  # forgotten
    assert twins.twin("elsewhere", fragment) is None


def test_the_clean_fragments_come_from_a_bounded_number_of_versions(tmp_path):
    """At most ``max_sources`` versions' fragments are kept, the least recently used
    version's go first; a version is noted once."""
    twins = deletions.CleanFragments(max_sources=2)
    schema = _schema(pa.int64())
    uri = str(tmp_path / "t")
    versions = []
    for i in range(4):  # each version adds one fragment
        lance.write_dataset(
            _rows(np.arange(i * 10, i * 10 + 10), schema), uri, mode="append" if i else "create"
        )
        ds = lance.dataset(uri)
        versions.append(ds)
        twins.note(uri, ds.version, ds.get_fragments)
        # the first version's fragment stays in use
        assert twins.twin(uri, versions[0].get_fragments()[0]) is not None
    last = versions[-1].get_fragments()
    kept = [twins.twin(uri, f) is not None for f in last]
    # the second version went when the third came (the first stays in use), yet its
    # fragment is clean in the fourth too and was noted from there; the third went
    # when the fourth came
    assert kept == [True, True, False, True]
    calls = []
    twins.note(uri, versions[-1].version, lambda: calls.append(1) or [])
    assert not calls


def test_deleted_flags_are_lances_deleted_rows(tmp_path):
    """Both deletion file formats decode to the rows Lance leaves out; a file that cannot
    be read or decoded is None (the scan is then Lance's)."""
    schema = _schema(pa.int64())
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(20_000), schema), uri, max_rows_per_file=10_000)
    rng = np.random.default_rng(3)
    gone = np.concatenate([rng.choice(10_000, 6_000, replace=False), [10_001, 15_000]])
    lance.dataset(uri).merge_insert("id").when_matched_delete().execute(
        pa.table({"id": pa.array(gone)})
    )
    ds = lance.dataset(uri)
    kinds = set()
    for fragment in ds.get_fragments():
        kinds.add(fragment.metadata.deletion_file.file_type)
        live = ds.scanner(columns=[], fragments=[fragment], with_row_address=True).to_table()
        offsets = live.column("_rowaddr").to_numpy() & 0xFFFFFFFF
        want = np.ones(fragment.physical_rows, dtype=bool)
        want[offsets] = False

        def read(path):
            with open(os.path.join(uri, path), "rb") as f:
                return f.read()

        got = deletions.deleted_flags(uri, fragment, read)
        assert got is not None and np.array_equal(got, want)
        assert deletions.deleted_flags(uri + "-other", fragment, lambda p: b"garbage") is None
        assert (
            deletions.deleted_flags(uri + "-gone", fragment, lambda p: open("/nonexistent")) is None
        )
    assert kinds == {"bitmap", "array"}


def test_a_twins_deletion_file_that_cannot_be_decoded_is_reported(tmp_path):
    """The deletion file of a twinned fragment damaged before its rows were decoded: the
    fragment is left to Lance, whose read raises a typed error naming the file, never
    an answer with its deleted rows."""
    uri, plain = _base(tmp_path, pa.int64())
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table(filter=FILTERS[0])
    _round(t, plain, _schema(pa.int64()), 1)
    t.maintenance.merge()
    flt = pc.field("v") < 300
    reader.to_table(filter=flt)
    fragment = next(f for f in lance.dataset(uri).get_fragments() if f.num_deletions)
    name = fragment.deletion_file()
    with open(os.path.join(uri, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(uri, name)) // 2)
    deletions._DELETED.clear()  # the runs stay known: the scan still takes the twins
    with pytest.raises(CorruptFileError) as err:
        reader.to_table(filter=flt)
    assert name in str(err.value)


def test_a_filter_lance_refuses_met_after_the_twins_were_chosen(tmp_path, monkeypatch):
    """One query, several partitions: the first to choose its twins waits until another
    has found that Lance refuses the filter (a LIKE through ``pc.match_like``) and told
    every partition so; it then reads its fragments itself, as the others do (not its
    twins, whose deleted rows it would look up by an address its scan does not read),
    with the same answer as plain Lance."""
    import threading
    import time

    schema = _schema(pa.int64())
    uri, plain = str(tmp_path / "t"), str(tmp_path / "plain")
    for path in (uri, plain):
        lance.write_dataset(_rows(np.arange(BASE_ROWS), schema), path, max_rows_per_file=1_000)
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table(filter=pc.field("v") < 10)
    _round(t, plain, schema, 1)
    t.maintenance.merge()
    twins_of = provider._BaseFragment._twins
    first = threading.Lock()
    waited: list[bool] = []

    def held(self, candidates):
        out = twins_of(self, candidates)
        if first.acquire(blocking=False):  # the first partition here waits
            deadline = time.monotonic() + 10
            while self.state.filter.lance and time.monotonic() < deadline:
                time.sleep(0.01)
            waited.append(not self.state.filter.lance)
        return out

    monkeypatch.setattr(provider._BaseFragment, "_twins", held)
    flt = pc.match_like(pc.field("s"), "s%3")
    got = reader.to_table(filter=flt)
    assert waited == [True]  # another partition found Lance refusing the filter meanwhile
    want = lance.dataset(plain).to_table().filter(flt)
    assert _sorted(got).equals(_sorted(want))


@pytest.mark.parametrize("stable", [False, True], ids=["addresses", "stable-row-ids"])
def test_unfiltered_twin_scans_with_newer_rows_over_them(tmp_path, stable):
    """String keys (overwritten base rows dropped by Lance's blocklist or by row id),
    with and without stable row ids: a reader kept across a merge reads the twins
    whole, with newer rows over some of their rows, and equals plain Lance."""
    schema = _schema(pa.string())
    uri, plain = str(tmp_path / "t"), str(tmp_path / "plain")
    for path in (uri, plain):
        lance.write_dataset(
            _rows(np.arange(BASE_ROWS), schema),
            path,
            max_rows_per_file=FRAGMENT_ROWS,
            enable_stable_row_ids=stable,
        )
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    _round(t, plain, schema, 1)
    t.maintenance.merge()
    few = _rows(np.arange(0, BASE_ROWS, 997), schema, offset=9)  # Lance's blocklist drops
    t.write(few)
    lance.dataset(plain).merge_insert(
        "id"
    ).when_matched_update_all().when_not_matched_insert_all().execute(few)
    assert _sorted(reader.to_table()).equals(_sorted(lance.dataset(plain).to_table()))
    w = _round(t, plain, schema, 2, flush=False)  # many: dropped by row id
    assert _sorted(reader.to_table()).equals(_sorted(lance.dataset(plain).to_table()))
    w.close()
