"""A maintenance pass gives the memory it freed back to the system, real Lance tables.

A pass's working set (merge sources, Lance's joins, compaction rewrites) is freed when it
ends, but the C heap keeps freed pages for reuse: a ``--watch`` maintainer would stay at
its largest pass's high-water mark, and the free pages fragment further with every pass.
The test leaves a fragmented free heap in the process (what a pass leaves: many small
blocks freed, a few kept among them, so glibc returns none of it by itself), runs one
real pass, and checks the process's resident memory went down by most of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

BLOCK = 1024
BLOCKS = 64 * 1024  # 64 MiB of small blocks
KEEP_EVERY = 64  # one block kept per 64 KiB: the heap cannot shrink from its top

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm") or _malloc_trim() is None,
    reason="needs Linux's /proc and glibc's malloc_trim",
)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fragment_heap() -> list[int]:
    """Allocate and touch :data:`BLOCKS` small blocks, free all but every
    :data:`KEEP_EVERY`-th; returns the kept blocks (to free at the end)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    kept = blocks[::KEEP_EVERY]
    for i, b in enumerate(blocks):
        if i % KEEP_EVERY:
            libc.free(b)
    return kept


def _free(blocks: list[int]) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    for b in blocks:
        libc.free(b)


def test_a_pass_returns_the_free_heap_to_the_system(tmp_path: Any) -> None:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(100)), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    t.write(basic_rows(range(50, 150)))
    t.flush()
    policy = MaintenancePolicy(merge_over_generations=0)
    t.maintenance.maintain(policy)  # the first pass's one-off imports and allocations
    t.write(basic_rows(range(100, 200)))
    t.flush()
    kept = _fragment_heap()
    try:
        before = _rss()
        report = t.maintenance.maintain(policy)
        after = _rss()
    finally:
        _free(kept)
    assert report.merged, report.lines()
    freed = BLOCK * BLOCKS * (KEEP_EVERY - 1) // KEEP_EVERY
    # at least half of what was left free (the pass itself allocates and frees a little)
    assert before - after >= freed // 2, (before >> 20, after >> 20, freed >> 20)
    assert t.to_table().num_rows == 200


THREAD_HEAP = """
import ctypes, ctypes.util, os, sys, threading
import pyarrow
from memwal_query.storage.heap import bound_process_heap, release_unused_memory
print(bound_process_heap(), file=sys.stderr)
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def work():
    big = libc.malloc(20 << 20)  # freed: glibc's own rule would raise its thresholds
    ctypes.memset(big, 1, 20 << 20)
    libc.free(big)
    blocks = [libc.malloc(4096) for _ in range(8192)]  # 32 MiB in this thread's arena
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for b in blocks:
        libc.free(b)
before = rss()
th = threading.Thread(target=work)
th.start()
th.join()
release_unused_memory()
print(rss() - before)
"""


def test_the_watch_process_returns_a_threads_freed_arena() -> None:
    """``bound_process_heap`` (what ``memwal maintain --watch`` calls first): 32 MiB
    freed in a worker thread's arena go back to the system (with glibc's defaults
    they stay: the arena's top is trimmed only past a threshold the large free raised,
    and ``malloc_trim`` leaves the tops of thread arenas alone). In a child process:
    the settings are process-wide."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL"))
    }
    out = subprocess.run(
        [sys.executable, "-c", THREAD_HEAP], env=env, capture_output=True, text=True, check=True
    )
    assert "malloc thresholds" in out.stderr, out.stderr
    kept = int(out.stdout.split()[-1])
    assert kept < 8 << 20, (kept >> 20, out.stderr)


USER_CHOICE = """
import sys
import pyarrow as pa
from memwal_query.storage.heap import bound_process_heap, release_unused_memory
kept = pa.array(range(100000))  # allocated from the pool chosen at start
print(bound_process_heap(), file=sys.stderr)
made = pa.array(range(100000))
release_unused_memory()
del kept
release_unused_memory()
print(pa.default_memory_pool().backend_name, made.sum().as_py())
"""


@pytest.mark.parametrize(
    ("env", "done", "pool"),
    [
        ({}, ["malloc thresholds", "arrow system pool"], "system"),
        ({"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"}, ["malloc thresholds"], "jemalloc"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, ["arrow system pool"], "system"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, ["arrow system pool"], "system"),
    ],
)
def test_the_users_allocator_settings_win(env: dict[str, str], done: list[str], pool: str) -> None:
    """What the environment chose (glibc's tunables, Arrow's pool) is left alone; the
    pool is switched with arrays of the former one alive, which are freed by their own
    pool (no crash, the same values)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL"))
    }
    out = subprocess.run(
        [sys.executable, "-c", USER_CHOICE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stderr.strip().splitlines()[-1] == repr(done), out.stderr
    assert out.stdout.split() == [pool, str(sum(range(100000)))]


def test_passes_give_memory_back_while_other_threads_read(tmp_path: Any) -> None:
    """Passes (each ending in a trim of the heap and Arrow's pool) run while a reader
    thread decodes and frees rows: every answer is the table's."""
    import threading

    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(2000)), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))
    want = {k: float(k) for k in range(2000)}
    want.update({k: -1.0 for k in range(1000, 3000)})
    t.write(basic_rows(range(1000, 3000), [-1.0] * 2000))
    t.flush()
    t.close()
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        r = mq.MemWalTable.open(uri)
        try:
            while not stop.is_set():
                got = r.to_table()
                assert dict(zip(got["id"].to_pylist(), got["val"].to_pylist())) == want
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    th = threading.Thread(target=read)
    th.start()
    try:
        policy = MaintenancePolicy(merge_over_generations=0)
        for _ in range(3):
            t.maintenance.maintain(policy)
    finally:
        stop.set()
        th.join()
    assert not errors, errors[0]
