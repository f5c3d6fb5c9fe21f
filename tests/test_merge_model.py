"""Merges equal a dict model: rounds of upserts only, deletes only (of base keys, of
keys written in the same round, of keys never written), both and nothing, merged one round or
several at a time, with a single integer key and a composite one; the base table and
the deduplicated view after each merge are the model's."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK, clear_read_caches

KEYS = {
    "int": [pa.field("id", pa.int64(), False, PK)],
    "composite": [pa.field("a", pa.int32(), False, PK), pa.field("b", pa.string(), False, PK)],
}


def _key(kind: str, k: int) -> tuple:
    return (k,) if kind == "int" else (k % 7, f"s{k // 7}")


def _table(kind: str, keys, v: int) -> pa.Table:
    fields = KEYS[kind]
    cols = list(zip(*[_key(kind, k) for k in keys])) or [[] for _ in fields]
    data = {f.name: pa.array(list(c), f.type) for f, c in zip(fields, cols)}
    data["v"] = pa.array([v] * len(keys), pa.int64())
    return pa.table(data, schema=pa.schema([*fields, pa.field("v", pa.int64())]))


def _state(kind: str, t: pa.Table) -> dict:
    names = [f.name for f in KEYS[kind]]
    rows = t.to_pylist()
    out = {tuple(r[n] for n in names): r["v"] for r in rows}
    assert len(out) == len(rows)  # nothing twice
    return out


@pytest.mark.parametrize("kind", ["int", "composite"])
def test_merges_of_upserts_only_deletes_only_and_both_equal_a_model(tmp_path, kind):
    clear_read_caches()
    rng = np.random.default_rng(21)
    uri = str(tmp_path / "t")
    lance.write_dataset(_table(kind, range(0, 120, 2), 0), uri)
    t = mq.MemWalTable.initialize(uri)
    model = {_key(kind, k): 0 for k in range(0, 120, 2)}
    rounds = ["upserts", "deletes", "both", "nothing", "deletes", "upserts", "both", "deletes"]
    for step, what in enumerate(rounds, start=1):
        if what in ("upserts", "both"):
            keys = sorted({int(k) for k in rng.integers(0, 200, 25)})
            t.write(_table(kind, keys, step))
            model.update({_key(kind, k): step for k in keys})
        if what in ("deletes", "both"):
            gone = sorted({int(k) for k in rng.integers(0, 260, 12)})  # some never written
            t.delete(_table(kind, gone, 0).select([f.name for f in KEYS[kind]]))
            for k in gone:
                model.pop(_key(kind, k), None)
        t.flush()
        if step % 2 == 1 or step == len(rounds):
            t.maintenance.merge()
            assert _state(kind, lance.dataset(uri).to_table()) == model
        assert _state(kind, t.to_table()) == model
        assert t.count_rows() == len(model)
    t.close()
