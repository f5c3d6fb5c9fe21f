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
