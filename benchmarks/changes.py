"""Change feed and time travel: what they cost against reading the same rows by SQL.

Setup (temp dir): a base table of ``--base`` rows (default 1M; ``--quick``: 100k) and
``--changes`` upserts (default 200k, 20% new keys) written in puts of ``--put-rows``
rows (default 1,000) into two regions, flushed as generations, not merged.

Prints:

- change-feed throughput: ``t.changes(since=<before the upserts>)`` (every WAL entry,
  rows/s) against ``SELECT * ... WHERE _gen > 0`` through DataFusion over the same rows
  (the deduplicated generations) and against reading the generations with Lance;
- ``as_of`` queries against the same query on the current table (``SELECT count(*),
  sum(val)``): ``as_of`` now (the same rows, with the time-travel resolution: base
  version by timestamp, region manifest versions by modification time) and ``as_of``
  the base version before the upserts.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import datafusion
import lance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SCHEMA, machine, make_rows, median, print_table, timed  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.regions.spec import bucket_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--base", type=int, default=1_000_000)
    ap.add_argument("--changes", type=int, default=200_000)
    ap.add_argument("--put-rows", type=int, default=1_000)
    args = ap.parse_args()
    base_rows = 100_000 if args.quick else args.base
    n_changes = 20_000 if args.quick else args.changes
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"{tmp}/base"
        lance.write_dataset(make_rows(np.arange(base_rows), rng), uri, schema=SCHEMA)
        ds = lance.dataset(uri)
        t = mq.MemWalTable.initialize(uri, region_spec=bucket_spec(ds, "id", 2))
        before = t.catalog.dataset().version
        t.configure_writers(max_memtable_rows=n_changes // 4)
        new_keys = int(n_changes * 0.2)
        ids = np.concatenate(
            [
                rng.integers(0, base_rows, n_changes - new_keys),
                np.arange(base_rows, base_rows + new_keys),
            ]
        )
        rng.shuffle(ids)
        start = time.perf_counter()
        for i in range(0, n_changes, args.put_rows):
            t.write(make_rows(ids[i : i + args.put_rows], rng))
        t.flush()
        write_s = time.perf_counter() - start
        feed = t.changes(since=before)
        assert feed.num_rows == n_changes, (feed.num_rows, n_changes)

        ctx = datafusion.SessionContext()
        ctx.register_table("t", t.provider(meta_columns=True))
        sql_rows = ctx.sql("SELECT count(*) AS n FROM t WHERE _gen > 0").to_arrow_table()
        plan = t.provider().check()

        def read_generations() -> None:
            for g in plan.generations:
                lance.dataset(g.uri).to_table()

        feed_s = median(timed(lambda: t.changes(since=before), repeat=3))
        sql_s = median(
            timed(lambda: ctx.sql("SELECT * FROM t WHERE _gen > 0").to_arrow_table(), repeat=3)
        )
        gen_s = median(timed(read_generations, repeat=3))
        n_sql = sql_rows["n"][0].as_py()
        print(
            f"machine: {machine()}; base {base_rows:,} rows; {n_changes:,} changes in "
            f"puts of {args.put_rows} ({write_s:.1f} s to write)"
        )
        print_table(
            "Change feed vs reading the same rows",
            ["read", "rows", "seconds", "rows/s", "ratio to feed"],
            [
                ["t.changes(since=version)", n_changes, feed_s, n_changes / feed_s, 1.0],
                ["SQL WHERE _gen > 0 (deduplicated)", n_sql, sql_s, n_sql / sql_s, sql_s / feed_s],
                [
                    "Lance scan of the generations",
                    n_changes,
                    gen_s,
                    n_changes / gen_s,
                    gen_s / feed_s,
                ],
            ],
        )
        query = "SELECT count(*) AS n, sum(val) AS s FROM {}"
        ctx_now = datafusion.SessionContext()
        ctx_now.register_table("now", t.provider())
        ctx_old = datafusion.SessionContext()
        ctx_old.register_table("old", t.provider(as_of=before))
        ctx_moment = datafusion.SessionContext()
        time.sleep(0.05)
        ctx_moment.register_table("moment", t.provider(as_of=datetime.datetime.now()))
        now_s = median(timed(lambda: ctx_now.sql(query.format("now")).to_arrow_table()))
        moment_s = median(timed(lambda: ctx_moment.sql(query.format("moment")).to_arrow_table()))
        same = ctx_moment.sql(query.format("moment")).to_arrow_table()
        assert same.equals(ctx_now.sql(query.format("now")).to_arrow_table())
        old_s = median(timed(lambda: ctx_old.sql(query.format("old")).to_arrow_table()))
        old_n = ctx_old.sql(query.format("old")).to_arrow_table()["n"][0].as_py()
        assert old_n == base_rows, old_n
        print_table(
            "as_of against a current query (count(*), sum(val))",
            ["query", "seconds", "ratio"],
            [
                ["current", now_s, 1.0],
                ["as_of=now (same rows, resolved by time travel)", moment_s, moment_s / now_s],
                [f"as_of=version {before} (base alone)", old_s, old_s / now_s],
            ],
        )
        t.close(flush=False)


if __name__ == "__main__":
    main()
