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


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    raises=subprocess.TimeoutExpired,
    reason="open: a flush blocked in storage holds a ThreadPoolExecutor worker, which "
    "the interpreter joins at exit whatever the exit hook does",
)
def test_the_exit_flush_is_bounded_when_storage_hangs(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows([1, 2]), uri)
    mq.MemWalTable.initialize(uri)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    started = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, uri], env=env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    assert "acknowledged" in p.stdout
    assert time.monotonic() - started < 60
    assert "not flushed at exit" in p.stderr
    got = mq.MemWalTable.open(uri).to_table()  # durable in the WAL
    assert sorted(got["id"].to_pylist()) == [1, 2, 7, 8]
