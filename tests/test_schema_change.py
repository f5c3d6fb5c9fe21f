"""Base-table schema changes made while MemWalTable objects and writers are open."""

import lance
import pyarrow as pa

import memwal_query as mq

from helpers import basic_rows


def _rows(uri):
    return {r["id"]: r for r in lance.dataset(uri).to_table().to_pylist()}


def test_merger_opened_before_add_columns_keeps_new_column_values(tmp_path):
    """A MemWalTable opened before a column was added merges generations that carry
    the column: the values reach the base table (they were set to NULL)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    stale = mq.MemWalTable.initialize(uri)
    lance.dataset(uri).add_columns({"extra": "CAST(NULL AS BIGINT)"})
    fresh = mq.MemWalTable.open(uri)
    with fresh.writer() as w:
        w.put(pa.table({"id": [2, 8], "val": [2.5, 8.0], "extra": [20, 80]}), partial=True)
    expected = {r["id"]: r for r in fresh.to_table().to_pylist()}
    assert expected[2]["extra"] == 20 and expected[8]["extra"] == 80
    stale.maintenance.merge()
    assert _rows(uri) == expected


def test_merger_opened_before_drop_columns_merges(tmp_path):
    """A MemWalTable opened before a column was dropped still merges (it failed with
    'Append with different schema')."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    stale = mq.MemWalTable.initialize(uri)
    with stale.writer() as w:
        w.put(basic_rows([1, 7], val=[-1.0, 70.0]))
    lance.dataset(uri).drop_columns(["name"])
    expected = {r["id"]: r for r in mq.MemWalTable.open(uri).to_table().to_pylist()}
    assert expected[1] == {"id": 1, "val": -1.0}
    stale.maintenance.merge()
    assert _rows(uri) == expected
