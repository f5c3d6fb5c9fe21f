"""The WAL tail a default reader reads, against hostile WAL contents."""

from __future__ import annotations

import os
import sys

import pyarrow as pa

import memwal_query as mq
from memwal_query.format.wal import Wal
from memwal_query.storage import paths

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import basic_rows  # noqa: E402


def _val(uri: str, **kw) -> list[float]:
    got = mq.MemWalTable.open(uri).to_table(**kw).to_pydict()
    return [v for k, v in zip(got["id"], got["val"]) if k == 1]


def test_a_fenced_writers_late_entry_reads_as_its_replay_will(table):
    # Writer A (epoch 1) writes entry 1; writer B claims (epoch 2), writes entry 2 and
    # flushes generation 1. A, not knowing it is fenced, then writes entry 3, still
    # recording generation 1. Entry 3 is above the replay position: the next writer
    # replays it into the current generation, so it is the newest value of key 1. A
    # default reader must answer so already, not change its answer at the replay.
    a = table.writer(heartbeat_interval=3600.0)
    a.put(basic_rows([1], [1.0]))
    region = a.region_id
    b = mq.MemWalTable.open(table.uri).writer(region)
    b.put(basic_rows([1], [2.0]))
    assert b.flush() == 1
    wal = Wal(table.catalog.io, paths.wal_dir(table.uri, region), region)
    first = next(iter(wal.replay(0, 1 << 32)))
    late = first.table.set_column(first.table.schema.get_field_index("val"), "val", pa.array([3.0]))
    wal.append(3, late, writer_epoch=a.epoch, generation=first.generation)
    assert _val(table.uri, consistency="strong") == [2.0]
    before = _val(table.uri)
    b.close(flush=False)
    c = mq.MemWalTable.open(table.uri).writer(region)  # replays entry 3, flushes it
    c.flush()
    c.close()
    assert _val(table.uri, consistency="strong") == [3.0]
    assert before == _val(table.uri) == [3.0]
