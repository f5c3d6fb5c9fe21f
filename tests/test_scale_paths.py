"""Strategies chosen for large inputs (small data that exercises the same code paths).

- A MemTable filled by many small puts holds one record batch per put; Lance writes
  thousands of small batches ~20x slower than a few large ones (1M rows in 100-row puts:
  2.6 s against 0.13 s), so a flush hands Lance coalesced batches.
- A lookup of many keys filtered the base table chunk by chunk (~8 us per key: 10 s for
  1M keys on a 2M-row base); it now scans the base's key columns once (2 s).
"""

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.search import pointlookup
from memwal_query.write import flush as flush_mod

from helpers import BASIC_SCHEMA, PK, basic_rows


def _spy_write_dataset(monkeypatch) -> list[list[int]]:
    """Record the batch sizes every ``lance.write_dataset`` call receives (then write)."""
    calls: list[list[int]] = []
    orig = lance.write_dataset

    def write_dataset(data, *args, **kwargs):
        if isinstance(data, pa.RecordBatchReader):
            batches = list(data)
            calls.append([b.num_rows for b in batches])
            data = pa.Table.from_batches(batches, schema=data.schema)
        elif isinstance(data, pa.Table):
            calls.append([b.num_rows for b in data.to_batches()])
        return orig(data, *args, **kwargs)

    monkeypatch.setattr(lance, "write_dataset", write_dataset)
    return calls


def test_flush_of_many_small_puts_writes_coalesced_batches(tmp_path, monkeypatch):
    lance.write_dataset(basic_rows(range(10)), tmp_path / "t", schema=BASIC_SCHEMA)
    t = mq.MemWalTable.initialize(tmp_path / "t")
    with t.writer(max_memtable_rows=10**6) as w:
        for i in range(300):  # one batch per put; key i % 250 written again later
            ids = [(i * 10 + j) % 2500 for j in range(10)]
            w.put(basic_rows(ids, val=[float(i)] * 10))
        calls = _spy_write_dataset(monkeypatch)
        w.flush()
    assert calls == [[3000]]  # one batch, not 300
    (gen,) = t.catalog.region_manifest(w.region_id).flushed_generations
    gen_ds = lance.dataset(flush_mod.paths.generation_path(t.uri, w.region_id, gen.path))
    rows = gen_ds.to_table(columns=["id", "val"], with_row_address=True)
    assert rows.column("_rowaddr").to_pylist() == list(range(3000))  # write order kept
    assert rows.column("val").to_pylist() == [float(i // 10) for i in range(3000)]
    got = t.to_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(2500))
    expected = [float(i // 10 + 250) if i < 500 else float(i // 10) for i in range(2500)]
    assert got.column("val").to_pylist() == expected


def test_coalesced_batches_groups_in_order():
    table = pa.Table.from_batches(
        [pa.record_batch({"x": list(range(i * 7, i * 7 + 7))}) for i in range(100)]
    )
    out = list(flush_mod.coalesced_batches(table, min_rows=50))
    assert [b.num_rows for b in out] == [56] * 12 + [28]
    assert pa.Table.from_batches(out).equals(table.combine_chunks())
    assert list(flush_mod.coalesced_batches(table.slice(0, 0), min_rows=50)) == []


@pytest.mark.parametrize("key", ["int", "string", "composite"])
def test_lookup_of_many_keys_scans_the_base_keys(tmp_path, monkeypatch, key):
    n = 4000
    ids = np.arange(n)
    if key == "int":
        fields = [pa.field("id", pa.int64(), False, PK)]
        keys = {"id": pa.array(ids)}
    elif key == "string":
        fields = [pa.field("id", pa.string(), False, PK)]
        keys = {"id": pa.array([f"k'{i}" for i in ids])}
    else:
        fields = [pa.field("a", pa.string(), False, PK), pa.field("b", pa.int32(), False, PK)]
        keys = {"a": pa.array([f"a{i % 7}" for i in ids]), "b": pa.array(ids // 7, pa.int32())}
    schema = pa.schema([*fields, pa.field("val", pa.int64())])
    pk = [f.name for f in fields]
    base = pa.table({**keys, "val": pa.array(ids)}, schema=schema)
    lance.write_dataset(base, tmp_path / "t", schema=schema)
    t = mq.MemWalTable.initialize(tmp_path / "t")
    updated, deleted = np.arange(0, n, 3), np.arange(1, n, 5)
    with t.writer() as w:
        w.put(base.take(pa.array(updated)).set_column(len(pk), "val", pa.array(updated + 10 * n)))
        w.delete(base.take(pa.array(deleted)).select(pk))
    t.maintenance.merge()  # the base now has deleted rows and rows rewritten by the merge
    ds = t.catalog.dataset()

    # Many keys relative to the base rows: one key scan; few keys: filtered chunks.
    assert pointlookup._use_base_key_scan(ds, pointlookup._BASE_KEY_SCAN_MIN_KEYS)
    assert not pointlookup._use_base_key_scan(ds, pointlookup._BASE_KEY_SCAN_MIN_KEYS - 1)
    monkeypatch.setattr(pointlookup, "_BASE_KEY_SCAN_MIN_KEYS", 1000)  # small data, same path
    assert pointlookup._use_base_key_scan(ds, n) and not pointlookup._use_base_key_scan(ds, 10)
    scans = []
    orig = pointlookup._base_rows_by_key_scan
    monkeypatch.setattr(
        pointlookup, "_base_rows_by_key_scan", lambda *a: scans.append(a[1].num_rows) or orig(*a)
    )

    probe = base.take(pa.array(ids[::-1])).select(pk)  # every key, reversed
    got = t.lookup(probe)
    assert scans == [n]  # one scan for all keys (the generation is merged)
    live = np.setdiff1d(ids, deleted)
    expected = pa.table(
        {
            **{c: base.column(c).take(pa.array(live)) for c in pk},
            "val": np.where(live % 3 == 0, live + 10 * n, live),
        }
    ).cast(schema)
    order = [(c, "ascending") for c in pk]
    assert got.select([*pk, "val"]).sort_by(order).equals(expected.sort_by(order))
