"""A writer that finds its next WAL position taken adopts the entry only when an older
(fenced) writer or itself wrote it; an entry of a newer writer fences it at once
(write/walpath.py ``_adopt``): it neither takes the newer writer's rows into its
MemTable nor writes an entry after them, which the newer writer would adopt in turn.
"""

from __future__ import annotations

import lance
import pytest

import memwal_query as mq
from memwal_query.format.wal import Wal, decode_entry
from memwal_query.storage import paths
from memwal_query.storage.factory import file_io_for

from helpers import basic_rows


def test_an_entry_of_a_newer_writer_is_not_adopted(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(5)), uri)
    mq.MemWalTable.initialize(uri)
    a, b = mq.MemWalTable.open(uri), mq.MemWalTable.open(uri)
    wa = a.writer()
    wa.put(basic_rows([100], val=[1.0]))
    wb = b.writer()  # fences wa and replays its entry; wb writes wa's next position
    wb.put(basic_rows([200], val=[2.0]))
    io = file_io_for(uri, None)
    wal = Wal(io, paths.wal_dir(uri, wa.region_id), wa.region_id)
    before = wal.positions()

    with pytest.raises(mq.FencedError):
        wa.put(basic_rows([300], val=[3.0]))  # its next position holds wb's entry

    assert wa.stats.adopted_entries == 0
    assert wal.positions() == before, "the fenced writer wrote a WAL entry"
    epochs = [decode_entry(wal.path(p), p, io.read(wal.path(p))).writer_epoch for p in before]
    assert epochs == sorted(epochs)
    wb.put(basic_rows([201], val=[2.5]))
    wb.close()
    ids = set(mq.MemWalTable.open(uri).to_table().column("id").to_pylist())
    assert {100, 200, 201} <= ids and 300 not in ids
