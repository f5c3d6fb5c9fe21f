"""The readahead of memwal_query's Lance scans: never fewer batches decoded at once
than Lance's own default, which is one on a machine of up to three CPUs, and never
more than Lance decodes on a machine of six."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from lance.dataset import LanceDataset

import memwal_query as mq
from memwal_query.format import lancescan


@pytest.mark.parametrize(
    ("cpus", "reserved", "expected"),
    [(1, None, 4), (2, None, 4), (3, None, 4), (5, None, 4), (6, None, None), (64, None, None)]
    + [(4, "0", None), (4, "1", 4), (8, "5", 4)],
)
def test_four_batches_where_lance_decodes_fewer(monkeypatch, cpus, reserved, expected):
    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    if reserved is None:
        monkeypatch.delenv("LANCE_IO_CORE_RESERVATION", raising=False)
    else:
        monkeypatch.setenv("LANCE_IO_CORE_RESERVATION", reserved)
    monkeypatch.setattr(lancescan, "cpus", lambda: cpus)
    assert lancescan.batch_readahead() == expected


def test_lances_thread_count_set_by_the_user_leaves_lances_default(monkeypatch):
    monkeypatch.setattr(lancescan, "cpus", lambda: 2)
    monkeypatch.setenv("LANCE_CPU_THREADS", "1")
    assert lancescan.batch_readahead() is None


@pytest.mark.parametrize(
    ("affinity", "quota", "expected"), [(64, 2, 2), (64, None, 64), (2, 8, 2), (4, 1, 1)]
)
def test_a_containers_cpu_limit_counts(monkeypatch, affinity, quota, expected):
    monkeypatch.setattr(lancescan.os, "sched_getaffinity", lambda _: set(range(affinity)))
    monkeypatch.setattr(lancescan, "_cgroup_cpus", lambda: quota)
    assert lancescan.count_cpus() == expected


def test_the_cgroup_quota_is_read_as_the_kernel_writes_it(tmp_path, monkeypatch):
    v2, v1q, v1p = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    monkeypatch.setattr(lancescan, "_CGROUP_FILES", ((str(v2), None), (str(v1q), str(v1p))))
    assert lancescan._cgroup_cpus() is None  # no file
    v1q.write_text("150000\n")
    v1p.write_text("100000\n")
    assert lancescan._cgroup_cpus() == 2  # 1.5 CPUs, rounded up
    v1q.write_text("-1\n")
    assert lancescan._cgroup_cpus() is None
    v2.write_text("max 100000\n")
    assert lancescan._cgroup_cpus() is None
    v2.write_text("300000 100000\n")
    assert lancescan._cgroup_cpus() == 3


def _recorded(monkeypatch, column: str) -> list[tuple[object, object]]:
    """(batch_readahead, include_deleted_rows) of every Lance scan reading ``column``."""
    asked: list[tuple[object, object]] = []
    real = LanceDataset.scanner

    def scanner(self, *args, **kwargs):
        if kwargs.get("columns") and column in kwargs["columns"]:
            asked.append((kwargs.get("batch_readahead"), kwargs.get("include_deleted_rows")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LanceDataset, "scanner", scanner)
    return asked


@pytest.mark.parametrize(
    "flt",
    [None, pc.field("v") < 50, pc.field("u") < 20],
    ids=["whole", "filtered by Lance", "filtered by pyarrow"],
)
def test_the_base_scans_of_a_read_ask_for_it(tmp_path, monkeypatch, flt):
    monkeypatch.setattr(lancescan, "cpus", lambda: 2)
    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    monkeypatch.delenv("LANCE_IO_CORE_RESERVATION", raising=False)
    uri = str(tmp_path / "t")
    ids = np.arange(3000)
    rows = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "v": pa.array(ids // 30, pa.int64()),
            "u": pa.array(ids // 30, pa.uint32()),  # Lance refuses filters on it
        }
    )
    lance.write_dataset(rows, uri)
    t = mq.MemWalTable.initialize(uri, primary_key="id")
    gone = pa.array(ids[::3], pa.int64())  # a deletion file with a run per deleted row
    t.delete(pa.table({"id": gone}))
    t.flush()
    t.maintenance.merge()
    t.write(
        pa.table(
            {"id": pa.array([1, 5000], pa.int64()), "v": [7, 8], "u": pa.array([7, 8], pa.uint32())}
        )
    )
    t.close()
    assert lance.dataset(uri).get_fragments()[0].num_deletions == 1000
    asked = _recorded(monkeypatch, "v")
    got = mq.MemWalTable.open(uri).to_table(filter=flt)
    assert asked and all(a == 4 for a, _ in asked), asked
    assert any(deleted for _, deleted in asked), "the deleted rows were not read"
    model = {i: (i // 30) for i in range(3000) if i % 3} | {1: 7, 5000: 8}
    keep = {k: v for k, v in model.items() if flt is None or v < (50 if "v" in str(flt) else 20)}
    assert dict(zip(got["id"].to_pylist(), got["v"].to_pylist(), strict=True)) == keep


def test_a_scan_of_vectors_keeps_lances_default(tmp_path, monkeypatch):
    monkeypatch.setattr(lancescan, "cpus", lambda: 2)
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
    mq.MemWalTable.initialize(uri, primary_key="id").close()
    asked = _recorded(monkeypatch, "vec")
    got = mq.MemWalTable.open(uri).to_table()
    assert asked and all(a is None for a, _ in asked), asked
    assert got.sort_by("id").column("vec").to_pylist() == vectors.tolist()


def test_the_cpus_are_counted_once_per_process(monkeypatch):
    counted: list[int] = []

    def count() -> int:
        counted.append(3)
        return 3

    monkeypatch.setattr(lancescan, "_CPUS", [])
    monkeypatch.setattr(lancescan, "count_cpus", count)
    assert [lancescan.cpus() for _ in range(5)] == [3] * 5
    assert counted == [3]
