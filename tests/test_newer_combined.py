"""The newer view kept between reads of a live table (bucket regions, generations and
WAL tails): a read of unchanged sources reuses the combination of the read before;
any change (rows written, a generation flushed, generations merged, deletes) gives the
answer a fresh process gives; and in a bucket layout, where every key has one region,
a key in a region's generations and its MemTable needs no cross-region decision.
"""

from __future__ import annotations

import datafusion
import lance
import numpy as np
import pyarrow as pa

import memwal_query as mq
from memwal_query.read import newer

from helpers import basic_rows, clear_read_caches


def _table(tmp_path) -> tuple[str, mq.MemWalTable]:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(200)), uri)
    ds = lance.dataset(uri)
    mq.MemWalTable.initialize(uri, region_spec=mq.bucket_spec(ds.lance_schema, "id", 4))
    w = mq.MemWalTable.open(uri)
    w.configure_writers(max_memtable_age=1e9)
    return uri, w


def _view(r: mq.MemWalTable) -> newer.NewerView:
    """The newer view of a ``count(*)``'s plan (the query builds it first)."""
    provider = r.provider(consistency="latest")
    ctx = datafusion.SessionContext()
    ctx.register_table("t", provider)
    ctx.sql("SELECT count(*) FROM t").to_arrow_table()
    assert provider.last_plan is not None
    return newer.newer_view(provider.last_plan, r.schema, r.primary_key)


def _answer(r: mq.MemWalTable) -> dict[int, float]:
    got = r.to_table(consistency="latest")
    return dict(zip(got["id"].to_pylist(), got["val"].to_pylist(), strict=True))


def _fresh(uri: str) -> tuple[dict[int, float], np.ndarray, np.ndarray]:
    """The answer, winners and tombstone flags with every read cache empty."""
    clear_read_caches()
    r = mq.MemWalTable.open(uri)
    v = _view(r)
    return _answer(r), v.winners.copy(), np.asarray(v.tombstones).copy()


def test_unchanged_sources_reuse_the_combined_view(tmp_path):
    clear_read_caches()
    uri, w = _table(tmp_path)
    w.write(basic_rows(range(150, 260), [float(k) + 0.5 for k in range(150, 260)]))
    for x in w._routed.writers()[:2]:
        x.flush()  # two regions with a generation, all four with WAL rows
    w.write(basic_rows(range(100, 180), [float(k) + 0.25 for k in range(100, 180)]))
    r = mq.MemWalTable.open(uri)
    first = _view(r)
    again = _view(r)
    assert again.winners is first.winners
    assert again.tombstones is first.tombstones
    w.write(basic_rows([5], [-1.0]))
    later = _view(r)
    assert later.winners is not first.winners
    assert len(later.winners) == len(first.winners) + 1
    w.close(flush=False)


def test_live_reads_equal_a_fresh_process_through_flushes_merges_and_deletes(tmp_path):
    clear_read_caches()
    uri, w = _table(tmp_path)
    r = mq.MemWalTable.open(uri)
    rng = np.random.default_rng(7)
    model = {k: float(k) for k in range(200)}
    for step in range(12):
        keys = sorted({int(k) for k in rng.integers(0, 300, 40)})
        vals = [step * 1000.0 + k for k in keys]
        w.write(basic_rows(keys, vals))
        model.update(zip(keys, vals, strict=True))
        gone = sorted({int(k) for k in rng.integers(0, 300, 8)} - set(keys))
        if gone:
            w.delete(pa.table({"id": pa.array(gone, pa.int64())}))
            for k in gone:
                model.pop(k, None)
        writers = w._routed.writers()
        if step % 3 == 1:
            writers[step % len(writers)].flush()  # one region's rows become a generation
        if step == 7:
            w.close(flush=True)
            r.maintenance.maintain()  # generations merged into the base
        _view(r)  # the live reader keeps its caches
        assert _answer(r) == model
        assert r.count_rows(consistency="latest") == len(model)
        live = _view(r)
        winners, tombstones = live.winners.copy(), np.asarray(live.tombstones).copy()
        want, fresh_winners, fresh_tombstones = _fresh(uri)
        assert want == model
        np.testing.assert_array_equal(winners, fresh_winners)
        np.testing.assert_array_equal(tombstones, fresh_tombstones)
    w.close(flush=False)


def test_bucket_regions_decide_no_key_across_regions(tmp_path, monkeypatch):
    """Keys in a region's generations and its WAL tail: the MemTable rows win without
    the cross-region rule (which would rank every such key again)."""
    clear_read_caches()
    uri, w = _table(tmp_path)
    w.write(basic_rows(range(0, 300), [float(k) + 0.5 for k in range(300)]))
    w.close(flush=True)  # every region has a generation
    w = mq.MemWalTable.open(uri)
    w.write(basic_rows(range(50, 250), [float(k) + 0.75 for k in range(50, 250)]))
    w.delete(pa.table({"id": pa.array([60, 61, 280], pa.int64())}))
    want = {k: float(k) + 0.5 for k in range(300)}
    want.update({k: float(k) + 0.75 for k in range(50, 250)})
    for k in (60, 61, 280):
        del want[k]

    def no_rule(*args, **kwargs):
        raise AssertionError("no key is in two regions")

    monkeypatch.setattr(newer, "newest_indices", no_rule)
    r = mq.MemWalTable.open(uri)
    assert _answer(r) == want
    assert r.count_rows(consistency="latest") == len(want)
    w.close(flush=False)
