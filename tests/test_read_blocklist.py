"""Overwritten base rows skipped by Lance (``row_addr_blocklist``) in unfiltered scans.

The blocklist is Lance's serialized ``RowAddrTreeMap``, built with numpy
(:func:`memwal_query.format.rowaddrs.row_address_treemap`); Lance itself checks the encoding
here: a scan with it as allowlist returns exactly those rows, as blocklist all others.
"""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format.rowaddrs import row_address_treemap
from memwal_query.read import provider

from helpers import PK


@pytest.fixture(scope="module")
def three_fragments(tmp_path_factory):
    """140,000 rows in fragments of 70,000, 50,000 and 20,000 rows (``id`` = row number)."""
    uri = str(tmp_path_factory.mktemp("blocklist") / "d")
    n = 140_000
    ids = np.arange(n, dtype=np.int64)
    lance.write_dataset(pa.table({"id": ids[:70_000]}), uri)
    lance.write_dataset(pa.table({"id": ids[70_000:120_000]}), uri, mode="append")
    ds = lance.write_dataset(pa.table({"id": ids[120_000:]}), uri, mode="append")
    assert [f.count_rows() for f in ds.get_fragments()] == [70_000, 50_000, 20_000]
    return ds


@pytest.mark.parametrize(
    "case", ["empty", "edges", "dense", "bitmap-containers", "every-row-of-a-fragment"]
)
def test_treemap_is_what_lance_reads(three_fragments, case):
    ds = three_fragments
    table = ds.to_table(columns=["id"], with_row_address=True)
    addr = table.column("_rowaddr").to_numpy()
    rng = np.random.default_rng(3)
    pick = {
        "empty": np.zeros(0, dtype=np.int64),
        "edges": np.array([0, 65_535, 65_536, 69_999, 70_000, 119_999, 120_000, 139_999]),
        "dense": rng.choice(len(addr), 3_000, replace=False),
        # over 4096 offsets in one 65536-row chunk: bitmap containers, next to arrays
        "bitmap-containers": np.concatenate([np.arange(0, 60_000, 2), np.arange(125_000, 125_100)]),
        "every-row-of-a-fragment": np.arange(70_000, 120_000),
    }[case]
    chosen = addr[pick]
    blob = row_address_treemap(rng.permutation(np.concatenate([chosen, chosen[:5]])))
    want = set(pick.tolist())
    if len(chosen):  # an empty allowlist means "no restriction" to nobody: not asked
        allowed = ds.scanner(columns=["id"], row_addr_allowlist=blob).to_table()
        assert sorted(allowed.column("id").to_pylist()) == sorted(want)
    kept = ds.scanner(columns=["id"], row_addr_blocklist=blob).to_table()
    assert set(kept.column("id").to_pylist()) == set(range(len(addr))) - want
    assert kept.num_rows == len(addr) - len(want)


def _overwritten(tmp_path, key_type=None):
    """A 3,000-row base (fragments of 1,000) with keys overwritten and deleted in a
    flushed generation and in the writer's MemTable: (table, writer, model id -> v);
    with a string ``key_type`` the key ``id`` holds the decimal digits of the numbers."""
    key_type = pa.int64() if key_type is None else key_type
    schema = pa.schema(
        [
            pa.field("id", key_type, False, PK),
            pa.field("v", pa.int64()),
            pa.field("s", pa.string()),
        ]
    )
    text = pa.types.is_string(key_type)

    def rows(ids, v):
        ids = list(ids)
        keys = [str(i) for i in ids] if text else ids
        return pa.table(
            {"id": keys, "v": [v + i for i in ids], "s": [f"s{i}" for i in ids]}, schema
        )

    uri = str(tmp_path / "t")
    lance.write_dataset(rows(range(3000), 0), uri, max_rows_per_file=1000)
    model = {i: i for i in range(3000)}
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(rows(range(2500, 3500), 10_000))
    key = (lambda ids: [str(i) for i in ids]) if text else list
    w.delete(pa.table({"id": key(range(0, 3000, 11))}, pa.schema([schema.field("id")])))
    w.flush()
    w.put(rows(range(100, 150), 50_000))
    w.delete(pa.table({"id": key([2600, 7])}, pa.schema([schema.field("id")])))
    model.update({i: 10_000 + i for i in range(2500, 3500)})
    for i in [*range(0, 3000, 11), 2600, 7]:
        model.pop(i, None)
    model.update({i: 50_000 + i for i in range(100, 150)})
    return t, w, model


@pytest.mark.parametrize("key_type", [pa.string(), pa.int64()], ids=["string", "int"])
def test_unfiltered_scans_skip_overwritten_rows_in_lance(tmp_path, monkeypatch, key_type):
    """SELECT * / count(*) / projections without a filter drop overwritten base rows
    (keys in a flushed generation and in the MemTable, deletes in both) through the
    blocklist when the keys are hashed (strings), by a per-batch test of the integer
    key column otherwise (no blocklist built); filtered queries test keys per batch;
    every answer matches the model."""
    text = pa.types.is_string(key_type)
    t, w, model = _overwritten(tmp_path, key_type)
    if text:
        model = {str(k): v for k, v in model.items()}

    built: list[int] = []
    treemap = provider.row_address_treemap

    def counting(addresses: np.ndarray) -> bytes:
        built.append(len(addresses))
        return treemap(addresses)

    monkeypatch.setattr(provider, "row_address_treemap", counting)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    got = ctx.sql("SELECT * FROM t").to_arrow_table()
    assert dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist())) == model
    assert got.num_rows == len(model)
    assert got.column("s").to_pylist() == [f"s{i}" for i in got.column("id").to_pylist()]
    stale = {*range(2500, 3000), *range(0, 3000, 11), *range(100, 150), 7, 2600}
    if text:
        assert built and built[-1] >= len(stale), built  # every overwritten base row
    else:
        assert not built  # integer keys: tested per batch
    n = ctx.sql("SELECT count(*) AS n, sum(v) AS v FROM t").to_arrow_table().to_pylist()[0]
    assert n == {"n": len(model), "v": sum(model.values())}
    assert t.provider(writers=[w]).count_rows() == len(model)
    built.clear()
    keys = "'7', '8', '120', '2501'" if text else "7, 8, 120, 2501"
    one = ctx.sql(f"SELECT v FROM t WHERE id IN ({keys})").to_arrow_table()
    assert sorted(one.column("v").to_pylist()) == [8, 12_501, 50_120]
    assert not built  # a filtered scan tests keys per batch
    assert t.provider(writers=[w]).to_table().num_rows == len(model)
    w.close(flush=False)


@pytest.mark.parametrize("columns", [None, ["s", "id"], ["v"], ["_rowaddr", "_gen", "v"]])
def test_to_table_reads_the_base_in_one_lance_scan(tmp_path, monkeypatch, columns):
    """An unfiltered ``to_table()`` reads the base with one Lance ``to_table`` (the
    blocklist skipping overwritten rows) and appends the newer rows: the same rows and
    meta columns as the partition scan (the DuckDB / Polars path); filtered,
    column-less and over-size reads take the partition scan."""
    t, w, model = _overwritten(tmp_path)
    wholes: list[object] = []
    whole = provider._BaseFragment.whole

    def spy(self, out_schema):
        got = whole(self, out_schema)
        wholes.append(got)
        return got

    monkeypatch.setattr(provider._BaseFragment, "whole", spy)
    ds = t.provider(writers=[w], meta_columns=True)
    got = ds.to_table(columns=columns)
    assert len(wholes) == 1 and wholes[0] is not None
    scanned = ds.scanner(columns=columns).to_table()  # its base partitions interleave
    order = [(c, "ascending") for c in got.column_names]
    assert got.sort_by(order).equals(scanned.sort_by(order))
    assert got.num_rows == len(model)
    if columns is None:
        assert dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist())) == model
        newer = sum(v >= 10_000 for v in model.values())  # base rows first
        gens = got.column("_gen").to_numpy()
        assert (gens[:-newer] == 0).all() and (gens[-newer:] > 0).all()
    wholes.clear()
    assert ds.to_table(filter=pa.compute.field("v") >= 50_000).num_rows == 50
    assert ds.count_rows() == len(model)
    assert not wholes  # a filter, or no column: the partition scan
    monkeypatch.setattr(provider, "ADDRESS_DEDUP_MAX_ROWS", 10)  # no blocklist
    decided: list[bool] = []
    can = provider._BaseFragment.can_be_whole

    def asked(self, out_schema):
        decided.append(can(self, out_schema))
        return decided[-1]

    monkeypatch.setattr(provider._BaseFragment, "can_be_whole", asked)
    again = ds.to_table(columns=columns)
    assert decided == [False] and not wholes  # the partition scan
    assert again.sort_by(order).equals(got.sort_by(order))
    w.close(flush=False)


def test_stable_row_ids_base(tmp_path):
    """A base with stable row ids, compacted: its row ids are no longer its row
    addresses, and Lance matches the blocklist against row ids (a blocklist of
    addresses would drop nothing and return overwritten rows twice)."""
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "t")
    ids = list(range(2000))
    lance.write_dataset(
        pa.table({"id": ids, "v": ids}, schema),
        uri,
        max_rows_per_file=500,
        enable_stable_row_ids=True,
    )
    ds = lance.dataset(uri)
    ds.delete("id < 300")
    ds.optimize.compact_files(target_rows_per_fragment=5000)
    x = lance.dataset(uri).to_table(columns=["id"], with_row_id=True, with_row_address=True)
    assert x.column("_rowid") != x.column("_rowaddr")  # the case under test
    model = {i: i for i in range(300, 2000)}
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": list(range(1500, 2500)), "v": [-1] * 1000}, schema))
    w.flush()
    w.put(pa.table({"id": [400, 401], "v": [-2, -2]}, schema))
    model.update({i: -1 for i in range(1500, 2500)})
    model.update({400: -2, 401: -2})
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(writers=[w]))
    got = ctx.sql("SELECT id, v FROM t").to_arrow_table()
    assert got.num_rows == len(model)
    assert dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist())) == model
    w.close(flush=False)
