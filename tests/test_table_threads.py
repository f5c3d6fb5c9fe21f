"""MemWalTable.write / delete from several threads at once."""

import threading

import lance
import pyarrow as pa

import memwal_query as mq

from helpers import basic_rows


def _run_threads(fn, n):
    barrier = threading.Barrier(n)
    errors = []

    def run(i):
        barrier.wait()
        try:
            fn(i)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


def test_two_threads_writing_one_region_share_one_writer(tmp_path):
    """Two threads routing rows to the same region share one writer (one writer each
    would let the second claim fence the first, whose puts would raise FencedError)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 1)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    errors = _run_threads(lambda i: [t.write(basic_rows([100 * (i + 1) + j])) for j in range(5)], 4)
    assert errors == []
    assert len(t.writers()) == 1
    errors = _run_threads(lambda i: t.delete(pa.table({"id": [100 * (i + 1)]})), 4)
    assert errors == []
    t.close()
    got = sorted(r["id"] for r in mq.MemWalTable.open(uri).to_table().to_pylist())
    assert got == list(range(5)) + [100 * i + j for i in range(1, 5) for j in range(1, 5)]


def test_two_threads_writing_without_spec_share_one_writer(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    t = mq.MemWalTable.initialize(uri)
    errors = _run_threads(lambda i: [t.write(basic_rows([100 * (i + 1) + j])) for j in range(5)], 4)
    assert errors == []
    assert len(t.writers()) == 1
    t.close()
    got = sorted(r["id"] for r in mq.MemWalTable.open(uri).to_table().to_pylist())
    assert got == list(range(5)) + [100 * i + j for i in range(1, 5) for j in range(5)]
