"""Decimal columns (128- and 256-bit, also inside a struct and a list) through every
place rows are read from Arrow IPC bytes and handed to Lance: rows sidecars of flushed
generations (merged with ``merge_insert``), WAL entries replayed by recovery and by a
flush of a reopened writer. An IPC body aligns buffers to 8 bytes, a decimal needs 16
in Lance's Rust side (which panics otherwise): the reader copies such columns to
aligned memory (:func:`memwal_query.format.rowfile.aligned`).
"""

from __future__ import annotations

import decimal

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format.rowfile import aligned
from memwal_query.maintain.policy import MaintenancePolicy

from helpers import PK

D = decimal.Decimal
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("small", pa.int32()),
        pa.field("dec", pa.decimal128(12, 3)),
        pa.field("big", pa.decimal256(40, 2)),
        pa.field("pair", pa.struct([("x", pa.int32()), ("d", pa.decimal128(8, 2))])),
        pa.field("many", pa.list_(pa.decimal128(10, 1))),
    ]
)


def _rows(ids, offset: int = 0) -> pa.Table:
    ids = [int(i) for i in ids]
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "small": pa.array([i % 7 for i in ids], pa.int32()),
            "dec": [None if i % 5 == 0 else D(f"{i + offset}.125") for i in ids],
            "big": [D(f"{i * 1000 + offset}.5") for i in ids],
            "pair": [{"x": i, "d": D(f"{i % 100}.25")} for i in ids],
            "many": [[D(f"{j}.5") for j in range(i % 3)] for i in ids],
        },
        schema=SCHEMA,
    )


def _misaligned(table: pa.Table) -> pa.Table:
    """``table`` read back from IPC bytes placed 8 bytes past a 16-byte boundary."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    for pad in range(0, 16):
        buf = pa.py_buffer(b"\0" * pad + data).slice(pad)
        if buf.address % 16 == 8:
            return pa.ipc.open_file(buf).read_all()
    raise AssertionError("no misaligned placement found")


def test_aligned_copies_only_misaligned_decimal_columns():
    rows = _misaligned(_rows(range(1, 9)))
    bad = [b for b in rows.column("dec").chunks[0].buffers() if b is not None and b.address % 16]
    assert bad  # as an IPC reader leaves them
    fixed = aligned(rows)
    assert fixed.equals(rows)
    for name in ("dec", "big", "pair", "many"):
        for chunk in fixed.column(name).chunks:
            assert all(b is None or b.address % 16 == 0 for b in chunk.buffers()), name
    # columns without decimals are not copied
    assert fixed.column("small").chunks[0].buffers()[1].address == (
        rows.column("small").chunks[0].buffers()[1].address
    )


@pytest.mark.parametrize("regions", [2, 5])
def test_decimal_rows_merge_and_replay(tmp_path, regions):
    """Generations of several sizes in several regions merge (every region: some of
    them lay a decimal buffer 8 bytes off), WAL entries left by writers that did not
    flush are recovered and merged, and every answer equals the model."""
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(100)), uri, schema=SCHEMA)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = {r["id"]: r for r in _rows(range(100)).to_pylist()}
    rng = np.random.default_rng(regions)
    for size in (1, 2, 3, 5, 8, 13):
        ids = rng.choice(150, size, replace=False)
        rows = _rows(ids, offset=size)
        t.write(rows)
        t.flush()
        model.update({r["id"]: r for r in rows.to_pylist()})
    for k in range(3):  # acknowledged, never flushed by their writers
        w = mq.MemWalTable.open(uri)
        rows = _rows([200 + k, 7 * k + 1], offset=100 + k)
        w.write(rows)
        w.close(flush=False)
        model.update({r["id"]: r for r in rows.to_pylist()})
    report = t.maintenance.maintain(MaintenancePolicy(merge_over_generations=0))
    assert report.merged
    want = sorted(model.values(), key=lambda r: r["id"])
    got = mq.MemWalTable.open(uri).to_table().sort_by("id").to_pylist()
    assert got == want
    t.maintenance.merge()
    base = lance.dataset(uri).to_table().sort_by("id").to_pylist()
    assert base == want
