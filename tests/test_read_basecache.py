"""A reader kept open across a merge takes the fragment the merge wrote from memory
(:mod:`memwal_query.read.basecache`) after its first full read of it.

Every answer is compared with plain Lance reading the same rows: integer, string and
composite keys; full reads, projections, filters and DataFusion SQL; newer rows
overwriting rows of the cached fragment (by key, and by Lance's blocklist for string
keys); the cached fragment given a deletion file by a later merge; a column added; a
process that opened the table after the merge, bases with stable row ids, too many new
fragments and a small cache budget, where nothing is cached.
"""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_read_twins import BASE_ROWS, FILTERS, QUERIES, _base, _round, _rows, _schema, _sorted

import memwal_query as mq
from memwal_query.read import basecache
from memwal_query.storage import cache


@pytest.fixture(autouse=True)
def _empty_cache():
    basecache.FRAGMENTS.clear()
    yield
    basecache.FRAGMENTS.clear()


def _cached_ids() -> set[int]:
    """The fragment ids of every cached fragment (from its row addresses)."""
    return {
        int(rows.column("_rowaddr")[0].as_py()) >> 32
        for _, rows in basecache.FRAGMENTS.items()
        if rows.num_rows
    }


def _merged_and_cached(tmp_path):
    """(uri, plain copy, table, reader): a reader that read the base, then one merge,
    then the reader's full read (its fragment cached)."""
    uri, plain = _base(tmp_path, pa.int64())
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    _round(t, plain, _schema(pa.int64()), 1)
    t.maintenance.merge()
    reader.to_table()
    assert _cached_ids()
    return uri, plain, t, reader


def _same(reader, plain: str) -> None:
    want = lance.dataset(plain)
    got = reader.to_table()
    assert _sorted(got).equals(_sorted(want.to_table().select(got.column_names)))
    got = reader.to_table(columns=["s", "id"])
    assert _sorted(got).equals(_sorted(want.to_table(columns=["s", "id"])))
    for flt in FILTERS:
        got = reader.to_table(filter=flt)
        assert _sorted(got).equals(_sorted(want.to_table(filter=flt))), str(flt)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", reader.provider())
    ctx.from_arrow(want.to_table(), name="plain")
    for q in [*QUERIES, "SELECT * FROM {t}", "SELECT id, s FROM {t} WHERE id IS NOT NULL"]:
        got = ctx.sql(q.format(t="t")).to_arrow_table()
        expected = ctx.sql(q.format(t="plain")).to_arrow_table()
        assert _sorted(got).equals(_sorted(expected)), q
    assert reader.count_rows() == want.count_rows()


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int", "string"])
def test_the_fragment_a_merge_wrote_is_read_from_memory(tmp_path, key_type):
    """After a merge, a reader that read the table before it caches the merge's fragment
    at its first full read and answers from it; newer rows over it (flushed and in the
    MemTable), a second merge that gives it a deletion file, and a third that writes
    another: every answer equals plain Lance's."""
    uri, plain = _base(tmp_path, key_type)
    schema = _schema(key_type)
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    _round(t, plain, schema, 1)
    t.maintenance.merge()
    assert not _cached_ids()
    _same(reader, plain)
    assert _cached_ids() == {4}  # the merge's own fragment, not the base's four
    # newer rows over the cached fragment's keys, some of them only a few (Lance's
    # blocklist path for string keys)
    _round(t, plain, schema, 2)
    _same(reader, plain)
    w = t.writer()
    merged = lance.dataset(uri).get_fragment(4).to_table(columns=["id"]).column("id")
    few = pa.table({"id": merged.slice(0, 3)})
    rows = _rows(np.array([int(x) for x in few.column("id").to_pylist()]), schema, offset=77)
    w.put(rows)
    lance.dataset(plain).merge_insert(
        "id"
    ).when_matched_update_all().when_not_matched_insert_all().execute(rows)
    _same(reader, plain)
    w.close()
    t.maintenance.merge()  # the cached fragment gets a deletion file
    assert lance.dataset(uri).get_fragment(4).num_deletions
    _same(reader, plain)
    assert 4 in _cached_ids()
    _round(t, plain, schema, 3)
    t.maintenance.merge()
    _same(reader, plain)


def test_a_composite_key_over_the_cached_fragment(tmp_path):
    """Composite keys (hashed key sets, dropped by row address): newer rows over the
    cached fragment are dropped from it."""
    schema = pa.schema(
        [
            pa.field("a", pa.int32(), False),
            pa.field("b", pa.string(), False),
            pa.field("v", pa.int64()),
        ]
    )

    def rows(ids, offset=0):
        ids = np.asarray(ids)
        return pa.table(
            [
                pa.array(ids % 7, pa.int32()),
                pa.array((ids // 7).astype(str)),
                pa.array(ids + offset),
            ],
            schema=schema,
        )

    uri, plain = str(tmp_path / "t"), str(tmp_path / "plain")
    for path in (uri, plain):
        lance.write_dataset(rows(np.arange(10_000)), path, max_rows_per_file=2_500)
    t = mq.MemWalTable.initialize(uri, primary_key=["a", "b"])
    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    rng = np.random.default_rng(2)

    def upsert(ids, offset):
        data = rows(ids, offset)
        t.write(data)
        t.flush()
        lance.dataset(plain).merge_insert(
            ["a", "b"]
        ).when_matched_update_all().when_not_matched_insert_all().execute(data)

    upsert(rng.choice(12_000, 3_000, replace=False), 1_000_000)
    t.maintenance.merge()
    want = _sorted(lance.dataset(plain).to_table())
    assert _sorted(reader.to_table()).equals(want)
    assert _cached_ids()
    upsert(np.arange(10_000, 12_000)[:50], 2_000_000)  # rows of the merge's fragment
    want = _sorted(lance.dataset(plain).to_table())
    assert _sorted(reader.to_table()).equals(want)
    flt = pc.field("v") > 1_500_000
    assert _sorted(reader.to_table(filter=flt)).equals(_sorted(want.filter(flt)))


def test_a_column_added_after_the_cache_is_read(tmp_path):
    """A column added to the table after its merge's fragment was cached: the answers
    hold it (the cached rows, without it, are not used)."""
    uri, plain, t, reader = _merged_and_cached(tmp_path)
    t.alter.add_columns(pa.field("extra", pa.int32()))
    got = mq.MemWalTable.open(uri).to_table()  # the same process, the new schema
    assert "extra" in got.column_names and got.column("extra").null_count == got.num_rows
    want = lance.dataset(plain).to_table()
    assert _sorted(got.drop_columns(["extra"])).equals(_sorted(want))


def test_nothing_is_cached_where_it_would_not_pay(tmp_path):
    """A process that opened the table after the merge, more new fragments than
    ``MAX_NEW_FRAGMENTS``, a fragment above the budget's share, and a base with stable
    row ids: nothing cached, the same answers."""
    uri, plain = _base(tmp_path, pa.int64())
    schema = _schema(pa.int64())
    t = mq.MemWalTable.initialize(uri)
    _round(t, plain, schema, 1)
    t.maintenance.merge()
    after = mq.MemWalTable.open(uri)
    basecache._FIRST.clear()
    _same(after, plain)
    assert not _cached_ids()

    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    for i in range(basecache.MAX_NEW_FRAGMENTS + 1):  # new keys: one clean fragment each
        new = _rows(np.arange(100) + 100_000 + 1_000 * i, schema)
        t.write(new)
        t.flush()
        lance.dataset(plain).insert(new)
        t.maintenance.merge()
    _same(reader, plain)
    assert not _cached_ids()

    uri2, plain2 = _base(tmp_path / "small", pa.int64())
    t2 = mq.MemWalTable.initialize(uri2)
    reader = mq.MemWalTable.open(uri2)
    reader.to_table()
    _round(t2, plain2, schema, 1)
    t2.maintenance.merge()
    before = cache.cache_size_bytes()
    cache.set_cache_size_bytes(100_000)
    try:
        _same(reader, plain2)
        assert not _cached_ids()
    finally:
        cache.set_cache_size_bytes(before)

    uri3 = str(tmp_path / "stable")
    lance.write_dataset(
        _rows(np.arange(BASE_ROWS), schema),
        uri3,
        max_rows_per_file=5_000,
        enable_stable_row_ids=True,
    )
    t3 = mq.MemWalTable.initialize(uri3)
    reader = mq.MemWalTable.open(uri3)
    reader.to_table()
    t3.write(_rows(np.arange(0, BASE_ROWS, 3), schema, offset=5))
    t3.flush()
    t3.maintenance.merge()
    got = reader.to_table()
    assert got.num_rows == BASE_ROWS
    assert not _cached_ids()


def test_a_filter_pyarrow_evaluates_otherwise_is_left_to_lance(tmp_path):
    """Filters Lance evaluates where pyarrow would raise on the cached rows (arithmetic
    that overflows, a time-zone-aware column against a naive literal, a cast out of
    range): the cached fragment is scanned instead, and every answer is the one a
    process without the cache gives."""
    import datetime as dt

    from memwal_query.read import deletions

    schema = pa.schema(
        [
            pa.field("id", pa.int64(), False, {"lance-schema:unenforced-primary-key": "true"}),
            pa.field("v", pa.int64()),
            pa.field("ts", pa.timestamp("us", tz="UTC")),
        ]
    )

    def rows(ids, v):
        when = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
        return pa.table({"id": ids, "v": [v] * len(ids), "ts": [when] * len(ids)}, schema=schema)

    uri = str(tmp_path / "t")
    lance.write_dataset(rows(list(range(4000)), 1), uri, max_rows_per_file=1000)
    t = mq.MemWalTable.initialize(uri)
    reader = mq.MemWalTable.open(uri)
    reader.to_table()
    t.write(rows([5000, 5001], 2**63 - 5))
    t.flush()
    t.maintenance.merge()
    filters = [
        (pc.field("v") + 10) > 0,
        (pc.field("v") * 2) > 0,
        pc.field("ts") > pa.scalar(dt.datetime(2023, 1, 1)),
        pc.field("v").cast(pa.int32()) > 0,
        pc.field("v") > 0,
    ]

    def answers() -> list[object]:
        out: list[object] = []
        for flt in filters:
            try:
                out.append(_sorted(reader.to_table(filter=flt)))
            except mq.MemWalError as e:  # the same typed error either way
                out.append(type(e))
            except Exception as e:  # noqa: BLE001 - compared, not hidden
                out.append(type(e))
        return out

    basecache.FRAGMENTS.clear()
    deletions.TWINS.clear()
    uncached = answers()
    basecache.FRAGMENTS.clear()
    reader.to_table()  # the merge's fragment is kept
    assert _cached_ids()
    cached = answers()
    for a, b in zip(uncached, cached):
        assert a.equals(b) if isinstance(a, pa.Table) else a == b, (a, b)
    assert isinstance(cached[-1], pa.Table) and cached[-1].num_rows == 4002


def test_the_cache_keeps_to_its_share_of_a_lowered_budget(tmp_path):
    """The cached fragments hold at most a quarter of the budget, also after the budget
    is lowered."""
    _, plain, _, reader = _merged_and_cached(tmp_path)
    held = basecache.FRAGMENTS.nbytes
    before = cache.cache_size_bytes()
    cache.set_cache_size_bytes(held * basecache.BUDGET_SHARE - 1)
    try:
        _same(reader, plain)
        assert basecache.FRAGMENTS.nbytes < held
    finally:
        cache.set_cache_size_bytes(before)
