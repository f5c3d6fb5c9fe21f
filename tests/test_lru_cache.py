"""The bounded LRU map every in-process cache of memwal_query is: what its removals
keep, and the bytes they account for."""

from __future__ import annotations

from memwal_query.storage.cache import LRUCache


def _cache() -> LRUCache[tuple[str, int], bytes]:
    c: LRUCache[tuple[str, int], bytes] = LRUCache(100, max_bytes=1 << 20, sizeof=len)
    for table in ("a", "b"):
        for i in range(5):
            c.put((table, i), b"x" * (i + 1))
    return c


def test_keep_recent_keeps_the_most_recently_used_of_a_group() -> None:
    c = _cache()
    c.get(("a", 0))  # used last: kept over newer entries
    assert c.keep_recent(lambda k: k[0] == "a", 2) == 3
    assert sorted(k for k, _ in c.items() if k[0] == "a") == [("a", 0), ("a", 4)]
    assert len([k for k, _ in c.items() if k[0] == "b"]) == 5  # another group untouched
    assert c.nbytes == 1 + 5 + sum(range(1, 6))
    assert c.keep_recent(lambda k: k[0] == "a", 2) == 0  # already within
    assert c.keep_recent(lambda k: k[0] == "c", 0) == 0


def test_discard_where_removes_every_entry_of_a_group() -> None:
    c = _cache()
    assert c.discard_where(lambda k: k[0] == "b" and k[1] % 2 == 0) == 3
    assert sorted(k for k, _ in c.items() if k[0] == "b") == [("b", 1), ("b", 3)]
    assert c.nbytes == sum(range(1, 6)) + 2 + 4
    c.put(("b", 9), b"y")  # the bounds still hold after removals
    assert c.nbytes == sum(range(1, 6)) + 2 + 4 + 1
