"""Merging deletes and upserts is exact for every primary-key type (real Lance tables).

The merger once expressed deleted keys as SQL literals: sub-microsecond or time-zoned
timestamps silently kept deleted rows, decimal / inf / NaN / time keys failed every
merge, and one failing region blocked every region after it.
"""

import datetime as dt
import decimal

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.exceptions import MergeFailedError
from memwal_query.format import index as mwindex

from helpers import PK, basic_rows, expr_table

UTC = dt.timezone.utc
KOLKATA = dt.timezone(dt.timedelta(hours=5, minutes=30))

# (name, key types, key rows, indexes of the rows to delete)
CASES = [
    ("ts_ns_subus", [pa.timestamp("ns")], [(1_000_000_001,), (1_000_000_002,), (5,)], [0]),
    (
        "ts_tz_kolkata",
        [pa.timestamp("us", tz="Asia/Kolkata")],
        [(dt.datetime(2024, 1, 1, tzinfo=UTC),), (dt.datetime(2024, 1, 2, tzinfo=KOLKATA),)],
        [1],
    ),
    ("ts_ns_utc", [pa.timestamp("ns", tz="UTC")], [(7,), (8,)], [0]),
    (
        "decimal",
        [pa.decimal128(10, 2)],
        [(decimal.Decimal("1.10"),), (decimal.Decimal("2.00"),), (decimal.Decimal("-3.5"),)],
        [0, 2],
    ),
    ("float_inf_nan", [pa.float64()], [(float("inf"),), (float("nan"),), (1.5,)], [0, 1]),
    ("float32", [pa.float32()], [(0.1,), (2.0,)], [0]),
    ("time64", [pa.time64("us")], [(dt.time(1, 2, 3),), (dt.time(4, 5, 6),)], [0]),
    ("time32", [pa.time32("ms")], [(dt.time(1, 2, 3),), (dt.time(4, 5, 6),)], [1]),
    ("date64", [pa.date64()], [(dt.date(2020, 1, 1),), (dt.date(2020, 1, 2),)], [1]),
    ("binary", [pa.binary()], [(b"\x00\xff",), (b"'",)], [0, 1]),
    ("string_quotes", [pa.string()], [("a'b",), ("c\\",), ("é\n",)], [0, 2]),
    (
        "composite_mixed",
        [pa.string(), pa.timestamp("ns", tz="UTC"), pa.decimal128(5, 1)],
        [
            ("a", 1, decimal.Decimal("1.0")),
            ("a", 2, decimal.Decimal("1.0")),
            ("b", 1, decimal.Decimal("2.0")),
        ],
        [0, 2],
    ),
]


def _make(tmp_path, types, rows):
    uri = str(tmp_path / "base")
    fields = [pa.field(f"k{i}", t, nullable=False, metadata=PK) for i, t in enumerate(types)]
    schema = pa.schema([*fields, pa.field("v", pa.int64())])
    cols = {f"k{i}": pa.array([r[i] for r in rows], t) for i, t in enumerate(types)}
    cols["v"] = pa.array(range(len(rows)), pa.int64())
    data = pa.table(cols, schema=schema)
    lance.write_dataset(data, uri)
    return mq.MemWalTable.initialize(uri), data


def _key_cols(types):
    return [f"k{i}" for i in range(len(types))]


@pytest.mark.parametrize("name,types,rows,dels", CASES, ids=[c[0] for c in CASES])
def test_deletes_are_merged_exactly_for_every_key_type(tmp_path, name, types, rows, dels):
    t, data = _make(tmp_path, types, rows)
    keys = _key_cols(types)
    w = t.writer()
    w.delete(data.take(dels).select(keys))
    w.flush()
    w.close()
    expected = sorted(set(range(len(rows))) - set(dels))
    assert sorted(t.to_table().column("v").to_pylist()) == expected
    assert len(t.maintenance.merge().merged) == 1
    assert sorted(lance.dataset(t.uri).to_table().column("v").to_pylist()) == expected


@pytest.mark.parametrize("name,types,rows,dels", CASES, ids=[c[0] for c in CASES])
def test_generation_with_upserts_and_deletes_of_every_key_type(tmp_path, name, types, rows, dels):
    """Deletes and upserts of one generation, and progress recorded once."""
    t, data = _make(tmp_path, types, rows)
    keys = _key_cols(types)
    keep = [i for i in range(len(rows)) if i not in dels]
    upd = data.take(pa.array(keep, pa.int64()))
    vals = pa.array([100 + i for i in keep], pa.int64())
    upd = upd.set_column(upd.schema.get_field_index("v"), "v", vals)
    w = t.writer()
    if upd.num_rows:
        w.put(upd)
    w.delete(data.take(dels).select(keys))
    w.flush()
    w.close()
    region = w.region_id
    assert t.maintenance.merge().by_region() == {region: [1]}
    base = lance.dataset(t.uri).to_table()
    assert sorted(base.column("v").to_pylist()) == [100 + i for i in keep]
    assert t.catalog.index().merged_generations() == {region: 1}
    # Exactly one version carries the progress; it is the last one.
    history = []
    for v in lance.dataset(t.uri).versions():
        idx = mwindex.read_index(t.catalog.io, lance.dataset(t.uri, version=v["version"]))
        history.append(0 if idx is None else idx.merged_generations().get(region, 0))
    assert history.count(1) == 1 and history[-1] == 1


def test_failing_region_does_not_block_other_regions(base_uri, monkeypatch):
    """Each region is merged even if one before it fails; the error names the region."""
    from memwal_query.maintain import merger

    table = expr_table(base_uri, "col0 % 3")
    writers = [table.writer(region_values={"r": (1000 + i) % 3}) for i in range(3)]
    for i, w in enumerate(writers):
        w.put(basic_rows([1000 + i]))
        w.flush()
        w.close()
    bad = sorted(table.catalog.region_ids())[0]
    real = merger.prepare_generation

    def broken(tbl, region_id, gen, *rest):
        if region_id == bad:
            raise ValueError("unreadable generation")
        return real(tbl, region_id, gen, *rest)

    monkeypatch.setattr(merger, "prepare_generation", broken)
    with pytest.raises(MergeFailedError) as info:
        table.maintenance.merge()
    assert list(info.value.errors) == [bad]
    assert bad in str(info.value)
    assert isinstance(info.value.errors[bad], ValueError)
    merged = table.catalog.index().merged_generations()
    assert set(merged) == {w.region_id for w in writers} - {bad}
    assert {r.region_id for r in info.value.results} == set(merged)
    ids = set(lance.dataset(table.uri).to_table().column("id").to_pylist())
    assert {1000 + i for i, w in enumerate(writers) if w.region_id != bad} <= ids
    monkeypatch.setattr(merger, "prepare_generation", real)
    assert table.maintenance.merge().by_region() == {bad: [1]}


def _composite_base_with_deletes(tmp_path, n=20_000):
    """A base of ``n`` (string, int64)-keyed rows and a writer that deleted every other."""
    schema = pa.schema(
        [
            pa.field("a", pa.string(), nullable=False, metadata=PK),
            pa.field("b", pa.int64(), nullable=False, metadata=PK),
            pa.field("v", pa.int64()),
        ]
    )
    uri = str(tmp_path / "base")
    data = pa.table(
        {"a": [f"k{i % 7}" for i in range(n)], "b": list(range(n)), "v": list(range(n))},
        schema=schema,
    )
    lance.write_dataset(data, uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.delete(data.select(["a", "b"]).take(list(range(0, n, 2))))
    return n, schema, uri, t, w


def _spy_delete_predicates(monkeypatch) -> list[str]:
    """Every SQL predicate the merge hands Lance to delete rows by (merge-insert's
    ``when_not_matched_by_source_delete`` and ``LanceDataset.delete``), in call order."""
    from lance.dataset import MergeInsertBuilder

    seen: list[str] = []
    by_source = MergeInsertBuilder.when_not_matched_by_source_delete
    delete = lance.LanceDataset.delete

    def spy_by_source(self, expr=None, *args, **kwargs):
        seen.append(str(expr))
        return by_source(self, expr, *args, **kwargs)

    def spy_delete(self, predicate, *args, **kwargs):
        seen.append(str(predicate))
        return delete(self, predicate, *args, **kwargs)

    monkeypatch.setattr(MergeInsertBuilder, "when_not_matched_by_source_delete", spy_by_source)
    monkeypatch.setattr(lance.LanceDataset, "delete", spy_delete)
    return seen


def test_many_composite_deletes_merge_as_a_key_join(tmp_path, monkeypatch):
    """10k composite-key deletes: a key join, not a 10k-term SQL predicate (that took
    ~9 s): no delete predicate reaches Lance at all."""
    n, schema, uri, t, w = _composite_base_with_deletes(tmp_path)
    w.flush()
    w.close()
    predicates = _spy_delete_predicates(monkeypatch)
    t.maintenance.merge()
    assert predicates == []
    assert lance.dataset(uri).count_rows() == n // 2


def test_generation_with_upserts_and_deletes_is_one_commit(table):
    """Upserts, inserts and deletes of one generation: one Lance commit carrying progress."""
    w = table.writer()
    w.put(basic_rows([1, 500], val=[-1.0, 500.0]))
    w.delete(pa.table({"id": pa.array([2, 3], pa.int64())}))
    w.flush()
    w.close()
    expected = sorted(set(range(100)) - {2, 3} | {500})
    v0 = lance.dataset(table.uri).version
    assert table.maintenance.merge().by_region() == {w.region_id: [1]}
    assert lance.dataset(table.uri).version == v0 + 1  # data and progress: one commit
    assert table.catalog.index().merged_generations() == {w.region_id: 1}
    base = {r["id"]: r["val"] for r in lance.dataset(table.uri).to_table().to_pylist()}
    assert sorted(base) == expected and base[1] == -1.0


def test_many_composite_deletes_with_upserts_merge_as_one_in_list(tmp_path, monkeypatch):
    """10k composite-key deletes beside upserts: one concatenated-key IN list, not 10k
    ``(a = .. AND b = ..)`` terms joined by OR."""
    n, schema, uri, t, w = _composite_base_with_deletes(tmp_path)
    w.put(pa.table({"a": ["new"], "b": [-1], "v": [-1]}, schema=schema))
    w.flush()
    w.close()
    v0 = lance.dataset(uri).version
    predicates = _spy_delete_predicates(monkeypatch)
    t.maintenance.merge()
    assert len(predicates) == 1
    (predicate,) = predicates
    assert predicate.startswith("concat(") and predicate.count(" IN (") == 1
    assert " OR " not in predicate and " AND " not in predicate
    assert lance.dataset(uri).version == v0 + 1
    assert lance.dataset(uri).count_rows() == n // 2 + 1


def test_key_predicate_cannot_be_forged_by_separators(tmp_path):
    """Composite string keys holding the separator and length prefix stay distinct."""
    from memwal_query.read.keypredicate import key_predicate

    keys = pa.table({"a": ["x|1:y", "x"], "b": ["z", "1:y|z"]})
    pred = key_predicate(keys.slice(0, 1))
    data = pa.table({"a": ["x|1:y", "x", "x|1:y"], "b": ["z", "1:y|z", "q"], "i": [0, 1, 2]})
    uri = str(tmp_path / "t")
    lance.write_dataset(data, uri)
    assert lance.dataset(uri).to_table(filter=pred).column("i").to_pylist() == [0]
