"""Scans and lookups over many generations read their rows sidecars, not their Lance
tables (real Lance tables): a cold lookup reads the checksummed bloom filters,
then the rows of the generations that may hold the key; a scan drops a large share of
overwritten base rows with a row-id mask instead of Lance's blocklist. Answers stay the
same, a gone generation stays a typed error, and a damaged filter or sidecar falls back.
"""

from __future__ import annotations

import os
import shutil
import warnings

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_cold_caches import _forget, _generations, _table

import memwal_query as mq
from memwal_query.exceptions import GenerationGoneError
from memwal_query.format import bloom, rowfile
from memwal_query.format.rowaddrs import RowIdMask
from memwal_query.read import provider, sources

from helpers import PK


def _opened(monkeypatch) -> list[str]:
    opened: list[str] = []
    real = lance.dataset

    def spy(uri, *a, **k):
        opened.append(str(uri))
        return real(uri, *a, **k)

    monkeypatch.setattr(lance, "dataset", spy)
    return opened


def _want(t: mq.MemWalTable, keys: list[int]) -> list:
    rows = t.to_table(columns=["id", "cat"])
    rows = rows.filter(pc.is_in(rows["id"], pa.array(keys, pa.int64()))).sort_by("id")
    return list(zip(rows["id"].to_pylist(), rows["cat"].to_pylist()))


def _got(t: mq.MemWalTable, keys: list[int]) -> list:
    rows = t.lookup(keys, columns=["id", "cat"]).sort_by("id")
    return list(zip(rows["id"].to_pylist(), rows["cat"].to_pylist()))


def test_a_cold_lookup_opens_no_generation_lance_table(tmp_path, monkeypatch):
    t = _table(tmp_path)
    keys = list(range(0, 150, 7))
    want = _want(t, keys)
    gens = _generations(t)
    _forget()
    opened = _opened(monkeypatch)
    assert _got(t, keys) == want
    assert not [u for u in opened if u in gens]
    # a filter without its checksum (as pylance writes it), a missing sidecar: the
    # Lance table of those generations is read, the answer is the same
    os.remove(os.path.join(gens[0], bloom.BLOOM_META_FILE))
    os.remove(os.path.join(gens[-1], rowfile.ROWS_FILE))
    _forget()
    assert _got(t, keys) == want
    assert gens[0] in opened


def test_a_cold_lookup_in_a_gone_generation_is_a_typed_error(tmp_path):
    t = _table(tmp_path)
    gone = _generations(t)[-1]
    key = pc.min(lance.dataset(gone).to_table(columns=["id"])["id"]).as_py()
    shutil.rmtree(gone)
    _forget()
    with pytest.raises(GenerationGoneError, match=gone):
        t.lookup([key])


def test_a_warm_scan_of_a_generation_gone_from_the_cache_reads_it_again(tmp_path):
    t = _table(tmp_path)
    t.to_table(columns=["id", "cat"])  # newest rows of the generations cached
    gone = _generations(t)[1]
    shutil.rmtree(gone)
    sources.GENERATION_CACHE.clear()
    with pytest.raises(GenerationGoneError, match=gone):
        t.to_table(columns=["id", "cat"])


def test_overwritten_base_rows_dropped_by_mask_or_blocklist_alike(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    uri = str(tmp_path / "t")
    ids = np.arange(3000, dtype=np.int64)
    base = pa.table({"id": ids, "cat": ids % 5}, schema=_schema())
    lance.write_dataset(base, uri, max_rows_per_file=700)  # several fragments
    lance.dataset(uri).delete("id % 11 = 0")
    t = mq.MemWalTable.initialize(uri)
    for g in range(3):
        upd = rng.choice(3300, 900, replace=False).astype(np.int64)
        t.write(pa.table({"id": upd, "cat": np.full(len(upd), 10 + g)}, schema=_schema()))
        t.delete(pa.table({"id": pa.array(rng.choice(3300, 40), pa.int64())}))
        t.flush()
    t.close()
    got = []
    for share in (0.0, 1.0):  # 0: always the mask, 1: always Lance's blocklist
        monkeypatch.setattr(provider, "MASK_SHARE", share)
        got.append(t.to_table(columns=["id", "cat"]).sort_by("id"))
        got.append(t.provider().scanner(columns=["id", "cat"]).to_table().sort_by("id"))
    assert all(g.equals(got[0]) for g in got)
    assert len(set(got[0]["id"].to_pylist())) == got[0].num_rows


def _schema() -> pa.Schema:
    return pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("cat", pa.int64())])


def test_row_id_mask_equals_isin():
    rng = np.random.default_rng(0)
    frags = rng.integers(0, 5, 4000).astype(np.uint64)
    values = (frags << np.uint64(32)) | rng.integers(0, 3000, 4000).astype(np.uint64)
    members = np.unique(values[rng.random(4000) < 0.3])
    probe = np.concatenate([values, values[::-1] + np.uint64(1), np.array([1 << 40], np.uint64)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = RowIdMask(members).contains(probe)
    assert (got == np.isin(probe, members)).all()
    assert not RowIdMask(np.zeros(0, np.uint64)).contains(probe).any()
