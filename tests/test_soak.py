"""Soak: 8 writer threads over 4 regions, 2 readers (SQL + lookups), a merger + GC loop.

Bounded in time (``MEMWAL_SOAK_SECONDS``, CI default 20; set it for longer soaks) and
in count; everything is in-process on a local table. Readers check that no key appears
twice and that each
key's value is one its writer had written, at least as new as what was acknowledged
before the read started; and that each region shows a consistent prefix of every
writer thread's puts into it: if a read shows a thread's put number ``m`` in a region, it
shows each key of that thread in that region at its last value written by a put
``<= m`` (no put seen partly, none skipped). At the end the view equals the model.
Throughput and reader latency percentiles are printed (in the CI log, too).
"""

import bisect
import datetime as dt
import os
import random
import threading
import time

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK

SECONDS = float(os.environ.get("MEMWAL_SOAK_SECONDS", "20"))
THREADS, REGIONS, KEYS_PER_THREAD = 8, 4, 50
SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("seq", pa.int64())])


@pytest.mark.slow
def test_soak(tmp_path, capsys):
    uri = str(tmp_path / "t")
    n_keys = THREADS * KEYS_PER_THREAD
    lance.write_dataset(pa.table({"id": range(n_keys), "seq": [0] * n_keys}, schema=SCHEMA), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", REGIONS)
    table = mq.MemWalTable.initialize(uri, region_spec=spec)
    # one writer per region, shared by the two threads whose keys fall in it
    writers = {
        b: table.writer(region_values={"bucket": b}, max_memtable_rows=2_000)
        for b in range(REGIONS)
    }
    bucket = spec.evaluate(
        pa.table({"id": pa.array(range(n_keys), pa.int64())}), table.catalog.lance_schema
    )
    bucket_of = bucket.column(0).to_pylist()
    owner = np.arange(n_keys) // KEYS_PER_THREAD  # the thread writing each key
    group = owner * REGIONS + np.asarray(bucket_of)  # (thread, region) of each key
    history: list[list[int]] = [[0] for _ in range(n_keys)]  # seqs written, ascending
    acked = np.zeros(n_keys, dtype=np.int64)  # last acknowledged seq per key
    written = np.zeros(n_keys, dtype=np.int64)  # last seq handed to put (may be unacked)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"puts": 0, "rows": 0, "reads": 0, "lookups": 0, "merges": 0, "keys_checked": 0}
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def writer_thread(t: int) -> None:
        rng = random.Random(t)
        keys = list(range(t * KEYS_PER_THREAD, (t + 1) * KEYS_PER_THREAD))
        seq = 0
        try:
            while not stop.is_set() and time.monotonic() < deadline and seq < 100_000:
                seq += 1
                chosen = rng.sample(keys, rng.randint(1, 10))
                by_bucket: dict[int, list[int]] = {}
                for k in chosen:
                    by_bucket.setdefault(bucket_of[k], []).append(k)
                for b, ks in by_bucket.items():
                    for k in ks:
                        history[k].append(seq)
                    written[ks] = seq
                    writers[b].put(pa.table({"id": ks, "seq": [seq] * len(ks)}, schema=SCHEMA))
                    acked[ks] = seq
                    with lock:
                        counts["puts"] += 1
                        counts["rows"] += len(ks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def check_prefix(ids: np.ndarray, seqs: np.ndarray) -> None:
        """Per (thread, region): the read shows whole puts, up to the newest one seen."""
        newest: dict[int, int] = {}
        for k, v in zip(ids.tolist(), seqs.tolist()):
            g = int(group[k])
            newest[g] = max(newest.get(g, 0), v)
        for k, v in zip(ids.tolist(), seqs.tolist()):
            m = newest[int(group[k])]
            h = history[k]
            expected = h[bisect.bisect_right(h, m) - 1]  # k's last write by a put <= m
            assert v == expected, (
                f"key {k}: read seq {v}, but the read shows put {m} of its writer in its "
                f"region, after which the key's value is {expected}: not a consistent prefix"
            )
        with lock:
            counts["keys_checked"] += len(ids)

    def reader_thread(r: int) -> None:
        ctx = datafusion.SessionContext()
        ctx.register_table("t", table.provider(writers=list(writers.values())))
        rng = random.Random(100 + r)
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                before = acked.copy()
                started = time.perf_counter()
                if rng.random() < 0.7:
                    got = ctx.sql("SELECT id, seq FROM t").to_arrow_table()
                    kind = "reads"
                else:
                    ks = rng.sample(range(n_keys), 20)
                    got = ctx.sql(
                        f"SELECT id, seq FROM t WHERE id IN ({','.join(map(str, ks))})"
                    ).to_arrow_table()
                    kind = "lookups"
                latencies.append(time.perf_counter() - started)
                after = written.copy()
                ids = np.asarray(got.column("id").to_pylist())
                seqs = np.asarray(got.column("seq").to_pylist())
                assert len(ids) == len(set(ids.tolist())), "duplicate key in a read"
                assert (seqs >= before[ids]).all(), "a read lost an acknowledged write"
                assert (seqs <= after[ids]).all(), "a read returned a value never written"
                check_prefix(ids, seqs)
                with lock:
                    counts[kind] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def background() -> None:
        try:
            rng = random.Random(7)
            while not stop.is_set() and time.monotonic() < deadline:
                writers[rng.randrange(REGIONS)].flush()
                counts["merges"] += len(table.maintenance.merge(max_generations=2))
                table.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=30))
                time.sleep(0.5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer_thread, args=(t,)) for t in range(THREADS)]
    threads += [threading.Thread(target=reader_thread, args=(r,)) for r in range(2)]
    threads.append(threading.Thread(target=background))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 120)
    stop.set()
    elapsed = time.monotonic() - started
    assert not errors, errors[0]
    final = {r["id"]: r["seq"] for r in table.to_table(writers=list(writers.values())).to_pylist()}
    assert final == {k: int(acked[k]) for k in range(n_keys)}
    for w in writers.values():
        w.close()
    table.maintenance.merge()
    final = {r["id"]: r["seq"] for r in lance.dataset(uri).to_table().to_pylist()}
    assert final == {k: int(acked[k]) for k in range(n_keys)}
    lat = np.asarray(latencies) * 1e3
    with capsys.disabled():  # the figures of every run, in the CI log
        print(
            f"\nsoak {elapsed:.0f}s: {counts['puts'] / elapsed:,.0f} puts/s, "
            f"{counts['rows'] / elapsed:,.0f} rows/s, {counts['reads']} scans, "
            f"{counts['lookups']} key lookups, {counts['keys_checked']:,} key reads checked, "
            f"{counts['merges']} generations merged; reader latency "
            f"p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms"
        )
    assert counts["reads"] > 0 and counts["puts"] > 0
