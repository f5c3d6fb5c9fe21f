"""A long-lived reader's resident memory stays bounded while others write and merge.

A reader process keeps one table open and queries it while the table is written,
flushed and merged. Its queries decode and free large buffers: with glibc's own
thresholds, a large free raises the threshold below which a heap keeps its top (up to
64 MiB), so the process keeps its largest query's pages, and the tops of the thread
arenas are never trimmed otherwise. The read path fixes the thresholds from a process's
second read on (``memwal_query.storage.heap``; the first runs with glibc's own rule). The
test runs two real reader processes on the same rounds of writes, flushes and merges;
each round is a real query, then a transient the size of a query's decode (a 30 MiB
block freed, then 20, 26, ... 50 MiB of small blocks freed). After its first query, the
reader with the library's defaults keeps none of it; the one whose environment tells
the library to leave glibc alone keeps each round's new high-water mark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import lance
import pytest

import memwal_query as mq
from memwal_query.maintain.policy import MaintenancePolicy
from memwal_query.storage.heap import _malloc_trim

from helpers import basic_rows, parity_spec

ROUNDS = 6
ROWS = 100

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm") or _malloc_trim() is None,
    reason="needs Linux's /proc and glibc's malloc_trim",
)

READER = """
import ctypes, ctypes.util, json, os, sys
import datafusion
import memwal_query as mq
from memwal_query.storage.heap import heap_thresholds
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def transient(mib):
    big = libc.malloc(30 << 20)
    ctypes.memset(big, 1, 30 << 20)
    libc.free(big)
    blocks = [libc.malloc(4096) for _ in range(256 * mib)]
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for b in blocks:
        libc.free(b)
t = mq.MemWalTable.open(sys.argv[1])
for i, line in enumerate(sys.stdin):
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider(consistency="latest"))
    rows = ctx.sql("SELECT count(*) FROM t").to_arrow_table().column(0)[0].as_py()
    before = rss()
    transient(20 + 6 * i)
    kept = rss() - before
    print(json.dumps({"rows": rows, "kept": kept, "who": heap_thresholds()}), flush=True)
"""


def _reader(uri: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", READER, uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _round(child: subprocess.Popen[str]) -> dict[str, Any]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("\n")
    child.stdin.flush()
    line = child.stdout.readline()
    assert line, "the reader process ended"
    return json.loads(line)


def test_a_reader_keeps_no_arena_tops_while_others_write_and_merge(tmp_path: Any) -> None:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(ROWS)), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL"))
    }
    # a tunable that changes nothing: the environment speaks, the library steps aside
    readers = [_reader(uri, env), _reader(uri, dict(env, GLIBC_TUNABLES="glibc.malloc.perturb=0"))]
    got: list[list[dict[str, Any]]] = [[], []]
    policy = MaintenancePolicy(merge_over_generations=0)
    try:
        for i in range(ROUNDS):
            t.write(basic_rows(range(ROWS + 50 * i, ROWS + 50 * (i + 1))))  # inserts
            t.write(basic_rows(range(10 * i, 10 * i + 10), val=[-1.0] * 10))  # updates
            t.flush()
            if i % 2:
                t.maintenance.maintain(policy)
            for j, child in enumerate(readers):
                got[j].append(_round(child))
    finally:
        for child in readers:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=60)
    for rounds in got:
        assert [r["rows"] for r in rounds] == [ROWS + 50 * (i + 1) for i in range(ROUNDS)]
    fixed, control = got
    # the first query runs with glibc's own rule (nothing chosen yet), the later ones not
    assert fixed[0]["who"] is None and control[0]["who"] is None
    assert {r["who"] for r in fixed[1:]} == {"read path"}
    assert {r["who"] for r in control[1:]} == {"environment"}
    kept = [[r["kept"] >> 20 for r in rounds[1:]] for rounds in got]
    # glibc's own thresholds keep each round's new high-water mark, 6 MiB a round after
    # the first (the test can fail); the read path's trim threshold is below each round's
    assert sum(kept[1]) >= 18, kept
    assert sum(max(k, 0) for k in kept[0]) < 8, kept  # a trim does not hide a keep


WHO = """
import sys
import memwal_query as mq
from memwal_query.storage.cache import LRUCache
from memwal_query.storage.heap import heap_thresholds, release_free_heap
if sys.argv[1] == "store":  # a process that resolves no view (a Spark executor)
    LRUCache(4, max_bytes=1 << 20, sizeof=len, name="probe").put("k", b"value")
    print(heap_thresholds())
else:  # a reader: its first read with glibc's own rule, then fixed
    t = mq.MemWalTable.open(sys.argv[2])
    t.to_table()
    release_free_heap(force=True)
    first = heap_thresholds()
    t.to_table()
    print(first, heap_thresholds())
"""


def test_who_fixes_the_thresholds_and_when(tmp_path: Any) -> None:
    """A process that resolves no view fixes glibc's thresholds on its first cache store;
    a reader from its second read on, whatever it stores during its first."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(ROWS)), uri)
    mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}

    def who(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", WHO, *args], capture_output=True, text=True, env=env
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert who("store") == "read path"
    assert who("read", uri) == "None read path"
