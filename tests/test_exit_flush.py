"""The flush at interpreter exit of the writers ``MemWalTable.write`` opened is bounded:
storage that hangs never hangs the interpreter's exit, and the rows stay durable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import lance
import pytest

import memwal_query as mq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from helpers import basic_rows  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import memwal_query as mq
    from memwal_query.write import flush
    from helpers import basic_rows

    t = mq.MemWalTable.open(sys.argv[1])
    t.write(basic_rows([7, 8]))

    def hangs(*a, **k):  # the store stops answering
        threading.Event().wait()

    flush.write_generation = hangs
    print("acknowledged", flush=True)
    """
)


def _exit_after(tmp_path, script: str, exit_timeout: str, *args: str) -> tuple[str, str]:
    """Run ``script`` on a new table with ``MEMWAL_EXIT_FLUSH_TIMEOUT=exit_timeout``; the
    table's uri and the process's stderr, once it exited normally."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows([1, 2]), uri)
    mq.MemWalTable.initialize(uri)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    env["MEMWAL_EXIT_FLUSH_TIMEOUT"] = exit_timeout
    p = subprocess.run(
        [sys.executable, "-c", script, uri, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "acknowledged" in p.stdout
    return uri, p.stderr


@pytest.mark.slow
def test_the_exit_flush_is_bounded_when_storage_hangs(tmp_path):
    started = time.monotonic()
    uri, stderr = _exit_after(tmp_path, SCRIPT, "2")
    assert time.monotonic() - started < 25
    assert "not flushed at exit" in stderr
    got = mq.MemWalTable.open(uri).to_table()  # durable in the WAL
    assert sorted(got["id"].to_pylist()) == [1, 2, 7, 8]


SLOW_FLUSH = textwrap.dedent(
    """
    import sys, time
    import memwal_query as mq
    from memwal_query.write import flush
    from helpers import basic_rows

    slow, real = float(sys.argv[3]), flush.write_generation

    def slowly(*a, **k):  # storage answers, slowly
        time.sleep(slow)
        return real(*a, **k)

    flush.write_generation = slowly
    t = mq.MemWalTable.open(sys.argv[1])
    if sys.argv[2] == "write":
        t.write(basic_rows([7, 8]))  # flushed by the exit hook
    else:
        w = t.writer()
        w.put(basic_rows([7, 8]))
        w._seal(force=True)  # a background flush in flight at exit, never closed
    print("acknowledged", flush=True)
    """
)


@pytest.mark.slow  # Python processes
@pytest.mark.parametrize("how", ["write", "writer"])
def test_a_flush_that_finishes_within_the_deadline_is_not_lost_at_exit(tmp_path, how):
    uri, stderr = _exit_after(tmp_path, SLOW_FLUSH, "20", how, "1.5")
    assert "not flushed" not in stderr
    t = mq.MemWalTable.open(uri)
    assert sorted(t.to_table(consistency="strong")["id"].to_pylist()) == [1, 2, 7, 8]
    assert t.maintenance.status().unflushed_rows == 0
