"""concurrent_streams: the partitions of a scan outside DataFusion, read at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from memwal_query.read.parallel import concurrent_streams


def test_items_come_stream_by_stream_in_order_and_run_concurrently():
    second_started = threading.Event()

    def first() -> Iterator[int]:
        # blocks until the second stream runs: only possible if both run at once
        assert second_started.wait(30), "streams were not produced concurrently"
        yield from range(5)

    def second() -> Iterator[int]:
        second_started.set()
        yield from range(100, 110)

    def third() -> Iterator[int]:
        return iter(())

    out = list(concurrent_streams([first, second, third], depth=2))
    assert out == [*range(5), *range(100, 110)]


def test_an_error_is_raised_after_the_items_before_it():
    def good() -> Iterator[int]:
        yield from (1, 2)

    def bad() -> Iterator[int]:
        yield 3
        raise ValueError("stream 2 broke")

    got: list[int] = []
    with pytest.raises(ValueError, match="stream 2 broke"):
        for x in concurrent_streams([good, bad]):
            got.append(x)
    assert got == [1, 2, 3]


def test_a_consumer_that_stops_early_stops_and_closes_the_producers():
    closed = [threading.Event(), threading.Event()]

    def endless(i: int):
        def stream() -> Iterator[int]:
            try:
                n = 0
                while True:
                    yield n
                    n += 1
            finally:
                closed[i].set()

        return stream

    it = concurrent_streams([endless(0), endless(1)], depth=3)
    assert [next(it) for _ in range(10)] == list(range(10))
    it.close()  # what LIMIT or an error in the consumer does
    assert all(c.wait(30) for c in closed), "a producer kept running"


def test_one_stream_needs_no_thread():
    def stream() -> Iterator[str]:
        assert threading.current_thread() is threading.main_thread()
        yield "x"

    assert list(concurrent_streams([stream])) == ["x"]


def _blocked_until_second_ends(second_done: threading.Event, seconds: float) -> Iterator[int]:
    # the first stream waits for the second to be produced to its end
    if not second_done.wait(seconds):
        raise TimeoutError("the second stream was held back")
    yield from range(3)


def test_without_a_bound_a_stream_runs_to_its_end_before_the_ones_before_it_are_taken():
    second_done = threading.Event()

    def second() -> Iterator[int]:
        yield from range(100, 110)  # more items than a bounded depth holds
        second_done.set()

    out = list(
        concurrent_streams([lambda: _blocked_until_second_ends(second_done, 30), second], None)
    )
    assert out == [*range(3), *range(100, 110)]


def test_with_a_bound_a_stream_waits_for_the_consumer():
    second_done = threading.Event()

    def second() -> Iterator[int]:
        yield from range(100, 110)
        second_done.set()

    with pytest.raises(TimeoutError, match="held back"):
        list(concurrent_streams([lambda: _blocked_until_second_ends(second_done, 0.5), second], 2))


def test_a_scanners_to_table_reads_its_partitions_without_a_bound(tmp_path, monkeypatch):
    import lance
    import pyarrow as pa
    import pyarrow.compute as pc

    import memwal_query as mq
    from memwal_query.read import parallel

    uri = str(tmp_path / "t")
    for part in range(4):  # four base fragments: two partitions of two
        ids = pa.array(range(part * 100, part * 100 + 100), pa.int64())
        rows = pa.table({"id": ids, "v": pc.multiply(ids, 2)})
        lance.write_dataset(rows, uri, mode="append" if part else "create")
    t = mq.MemWalTable.initialize(uri, primary_key="id")
    t.write(pa.table({"id": pa.array([5, 250, 999], pa.int64()), "v": pa.array([-1, -2, -3])}))
    t.close()
    depths: list[int | None] = []
    real = parallel.concurrent_streams

    def recorded(streams, depth=2):
        depths.append(depth)
        return real(streams, depth)

    monkeypatch.setattr(parallel, "concurrent_streams", recorded)
    ds = mq.MemWalTable.open(uri).provider()
    flt = pc.field("v") < 300
    whole = ds.scanner(filter=flt).to_table()
    streamed = pa.Table.from_batches(list(ds.scanner(filter=flt).to_batches()))
    assert depths == [None, 2]
    expected = {i: 2 * i for i in range(400) if 2 * i < 300 and i not in (5, 250)}
    expected.update({5: -1, 250: -2, 999: -3})
    for got in (whole, streamed, ds.to_table(filter=flt)):
        assert dict(zip(got["id"].to_pylist(), got["v"].to_pylist(), strict=True)) == expected
        assert got.num_rows == len(expected)
