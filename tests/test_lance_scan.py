"""The readahead of memwal_query's Lance scans: never fewer batches decoded at once
than Lance's own default, which is one on a machine of up to three CPUs."""

from __future__ import annotations

import os

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from lance.dataset import LanceDataset

import memwal_query as mq
from memwal_query.format import lancescan


def test_at_least_four_batches_and_every_cpu(monkeypatch):
    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    got = lancescan.batch_readahead()
    assert got is not None
    assert got >= lancescan.MIN_BATCH_READAHEAD
    assert got >= len(os.sched_getaffinity(0))


def test_lances_thread_count_set_by_the_user_leaves_lances_default(monkeypatch):
    monkeypatch.setenv("LANCE_CPU_THREADS", "3")
    assert lancescan.batch_readahead() is None


@pytest.mark.parametrize("flt", [None, pc.field("v") < 50], ids=["whole", "filtered"])
def test_the_base_scans_of_a_read_ask_for_it(tmp_path, monkeypatch, flt):
    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    uri = str(tmp_path / "t")
    ids = pa.array(range(1000), pa.int64())
    lance.write_dataset(pa.table({"id": ids, "v": pc.divide(ids, 10)}), uri)
    t = mq.MemWalTable.initialize(uri, primary_key="id")
    t.write(pa.table({"id": pa.array([1, 2000], pa.int64()), "v": pa.array([7, 8])}))
    t.maintenance.merge()  # a deletion file on the base: the scan reads its deleted rows
    t.write(pa.table({"id": pa.array([3], pa.int64()), "v": pa.array([9])}))
    t.close()
    asked: list[object] = []
    real = LanceDataset.scanner

    def scanner(self, *args, **kwargs):
        if kwargs.get("columns") and "v" in kwargs["columns"]:  # a scan of the rows
            asked.append(kwargs.get("batch_readahead"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LanceDataset, "scanner", scanner)
    got = mq.MemWalTable.open(uri).to_table(filter=flt)
    assert asked and all(a == lancescan.batch_readahead() for a in asked), asked
    rows = dict(zip(got["id"].to_pylist(), got["v"].to_pylist(), strict=True))
    model = {i: i // 10 for i in range(1000)} | {1: 7, 2000: 8, 3: 9}
    assert rows == {k: v for k, v in model.items() if flt is None or v < 50}


def test_a_scan_of_vectors_keeps_lances_default(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    uri = str(tmp_path / "t")
    vectors = np.arange(200 * 8, dtype=np.float32).reshape(200, 8)
    rows = pa.table(
        {
            "id": pa.array(range(200), pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 8),
        }
    )
    lance.write_dataset(rows, uri)
    t = mq.MemWalTable.initialize(uri, primary_key="id")
    t.close()
    asked: list[object] = []
    real = LanceDataset.scanner

    def scanner(self, *args, **kwargs):
        if kwargs.get("columns") and "vec" in kwargs["columns"]:
            asked.append(kwargs.get("batch_readahead", "absent"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LanceDataset, "scanner", scanner)
    got = mq.MemWalTable.open(uri).to_table()
    assert asked and all(a is None for a in asked), asked
    assert got.sort_by("id").column("vec").to_pylist() == vectors.tolist()
